"""MBRCSL: it stitches where RvS cannot (the issue's acceptance test, on a real gymnasium env), the one dynamics
model it shares with model-based OPE (elites, roll-out step), its roll-out filter and fallback, and save, load,
clone, resume and determinism on tiny networks."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
import sklearn.base
import torch

import offrl
from offrl.algos import MBRCSL, RvS
from offrl.algos.params import InvalidParameterError
from offrl.datasets import Dataset
from offrl.nn.dynamics import EnsembleDynamics
from offrl.ope import ModelBased, TargetPolicy

from conftest import pendulum_shaped_dataset

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(hidden_dims=(16, 16), batch_size=16, n_models=3, n_elites=2, dynamics_hidden_dims=(16, 16),
            dynamics_n_steps=30, behavior_hidden_dims=(16,), behavior_n_steps=30, rollout_batch_size=8, n_rollouts=4,
            max_rollout_batches=3, return_threshold=-1e9, rollout_range_margin=None, device="cpu")
# (the range check is off for these barely trained models, which leave the tiny data's range at once; it has its
# own test with a wide margin)


def state_of(algo) -> dict[str, torch.Tensor]:
    return {f"{name}.{k}": v.clone() for name, module in algo._state_objects().items()
            for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def pendulum() -> Dataset:
    return pendulum_shaped_dataset(n_episodes=4, length=15)


@pytest.fixture(scope="module")
def fitted(pendulum) -> MBRCSL:
    return MBRCSL(**TINY, random_state=0).fit(pendulum, n_steps=20, progress=False)


# ---------------------------------------------------------------------------------------------- stitching

HORIZON = 10


class StitchingWalk(gym.Env):
    """A 1-D walk with a clock: observation (t / 10, y), y' = y + 0.5 a, ten steps.

    The first five steps pay 1 - |y'| (stay on the line y = 0), the last five pay -y' (go down).  Every logged
    episode passes y = 0 at t = 5, the shared middle state.
    """

    observation_space = gym.spaces.Box(-10.0, 10.0, (2,), np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.t, self.y = 0, 0.0
        return self._obs(), {}

    def _obs(self) -> np.ndarray:
        return np.array([self.t / HORIZON, self.y], np.float32)

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.y = float(np.float32(self.y + 0.5 * float(np.clip(np.asarray(action).reshape(-1)[0], -1.0, 1.0))))
        reward = 1.0 - abs(self.y) if self.t < HORIZON // 2 else -self.y
        self.t += 1
        return self._obs(), float(reward), False, self.t >= HORIZON, {}


# Planned actions of the three logged families (Gaussian noise 0.1 is added to every action):
#   A: stays on the line (+5), then goes up (-7.5): return about -2.5;
#   B: detours up and back (+3), then goes down (+7.5): about 10.5, the best logged;
#   C: detours down and back (+3), then goes up (-7.5): about -4.5 (it shows the model the lower half).
# A's first half with B's second half returns about 12.5, more than any logged episode.
FAMILIES = {"A": [0, 0, 0, 0, 0, 1, 1, 1, 1, 1], "B": [1, 1, -1, -1, 0, -1, -1, -1, -1, -1],
            "C": [-1, -1, 1, 1, 0, 1, 1, 1, 1, 1]}


def stitching_dataset(episodes_per_family: int = 30, seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    env, episodes = StitchingWalk(), []
    for plan in FAMILIES.values():
        for _ in range(episodes_per_family):
            obs, _ = env.reset()
            observations, actions, rewards = [obs], [], []
            for t in range(HORIZON):
                action = np.clip([plan[t] + 0.1 * rng.normal()], -1.0, 1.0).astype(np.float32)
                obs, reward, _, _, _ = env.step(action)
                observations.append(obs)
                actions.append(action)
                rewards.append(reward)
            episodes.append({"observations": np.array(observations), "actions": np.array(actions),
                             "rewards": np.array(rewards), "terminations": [False] * HORIZON,
                             "truncations": [False] * (HORIZON - 1) + [True]})
    return Dataset.from_episodes(episodes, action_low=-1.0, action_high=1.0, metadata={"name": "stitching-walk"})


def test_mbrcsl_stitches_the_two_families_and_rvs_does_not():
    ds = stitching_dataset()
    best_logged = float(ds.episode_returns().max())
    assert 10.0 < best_logged < 11.5  # a family-B episode
    rcsl = dict(conditioning="rtg", policy="deterministic", return_scale=0.1, hidden_dims=(64, 64), lr=1e-3,
                batch_size=64, device="cpu", random_state=0)
    rvs = RvS(**rcsl).fit(ds, n_steps=2000, progress=False)
    mbrcsl = MBRCSL(**rcsl, weight_decay=0.0, n_models=7, n_elites=5, dynamics_hidden_dims=(64, 64, 64),
                    dynamics_lr=2e-3, dynamics_n_steps=4000, behavior_hidden_dims=(64, 64), behavior_n_steps=2000,
                    rollout_batch_size=200, n_rollouts=200, max_rollout_batches=10).fit(ds, n_steps=2000,
                                                                                        progress=False)
    env = StitchingWalk()  # deterministic: one episode says it all
    rvs_return = rvs.evaluate(env, n_episodes=1)["return_mean"]
    mbrcsl_return = mbrcsl.evaluate(env, n_episodes=1)["return_mean"]
    # RvS asked for the best logged return gets at most that: it follows family B.
    assert rvs_return < best_logged + 0.25
    # MBRCSL's kept roll-outs beat every logged episode in the model, and its policy does so in the environment.
    assert mbrcsl.rcsl_data_ == "rollouts" and mbrcsl.n_rollouts_kept_ > 0
    assert mbrcsl.return_threshold_ == best_logged and mbrcsl.rollout_return_max_ > best_logged
    assert mbrcsl.spec_["target_return"] == mbrcsl.kept_return_max_  # the default target: the best kept roll-out
    assert mbrcsl_return > best_logged + 0.5
    assert mbrcsl_return > rvs_return + 1.0


# ---------------------------------------------------------------------------------------------- the shared model


def test_model_based_ope_and_mbrcsl_use_one_dynamics_model(fitted, pendulum):
    import offrl.ope.model_based as model_based
    import offrl.nn.dynamics as dynamics

    ope = ModelBased(n_models=2, hidden_dims=(8,), n_steps=3, batch_size=8, device="cpu").fit(pendulum)
    assert type(ope.dynamics_) is EnsembleDynamics and type(fitted.dynamics_) is EnsembleDynamics
    assert ope.model_ is ope.dynamics_.model  # the network ModelBased reports is the shared model's
    assert model_based.gaussian_nll is dynamics.gaussian_nll  # one loss, not a copy
    # the default OPE model keeps every member; MBRCSL's keeps its elites
    assert ope.dynamics_.elites.tolist() == [0, 1] and len(fitted.dynamics_.elites) == 2


def test_model_based_ope_rolls_out_only_its_elites(pendulum):
    policy = TargetPolicy("deterministic", act=lambda obs: np.zeros((len(obs), 1), np.float32), name="zero")
    mb = ModelBased(n_models=3, n_elites=2, holdout_ratio=0.25, hidden_dims=(8,), n_steps=5, batch_size=8, horizon=3,
                    device="cpu", random_state=0)
    result = mb.estimate(pendulum, policy)
    assert len(result.diagnostics["member_values"]) == 2
    assert np.isfinite(mb.dynamics_.holdout_loss.numpy()).all()


def _fitted_dynamics(dataset: Dataset, n_steps: int = 50) -> EnsembleDynamics:
    torch.manual_seed(0)
    dynamics = EnsembleDynamics(dataset.observation_dim, dataset.action_dim, 4, (16, 16), n_elites=2)
    dynamics.fit(dataset, n_steps=n_steps, batch_size=16, lr=1e-3, generator=torch.Generator().manual_seed(0),
                 holdout_ratio=0.25)
    return dynamics


def test_elites_are_the_members_with_the_lowest_holdout_loss(pendulum):
    dynamics = _fitted_dynamics(pendulum)
    losses = dynamics.holdout_loss
    assert torch.isfinite(losses).all()
    assert set(dynamics.elites.tolist()) == set(torch.argsort(losses)[:2].tolist())
    # Spoil two members (their mean predictions far off); refitting with no steps re-ranks on the same holdout.
    spoiled = [i for i in range(4) if i in dynamics.elites.tolist()]
    with torch.no_grad():
        dynamics.model.layers[-1].bias[spoiled, :, : pendulum.observation_dim + 1] += 10.0
    dynamics.fit(pendulum, n_steps=0, batch_size=16, lr=1e-3, generator=torch.Generator().manual_seed(0),
                 holdout_ratio=0.25)
    assert sorted(dynamics.elites.tolist()) == sorted(set(range(4)) - set(spoiled))
    assert dynamics.holdout_loss[spoiled].min() > dynamics.holdout_loss[dynamics.elites].max()


def test_model_steps_go_through_the_elites_only(pendulum):
    dynamics = _fitted_dynamics(pendulum, n_steps=5)
    others = [i for i in range(4) if i not in dynamics.elites.tolist()]
    with torch.no_grad():
        dynamics.model.layers[-1].bias[others] = float("nan")  # a non-elite would poison every prediction
    obs = torch.from_numpy(pendulum.observations[:32])
    actions = torch.from_numpy(pendulum.actions[:32])
    nxt, rewards, p_terminal = dynamics.step(obs, actions, torch.Generator().manual_seed(1))
    assert nxt.shape == obs.shape and rewards.shape == (32,) and torch.isfinite(nxt).all()
    assert torch.isfinite(rewards).all() and (p_terminal == 0).all()  # the pendulum data has no terminals
    # (n_elites, n, obs_dim): elite i drives block i, without noise the same as the elite's mean
    blocks, block_rewards, _ = dynamics.step(obs.expand(2, -1, -1), actions.expand(2, -1, -1), sample=False)
    mean = dynamics.predict(obs, actions, dynamics.elites)[0] * dynamics.target_std + dynamics.target_mean
    torch.testing.assert_close(blocks, obs + mean[..., :-1])
    torch.testing.assert_close(block_rewards, mean[..., -1])
    with pytest.raises(ValueError, match="elites"):
        dynamics.step(obs.expand(4, -1, -1), actions.expand(4, -1, -1))


# ---------------------------------------------------------------------------------------------- roll-outs


def test_a_rollout_batch_stops_once_every_rollout_has_ended(pendulum, monkeypatch):
    algo = MBRCSL(**TINY, random_state=0).fit(pendulum, n_steps=1, progress=False)
    dynamics, step = algo.dynamics_, algo.dynamics_.step

    def falls_at_once(obs, actions, generator):  # the model says every state terminates (a hopper's fall)
        nxt, rewards, p_terminal = step(obs, actions, generator)
        return nxt, rewards, torch.ones_like(p_terminal)

    monkeypatch.setattr(dynamics, "step", falls_at_once)
    dynamics.has_terminals.fill_(True)
    columns, mask, left = algo._rollout_batch(torch.from_numpy(pendulum.observations[:5]), 15,
                                              torch.Generator().manual_seed(0), algo._data_box(pendulum))
    assert not left.any()  # a terminal step's next state is not checked against the data's range
    assert mask.shape == (5, 1) and mask.all() and columns["terminals"].all()
    assert columns["observations"].shape == (5, 1, pendulum.observation_dim)
    kept = algo._rollouts(pendulum, torch.Generator().manual_seed(0))  # threshold -1e9: every roll-out kept
    assert kept is not None and (kept.episode_lengths() == 1).all() and kept.terminals.all()


def test_kept_batches_of_different_lengths_join_into_one_dataset(pendulum, monkeypatch):
    """A batch stops when its last roll-out ends, so kept batches differ in length (hopper: 875 and 843 steps)."""
    algo = MBRCSL(**{**TINY, "n_rollouts": 1000, "max_rollout_batches": 2}, random_state=0).fit(
        pendulum, n_steps=1, progress=False)
    dynamics, step = algo.dynamics_, algo.dynamics_.step
    calls = []

    def falls_on_calls_0_and_3(obs, actions, generator):  # batch 0 ends after 1 step, batch 1 after 3
        nxt, rewards, p_terminal = step(obs, actions, generator)
        calls.append(len(calls))
        return nxt, rewards, torch.full_like(p_terminal, float(calls[-1] in (0, 3)))

    monkeypatch.setattr(dynamics, "step", falls_on_calls_0_and_3)
    dynamics.has_terminals.fill_(True)
    kept = algo._rollouts(pendulum, torch.Generator().manual_seed(0))
    assert len(calls) == 4 and algo.n_rollouts_kept_ == 16
    assert kept.n_episodes == 16 and (kept.episode_lengths() == [1] * 8 + [3] * 8).all()
    ends = np.asarray(kept.episode_starts[1:]) - 1
    assert kept.terminals[ends].all() and kept.terminals.sum() == 16
    # each roll-out's steps are contiguous: a step's next observation is the following step's observation
    second = kept.episode_starts[8]
    inner = np.setdiff1d(np.arange(second, kept.n_transitions), ends)
    np.testing.assert_array_equal(kept.next_observations[inner], kept.observations[inner + 1])


def test_rollouts_that_leave_the_logged_range_stop_there_and_are_never_kept(pendulum, monkeypatch):
    """Hopper medium's kept roll-outs left the data within ~80 steps and reached model returns of 100,000+."""
    params = {**TINY, "n_rollouts": 1000, "max_rollout_batches": 1}
    algo = MBRCSL(**{**params, "rollout_range_margin": 10.0}, random_state=0).fit(pendulum, n_steps=1,
                                                                                  progress=False)
    dynamics, step = algo.dynamics_, algo.dynamics_.step
    low, high = algo._data_box(pendulum)
    width = pendulum.rewards.max() - pendulum.rewards.min()
    assert float(high[-1]) == pytest.approx(pendulum.rewards.max() + 10 * width, rel=1e-5)
    calls = []

    def escapes(obs, actions, generator):  # on the third step rows 0-1 leave by their state, rows 2-3 by reward
        nxt, rewards, p_terminal = step(obs, actions, generator)
        calls.append(len(calls))
        if calls[-1] == 2:
            nxt, rewards = nxt.clone(), rewards.clone()
            nxt[:2, 0] = 1e3
            rewards[2:4] = 1e3
        return nxt, rewards, p_terminal

    monkeypatch.setattr(dynamics, "step", escapes)
    columns, mask, left = algo._rollout_batch(torch.from_numpy(pendulum.observations[:8]), 15,
                                              torch.Generator().manual_seed(0), (low, high))
    assert left.tolist() == [True] * 4 + [False] * 4
    assert mask[:4].sum(1).tolist() == [3] * 4 and mask[4:].all()  # they stop at the step that left
    calls.clear()
    kept = algo._rollouts(pendulum, torch.Generator().manual_seed(0))  # threshold -1e9: all but those kept
    assert algo.n_rollouts_left_data_ == 4 and algo.n_rollouts_kept_ == 4 == kept.n_episodes
    assert np.abs(kept.rewards).max() < 1e3 and np.abs(kept.next_observations).max() < 1e3
    unchecked = MBRCSL(**params, random_state=0).fit(pendulum, n_steps=1, progress=False)
    monkeypatch.setattr(unchecked.dynamics_, "step", escapes)
    calls.clear()
    assert unchecked._rollouts(pendulum, torch.Generator().manual_seed(0)).n_episodes == 8
    assert unchecked.n_rollouts_left_data_ == 0


