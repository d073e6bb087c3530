"""Dual RL (XQL, f-DVL, ReCOIL) and GORL: the value losses' optima, a stable Gumbel exponent, the guide as a
plug-in that reduces exactly to its base algorithm, ReCOIL without rewards, and the usual estimator surface."""

from __future__ import annotations

import math

import numpy as np
import pytest
import sklearn.base
import torch

import offrl
from offrl.algos import FDVL, IQL, XQL, BC, ReCOIL, TD3PlusBC
from offrl.algos.guide import Guide, as_guide
from offrl.algos.losses import (VALUE_LOSSES, chi_square_loss, expectile_loss, gumbel_log_loss, gumbel_loss,
                                total_variation_loss, value_loss)
from offrl.algos.params import InvalidParameterError
from offrl.algos.presets import preset_params
from offrl.datasets import Dataset
from offrl.monitor import TrainingDivergedError

from conftest import pendulum_shaped_dataset

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(hidden_dims=(32, 32), batch_size=32)


# ---------------------------------------------------------------------------------------------- the value losses


def descend(loss_of, x: torch.Tensor, steps: int = 4000) -> float:
    """Minimise loss_of(x - v) over a scalar v by Adam with a decaying step (float64); returns v."""
    v = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.Adam([v], lr=0.05)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 0.5 * (1 + math.cos(math.pi * i / steps)) + 1e-4)
    for _ in range(steps):
        optimizer.zero_grad()
        loss_of(x - v).backward()
        optimizer.step()
        schedule.step()
    return float(v.detach())


def bisect(f, low: float, high: float) -> float:
    """The root of a decreasing f on [low, high] (f(low) > 0 > f(high))."""
    for _ in range(200):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if f(mid) > 0 else (low, mid)
    return 0.5 * (low + high)


@pytest.fixture(scope="module")
def q_values() -> np.ndarray:
    return np.random.default_rng(0).gamma(2.0, 1.0, size=4000) - 2.0  # skewed, so each statistic is distinct


def test_expectile_loss_reaches_the_expectile(q_values):
    x = torch.as_tensor(q_values)
    tau = 0.8
    # The tau-expectile v solves tau E(x - v)+ = (1 - tau) E(v - x)+.
    expected = bisect(lambda v: tau * np.maximum(q_values - v, 0).mean() - (1 - tau) * np.maximum(v - q_values, 0).mean(),
                      q_values.min(), q_values.max())
    assert descend(lambda d: expectile_loss(d, tau), x) == pytest.approx(expected, abs=1e-4)
    assert expected > q_values.mean() + 0.3  # an upper statistic, not the mean


@pytest.mark.parametrize("beta", [0.5, 2.0])
def test_gumbel_loss_reaches_the_log_sum_exp(q_values, beta):
    x = torch.as_tensor(q_values)
    expected = beta * (np.logaddexp.reduce(q_values / beta) - math.log(len(q_values)))  # beta log E exp(Q / beta)
    assert descend(lambda d: gumbel_loss(d, beta, max_clip=None), x) == pytest.approx(expected, abs=1e-3)
    # The clip at 7 leaves it unchanged when no z exceeds 7 at the optimum.
    assert ((q_values - expected) / beta).max() < 7.0 or beta == 0.5
    if beta == 2.0:
        assert descend(lambda d: gumbel_loss(d, beta, max_clip=7.0), x) == pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize("beta", [0.5, 2.0])
def test_gumbel_log_loss_reaches_the_same_log_sum_exp(q_values, beta):
    x = torch.as_tensor(q_values)
    expected = beta * (np.logaddexp.reduce(q_values / beta) - math.log(len(q_values)))
    assert descend(lambda d: gumbel_log_loss(d, beta, max_clip=None), x) == pytest.approx(expected, abs=1e-3)


