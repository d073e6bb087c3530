"""Diffusion-QL, EDP (TD3 and IQL variants), FQL and OFQL as estimators.

What the generative policies are for (a multimodal behaviour, a ring of
Gaussians split by a context bit, whose modes they must each cover where a
Gaussian policy cannot), what the one-step models promise (one network
evaluation per action), and what every offrl estimator promises
(bit-identical save / load / clone / resume, deterministic `predict`,
TorchScript export equal to `predict`, nothing stale after acting mid-training,
bf16, hyper-parameter checks).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import pytest
import sklearn.base
import torch

import offrl
from conftest import make_episodes, pendulum_shaped_dataset
from offrl.algos import BC, EDP, FQL, OFQL, DiffusionQL
from offrl.algos.params import InvalidParameterError
from offrl.datasets import Dataset
from offrl.nn import MLP

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {"hidden_dims": (32, 32), "batch_size": 32}
# Tiny models for the bookkeeping tests.  The EMA starts at step 5 (default 1000) so that a 30-step run
# moves the EMA actor too, and a few options off the default path (max-Q backup, gradient clipping) run.
TINY_MODELS: dict[str, Callable[..., offrl.algos.OfflineAlgorithm]] = {
    "DiffusionQL": functools.partial(DiffusionQL, **TINY, n_diffusion_steps=3, n_action_samples=4, ema_start=5,
                                     ema_every=3, max_q_backup=True, n_backup_samples=3, max_grad_norm=1.0),
    "EDP-td3": functools.partial(EDP, variant="td3", **TINY, n_diffusion_steps=3, n_action_samples=4, ema_start=5,
                                 ema_every=3),
    "EDP-iql": functools.partial(EDP, variant="iql", **TINY, n_diffusion_steps=3, n_action_samples=4),
    "FQL": functools.partial(FQL, **TINY, actor_hidden_dims=(32, 32), flow_steps=3, n_action_samples=4),
    "OFQL": functools.partial(OFQL, **TINY, n_action_samples=4, ema_start=5, ema_every=3, max_grad_norm=1.0),
}


def state_of(algo) -> dict[str, torch.Tensor]:
    return {f"{name}.{k}": v.clone() for name, module in algo._state_objects().items()
            for k, v in module.state_dict().items()}


def assert_same_state(a, b) -> None:
    first, second = state_of(a), state_of(b)
    assert first.keys() == second.keys()
    different = [k for k in first if not torch.equal(first[k], second[k])]
    assert not different, different


@pytest.fixture(scope="module")
def episodic() -> Dataset:
    """Multi-step episodes (terminals and time-outs) with 2-d actions in [-1, 1]."""
    return Dataset.from_episodes(make_episodes(lengths=(30,) * 6, obs_dim=3, act_dim=2, log_probs=False),
                                 action_low=-1.0, action_high=1.0, metadata={"name": "toy-episodes"})


# ---------------------------------------------------------------------- a multimodal behaviour policy
# A ring of 8 Gaussians (radius 0.7, std 0.05); the observation is a context bit that picks every other one:
# context 0 the modes at 0, 90, 180 and 270 degrees, context 1 those rotated by 45 degrees.  A sample
# counts for a mode within 0.2 of its centre; the other context's modes are 0.54 away, so a policy that
# ignores the context puts about half its samples there and misses.  (With all 8 modes in each context,
# rotated by 22.5 degrees, the criterion cannot tell modes from a ring: the 0.2 discs of 8 modes cover
# 73% of a uniform ring of radius 0.7, and no model here learns that many modes in a CPU test's budget.)
RING_RADIUS, MODE_STD, NEAR = 0.7, 0.05, 0.2
MIN_MODE_SHARE, MIN_NEAR_SHARE = 0.05, 0.7


def mode_centres(context: int) -> np.ndarray:
    angles = np.pi / 2 * np.arange(4) + context * np.pi / 4
    return RING_RADIUS * np.stack([np.cos(angles), np.sin(angles)], axis=1)


def ring_dataset(n: int = 4000, seed: int = 0) -> Dataset:
    """One-step episodes, reward 0: nothing to learn but the behaviour distribution."""
    rng = np.random.default_rng(seed)
    context = rng.integers(0, 2, n)
    centres = np.stack([mode_centres(0), mode_centres(1)])[context, rng.integers(0, 4, n)]
    actions = np.clip(centres + MODE_STD * rng.normal(size=(n, 2)), -1.0, 1.0)
    obs = context[:, None].astype(np.float32)
    return Dataset.from_arrays(obs, actions, np.zeros(n), terminals=np.ones(n), next_observations=obs,
                               action_low=-1.0, action_high=1.0, metadata={"name": "ring-of-gaussians"})


def mode_shares(actions: np.ndarray, context: int) -> tuple[np.ndarray, float]:
    """(share of the samples within NEAR of each of the context's modes, share near any of them)."""
    near = np.linalg.norm(actions[:, None, :] - mode_centres(context)[None], axis=-1) < NEAR
    return near.mean(0), float(near.any(1).mean())


def covers_the_modes(actions: np.ndarray, context: int, min_near_share: float = MIN_NEAR_SHARE) -> bool:
    per_mode, near = mode_shares(actions, context)
    return bool(per_mode.min() >= MIN_MODE_SHARE and near >= min_near_share)


def context_obs(context: int, n: int = 1000) -> np.ndarray:
    return np.full((n, 1), float(context), np.float32)


def test_the_mode_criterion_tells_modes_from_a_ring_a_blur_and_the_wrong_context():
    """The criterion the generative policies must meet fails every unimodal or context-blind stand-in."""
    data = ring_dataset()
    rng = np.random.default_rng(1)
    by_context = [data.actions[data.observations[:, 0] == c][:1000] for c in (0, 1)]
    angles = rng.uniform(0, 2 * np.pi, 1000)
    uniform_ring = RING_RADIUS * np.stack([np.cos(angles), np.sin(angles)], axis=1)
    for c in (0, 1):
        assert covers_the_modes(by_context[c], c)  # the behaviour policy itself (~99% near)
        assert not covers_the_modes(by_context[1 - c], c)  # the other context's modes
        assert not covers_the_modes(data.actions[:1000], c)  # both contexts mixed: ignoring the context
        assert not covers_the_modes(uniform_ring, c)  # a ring without modes (36% near)
        fitted = rng.normal(by_context[c].mean(0), by_context[c].std(0), size=(1000, 2))  # a Gaussian fit
        assert not covers_the_modes(fitted, c)


@pytest.fixture(scope="module")
def ring() -> Dataset:
    return ring_dataset()


def test_a_gaussian_policy_fails_the_mode_criterion(ring):
    algo = BC(policy="gaussian", hidden_dims=(128, 128), lr=3e-3, random_state=0).fit(ring, n_steps=1000,
                                                                                     progress=False)
    for context in (0, 1):
        actions = algo.sample_action(context_obs(context))
        per_mode, near = mode_shares(actions, context)
        assert not covers_the_modes(actions, context), (per_mode, near)
        assert near < 0.5 * MIN_NEAR_SHARE  # not a near miss


# The Q terms are off (eta = alpha = 0) or vanish (zero rewards: Q -> 0, so EDP-iql's weights exp(3 A) -> 1
# and FQL's -Q -> 0).  Diffusion needs 20 steps here: with the default 5, even the exact noise predictor
# puts only 28% of the samples near a mode (the last DDPM step returns E[a | a_1], a blur of the modes).
DIFFUSION = {"n_diffusion_steps": 20, "hidden_dims": (128, 128, 128), "critic_hidden_dims": (32, 32),
             "actor_lr": 3e-3, "n_action_samples": 1}
RING_MODELS = {
    "EDP-td3": (functools.partial(EDP, variant="td3", alpha=0.0, **DIFFUSION), 2500),
    "DiffusionQL": (functools.partial(DiffusionQL, eta=0.0, batch_size=128, **DIFFUSION), 3000),
    "EDP-iql": (functools.partial(EDP, variant="iql", **DIFFUSION), 3000),
    "OFQL": (functools.partial(OFQL, eta=0.0, hidden_dims=(256, 256), critic_hidden_dims=(32, 32), actor_lr=1e-3),
             2000),
}
EDP_IQL_MISSES = pytest.mark.xfail(strict=True, reason=(
    "measured: ~12% of samples near a mode after 3000-6000 steps, where EDP-td3 with the same networks has 80% "
    "(its Gaussian regression of the x0 estimate, whose gradient grows as 1/abar_t, swamps the low-noise steps)"))
OFQL_MISSES = pytest.mark.xfail(strict=True, reason=(
    "measured: ~14% of samples near a mode after 2000 steps; the one-step samples (r=0, t=1, a pair the "
    "logit-normal times rarely draw) are not learnt in this budget and drift to the centre after ~2500 steps"))


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    "EDP-td3", "DiffusionQL",
    pytest.param("EDP-iql", marks=EDP_IQL_MISSES), pytest.param("OFQL", marks=OFQL_MISSES)])