def test_kept_rollouts_beat_the_threshold_and_mix_dataset_adds_the_logged_episodes(pendulum):
    threshold = float(np.median(pendulum.episode_returns()))
    algo = MBRCSL(**{**TINY, "return_threshold": threshold, "max_rollout_batches": 2, "n_rollouts": 1000},
                  random_state=0).fit(pendulum, n_steps=1, progress=False)
    data = algo._rcsl_dataset(pendulum)  # rolls out again, to the same roll-outs
    assert data.n_episodes == algo.n_rollouts_kept_ > 0 and algo.n_rollouts_ == 16
    assert (data.episode_returns() > threshold).all()
    assert (data.episode_lengths() == 15).all()  # the longest logged episode
    assert algo.spec_["target_return"] == pytest.approx(data.episode_returns().max())
    mixed = MBRCSL(**{**TINY, "return_threshold": threshold, "max_rollout_batches": 2, "n_rollouts": 1000},
                   mix_dataset=True, random_state=0).fit(pendulum, n_steps=1, progress=False)
    assert mixed.rcsl_data_ == "rollouts+dataset"
    assert mixed._rcsl_dataset(pendulum).n_episodes == algo.n_rollouts_kept_ + pendulum.n_episodes


def test_no_rollout_above_the_threshold_warns_and_trains_on_the_dataset(pendulum):
    with pytest.warns(RuntimeWarning, match="none of the 8 model roll-outs beat the return threshold"):
        algo = MBRCSL(**{**TINY, "return_threshold": 1e9, "max_rollout_batches": 1}, random_state=0).fit(
            pendulum, n_steps=2, progress=False)
    assert algo.rcsl_data_ == "dataset" and algo.n_rollouts_kept_ == 0 and np.isnan(algo.kept_return_max_)
    assert algo.spec_["target_return"] == pytest.approx(pendulum.episode_returns().max())
    assert np.isfinite(algo.predict(pendulum.observations[:3])).all()