def test_gumbel_log_loss_is_the_log_of_the_gumbel_loss_with_its_gradient():
    """Value log(J + 1) and gradient dJ / (J + 1), J the Gumbel loss, where nothing is clipped; finite where the
    textbook form overflows."""
    diff = torch.tensor([-3.0, -0.5, 0.2, 1.5, 4.0], dtype=torch.float64, requires_grad=True)
    z = diff / 2.0
    textbook = torch.log((torch.exp(z) - z - 1).mean() + 1)
    (expected_grad,) = torch.autograd.grad(textbook, diff)
    loss = gumbel_log_loss(diff, 2.0, max_clip=7.0)
    (grad,) = torch.autograd.grad(loss, diff)
    assert loss.item() == pytest.approx(textbook.item(), rel=1e-12)
    assert torch.allclose(grad, expected_grad, rtol=1e-12, atol=0)
    wide = torch.tensor([0.0, 50.0, 400.0, -3.0], requires_grad=True)  # z = 200 at beta 2: exp overflows float32
    stable = gumbel_log_loss(wide, 2.0, max_clip=7.0)
    stable.backward()
    assert torch.isfinite(stable) and torch.isfinite(wide.grad).all()


@pytest.mark.parametrize("lam", [0.6, 0.8])
def test_total_variation_loss_reaches_its_quantile(q_values, lam):
    x = torch.as_tensor(q_values)
    level = (2 * lam - 1) / lam  # P(Q > v) = (1 - lam) / lam
    v = descend(lambda d: total_variation_loss(d, lam), x)
    assert np.mean(q_values > v) == pytest.approx((1 - lam) / lam, abs=2e-3)
    assert v == pytest.approx(np.quantile(q_values, level), abs=0.02)


@pytest.mark.parametrize("lam", [0.6, 0.8])
def test_chi_square_loss_reaches_its_closed_form_optimum(q_values, lam):
    x = torch.as_tensor(q_values)

    def stationarity(v: float) -> float:  # minus the derivative in v: lam E[(1 + y/2) 1(y > 0 or y < -4)] - (1 - lam)
        y = q_values - v
        return lam * np.mean((1 + y / 2) * ((y > 0) | (y < -4))) - (1 - lam)

    expected = bisect(stationarity, q_values.min() - 1, q_values.max())
    assert descend(lambda d: chi_square_loss(d, lam), x) == pytest.approx(expected, abs=1e-3)


def test_value_loss_names_every_divergence_and_refuses_others():
    diff = torch.linspace(-1, 1, 11)
    assert value_loss("expectile", diff, expectile=0.7) == expectile_loss(diff, 0.7)
    assert value_loss("kl", diff, beta=2.0) == gumbel_loss(diff, 2.0)
    assert value_loss("chi2", diff, lam=0.7) == chi_square_loss(diff, 0.7)
    assert value_loss("tv", diff, lam=0.7) == total_variation_loss(diff, 0.7)
    assert set(VALUE_LOSSES) == {"expectile", "kl", "chi2", "tv"}
    with pytest.raises(ValueError, match="divergence must be one of"):
        value_loss("js", diff)


def test_the_gumbel_exponent_stays_finite_where_the_naive_one_overflows():
    diff = torch.tensor([0.0, 50.0, 400.0, -3.0], requires_grad=True)  # a Q-value gap of 400 at beta 2: z = 200
    z = diff / 2.0
    naive = (torch.exp(z) - z - 1).mean()
    assert not torch.isfinite(naive)  # float32 exp overflows above z ~ 88.7
    stable = gumbel_loss(diff, 2.0, max_clip=7.0)
    stable.backward()
    assert torch.isfinite(stable) and torch.isfinite(diff.grad).all()
    assert diff.grad.abs().max() <= 1.0  # the max-normalisation bounds the step


def large_gap_dataset() -> Dataset:
    ds = pendulum_shaped_dataset(n_episodes=6, length=40)
    return ds.with_rewards((ds.rewards + 10.0) * 2000.0)  # rewards up to 2e4: Q runs ahead of V by thousands


class NaiveXQL(XQL):
    """XQL with the textbook exponent: exp(z) - z - 1, no clip, no rescaling."""

    def _value_objective(self, diff):
        z = diff / self.beta
        return (torch.exp(z) - z - 1).mean()


def test_xql_trains_finite_on_large_q_gaps_where_the_naive_exponent_diverges():
    ds = large_gap_dataset()
    # A fast MSE critic (lr 1e-2, target = critic) runs Q ahead of V by thousands within a few dozen steps.
    params = dict(SMALL, reward_normalization=None, random_state=0, critic_loss="mse", critic_lr=1e-2, tau=1.0)
    for log_loss in (False, True):
        model = XQL(**params, log_loss=log_loss).fit(ds, n_steps=100, progress=False, log_every=10)
        assert all(torch.isfinite(p).all() for p in model.value_.parameters())
        assert all(np.isfinite(v) for v in model.last_metrics_.values())
    with pytest.raises(TrainingDivergedError, match="value_loss"):
        NaiveXQL(**params).fit(ds, n_steps=100, progress=False, log_every=10)