def test_generative_policies_cover_every_mode_of_their_context(name, ring):
    make, n_steps = RING_MODELS[name]
    algo = make(random_state=0).fit(ring, n_steps=n_steps, progress=False)
    if name == "EDP-iql":  # the advantage-weighted term is plain regression here: weights exp(3 A) ~ 1
        with torch.no_grad():
            obs, actions = torch.as_tensor(ring.observations), torch.as_tensor(ring.actions)
            advantage = algo.critic_target_(obs, actions).min(0).values - algo.value_(obs)
        assert advantage.abs().max() < 0.01
    for context in (0, 1):
        actions = algo.sample_action(context_obs(context))
        assert covers_the_modes(actions, context), mode_shares(actions, context)


@pytest.mark.slow
def test_fql_flow_covers_every_mode_and_its_one_step_policy_every_mode_more_loosely(ring):
    """FQL acts with a one-step policy distilled from its flow; the flow meets the criterion, the student only
    a looser one in this budget (measured ~60% near a mode after 1000-3000 steps, the flow ~75-79%)."""
    algo = FQL(hidden_dims=(32, 32), actor_hidden_dims=(256, 256), actor_lr=3e-3, random_state=0)
    algo.fit(ring, n_steps=1500, progress=False)
    assert abs(algo.last_metrics_["q_loss"]) < 0.01  # -Q with Q -> 0: the policy is pure BC
    for context in (0, 1):
        with torch.no_grad():
            obs = algo.obs_normalizer_(torch.as_tensor(context_obs(context)))
            flow = algo.flow_policy_(obs, algo.flow_policy_.draw_noise(obs)).numpy()
        assert covers_the_modes(flow, context), mode_shares(flow, context)
        one_step = algo.sample_action(context_obs(context))
        per_mode, near = mode_shares(one_step, context)
        _, near_other = mode_shares(one_step, 1 - context)
        assert covers_the_modes(one_step, context, min_near_share=0.5), (per_mode, near)
        assert near_other < 0.5 * near  # it follows the context


