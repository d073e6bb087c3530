"""Each offline algorithm on a tiny problem: losses finite and moving the right way, the policy
moving towards the best action, and save/load/clone/resume; plus the algorithm-specific pieces
(TD3+BC's delayed actor, IQL's schedule and reward scaling, CQL's Lagrange variant, Cal-QL's
Monte-Carlo bounds and parameters, presets) and the shared losses."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import sklearn.base
import torch

import offrl
from offrl.algos import BC, CQL, IQL, CalQL, TD3PlusBC
from offrl.algos.cql import calql_mc_returns, cql_penalty
from offrl.algos.iql import expectile_loss
from offrl.algos.losses import LearnedScale, critic_td_loss, sac_actor_loss, temperature_loss
from offrl.algos.presets import preset_params
from offrl.datasets import Dataset
from offrl.ope.fqe import FQE

ALGORITHMS = [BC, TD3PlusBC, IQL, CQL, CalQL]
CRITIC_ALGORITHMS = [TD3PlusBC, IQL, CQL, CalQL]
SMALL = dict(hidden_dims=(64, 64), batch_size=64)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny networks gain nothing from more threads, and a shared CPU punishes OpenMP spinning."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def best_action(obs: np.ndarray) -> np.ndarray:
    return 0.8 * np.tanh(2.0 * obs[:, 0])


def bandit_dataset(n: int = 2000, seed: int = 0) -> Dataset:
    """One-step episodes: r = 1 - 4 (a - a*(s))^2; half the actions near a*(s), half uniform."""
    rng = np.random.default_rng(seed)
    obs = rng.normal(size=(n, 3)).astype(np.float32)
    best = best_action(obs)
    good = np.clip(best + 0.2 * rng.normal(size=n), -1, 1)
    actions = np.where(rng.random(n) < 0.5, good, rng.uniform(-1, 1, n))[:, None]
    rewards = 1.0 - 4.0 * (actions[:, 0] - best) ** 2
    return Dataset.from_arrays(obs, actions, rewards, terminals=np.ones(n), next_observations=rng.normal(size=(n, 3)),
                               action_low=-1.0, action_high=1.0, metadata={"name": "bandit"})


def episodic_dataset(n_episodes: int = 6, length: int = 30, seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    episodes = []
    for i in range(n_episodes):
        episodes.append({"observations": rng.normal(size=(length + 1, 3)), "actions": rng.uniform(-1, 1, (length, 2)),
                         "rewards": rng.normal(size=length),
                         "terminations": [False] * (length - 1) + [i % 2 == 0],
                         "truncations": [False] * (length - 1) + [i % 2 == 1]})
    return Dataset.from_episodes(episodes, action_low=-1.0, action_high=1.0, metadata={"name": "toy-episodes"})


@pytest.fixture(scope="module")
def bandit() -> Dataset:
    return bandit_dataset()


@pytest.fixture(scope="module")
def episodic() -> Dataset:
    return episodic_dataset()


def state_of(algo) -> dict[str, torch.Tensor]:
    return {f"{name}.{k}": v.clone() for name, module in algo._state_objects().items()
            for k, v in module.state_dict().items()}


# ---------------------------------------------------------------------- learning on a tiny problem
@pytest.mark.parametrize("cls", ALGORITHMS, ids=lambda c: c.__name__)
def test_losses_finite_and_policy_moves_towards_the_best_action(cls, bandit, tmp_path):
    obs = np.random.default_rng(1).normal(size=(500, 3)).astype(np.float32)
    algo = cls(**SMALL, random_state=0)
    algo.fit(bandit, n_steps=0, progress=False)  # builds the initial networks
    initial_error = np.abs(algo.predict(obs)[:, 0] - best_action(obs)).mean()
    if cls is not BC:
        scale, bias = algo.spec_["reward_scale"], algo.spec_["reward_bias"]
        target = bandit.rewards * scale + bias  # one-step episodes: Q(s, a) should become r
        initial_fit = np.corrcoef(algo.predict_value(bandit.observations, bandit.actions), target)[0, 1]

    algo.fit(bandit, n_steps=400, log_dir=tmp_path, log_every=50, progress=False)
    with open(tmp_path / "train.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8
    assert all(math.isfinite(float(v)) for row in rows for v in row.values())
    error = np.abs(algo.predict(obs)[:, 0] - best_action(obs)).mean()
    assert error < 0.75 * initial_error, (initial_error, error)
    if cls is not BC:
        # (correlation, not squared error: IQL's rewards are scaled by 1000 / return range, so
        # matching their size takes longer than this test runs)
        fit = np.corrcoef(algo.predict_value(bandit.observations, bandit.actions), target)[0, 1]
        assert fit > 0.35 and fit > initial_fit + 0.25, (initial_fit, fit)


@pytest.mark.parametrize("cls", CRITIC_ALGORITHMS, ids=lambda c: c.__name__)
def test_bf16_precision_trains_with_finite_losses(cls, bandit):
    algo = cls(**SMALL, precision="bf16", random_state=0).fit(bandit, n_steps=30, progress=False)
    assert all(math.isfinite(v) for v in algo.last_metrics_.values())
    assert all(p.dtype == torch.float32 for p in algo.critic_.parameters())


# ---------------------------------------------------------------------- save / load / clone / resume
@pytest.mark.parametrize("cls", ALGORITHMS, ids=lambda c: c.__name__)
def test_save_load_clone_and_resume(cls, episodic, tmp_path):
    small = dict(hidden_dims=(32, 32), batch_size=32)
    full = cls(**small, random_state=0).fit(episodic, n_steps=30, log_every=10, progress=False)

    full.save(tmp_path / "model.pt")
    loaded = offrl.load(tmp_path / "model.pt")
    obs, actions = episodic.observations[:20], episodic.actions[:20]
    np.testing.assert_array_equal(loaded.predict(obs), full.predict(obs))
    if cls is not BC:
        np.testing.assert_array_equal(loaded.predict_value(obs, actions), full.predict_value(obs, actions))

    clone = sklearn.base.clone(full)
    assert clone.get_params() == full.get_params() and not hasattr(clone, "spec_")

    log_dir = tmp_path / "run"
    cls(**small, random_state=0).fit(episodic, n_steps=30, log_dir=log_dir, checkpoint_every=10, log_every=10, progress=False,
                                     callbacks=[lambda algo, step, metrics: step < 20])
    resumed = cls(**small, random_state=0).fit(episodic, n_steps=30, log_dir=log_dir, checkpoint_every=10, log_every=10,
                                               resume=True, progress=False)
    a, b = state_of(full), state_of(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("cls", [*ALGORITHMS, FQE], ids=lambda c: c.__name__)
def test_log_every_is_a_constructor_parameter_that_clone_keeps(cls):
    assert cls().get_params()["log_every"] == 100
    assert sklearn.base.clone(cls(log_every=7)).log_every == 7


def test_the_estimators_log_every_sets_the_logging_interval(bandit, tmp_path):
    BC(**SMALL, log_every=5, random_state=0).fit(bandit, n_steps=20, log_dir=tmp_path, progress=False)
    with open(tmp_path / "train.csv") as f:
        assert [int(row["step"]) for row in csv.DictReader(f)] == [5, 10, 15, 20]


# ---------------------------------------------------------------------- algorithm-specific
def test_td3_bc_updates_the_actor_every_second_step(bandit):
    algo = TD3PlusBC(**SMALL, random_state=0).fit(bandit, n_steps=0, progress=False)
    initial = {k: v.clone() for k, v in algo.policy_.state_dict().items()}
    target = {k: v.clone() for k, v in algo.critic_target_.state_dict().items()}
    batch = algo._make_sampler(bandit).gather(torch.arange(64))
    algo._update(batch, 0)
    assert all(torch.equal(v, algo.policy_.state_dict()[k]) for k, v in initial.items())
    assert all(torch.equal(v, algo.critic_target_.state_dict()[k]) for k, v in target.items())
    algo._update(batch, 1)
    assert not all(torch.equal(v, algo.policy_.state_dict()[k]) for k, v in initial.items())
    assert not all(torch.equal(v, algo.critic_target_.state_dict()[k]) for k, v in target.items())


def test_iql_scales_rewards_by_the_return_range_and_decays_the_actor_lr(episodic):
    algo = IQL(hidden_dims=(32, 32), batch_size=32, random_state=0).fit(episodic, n_steps=20, progress=False)
    returns = episodic.episode_returns()
    assert algo.spec_["reward_scale"] == pytest.approx(1000.0 / (returns.max() - returns.min()), rel=1e-6)
    # cosine decay over the 20 steps of this run: the last update used lr * (1 + cos(pi * 19/20)) / 2
    assert algo.actor_optimizer_.param_groups[0]["lr"] == pytest.approx(3e-4 * 0.5 * (1 + math.cos(math.pi * 19 / 20)))
    assert algo.critic_optimizer_.param_groups[0]["lr"] == 3e-4
    raw = IQL(hidden_dims=(32, 32), reward_normalization=None, reward_bias=-1.0).fit(episodic, n_steps=1, progress=False)
    assert (raw.spec_["reward_scale"], raw.spec_["reward_bias"]) == (1.0, -1.0)


def test_expectile_loss_weights_positive_errors_by_tau():
    diff = torch.tensor([2.0, -2.0])
    assert expectile_loss(diff[:1], 0.7).item() == pytest.approx(0.7 * 4)
    assert expectile_loss(diff[1:], 0.7).item() == pytest.approx(0.3 * 4)


def test_cql_penalty_is_logsumexp_minus_data_q():
    q_data = torch.tensor([[1.0, 2.0]])
    q_sampled = torch.tensor([[[0.0, 1.0], [math.log(3.0), 1.0]]])  # (1 critic, 2 samples, 2 states)
    gap = cql_penalty(q_data, q_sampled, torch.zeros(2, 2))
    expected = ((math.log(1 + 3) - 1.0) + (math.log(2 * math.e) - 2.0)) / 2
    assert gap.item() == pytest.approx(expected)


def test_cql_lagrange_learns_alpha_prime(bandit):
    algo = CQL(**SMALL, lagrange=True, target_action_gap=10.0, random_state=0).fit(bandit, n_steps=50, progress=False)
    # the gap stays below the (large) target, so alpha' shrinks from its initial e
    assert algo.last_metrics_["alpha_prime"] < math.e
    assert algo.alpha_prime_.log_value.grad is not None
    # the modules return the multipliers themselves; their parameter is the log
    with torch.no_grad():
        assert algo.alpha_prime_().item() == pytest.approx(math.exp(algo.alpha_prime_.log_value.item()))
        assert algo.temperature_().item() == pytest.approx(algo.last_metrics_["alpha"], rel=1e-2)
    assert {"temperature_", "alpha_prime_"} <= set(algo._state_objects())


def test_cql_rejects_a_non_positive_init_alpha(bandit):
    with pytest.raises(ValueError, match="init_alpha must be a real number > 0"):
        CQL(**SMALL, init_alpha=0.0).fit(bandit, n_steps=1, progress=False)


def test_calql_mc_returns_follow_the_episodes():
    rewards = np.array([1.0, 2.0, 3.0, 0.0, 0.0, 5.0], np.float32)
    ds = Dataset.from_arrays(np.zeros((6, 2)), np.zeros((6, 1)), rewards, terminals=[0, 0, 1, 0, 0, 0],
                             timeouts=[0, 0, 0, 0, 0, 1], next_observations=np.zeros((6, 2)))
    gamma = 0.9
    got = calql_mc_returns(ds, rewards, gamma)
    expected = [1 + gamma * 2 + gamma**2 * 3, 2 + gamma * 3, 3, gamma**2 * 5, gamma * 5, 5]
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    # sparse rewards: an episode ending on the lowest reward failed and is worth r_min / (1 - gamma) throughout
    sparse = np.array([0.0, 0.0, 1.0, 0.0, 0.0, 0.0], np.float32) - 1.0  # episode 1 reaches the goal, 2 fails
    got = calql_mc_returns(ds.with_rewards(sparse), sparse, gamma, sparse_rewards=True)
    np.testing.assert_allclose(got[:3], [-1 - gamma, -1, 0], rtol=1e-6)
    np.testing.assert_allclose(got[3:], -1.0 / (1 - gamma), rtol=1e-6)


def test_calql_sparse_failure_needs_every_reward_at_the_minimum():
    """An episode that reached the goal and then left it is no failure (reference: all rewards == r_neg).

    The old rule looked at the last reward only and gave this episode r_min / (1 - gamma) everywhere.
    """
    gamma = 0.9
    rewards = np.array([-1.0, 0.0, -1.0, -1.0, -1.0, -1.0], np.float32)  # episode 1: goal at step 1, then left
    ds = Dataset.from_arrays(np.zeros((6, 2)), np.zeros((6, 1)), rewards, terminals=[0, 0, 0, 0, 0, 0],
                             timeouts=[0, 0, 1, 0, 0, 1], next_observations=np.zeros((6, 2)))
    got = calql_mc_returns(ds, rewards, gamma, sparse_rewards=True)
    np.testing.assert_allclose(got[:3], [-1 + gamma * 0 + gamma**2 * -1, 0 + gamma * -1, -1], rtol=1e-6)
    np.testing.assert_allclose(got[3:], -1.0 / (1 - gamma), rtol=1e-6)  # episode 2 never reached the goal


def test_calql_clips_policy_q_values_at_the_mc_return(episodic):
    algo = CalQL(hidden_dims=(32, 32), batch_size=32, random_state=0).fit(episodic, n_steps=2, progress=False)
    q = torch.tensor([[[-5.0, 0.0], [3.0, -1.0]]])  # (1 critic, 2 samples, 2 states)
    clipped = algo._penalized_policy_q(q, {"mc_returns": torch.tensor([1.0, -0.5])})
    assert clipped.tolist() == [[[1.0, 0.0], [3.0, -0.5]]]
    assert CQL()._penalized_policy_q(q, {}) is q


def test_calql_has_every_cql_parameter_plus_sparse_rewards(episodic, tmp_path):
    assert set(CalQL().get_params()) == set(CQL().get_params()) | {"sparse_rewards"}
    assert CalQL().get_params() == {**CQL().get_params(), "sparse_rewards": False}  # CQL's defaults
    assert repr(CalQL()) == "CalQL()" and repr(CalQL(cql_alpha=1.0, sparse_rewards=True)) == (
        "CalQL(cql_alpha=1.0, sparse_rewards=True)")
    algo = CalQL(cql_alpha=2.0, sparse_rewards=True, log_every=5)
    clone = sklearn.base.clone(algo)
    assert type(clone) is CalQL and clone.get_params() == algo.get_params()
    clone.set_params(lagrange=True, sparse_rewards=False)
    assert (clone.lagrange, clone.sparse_rewards, clone.cql_alpha) == (True, False, 2.0)
    with pytest.raises(ValueError, match="Invalid parameter"):
        clone.set_params(no_such_parameter=1)
    with pytest.raises(TypeError, match="no_such_parameter"):
        CalQL(no_such_parameter=1)
    algo.set_params(hidden_dims=(16, 16), batch_size=16, random_state=0).fit(episodic, n_steps=3, progress=False)
    algo.save(tmp_path / "calql.pt")
    loaded = offrl.load(tmp_path / "calql.pt")
    assert type(loaded) is CalQL and loaded.get_params() == {**algo.get_params(), "device": loaded.device}
    np.testing.assert_array_equal(loaded.predict(episodic.observations[:5]), algo.predict(episodic.observations[:5]))


def test_shared_losses_match_their_definitions():
    q = torch.tensor([[1.0, 2.0, 3.0], [0.0, 2.0, 5.0]])
    target = torch.tensor([1.0, 1.0, 1.0])
    # sum over the two critics of each one's mean squared TD error
    assert critic_td_loss(q, target).item() == pytest.approx((0 + 1 + 4) / 3 + (1 + 1 + 16) / 3)
    log_prob, alpha = torch.tensor([-1.0, -3.0]), torch.tensor(0.5)
    assert sac_actor_loss(log_prob, torch.tensor([2.0, 4.0]), alpha).item() == pytest.approx(
        ((0.5 * -1 - 2) + (0.5 * -3 - 4)) / 2)
    log_alpha = torch.tensor(0.3, requires_grad=True)
    loss = temperature_loss(log_alpha, log_prob.requires_grad_(), target_entropy=1.0)
    loss.backward()
    assert loss.item() == pytest.approx(-0.3 * ((-1 + 1) + (-3 + 1)) / 2)
    assert log_alpha.grad.item() == pytest.approx(1.0) and log_prob.grad is None  # log pi is not trained by it
    scale = LearnedScale(2.0)
    assert scale().item() == pytest.approx(2.0) and scale.log_value.item() == pytest.approx(math.log(2.0))
    with pytest.raises(ValueError, match="init_value must be positive"):
        LearnedScale(0.0)


def test_presets_are_data_and_match_whole_words():
    assert IQL.from_preset("antmaze-umaze-v2").get_params()["expectile"] == 0.9
    assert IQL.from_preset("antmaze-umaze-v2", temperature=5.0).temperature == 5.0
    assert preset_params("IQL", "hopper-medium-v2") == {}
    assert preset_params("IQL", "pendulum-medium-v1") == {}  # not Adroit's "pen"
    assert preset_params("IQL", "pen-human-v1")["dropout"] == 0.1
    assert preset_params("CQL", "D4RL/antmaze/umaze-v1")["lagrange"] is True
    assert CalQL.from_preset("antmaze-large-play-v2").sparse_rewards is True


def test_antmaze_presets_use_the_reference_configs_deeper_critics():
    for cls in (CQL, CalQL):
        algo = cls.from_preset("antmaze-medium-play-v2", hidden_dims=(8, 8), batch_size=8, random_state=0)
        assert tuple(algo.critic_hidden_dims) == (256,) * 4
        assert cls.from_preset("hopper-medium-v2").critic_hidden_dims is None
    assert CalQL.from_preset("door-cloned-v1").cql_alpha == 1.0  # official run_adroit.sh and CORL: 1.0
    algo = CQL(hidden_dims=(8,), critic_hidden_dims=(16, 16, 16), batch_size=8, random_state=0)
    algo.fit(Dataset.from_arrays(np.zeros((20, 2)), np.zeros((20, 1)), np.zeros(20), timeouts=[0] * 19 + [1]),
             n_steps=1, progress=False)
    critic_weights = [tuple(p.shape[1:]) for n, p in algo.critic_.named_parameters() if n.endswith("weight")]
    assert critic_weights == [(3, 16), (16, 16), (16, 16), (16, 1)]
    policy_weights = [tuple(p.shape) for n, p in algo.policy_.named_parameters() if n.endswith("weight")]
    assert policy_weights == [(8, 2), (2, 8)]  # the actor keeps hidden_dims
    with pytest.raises(ValueError, match="no presets"):
        preset_params("NoSuchAlgo", "hopper")
    for cls in ALGORITHMS:  # every preset names real hyper-parameters
        for name in ("antmaze-umaze-v2", "pen-human-v1", "kitchen-mixed-v0"):
            cls.from_preset(name)


def test_review_fixes_in_parameter_rules():
    import torch as _torch

    from offrl.algos.params import InvalidParameterError

    IQL(device=_torch.device("cpu")).check_params()  # a torch.device is a device
    with pytest.raises(InvalidParameterError, match="needs gamma < 1"):
        CalQL(sparse_rewards=True, gamma=1.0).check_params()  # was: ZeroDivisionError in the MC returns
    CalQL(sparse_rewards=False, gamma=1.0).check_params()


def test_every_hyper_parameter_of_every_algorithm_has_a_rule():
    import offrl.algos as algos
    from offrl.algos.base import BaseEstimator
    from offrl.algos.params import param_rules

    checked = 0
    for name in algos.__all__:
        cls = getattr(algos, name)
        if not isinstance(cls, type) or not issubclass(cls, BaseEstimator) or cls in (BaseEstimator,
                                                                                      algos.OfflineAlgorithm):
            continue
        missing = sorted(set(cls().get_params(deep=False)) - set(param_rules(cls)))
        assert not missing, f"{name} has hyper-parameters without a rule: {missing}"
        cls().check_params()  # the defaults pass their own rules
        checked += 1
    assert checked >= 10


def test_generative_presets_follow_the_papers_tables():
    from offrl.algos import EDP, FQL, OFQL, DiffusionQL

    # Diffusion-QL main.py: hopper-medium-replay gn 4.0, hopper-medium 9.0 (the longer name's row wins).
    assert preset_params("DiffusionQL", "hopper-medium-replay-v2") == {"max_grad_norm": 4.0}
    assert preset_params("DiffusionQL", "D4RL/hopper/medium-replay-v0") == {"max_grad_norm": 4.0}
    assert preset_params("DiffusionQL", "hopper-medium-v2") == {"max_grad_norm": 9.0}
    assert preset_params("DiffusionQL", "pendulum-medium-replay-v1") == {}
    medium_play = DiffusionQL.from_preset("antmaze-medium-play-v2")
    assert (medium_play.eta, medium_play.actor_lr, medium_play.max_q_backup) == (2.0, 1e-3, True)
    assert (medium_play.reward_scale, medium_play.reward_bias) == (4.0, -2.0)  # "cql_antmaze": (r - 0.5) * 4
    # OFQL keeps Diffusion-QL's settings except eta; EDP reads only the clip.
    assert OFQL.from_preset("antmaze-medium-play-v2").eta == OFQL().eta
    assert OFQL.from_preset("antmaze-medium-play-v2").max_q_backup is True
    assert preset_params("EDP", "walker2d-medium-v2") == {"max_grad_norm": 1.0}
    # FQL's README: pen-expert alpha 3000 (before pen's 10000), AntMaze large alpha 3.
    assert preset_params("FQL", "pen-expert-v1") == {"alpha": 3000.0, "q_agg": "min"}
    assert preset_params("FQL", "pen-human-v1") == {"alpha": 10000.0, "q_agg": "min"}
    assert preset_params("FQL", "antmaze-large-diverse-v2") == {"alpha": 3.0}
    assert preset_params("FQL", "antmaze-medium-diverse-v2") == {}
    assert preset_params("FQL", "pendulum-medium-v1") == {}  # "pen" must be a word, not a prefix
    for cls in (DiffusionQL, EDP, FQL, OFQL):
        for name in ("antmaze-umaze-v2", "pen-human-v1", "kitchen-mixed-v0", "hopper-medium-expert-v2"):
            cls.from_preset(name).check_params()