# ---------------------------------------------------------------------------------------------- XQL and f-DVL


def test_fdvl_kl_is_xql_bit_for_bit():
    ds = pendulum_shaped_dataset()
    a = XQL(**SMALL, random_state=3).fit(ds, n_steps=30, progress=False)
    b = FDVL(divergence="kl", random_actions=0, **SMALL, random_state=3).fit(ds, n_steps=30, progress=False)
    for name in ("policy_", "value_", "critic_"):
        for p, q in zip(getattr(a, name).state_dict().values(), getattr(b, name).state_dict().values()):
            assert torch.equal(p, q)


def test_fdvl_divergences_change_only_the_value_loss():
    ds = pendulum_shaped_dataset()
    runs = {d: FDVL(divergence=d, **SMALL, random_state=1).fit(ds, n_steps=20, progress=False) for d in ("chi2", "tv")}
    first = [p.clone() for p in runs["chi2"].value_.parameters()]
    assert not all(torch.equal(p, q) for p, q in zip(first, runs["tv"].value_.parameters()))
    assert any(isinstance(m, torch.nn.LayerNorm) for m in runs["chi2"].value_.modules())  # the authors' value net
    with pytest.raises(InvalidParameterError, match="divergence"):
        FDVL(divergence="hellinger").check_params()


def test_random_actions_fit_the_value_to_data_and_uniform_actions_per_state():
    """The authors' --sample_random_times: each state once with its data action, then `random_actions` more times
    with actions uniform over the box; the actor still sees the data rows only."""
    ds = pendulum_shaped_dataset()  # actions in [-2, 2]
    model = FDVL(**SMALL, random_actions=2, random_state=0).fit(ds, n_steps=5, progress=False)
    obs = torch.as_tensor(ds.observations[:64])
    actions = torch.as_tensor(ds.actions[:64])
    torch.manual_seed(0)
    value_obs, value_actions = model._with_random_actions(obs, actions)
    assert value_obs.shape == (3 * 64, obs.shape[1]) and value_actions.shape == (3 * 64, actions.shape[1])
    assert torch.equal(value_actions[:64], actions)
    assert torch.equal(value_obs[64:128], obs) and torch.equal(value_obs[128:], obs)
    uniform = value_actions[64:]
    assert uniform.min() >= -2.0 and uniform.max() <= 2.0 and uniform.std() > 0.9  # uniform on [-2, 2]: std 1.15
    assert not torch.equal(value_actions[64:128], value_actions[128:])
    seen = []
    model._value_objective = lambda diff: seen.append(diff.shape[0]) or diff.mean()
    _, target_q = model._value_loss_eager(obs, actions)
    assert seen == [3 * 64] and target_q.shape == (64,)
    # A CPU run stays repeatable, and the option changes the update (0 is the plain batch; FDVL's default is 1,
    # XQL's 0).
    assert FDVL().random_actions == 1 and XQL().random_actions == 0
    twice = [FDVL(**SMALL, random_state=4).fit(ds, n_steps=20, progress=False) for _ in range(2)]
    plain = FDVL(**SMALL, random_actions=0, random_state=4).fit(ds, n_steps=20, progress=False)
    for p, q, r in zip(twice[0].value_.parameters(), twice[1].value_.parameters(), plain.value_.parameters()):
        assert torch.equal(p, q)
    assert not all(torch.equal(p, r) for p, r in zip(twice[0].value_.parameters(), plain.value_.parameters()))
    with pytest.raises(InvalidParameterError, match="random_actions"):
        XQL(random_actions=-1).check_params()