# ---------------------------------------------------------------------- save / load / clone / resume
@pytest.mark.parametrize("name", TINY_MODELS)
def test_save_load_clone_resume_and_reruns_are_bit_identical(name, episodic, tmp_path):
    make = TINY_MODELS[name]
    full = make(random_state=0).fit(episodic, n_steps=30, log_every=10, progress=False)
    again = make(random_state=0).fit(episodic, n_steps=30, log_every=10, progress=False)
    assert_same_state(full, again)
    other_seed = state_of(make(random_state=1).fit(episodic, n_steps=30, log_every=10, progress=False))
    assert any(not torch.equal(v, other_seed[k]) for k, v in state_of(full).items())  # the seed matters

    obs, actions = episodic.observations[:20], episodic.actions[:20]
    full.save(tmp_path / "model.pt")
    loaded = offrl.load(tmp_path / "model.pt")
    assert type(loaded) is type(full)
    assert_same_state(full, loaded)
    np.testing.assert_array_equal(loaded.predict(obs), full.predict(obs))
    np.testing.assert_array_equal(loaded.predict_value(obs, actions), full.predict_value(obs, actions))

    clone = sklearn.base.clone(full)
    assert clone.get_params() == full.get_params() and not hasattr(clone, "spec_")

    log_dir = tmp_path / "run"
    make(random_state=0).fit(episodic, n_steps=30, log_dir=log_dir, checkpoint_every=10, log_every=10,
                             progress=False, callbacks=[lambda algo, step, metrics: step < 20])
    resumed = make(random_state=0).fit(episodic, n_steps=30, log_dir=log_dir, checkpoint_every=10, log_every=10,
                                       resume=True, progress=False)
    assert resumed.n_steps_done_ == 30
    assert_same_state(full, resumed)


