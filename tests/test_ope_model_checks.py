"""Model-based OPE skips terminal rows' next states; a fitted FQE refuses a policy it was not fitted for."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import offrl
from offrl.datasets import Dataset
from offrl.ope import FQE, ModelBased, TargetPolicy

pytestmark = pytest.mark.usefixtures("one_thread")


def _counting_episodes(next_observations: bool) -> Dataset:
    """Three episodes of 1-d states counting up by 1 from 0, 1 and 2, each ending in a terminal at state 5."""
    lengths, starts = [6, 5, 4], [0.0, 1.0, 2.0]
    obs = np.concatenate([s + np.arange(n) for s, n in zip(starts, lengths)])[:, None].astype(np.float32)
    actions = np.tile([[0.3]], (len(obs), 1)).astype(np.float32)
    rewards = np.ones(len(obs), np.float32)
    terminals = np.concatenate([[0] * (n - 1) + [1] for n in lengths])
    episode_starts = np.concatenate([[0], np.cumsum(lengths)])
    nxt = obs + 1.0 if next_observations else None
    return Dataset.from_arrays(obs, actions, rewards, terminals=terminals, timeouts=np.zeros(len(obs)),
                               next_observations=nxt, episode_starts=episode_starts)


def test_model_based_ignores_the_next_state_of_terminal_rows():
    rebuilt, true = _counting_episodes(False), _counting_episodes(True)
    last = rebuilt.episode_starts[1:] - 1
    # the fault's precondition: a terminal row's rebuilt "next state" is the next episode's first observation
    assert rebuilt.terminals[last].all() and rebuilt.next_observations[last[0], 0] == 1.0
    assert true.next_observations[last[0], 0] == 6.0
    params = dict(n_models=2, hidden_dims=(16,), n_steps=30, batch_size=8, device="cpu", random_state=3)
    a, b = ModelBased(**params).fit(rebuilt), ModelBased(**params).fit(true)
    np.testing.assert_array_equal(a.y_mean_, b.y_mean_)
    for pa, pb in zip(a.model_.parameters(), b.model_.parameters()):
        assert torch.equal(pa, pb)  # what a terminal row says about the next state never reaches the model
    assert a.y_mean_[0] == pytest.approx(1.0) and a.y_std_[0] == pytest.approx(1e-4)  # every real step moves +1


def test_model_based_still_learns_terminal_rewards_and_termination():
    ds = _counting_episodes(False)
    model = ModelBased(n_models=1, hidden_dims=(32,), n_steps=300, batch_size=16, lr=3e-3, device="cpu",
                       random_state=0).fit(ds)
    x = torch.cat([torch.as_tensor((ds.observations - model.obs_mean_) / model.obs_std_),
                   model._action_input(torch.as_tensor(ds.actions))], dim=-1)
    with torch.no_grad():
        _, _, logit = model._split(model.model_(x[None]))
    p_end = torch.sigmoid(logit[0]).numpy()
    last = ds.episode_starts[1:] - 1
    others = np.setdiff1d(np.arange(ds.n_transitions), last)
    assert p_end[last].min() > p_end[others].mean() + 0.3


def _bandit_like(n: int = 200, seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    obs = rng.normal(size=(n, 2)).astype(np.float32)
    actions = rng.uniform(-1, 1, size=(n, 1)).astype(np.float32)
    rewards = (1.0 - (actions[:, 0] - 0.5) ** 2).astype(np.float32)
    return Dataset.from_arrays(obs, actions, rewards, terminals=np.ones(n), timeouts=np.zeros(n),
                               next_observations=obs, action_low=[-1.0], action_high=[1.0])


def _constant(value: float, name: str) -> TargetPolicy:
    return TargetPolicy("deterministic", act=lambda obs: np.full((len(obs), 1), value, np.float32), name=name)


def _gaussian(mean: float) -> TargetPolicy:
    def log_prob(obs, actions):
        return -0.5 * ((actions[:, 0] - mean) / 0.2) ** 2 - np.log(0.2 * np.sqrt(2 * np.pi))

    rng = np.random.default_rng(0)
    return TargetPolicy("stochastic", log_prob=log_prob,
                        sample=lambda obs: (mean + 0.2 * rng.standard_normal((len(obs), 1))).astype(np.float32))


def test_fitted_fqe_refuses_another_policy_and_accepts_the_same_one(tmp_path):
    ds = _bandit_like()
    fqe = FQE(hidden_dims=(16,), n_critics=2, n_steps=20, batch_size=32, device="cpu", random_state=0)
    fqe.fit(ds, policy=_constant(0.5, "good"))
    value = fqe.estimate(ds).value
    assert fqe.estimate(ds, fqe._policy_obj).value == value
    assert fqe.estimate(ds, _constant(0.5, "same, wrapped anew")).value == value
    # Before, this silently changed only the first action and reported the fitted policy's Q for it.
    with pytest.raises(ValueError, match="fitted to evaluate another policy"):
        fqe.estimate(ds, _constant(-0.5, "bad"))
    with pytest.raises(ValueError, match="fitted to evaluate another policy"):
        fqe.state_values(ds.observations[:3], policy=_constant(-0.5, "bad"))
    # after save/load the policy object is gone, but the check is not
    path = tmp_path / "fqe.offrl"
    offrl.save(fqe, path)
    loaded = offrl.load(path)
    assert loaded.estimate(ds, _constant(0.5, "good")).value == pytest.approx(value)
    with pytest.raises(ValueError, match="fitted to evaluate another policy"):
        loaded.estimate(ds, _constant(-0.5, "bad"))


def test_fitted_fqe_checks_stochastic_policies_by_their_density():
    ds = _bandit_like()
    fqe = FQE(hidden_dims=(16,), n_critics=2, n_steps=5, batch_size=32, device="cpu", random_state=0)
    fqe.fit(ds, policy=_gaussian(0.5))
    fqe.estimate(ds, _gaussian(0.5))  # a new sampler of the same density is the same policy
    with pytest.raises(ValueError, match="fitted to evaluate another policy"):
        fqe.estimate(ds, _gaussian(0.0))


def test_value_range_covers_episodes_that_end_early():
    from offrl.ope.results import value_range

    rewards = np.array([1.0, 1.5, 2.0])
    # a one-step episode's value is a single reward: the range starts at r_min, not at r_min * sum of discounts
    assert value_range((1.0, 2.0), rewards, 100.0) == (1.0, 200.0)
    assert value_range((-1.0, 2.0), rewards, 100.0) == (-100.0, 200.0)
    assert value_range(None, rewards, 100.0) is None
    with pytest.raises(ValueError, match="reward_bound"):
        value_range((1.2, 2.0), rewards, 100.0)  # a logged reward lies outside the given bound


def test_fqe_hoeffding_interval_contains_one_step_values():
    ds = _bandit_like()
    ds = ds.with_rewards(np.clip(ds.rewards, 0.0, 1.0) + 1.0)  # rewards in [1, 2], every episode one step long
    fqe = FQE(hidden_dims=(16,), n_critics=1, n_steps=2000, batch_size=32, interval="hoeffding", reward_bound=(1.0, 2.0),
              device="cpu", random_state=0)
    result = fqe.fit(ds, policy=_constant(0.5, "good")).estimate(ds)
    assert 1.0 < result.value < 2.0 and result.ci_low <= result.value <= result.ci_high


def test_reward_bounds_tolerate_float32_rewards():
    from offrl.ope.results import reward_range

    # 0.1 is stored as 0.10000000149 in a float32 reward column; a bound of 0.1 still holds
    low, high, source = reward_range((0.0, 0.1), np.float32([0.0, 0.1, 0.05]))
    assert (low, source) == (0.0, "given") and high >= np.float32(0.1)
    with pytest.raises(ValueError, match="reward_bound"):
        reward_range((0.0, 0.09), np.float32([0.0, 0.1]))


def test_a_column_without_weight_keeps_the_estimate_inside_its_interval():
    from offrl.ope.results import ColumnRanges, ratio_concentration_interval

    low, high = ratio_concentration_interval(np.zeros(50), np.zeros(50),
                                             ColumnRanges(np.array([1.0]), np.array([2.0]), np.array([5.0])))
    assert low <= 0.0 <= high  # the estimate counts such a column as 0


def test_model_predictions_never_make_a_guaranteed_interval():
    ds = _bandit_like()
    ds = ds.with_rewards(np.clip(ds.rewards, 0.0, 1.0))
    common = dict(interval="hoeffding", reward_bound=(0.0, 1.0), device="cpu")
    fqe = FQE(hidden_dims=(8,), n_critics=1, n_steps=5, batch_size=32, random_state=0, **common)
    mb = ModelBased(n_models=1, hidden_dims=(8,), n_steps=5, horizon=3, **common)
    for result in (fqe.fit(ds, policy=_constant(0.5, "p")).estimate(ds), mb.estimate(ds, _constant(0.5, "p"))):
        assert result.diagnostics["interval_guaranteed"] is False, result.method