def test_action_noise_perturbs_the_value_losss_actions_only():
    """The authors' --noise: the value loss sees the data actions plus clipped Gaussian noise (in units of half the
    action range), inside the box; the Q' returned for the actor is the data actions' own."""
    ds = pendulum_shaped_dataset()  # actions in [-2, 2]
    model = XQL(**SMALL, action_noise=0.1, random_state=0).fit(ds, n_steps=5, progress=False)
    actions = torch.as_tensor(ds.actions[:2000])
    noisy = model._with_action_noise(actions)
    step = noisy - actions
    assert noisy.min() >= -2.0 and noisy.max() <= 2.0
    assert step.abs().max() <= 1.0 + 1e-6  # 0.5 of the half-range 2
    inside = (actions.abs() < 1.5).squeeze(-1)  # away from the box's edges the noise is N(0, (0.1 * 2)^2)
    assert float(step[inside].std()) == pytest.approx(0.2, rel=0.1)
    obs = torch.as_tensor(ds.observations[:64])
    seen = []
    original = model._target_min
    model._target_min = lambda critic, o, a: seen.append(a) or original(critic, o, a)
    _, target_q = model._value_loss_eager(obs, actions[:64])
    assert not torch.equal(seen[0], actions[:64]) and torch.equal(seen[1], actions[:64])
    assert torch.equal(target_q, original(model.critic_target_, obs, actions[:64]))
    with pytest.raises(InvalidParameterError, match="action_noise"):
        FDVL(action_noise=-0.1).check_params()


@pytest.mark.parametrize("make", [lambda: XQL(**SMALL), lambda: FDVL(divergence="chi2", **SMALL),
                                  lambda: FDVL(divergence="tv", **SMALL)])
def test_xql_and_fdvl_learn_a_contextual_bandit(make):
    from test_algos import bandit_dataset, best_action

    ds = bandit_dataset()
    model = make().set_params(random_state=0, reward_normalization=None).fit(ds, n_steps=1500, progress=False)
    obs = np.random.default_rng(1).normal(size=(500, 3)).astype(np.float32)
    error = np.abs(model.predict(obs)[:, 0] - best_action(obs)).mean()
    assert error < 0.25  # uniform actions would be ~0.5 off


def test_save_load_clone_and_resume_of_xql(tmp_path):
    ds = pendulum_shaped_dataset()
    model = XQL(**SMALL, random_state=0).fit(ds, n_steps=12, progress=False, log_dir=tmp_path / "a",
                                             checkpoint_every=6)
    model.save(tmp_path / "xql.pt")
    loaded = offrl.load(tmp_path / "xql.pt")
    np.testing.assert_array_equal(loaded.predict(ds.observations[:5]), model.predict(ds.observations[:5]))
    assert sklearn.base.clone(model).get_params() == model.get_params()
    stop_at_6 = [lambda algo, step, metrics: step < 6]  # an interrupted run, then its resumption
    XQL(**SMALL, random_state=0).fit(ds, n_steps=12, progress=False, log_dir=tmp_path / "b", checkpoint_every=6,
                                     log_every=6, callbacks=stop_at_6)
    resumed = XQL(**SMALL, random_state=0).fit(ds, n_steps=12, progress=False, log_dir=tmp_path / "b",
                                                checkpoint_every=6, resume=True)
    np.testing.assert_array_equal(resumed.predict(ds.observations[:5]), model.predict(ds.observations[:5]))


def test_presets_carry_xqls_per_dataset_temperatures():
    assert preset_params("XQL", "hopper-medium-v2") == {"beta": 5.0, "max_clip": 7.0}
    assert preset_params("XQL", "hopper-medium-replay-v2") == {"beta": 2.0, "max_clip": 7.0}
    # hopper_expert.sh (medium-expert) adds --sample_random_times=1
    assert preset_params("XQL", "hopper-medium-expert-v2") == {"beta": 2.0, "max_clip": 7.0, "random_actions": 1}
    assert preset_params("XQL", "halfcheetah-medium-replay-v2") == {"beta": 1.0, "max_clip": 5.0}
    assert XQL.from_preset("walker2d-medium-replay-v2").beta == 5.0
    assert preset_params("FDVL", "hopper-medium-v2") == {}


# ---------------------------------------------------------------------------------------------- GORL


def expert_demos() -> Dataset:
    return pendulum_shaped_dataset(n_episodes=2, length=30, seed=7)


def states(model):
    return {f"{name}.{k}": v for name, module in model._state_objects().items() if not name.startswith("guide")
            for k, v in module.state_dict().items()}