# ---------------------------------------------------------------------- one network evaluation
class CallCounter:
    """Batch sizes of every call of the given modules (forward hooks), by name."""

    def __init__(self, **modules: torch.nn.Module) -> None:
        self.calls: dict[str, list[int]] = {name: [] for name in modules}
        self._handles = [module.register_forward_hook(self._hook(name)) for name, module in modules.items()]

    def _hook(self, name: str):
        def record(module, inputs, output) -> None:
            self.calls[name].append(inputs[0].shape[0])
        return record

    def reset(self) -> None:
        for calls in self.calls.values():
            calls.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def inner_networks(algo) -> dict[str, torch.nn.Module]:
    """The MLP that maps noise to an action in each policy, and the critics' networks."""
    nets = {"critic": algo.critic_.net, "critic_target": algo.critic_target_.net}
    if isinstance(algo, FQL):
        nets.update(policy=algo.policy_.net, flow=algo.flow_policy_.velocity.net)
    elif isinstance(algo, OFQL):
        nets.update(policy=algo.policy_.velocity.net, ema=algo.ema_policy_.velocity.net)
    else:
        nets.update(policy=algo.policy_.denoiser.net, ema=algo.ema_policy_.denoiser.net)
    assert isinstance(nets["policy"], MLP)
    return nets


@pytest.mark.parametrize("name, policy_calls", [("FQL", 1), ("OFQL", 1), ("DiffusionQL", 3)])
def test_one_step_policies_act_with_one_network_evaluation(name, policy_calls, episodic):
    """FQL's one-step policy and OFQL's average-velocity policy: one evaluation per action (a 3-step diffusion: 3)."""
    algo = TINY_MODELS[name](n_action_samples=1, random_state=0).fit(episodic, n_steps=5, progress=False)
    obs = episodic.observations[:9]
    counter = CallCounter(**inner_networks(algo))
    try:
        for act in (algo.predict, algo.sample_action):
            counter.reset()
            act(obs)
            expected = {net: [] for net in counter.calls} | {"policy": [len(obs)] * policy_calls}
            assert counter.calls == expected, act.__name__
        # with candidates, all of them go through the network in one batch, then one critic call picks
        algo.set_params(n_action_samples=4)
        counter.reset()
        algo.sample_action(obs)
        selector = "critic_target" if name == "DiffusionQL" else "critic"
        assert counter.calls["policy"] == [4 * len(obs)] * policy_calls
        assert counter.calls[selector] == [4 * len(obs)]
    finally:
        counter.remove()


# ---------------------------------------------------------------------- deterministic and stochastic acting
@pytest.mark.parametrize("name", TINY_MODELS)
def test_predict_is_a_function_of_the_observation_and_sample_action_is_random(name, episodic):
    algo = TINY_MODELS[name](random_state=0).fit(episodic, n_steps=20, progress=False)
    obs = np.random.default_rng(3).normal(size=(13, 3)).astype(np.float32)
    batch = algo.predict(obs)
    np.testing.assert_array_equal(algo.predict(obs), batch)  # repeatable
    # ... and independent of the rest of the batch (to float rounding: BLAS may sum a batch of 1 in another order)
    one_by_one = np.stack([algo.predict(row) for row in obs])
    np.testing.assert_allclose(one_by_one, batch, rtol=0, atol=1e-6)
    shuffled = np.random.default_rng(4).permutation(len(obs))
    np.testing.assert_allclose(algo.predict(obs[shuffled]), batch[shuffled], rtol=0, atol=1e-6)
    assert np.all(np.abs(batch) <= 1.0)
    # each action is one of that observation's candidates (the fixed noise table through the policy), and the
    # zero-noise candidate depends on the observation
    with torch.no_grad():
        normalised = algo.obs_normalizer_(torch.as_tensor(obs))
        table = algo.action_noise_.noise
        candidates = torch.stack([algo.policy_(normalised, row.unsqueeze(1).expand(-1, len(obs), -1))
                                  for row in table]).numpy()
    assert not np.allclose(candidates[0], candidates[0][0])
    assert all(np.abs(candidates[:, i] - batch[i]).max(-1).min() <= 1e-6 for i in range(len(obs)))

    first, second = algo.sample_action(obs), algo.sample_action(obs)
    assert first.shape == batch.shape and np.all(np.abs(first) <= 1.0)
    assert not np.allclose(first, second)  # fresh noise (and a softmax draw among the 4 candidates)
    algo.set_params(n_action_samples=1)  # one candidate: the noise alone must still make it random
    assert not np.allclose(algo.sample_action(obs), algo.sample_action(obs))