def test_default_threshold_is_the_best_complete_episode():
    """A last, partial episode of a cost task (here 3 steps of a 15-step task) does not set the threshold."""
    whole = pendulum_shaped_dataset(n_episodes=3, length=15)
    episodes = [{k: v for k, v in zip(("observations", "actions", "rewards"),
                                      (whole.observations[:4], whole.actions[:3], np.full(3, -0.1, np.float32)))}]
    episodes[0]["observations"] = np.concatenate([whole.observations[:3], whole.next_observations[2:3]])
    episodes[0]["truncations"] = [False, False, True]
    cut = Dataset.concatenate([whole, Dataset.from_episodes(episodes, action_low=-2.0, action_high=2.0)])
    assert cut.episode_returns()[-1] > cut.episode_returns()[:-1].max()
    params = {**TINY, "return_threshold": None, "max_rollout_batches": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        algo = MBRCSL(**params, random_state=0).fit(cut, n_steps=1, progress=False)
    assert algo.return_threshold_ == pytest.approx(whole.episode_returns().max())


def test_n_elites_cannot_exceed_n_models():
    with pytest.raises(InvalidParameterError, match="n_elites"):
        MBRCSL(n_models=3, n_elites=4).check_params()


# ---------------------------------------------------------------------------------------------- save / load / clone / export


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")
def test_same_seed_same_model_and_save_load_clone(fitted, pendulum, tmp_path):
    again = MBRCSL(**TINY, random_state=0).fit(pendulum, n_steps=20, progress=False)
    a, b = state_of(fitted), state_of(again)
    assert "dynamics_.elites" in a and any(k.startswith("behavior_policy_.") for k in a)  # saved with the policy
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert again._fitted_attributes() == fitted._fitted_attributes()
    other = MBRCSL(**TINY, random_state=1).fit(pendulum, n_steps=20, progress=False)
    assert not torch.equal(state_of(other)["dynamics_.model.layers.0.weight"], a["dynamics_.model.layers.0.weight"])

    fitted.save(tmp_path / "mbrcsl.pt")
    loaded = offrl.load(tmp_path / "mbrcsl.pt")
    obs = pendulum.observations[:10]
    np.testing.assert_array_equal(loaded.predict(obs), fitted.predict(obs))
    np.testing.assert_array_equal(loaded.predict(obs, target_return=-50.0), fitted.predict(obs, target_return=-50.0))
    assert loaded.spec_["target_return"] == fitted.spec_["target_return"]
    assert loaded.n_rollouts_kept_ == fitted.n_rollouts_kept_ and loaded.rcsl_data_ == fitted.rcsl_data_
    c = state_of(loaded)
    assert c.keys() == a.keys() and all(torch.equal(c[k], a[k]) for k in a)  # the model and behaviour policy too

    fitted.export_policy(tmp_path / "policy.pt")  # the first step's command fixed, as RvS exports
    exported = torch.jit.load(str(tmp_path / "policy.pt"))
    np.testing.assert_allclose(exported(torch.as_tensor(obs)).numpy(), fitted.predict(obs), rtol=1e-5, atol=1e-6)

    clone = sklearn.base.clone(fitted)
    assert clone.get_params() == fitted.get_params() and not hasattr(clone, "spec_")


def test_resume_rolls_out_the_restored_model_to_the_same_policy(pendulum, tmp_path):
    full = MBRCSL(**TINY, random_state=0).fit(pendulum, n_steps=30, log_every=10, progress=False)
    log_dir = tmp_path / "run"
    MBRCSL(**TINY, random_state=0).fit(pendulum, n_steps=30, log_dir=log_dir, checkpoint_every=10, log_every=10,
                                       progress=False, callbacks=[lambda algo, step, metrics: step < 20])
    resumed = MBRCSL(**TINY, random_state=0).fit(pendulum, n_steps=30, log_dir=log_dir, checkpoint_every=10,
                                                 log_every=10, resume=True, progress=False)
    a, b = state_of(full), state_of(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