@pytest.mark.parametrize("cls", [TD3PlusBC, IQL, XQL])
def test_gorl_with_a_constant_guide_is_the_base_algorithm_bit_for_bit(cls):
    ds = pendulum_shaped_dataset()
    base = cls(**SMALL, random_state=0).fit(ds, n_steps=8, progress=False)
    frozen = cls(**SMALL, random_state=0, guide=Guide(expert_demos(), lr=0.0, normalize=False)).fit(
        ds, n_steps=8, progress=False)
    frozen_normalized = cls(**SMALL, random_state=0, guide=Guide(expert_demos(), lr=0.0, normalize=True)).fit(
        ds, n_steps=8, progress=False)
    learning = cls(**SMALL, random_state=0, guide=Guide(expert_demos(), lr=1e-3)).fit(ds, n_steps=8, progress=False)
    a, b, c = states(base), states(frozen), states(learning)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)  # the meta step ran and changed nothing of the base update
    assert all(torch.equal(a[k], v) for k, v in states(frozen_normalized).items())  # 1 / mean(1) is 1 exactly
    assert not all(torch.equal(a[k], c[k]) for k in a)  # a learning guide does change it
    obs = torch.as_tensor(ds.observations[:64])
    act = torch.as_tensor(ds.actions[:64])
    assert torch.equal(frozen.guide_net_(frozen.obs_normalizer_(obs), act), torch.ones(64))
    assert learning.guide_net_(learning.obs_normalizer_(obs), act).std() > 0
    # the logs say how far the guide has moved from the constant: mean and spread of w over the last batch
    assert frozen.last_metrics_["guide_scale_mean"] == 1.0 and frozen.last_metrics_["guide_scale_std"] == 0.0
    assert learning.last_metrics_["guide_scale_std"] > 0


def test_the_guide_moves_toward_samples_that_bring_the_policy_to_the_expert():
    """TD3+BC on a bandit whose Q favours +1 everywhere, expert at -0.5: the guide damps improvement
    (scales below 1) on average, since each Q step moves the policy away from the expert."""
    rng = np.random.default_rng(0)
    n = 512
    obs = rng.normal(size=(n, 3)).astype(np.float32)
    actions = rng.uniform(-1, 1, (n, 1))
    ds = Dataset.from_arrays(obs, actions, rewards=actions[:, 0], terminals=np.ones(n), next_observations=obs,
                             action_low=-1.0, action_high=1.0)
    demos = Dataset.from_arrays(obs[:64], np.full((64, 1), -0.5), rewards=np.zeros(64), terminals=np.ones(64),
                                next_observations=obs[:64], action_low=-1.0, action_high=1.0)
    model = TD3PlusBC(**SMALL, random_state=0, guide=Guide(demos, lr=1e-3, normalize=False)).fit(
        ds, n_steps=400, progress=False)
    scales = model.guide_net_(model.obs_normalizer_(torch.as_tensor(obs)), torch.as_tensor(actions, dtype=torch.float32))
    assert scales.mean() < 0.9
    # normalised per batch, the guide cannot damp every sample: the batch's mean scale stays 1 (it still varies)
    model = TD3PlusBC(**SMALL, random_state=0, guide=Guide(demos, lr=1e-3, normalize=True)).fit(
        ds, n_steps=400, progress=False)
    assert model.last_metrics_["guide_scale_mean"] == pytest.approx(1.0, abs=1e-5)
    assert model.last_metrics_["guide_scale_std"] > 0


def test_guide_is_saved_and_loaded_with_the_model_and_resumes_exactly(tmp_path):
    ds = pendulum_shaped_dataset()
    guide = Guide(expert_demos(), lr=1e-3, hidden_dims=(16,))
    model = TD3PlusBC(**SMALL, random_state=0, guide=guide).fit(ds, n_steps=12, progress=False,
                                                                log_dir=tmp_path / "a", checkpoint_every=6)
    model.save(tmp_path / "gorl.pt")
    loaded = offrl.load(tmp_path / "gorl.pt")
    assert isinstance(loaded.guide, Guide) and loaded.guide.get_params()["lr"] == 1e-3
    np.testing.assert_array_equal(loaded.guide.expert.observations, guide.expert.observations)
    for p, q in zip(loaded.guide_net_.state_dict().values(), model.guide_net_.state_dict().values()):
        assert torch.equal(p, q)
    np.testing.assert_array_equal(loaded.predict(ds.observations[:5]), model.predict(ds.observations[:5]))
    TD3PlusBC(**SMALL, random_state=0, guide=guide).fit(ds, n_steps=12, progress=False, log_dir=tmp_path / "b",
                                                        checkpoint_every=6, log_every=6,
                                                        callbacks=[lambda algo, step, metrics: step < 6])
    resumed = TD3PlusBC(**SMALL, random_state=0, guide=guide).fit(ds, n_steps=12, progress=False,
                                                                  log_dir=tmp_path / "b", checkpoint_every=6,
                                                                  resume=True)
    for p, q in zip(resumed.guide_net_.state_dict().values(), model.guide_net_.state_dict().values()):
        assert torch.equal(p, q)
    np.testing.assert_array_equal(resumed.predict(ds.observations[:5]), model.predict(ds.observations[:5]))
    clone = sklearn.base.clone(model)
    assert not hasattr(clone, "guide_net_")
    assert isinstance(clone.guide, Guide) and clone.guide.lr == 1e-3 and clone.guide.hidden_dims == (16,)