# ---------------------------------------------------------------------- TorchScript export
@pytest.fixture(scope="module")
def pendulum() -> Dataset:
    """1-d actions in [-2, 2]: the export must scale the [-1, 1] sampler output to the env's box."""
    return pendulum_shaped_dataset()


JIT_LOAD_DEPRECATED = pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")


def exported(algo, path, **options) -> torch.jit.ScriptModule:
    algo.export_policy(path, **options)
    return torch.jit.load(str(path))


@JIT_LOAD_DEPRECATED
@pytest.mark.parametrize("name", TINY_MODELS)
def test_exported_policy_equals_predict_on_any_batch_size(name, pendulum, tmp_path):
    algo = TINY_MODELS[name](normalize_observations=True, random_state=0).fit(pendulum, n_steps=20, progress=False)
    module = exported(algo, tmp_path / "policy.pt")  # traced on a batch of one
    obs = pendulum.observations[::37][:13]
    np.testing.assert_array_equal(module(torch.as_tensor(obs)).numpy(), algo.predict(obs))
    np.testing.assert_array_equal(module(torch.as_tensor(obs[:1])).numpy(), algo.predict(obs[:1]))


def best_action(obs: np.ndarray) -> np.ndarray:
    return 1.5 * np.tanh(2.0 * obs[:, 0])


def bandit_dataset(n: int = 1000, seed: int = 0) -> Dataset:
    """One-step episodes, actions uniform in [-2, 2], reward -(a - a*(s))^2: only a critic knows a*(s)."""
    rng = np.random.default_rng(seed)
    obs = rng.normal(size=(n, 3)).astype(np.float32)
    actions = rng.uniform(-2.0, 2.0, size=(n, 1))
    return Dataset.from_arrays(obs, actions, -(actions[:, 0] - best_action(obs)) ** 2, terminals=np.ones(n),
                               next_observations=obs, action_low=-2.0, action_high=2.0)


@JIT_LOAD_DEPRECATED
def test_diffusion_ql_export_runs_the_sampler_and_the_critic_that_picks_the_candidate(tmp_path):
    bandit = bandit_dataset()
    # tau=1: DiffusionQL picks candidates with the target critics, which must have learnt something in 30 steps
    # reward_scale=100: Q differences between candidates large enough for softmax(Q) to tell them apart
    algo = DiffusionQL(**TINY, n_diffusion_steps=3, normalize_observations=True, tau=1.0, critic_lr=3e-3,
                       reward_scale=100.0, random_state=0)
    algo.fit(bandit, n_steps=300, progress=False)
    assert algo.n_action_samples == 50
    module = exported(algo, tmp_path / "policy.pt")
    assert tuple(module.actor.noise.shape) == (50, 3, 1) and hasattr(module.actor, "critic")
    obs = bandit.observations[:17]
    actions = module(torch.as_tensor(obs)).numpy()
    np.testing.assert_array_equal(actions, algo.predict(obs))

    # the same choice, written out row by row: each candidate's chain on its fixed noise, the target
    # critics' min Q, the candidate the fixed softmax draw picks
    with torch.no_grad():
        normalised = algo.obs_normalizer_(torch.as_tensor(obs))
        noise = algo.action_noise_.noise  # (candidates, noise vectors, action_dim)
        assert torch.equal(noise[0], torch.zeros_like(noise[0]))
        best_index, expected = [], []
        for row in normalised:
            row = row.unsqueeze(0)
            candidates = torch.cat([algo.policy_(row, table.unsqueeze(1)) for table in noise])
            q = algo.critic_target_(row.expand(len(noise), -1), candidates).min(0).values
            # the papers' softmax(Q) draw, fixed at its median: the first candidate whose cumulative
            # probability passes 1/2
            cumulative = torch.softmax(q, dim=0).cumsum(0)
            best_index.append(min(int((cumulative < 0.5).sum()), len(noise) - 1))
            expected.append(candidates[best_index[-1]])
    np.testing.assert_allclose(actions, torch.stack(expected).numpy(), rtol=0, atol=1e-5)
    assert np.all(np.abs(actions) <= 2.0)
    # the behaviour policy ignores the observation (uniform actions); the chosen candidate follows a*(s)
    assert len(set(best_index)) > 3
    assert np.corrcoef(actions[:, 0], best_action(obs))[0, 1] > 0.7