def test_guide_parameter_forms_and_errors(tmp_path):
    demos = expert_demos()
    demos.save(tmp_path / "demos.npz")
    assert as_guide(None) is None
    assert as_guide(demos).expert is demos
    assert as_guide(str(tmp_path / "demos.npz")).expert == str(tmp_path / "demos.npz")
    assert as_guide({"expert": demos, "lr": 3e-4}).lr == 3e-4
    with pytest.raises(TypeError, match="not Guide parameters"):
        as_guide({"experts": demos})
    with pytest.raises(InvalidParameterError, match="guide"):
        IQL(guide=3).check_params()
    ds = pendulum_shaped_dataset()
    model = IQL(**SMALL, random_state=0, guide=str(tmp_path / "demos.npz")).fit(ds, n_steps=3, progress=False)
    assert "guide_loss" in model.last_metrics_
    with pytest.raises(ValueError, match="Guide needs expert demonstrations"):
        IQL(**SMALL, guide=Guide()).fit(ds, n_steps=1, progress=False)
    wrong = Dataset.from_arrays(np.zeros((4, 5)), np.zeros((4, 1)), np.zeros(4), terminals=np.ones(4),
                                next_observations=np.zeros((4, 5)))
    with pytest.raises(ValueError, match="Guide expert has observation/action dims"):
        IQL(**SMALL, guide=wrong).fit(ds, n_steps=1, progress=False)


# ---------------------------------------------------------------------------------------------- ReCOIL


def test_recoil_trains_on_data_without_rewards_with_half_expert_batches():
    mixed = pendulum_shaped_dataset().without_rewards()
    assert not mixed.is_labelled("rewards")
    model = ReCOIL(expert=expert_demos(), **dict(SMALL, batch_size=40), random_state=0)
    sampler_counts = []
    original = model._make_sampler

    def spy(dataset):
        sampler = original(dataset)
        sampler_counts.append(sampler.counts)
        return sampler

    model._make_sampler = spy
    model.fit(mixed, n_steps=20, progress=False)
    assert sampler_counts == [[20, 20]]
    assert np.isfinite(model.last_metrics_["critic_loss"])
    with pytest.raises(ValueError, match="ReCOIL needs expert demonstrations"):
        ReCOIL(**SMALL).fit(mixed, n_steps=1, progress=False)
    with pytest.raises(ValueError, match="no online fine-tuning"):
        model.fit_online("Pendulum-v1", n_steps=1)


def test_recoil_ignores_rewards_entirely():
    ds = pendulum_shaped_dataset()
    a = ReCOIL(expert=expert_demos(), **SMALL, random_state=0).fit(ds, n_steps=10, progress=False)
    b = ReCOIL(expert=expert_demos(), **SMALL, random_state=0).fit(ds.without_rewards(), n_steps=10, progress=False)
    for p, q in zip(a.policy_.state_dict().values(), b.policy_.state_dict().values()):
        assert torch.equal(p, q)


def test_recoil_actor_data_all_trains_the_actor_on_the_expert_half_too():
    """The authors' actor (`actor_data="mixed"`) reads only the mixed half: after one update its policy does not
    depend on the demonstrations' actions (they are not in the mixed source here). With "all" it does."""
    mixed = pendulum_shaped_dataset().without_rewards()
    demos = expert_demos()
    other = demos.with_actions(-np.asarray(demos.actions))

    def policy_after_one_update(actor_data, expert):
        model = ReCOIL(expert=expert, expert_in_mixed=False, actor_data=actor_data, **SMALL, random_state=0)
        return model.fit(mixed, n_steps=1, progress=False).policy_.state_dict()

    def same(a, b):
        return all(torch.equal(a[k], b[k]) for k in a)

    assert same(policy_after_one_update("mixed", demos), policy_after_one_update("mixed", other))
    assert not same(policy_after_one_update("all", demos), policy_after_one_update("all", other))
    with pytest.raises(InvalidParameterError, match="actor_data"):
        ReCOIL(expert=demos, actor_data="expert").check_params()