@JIT_LOAD_DEPRECATED
def test_fql_exports_the_one_step_policy_or_the_zero_noise_flow(pendulum, tmp_path):
    algo = FQL(**TINY, actor_hidden_dims=(32, 32), flow_steps=4, normalize_observations=True, random_state=0)
    algo.fit(pendulum, n_steps=30, progress=False)
    obs = pendulum.observations[::31][:11]
    one_step = exported(algo, tmp_path / "one_step.pt")(torch.as_tensor(obs)).numpy()
    flow = exported(algo, tmp_path / "flow.pt", policy="flow")(torch.as_tensor(obs)).numpy()
    with torch.no_grad():
        normalised = algo.obs_normalizer_(torch.as_tensor(obs))
        zero_noise = torch.zeros(1, len(obs), 1)
        np.testing.assert_array_equal(one_step, algo.policy_(normalised, zero_noise).numpy())
        np.testing.assert_array_equal(flow, algo.flow_policy_(normalised, zero_noise).numpy())
    np.testing.assert_array_equal(one_step, algo.predict(obs))
    assert not np.allclose(flow, one_step)  # two different networks
    with pytest.raises(ValueError, match="one_step' or 'flow'"):
        algo.export_policy(tmp_path / "nope.pt", policy="ema")


@JIT_LOAD_DEPRECATED
@pytest.mark.parametrize("name", TINY_MODELS)
def test_predict_during_training_sees_the_updated_weights(name, episodic, tmp_path):
    """Acting between training steps (a callback, an evaluation) must not leave anything stale behind: e.g. a
    cache of OFQL's constant time features that an optimiser step does not invalidate."""
    obs = episodic.observations[:7]
    during = []
    algo = TINY_MODELS[name](random_state=0, n_action_samples=1)  # the policy's own path, no candidate choice
    algo.fit(episodic, n_steps=30, log_every=10, progress=False,
             callbacks=[lambda algo, step, metrics: during.append(algo.predict(obs))])
    assert len(during) == 3 and not np.allclose(during[0], during[-1])
    algo.save(tmp_path / "model.pt")
    fresh = offrl.load(tmp_path / "model.pt")  # the same weights in new modules
    np.testing.assert_array_equal(algo.predict(obs), fresh.predict(obs))
    traced = exported(algo, tmp_path / "policy.pt")
    np.testing.assert_array_equal(algo.predict(obs), traced(torch.as_tensor(obs)).numpy())


# ---------------------------------------------------------------------- bf16 and parameter checks
@pytest.mark.parametrize("name", TINY_MODELS)
def test_bf16_precision_trains_with_finite_losses(name, episodic):
    algo = TINY_MODELS[name](precision="bf16", random_state=0).fit(episodic, n_steps=20, progress=False)
    assert algo.last_metrics_ and all(math.isfinite(v) for v in algo.last_metrics_.values()), algo.last_metrics_
    assert all(p.dtype == torch.float32 for m in algo._state_objects().values() for p in m.parameters())
    actions = algo.predict(episodic.observations[:5])
    assert actions.dtype == np.float32 and np.all(np.isfinite(actions))


@pytest.mark.parametrize("make, parameter", [
    (functools.partial(EDP, variant="ppo"), "variant"),
    (functools.partial(DiffusionQL, n_diffusion_steps=0), "n_diffusion_steps"),
    (functools.partial(DiffusionQL, sampler="euler"), "sampler"),
    (functools.partial(DiffusionQL, eta=-0.5), "eta"),
    (functools.partial(OFQL, flow_ratio=1.5), "flow_ratio"),
    (functools.partial(OFQL, time_sigma=0.0), "time_sigma"),
    (functools.partial(FQL, q_agg="max"), "q_agg"),
    (functools.partial(FQL, flow_steps=0), "flow_steps"),
    (functools.partial(EDP, variant="iql", expectile=1.0), "expectile"),
    (functools.partial(OFQL, n_action_samples=0), "n_action_samples"),
    (functools.partial(DiffusionQL, ema_decay=1.0), "ema_decay"),
    (functools.partial(EDP, max_grad_norm=0.0), "max_grad_norm"),
], ids=lambda value: value if isinstance(value, str) else value.func.__name__)
def test_bad_hyper_parameters_are_refused_at_fit(make, parameter, episodic):
    algo = make(**TINY)
    with pytest.raises(InvalidParameterError, match=rf"{type(algo).__name__}: {parameter} must be"):
        algo.fit(episodic, n_steps=1, progress=False)
    assert not hasattr(algo, "spec_")