@pytest.mark.slow
def test_recoil_imitates_the_expert_better_than_bc_on_the_union():
    """A 1-D walk x' = x + a/2 (plus a noise feature): the expert steers to 0 (a = clip(-x)), the mixed data acts
    at random. ReCOIL with the authors' actor, given 3 expert episodes and no rewards, lands closer to the expert
    than BC on the union (measured 0.19 against 0.76 mean action error; BC on the 3 episodes alone 0.17)."""
    rng = np.random.default_rng(0)

    def expert_action(x):
        return np.clip(-x[..., :1], -1, 1)

    def episodes(n, expert):
        out = []
        for _ in range(n):
            x = np.zeros((21, 2))
            x[0] = [rng.uniform(-2, 2), rng.normal()]
            actions = []
            for t in range(20):
                a = expert_action(x[t]) if expert else rng.uniform(-1, 1, 1)
                actions.append(a)
                x[t + 1] = [x[t, 0] + 0.5 * a[0], rng.normal()]
            out.append({"observations": x, "actions": np.array(actions), "rewards": None,
                        "truncations": [False] * 19 + [True]})
        return Dataset.from_episodes(out, action_low=-1.0, action_high=1.0)

    mixed, demos = episodes(100, False), episodes(3, True)
    union = Dataset.concatenate([mixed, demos])
    recoil = ReCOIL(expert=demos, hidden_dims=(64, 64), actor_data="mixed", random_state=0)
    recoil.fit(mixed, n_steps=3000, progress=False)
    bc = BC(hidden_dims=(64, 64), random_state=0).fit(union, n_steps=3000, progress=False)
    obs = np.stack([rng.uniform(-2, 2, 500), rng.normal(size=500)], 1).astype(np.float32)
    target = expert_action(obs)
    recoil_error = np.abs(recoil.predict(obs) - target).mean()
    bc_error = np.abs(bc.predict(obs) - target).mean()
    assert recoil_error < 0.7 * bc_error, (recoil_error, bc_error)
    # The mixed data holds no expert actions beyond the 3 episodes, so the default actor, which also reads the
    # expert half, lands closer still (measured 0.12, below BC on the 3 episodes alone, 0.17).
    recoil_all = ReCOIL(expert=demos, hidden_dims=(64, 64), random_state=0)
    assert recoil_all.actor_data == "all"
    recoil_all.fit(mixed, n_steps=3000, progress=False)
    all_error = np.abs(recoil_all.predict(obs) - target).mean()
    assert all_error < 0.8 * recoil_error, (all_error, recoil_error)


def test_the_awr_weight_meta_gradient_stays_finite_where_exp_overflows():
    """GORL differentiates IQL's AWR weights with respect to per-sample temperatures; a clipped weight whose
    exponent overflows (exp = inf) gave 0 * inf = NaN in that gradient. The weights are unchanged, bit for bit."""
    from offrl.algos.losses import awr_actor_loss

    advantage = torch.tensor([-2.0, 0.1, 1.0, 40.0])
    log_prob = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    beta = torch.tensor([3.0, 3.0, 3.0, 3.0], requires_grad=True)
    naive = -(torch.exp(beta * advantage).clamp(max=100.0) * log_prob).mean()
    naive.backward()
    assert torch.isnan(beta.grad).any()  # the overflowing sample: exp(120) = inf in float32
    beta.grad = None
    loss = awr_actor_loss(advantage, log_prob, beta, 100.0)
    loss.backward()
    assert torch.isfinite(beta.grad).all() and beta.grad[3] == 0.0
    assert torch.equal(loss.detach(), naive.detach())
    rng = torch.Generator().manual_seed(0)
    a, lp = torch.randn(4096, generator=rng) * 3, torch.randn(4096, generator=rng)
    assert torch.equal(awr_actor_loss(a, lp, 3.0, 100.0), -(torch.exp(3.0 * a).clamp(max=100.0) * lp).mean())
