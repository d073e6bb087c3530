"""offrl.reward_labeling: the batched Sinkhorn solver against POT, OT reward labelling (OTR) that does not depend
on batching, inverse-dynamics and reward-model labellers on real Pendulum-v1 rollouts, and the labellers inside
Pipelines (fit on unlabelled data, clone, save/load, seeding) and their refusals of bad input."""

from __future__ import annotations

import itertools

import gymnasium as gym
import numpy as np
import ot
import pytest
import sklearn.base
import torch
from sklearn.exceptions import NotFittedError

import offrl
import offrl.reward_labeling.optimal_transport as ot_module
from offrl.algos import IQL
from offrl.algos.params import InvalidParameterError
from offrl.datasets import Dataset
from offrl.pipeline import make_pipeline
from offrl.reward_labeling import (
    InverseDynamicsLabeler,
    OTRewardLabeler,
    RewardModelLabeler,
    pairwise_cost,
    sinkhorn,
    transport_plan,
)
from conftest import make_episodes, pendulum_shaped_dataset

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL_IQL = {"hidden_dims": (32, 32), "batch_size": 32, "device": "cpu", "random_state": 0}
SMALL_MODEL = {"hidden_dims": (64, 64), "batch_size": 256, "device": "cpu"}


# ---------------------------------------------------------------------- helpers and data
def uniform_marginals(sizes: list[tuple[int, int]], n: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform marginals of each (n_i, m_i) problem, zero-padded to (B, n) and (B, m)."""
    a = torch.zeros(len(sizes), n, dtype=torch.float64)
    b = torch.zeros(len(sizes), m, dtype=torch.float64)
    for i, (n_i, m_i) in enumerate(sizes):
        a[i, :n_i] = 1.0 / n_i
        b[i, :m_i] = 1.0 / m_i
    return a, b


def row_shifted_spread(cost: np.ndarray) -> float:
    """The largest cost above its row's minimum: what `sinkhorn` compares with epsilon to pick its path."""
    return float((cost - cost.min(axis=-1, keepdims=True)).max())


def pendulum_rollouts(n_episodes: int, seed: int = 0) -> Dataset:
    """Real Pendulum-v1 episodes (200 steps, truncated) under uniform random actions in [-2, 2]."""
    env = gym.make("Pendulum-v1")
    rng = np.random.default_rng(seed)
    episodes = []
    for i in range(n_episodes):
        obs, _ = env.reset(seed=seed * 100_000 + i)
        observations, actions, rewards, terminations, truncations = [obs], [], [], [], []
        while True:
            action = rng.uniform(-2.0, 2.0, size=1).astype(np.float32)
            obs, reward, terminated, truncated, _ = env.step(action)
            observations.append(obs)
            actions.append(action)
            rewards.append(reward)
            terminations.append(terminated)
            truncations.append(truncated)
            if terminated or truncated:
                break
        episodes.append({"observations": np.array(observations), "actions": np.array(actions),
                         "rewards": np.array(rewards), "terminations": np.array(terminations),
                         "truncations": np.array(truncations)})
    env.close()
    return Dataset.from_episodes(episodes, action_low=-2.0, action_high=2.0, metadata={"env_id": "Pendulum-v1"})


@pytest.fixture(scope="module")
def pendulum_data() -> Dataset:
    """250 real Pendulum-v1 episodes: 50,000 transitions."""
    data = pendulum_rollouts(250)
    assert data.n_transitions == 50_000
    return data


@pytest.fixture(scope="module")
def ragged_data() -> Dataset:
    """Episodes of very different lengths (one of a single step), so that batches pad rows."""
    episodes = make_episodes((30, 12, 45, 1, 7, 21, 45, 3), obs_dim=3, seed=4)
    return Dataset.from_episodes(episodes, action_low=-1.0, action_high=1.0, metadata={"name": "ragged"})


@pytest.fixture(scope="module")
def expert_episodes() -> list[dict]:
    """Two demonstrations of different lengths (the labeller pads them to one array)."""
    return make_episodes((25, 40), obs_dim=3, seed=5)


def episode_slices(data: Dataset) -> list[slice]:
    """Each episode's rows."""
    return [slice(int(s), int(e)) for s, e in itertools.pairwise(data.episode_starts)]


def spy_batch_sizes(monkeypatch) -> list[int]:
    """Record the batch size of every `sinkhorn` call the labeller makes."""
    sizes: list[int] = []
    real = ot_module.sinkhorn

    def spy(cost, *args, **kwargs):
        sizes.append(int(cost.shape[0]))
        return real(cost, *args, **kwargs)

    monkeypatch.setattr(ot_module, "sinkhorn", spy)
    return sizes


# ---------------------------------------------------------------------- 1. the solver against POT
def test_pairwise_cost_matches_pot_dist():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(2, 6, 4)), rng.normal(size=(2, 5, 4))
    for cost, metric in (("cosine", "cosine"), ("euclidean", "euclidean"), ("sqeuclidean", "sqeuclidean")):
        ours = pairwise_cost(torch.as_tensor(x), torch.as_tensor(y), cost).numpy()
        for i in range(2):
            np.testing.assert_allclose(ours[i], ot.dist(x[i], y[i], metric=metric), atol=1e-10, err_msg=cost)
    with pytest.raises(ValueError, match="cost must be one of"):
        pairwise_cost(torch.as_tensor(x), torch.as_tensor(y), "l1")


def test_sinkhorn_approaches_exact_emd_as_epsilon_shrinks():
    """Plans and costs converge to POT's exact EMD, for full-size and padded problems in one batch."""
    rng = np.random.default_rng(2)
    n, m = 10, 8
    sizes = [(10, 8), (10, 8), (10, 8), (7, 8), (10, 5)]
    # Continuous random points: the EMD plan is unique almost surely, so the entropic plans converge to it.
    x, y = rng.normal(size=(len(sizes), n, 2)), rng.normal(size=(len(sizes), m, 2))
    cost = ((x[:, :, None] - y[:, None]) ** 2).sum(-1)
    cost /= cost.max(axis=(1, 2), keepdims=True)  # costs in [0, 1]: the log path starts below epsilon = 1/300
    a, b = uniform_marginals(sizes, n, m)
    emd_plans = [ot.emd(a[i, :ni].numpy(), b[i, :mi].numpy(), cost[i, :ni, :mi]) for i, (ni, mi) in enumerate(sizes)]
    emd_costs = np.array([(p * cost[i, :p.shape[0], :p.shape[1]]).sum() for i, p in enumerate(emd_plans)])

    cost_gaps, plan_gaps = [], []
    for epsilon in (0.1, 0.01, 0.002, 0.0005):
        result = sinkhorn(torch.as_tensor(cost), a, b, epsilon, max_iter=20_000, tol=1e-12)
        plan = transport_plan(torch.as_tensor(cost), result, epsilon).numpy()
        total = result.row_cost.sum(dim=1).numpy()
        cost_gaps.append(float(np.abs(total - emd_costs).max()))
        plan_gaps.append(max(float(np.abs(plan[i, :ni, :mi] - emd_plans[i]).max()) for i, (ni, mi) in enumerate(sizes)))
        for i, (ni, mi) in enumerate(sizes):  # padding carries no mass
            assert plan[i, ni:].sum() == 0 and plan[i, :, mi:].sum() == 0
    # Measured (seed 0): cost gaps 0.044, 0.0018, 6e-5, 6e-6; plan gaps 0.083, 0.039, 0.012, 0.007.
    assert all(later < earlier for earlier, later in itertools.pairwise(cost_gaps)), cost_gaps
    assert all(later < earlier for earlier, later in itertools.pairwise(plan_gaps)), plan_gaps
    assert cost_gaps[-1] < 1e-4, cost_gaps
    assert plan_gaps[-1] < 0.02, plan_gaps  # EMD plan entries are 1/10 .. 1/8 where mass moves


@pytest.mark.parametrize("epsilon,path", [(0.01, "_sinkhorn_kernel"), (0.005, "_sinkhorn_log")])
def test_sinkhorn_matches_pot_log_sinkhorn(epsilon, path, monkeypatch):
    """At a fixed epsilon and convergence, both solver paths give POT's plan to ~1e-9."""
    rng = np.random.default_rng(0)
    x = torch.as_tensor(rng.normal(size=(3, 10, 3)))
    y = torch.as_tensor(rng.normal(size=(3, 8, 3)))
    cost = pairwise_cost(x, y, "cosine")
    a, b = uniform_marginals([(10, 8)] * 3, 10, 8)
    spread_ratio = max(row_shifted_spread(c) for c in cost.numpy()) / epsilon
    if path == "_sinkhorn_kernel":
        assert spread_ratio <= ot_module._KERNEL_SPREAD_LIMIT
    else:
        assert spread_ratio > ot_module._KERNEL_SPREAD_LIMIT
    called: list[str] = []
    for name in ("_sinkhorn_kernel", "_sinkhorn_log"):
        real = getattr(ot_module, name)
        monkeypatch.setattr(ot_module, name, lambda *args, _real=real, _name=name: called.append(_name) or _real(*args))

    result = sinkhorn(cost, a, b, epsilon, max_iter=20_000, tol=1e-12)
    assert called == [path]
    assert result.marginal_error < 1e-11 and result.n_iter < 20_000  # converged, not stopped by the budget
    plan = transport_plan(cost, result, epsilon).numpy()
    for i in range(3):
        reference = ot.sinkhorn(a[i].numpy(), b[i].numpy(), cost[i].numpy(), epsilon, method="sinkhorn_log",
                                numItermax=100_000, stopThr=1e-14)
        np.testing.assert_allclose(plan[i], reference, rtol=0, atol=1e-9)
        np.testing.assert_allclose(result.row_cost[i].numpy(), (reference * cost[i].numpy()).sum(axis=1), atol=1e-9)


def test_sinkhorn_kernel_and_log_paths_agree(monkeypatch):
    """Forcing the log domain on a problem the kernel handles changes nothing but rounding."""
    rng = np.random.default_rng(2)
    cost = pairwise_cost(torch.as_tensor(rng.normal(size=(2, 9, 3))), torch.as_tensor(rng.normal(size=(2, 6, 3))))
    a, b = uniform_marginals([(9, 6), (5, 4)], 9, 6)
    kernel = sinkhorn(cost, a, b, 0.05, max_iter=37, tol=0.0)  # stopped mid-way: the iterates must agree too
    monkeypatch.setattr(ot_module, "_KERNEL_SPREAD_LIMIT", -1.0)
    log = sinkhorn(cost, a, b, 0.05, max_iter=37, tol=0.0)
    np.testing.assert_allclose(transport_plan(cost, log, 0.05).numpy(), transport_plan(cost, kernel, 0.05).numpy(),
                               rtol=0, atol=1e-12)
    np.testing.assert_allclose(log.row_cost.numpy(), kernel.row_cost.numpy(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("epsilon,padding", [
    (0.05, 123.0), (0.003, 123.0), (0.003, np.inf), (0.05, np.inf),
], ids=["kernel-finite", "log-finite", "log-inf", "kernel-inf"])
def test_zero_mass_padding_gives_the_unpadded_plan(epsilon, padding):
    """Padded rows and columns get zero mass; epsilon 0.05 runs the kernel path, 0.003 the log path."""
    rng = np.random.default_rng(1)
    n, m = 12, 9
    sizes = [(12, 9), (7, 5), (4, 9)]
    cost = pairwise_cost(torch.as_tensor(rng.normal(size=(3, n, 4))), torch.as_tensor(rng.normal(size=(3, m, 4))))
    padded = cost.clone()
    padded[1, 7:, :] = padding  # whatever the padding holds must not matter
    padded[1, :, 5:] = padding / 2
    a, b = uniform_marginals(sizes, n, m)
    spread = max(row_shifted_spread(cost[i, :ni, :mi].numpy()) for i, (ni, mi) in enumerate(sizes))
    assert (spread / epsilon > ot_module._KERNEL_SPREAD_LIMIT) == (epsilon == 0.003)
    batch = sinkhorn(padded, a, b, epsilon, max_iter=3000, tol=1e-13)
    batch_plan = transport_plan(padded, batch, epsilon)
    for i, (ni, mi) in enumerate(sizes):
        alone = sinkhorn(cost[i:i + 1, :ni, :mi], a[i:i + 1, :ni], b[i:i + 1, :mi], epsilon, max_iter=3000, tol=1e-13)
        alone_plan = transport_plan(cost[i:i + 1, :ni, :mi], alone, epsilon)[0]
        torch.testing.assert_close(batch_plan[i, :ni, :mi], alone_plan, rtol=0, atol=1e-12)
        torch.testing.assert_close(batch.row_cost[i, :ni], alone.row_cost[0], rtol=0, atol=1e-12)
        assert float(batch_plan[i, ni:].abs().sum() + batch_plan[i, :, mi:].abs().sum()) == 0.0
        assert float(batch.row_cost[i, ni:].abs().sum()) == 0.0


def test_sinkhorn_refuses_non_positive_epsilon():
    cost = torch.zeros(1, 2, 2, dtype=torch.float64)
    a, b = uniform_marginals([(2, 2)], 2, 2)
    with pytest.raises(ValueError, match="epsilon must be positive"):
        sinkhorn(cost, a, b, 0.0)


# ---------------------------------------------------------------------- 2. OT reward labelling
@pytest.mark.parametrize("epsilon", [0.01, 0.005, 0.0])
def test_ot_rewards_do_not_depend_on_batching_or_order(ragged_data, expert_episodes, epsilon, monkeypatch):
    labeler = OTRewardLabeler(expert_episodes, epsilon=epsilon, device="cpu").fit(ragged_data)
    sizes = spy_batch_sizes(monkeypatch)
    rewards = labeler.transform(ragged_data).rewards
    if epsilon > 0:  # all eight episodes went through the solver together, once per demonstration
        assert sizes == [ragged_data.n_episodes] * 2
    alone = np.concatenate([labeler.transform(ragged_data.subset([i])).rewards
                            for i in range(ragged_data.n_episodes)])
    np.testing.assert_allclose(rewards, alone, rtol=1e-5, atol=0)
    order = np.random.default_rng(0).permutation(ragged_data.n_episodes)
    shuffled = ragged_data.subset(order)
    shuffled_rewards = labeler.transform(shuffled).rewards
    pieces = {int(e): shuffled_rewards[s] for e, s in zip(order, episode_slices(shuffled))}
    np.testing.assert_allclose(np.concatenate([pieces[i] for i in range(ragged_data.n_episodes)]), rewards,
                               rtol=1e-5, atol=0)


def test_ot_rewards_with_one_episode_per_batch(ragged_data, expert_episodes, monkeypatch):
    """A budget of one cost entry puts every episode in its own solver batch; the rewards stay the same."""
    labeler = OTRewardLabeler(expert_episodes, device="cpu").fit(ragged_data)
    batched = labeler.transform(ragged_data).rewards
    real = ot_module._length_batches
    monkeypatch.setattr(ot_module, "_length_batches", lambda lengths, demo_length: real(lengths, demo_length, 1))
    sizes = spy_batch_sizes(monkeypatch)
    single = labeler.transform(ragged_data).rewards
    assert sizes == [1] * (2 * ragged_data.n_episodes)
    np.testing.assert_allclose(single, batched, rtol=1e-5, atol=0)


def test_batch_entries_setting_limits_the_batches(ragged_data, expert_episodes, monkeypatch):
    labeler = OTRewardLabeler(expert_episodes, device="cpu").fit(ragged_data)
    batched = labeler.transform(ragged_data).rewards
    monkeypatch.setattr(ot_module, "_BATCH_ENTRIES", 1)
    sizes = spy_batch_sizes(monkeypatch)
    single = labeler.transform(ragged_data).rewards
    np.testing.assert_allclose(single, batched, rtol=1e-5, atol=0)
    assert sizes == [1] * (2 * ragged_data.n_episodes), sizes


def test_ot_rewards_match_a_hand_computation_with_pot():
    """r_i = alpha * exp(-beta / d * T * sum_j P_ij C_ij), P from POT's log-domain Sinkhorn on ot.dist cosine."""
    rng = np.random.default_rng(3)
    episode = {"observations": rng.normal(size=(7, 3)), "actions": rng.uniform(-1, 1, size=(6, 1)),
               "rewards": np.zeros(6)}
    data = Dataset.from_episodes([episode], action_low=-1.0, action_high=1.0)
    demo = rng.normal(size=(5, 3)).astype(np.float32)
    alpha, beta, epsilon = 2.0, 3.0, 0.05
    labeler = OTRewardLabeler([demo], epsilon=epsilon, alpha=alpha, beta=beta, max_iter=10_000, tol=1e-13,
                              device="cpu")
    rewards = labeler.fit_transform(data).rewards

    x, y = data.observations.astype(np.float64), demo.astype(np.float64)
    cost = ot.dist(x, y, metric="cosine")
    plan = ot.sinkhorn(np.full(6, 1 / 6), np.full(5, 1 / 5), cost, epsilon, method="sinkhorn_log",
                       numItermax=100_000, stopThr=1e-14)
    expected = alpha * np.exp(-beta / 3 * 6 * (plan * cost).sum(axis=1))
    np.testing.assert_allclose(rewards, expected, rtol=1e-5)
    assert rewards.dtype == np.float32


def test_exact_emd_path_and_a_demo_identical_to_an_episode():
    data = pendulum_shaped_dataset(n_episodes=3, length=30, seed=1)
    first = episode_slices(data)[0]
    demo = data.observations[first]
    alpha = 5.0
    exact = OTRewardLabeler([demo], epsilon=0.0, alpha=alpha, device="cpu").fit_transform(data).rewards
    assert np.isfinite(exact).all() and (exact <= alpha * (1 + 1e-6)).all() and (exact > 0).all()
    # The identity plan costs nothing: exactly alpha on the matching episode, less elsewhere.
    np.testing.assert_allclose(exact[first], alpha, rtol=1e-6)
    assert exact[first.stop:].mean() < 0.95 * alpha
    entropic = OTRewardLabeler([demo], epsilon=0.01, alpha=alpha, device="cpu").fit_transform(data).rewards
    assert (entropic <= alpha * (1 + 1e-6)).all()
    # Entropy spreads some mass off the diagonal: measured mean 4.975 of 5 on the matching episode, 4.54 elsewhere.
    assert entropic[first].mean() > 0.97 * alpha
    assert entropic[first].mean() > entropic[first.stop:].mean() + 0.2


def test_top_k_and_n_demonstrations_choose_the_matching_demo():
    data = pendulum_shaped_dataset(n_episodes=4, length=20, seed=2)
    first = episode_slices(data)[0]
    matching = data.observations[first]
    opposite = -matching  # cosine cost 2 to its own mirror image: a poor demonstration
    only_match = OTRewardLabeler([matching], device="cpu").fit_transform(data).rewards
    only_opposite = OTRewardLabeler([opposite], device="cpu").fit_transform(data).rewards
    assert only_match[first].sum() > only_opposite[first].sum()

    top1 = OTRewardLabeler([opposite, matching], top_k=1, device="cpu").fit_transform(data).rewards
    np.testing.assert_allclose(top1[first], only_match[first], rtol=1e-6)
    for s in episode_slices(data):  # every episode takes its best-scoring demonstration
        best = only_match if only_match[s].sum() >= only_opposite[s].sum() else only_opposite
        np.testing.assert_allclose(top1[s], best[s], rtol=1e-6)
    top2 = OTRewardLabeler([opposite, matching], top_k=2, device="cpu").fit_transform(data).rewards
    np.testing.assert_allclose(top2, (only_match + only_opposite) / 2, rtol=1e-6)

    # n_demonstrations keeps the best-return expert episodes: here the matching one.
    expert = Dataset.from_episodes(
        [{"observations": demo, "next_observations": demo, "actions": np.zeros((len(demo), 1)),
          "rewards": np.full(len(demo), ret)} for demo, ret in ((opposite, -1.0), (matching, 1.0))],
        action_low=-2.0, action_high=2.0)
    picked = OTRewardLabeler(expert, n_demonstrations=1, device="cpu").fit(data)
    np.testing.assert_array_equal(picked.demonstrations_[0], matching)
    np.testing.assert_allclose(picked.transform(data).rewards, only_match, rtol=1e-6)
    with pytest.raises(ValueError, match="n_demonstrations=3"):
        OTRewardLabeler(expert, n_demonstrations=3, device="cpu").fit(data)
    with pytest.raises(ValueError, match="needs rewards"):
        OTRewardLabeler([opposite, matching], n_demonstrations=1, device="cpu").fit(data)


def test_ot_labeller_records_itself_and_labels_a_dataset_without_rewards(ragged_data, expert_episodes):
    unlabelled = ragged_data.without_rewards()
    assert not unlabelled.is_labelled("rewards")
    labeler = OTRewardLabeler(expert_episodes, epsilon=0.02, top_k=2, device="cpu").fit(unlabelled)
    out = labeler.transform(unlabelled)
    assert out.is_labelled("rewards") and np.isfinite(out.rewards).all()
    np.testing.assert_array_equal(out.rewards, labeler.transform(ragged_data).rewards)  # old rewards play no part
    entry = out.metadata["transforms"][-1]
    assert entry["transformer"] == "OTRewardLabeler" and entry["labels"] == "rewards"
    assert entry["n_labelled"] == ragged_data.n_transitions and entry["n_demonstrations"] == 2
    assert entry["epsilon"] == 0.02 and entry["top_k"] == 2 and entry["cost"] == "cosine"
    assert entry["reward_mean"] == pytest.approx(float(out.rewards.mean()))
    assert "transforms" not in unlabelled.metadata  # the input's metadata is untouched


# ---------------------------------------------------------------------- 3. inverse dynamics
def test_inverse_dynamics_recovers_pendulum_actions(pendulum_data):
    data = pendulum_data.subset(np.arange(40))  # 40 episodes x 200 steps
    labeler = InverseDynamicsLabeler(n_steps=2000, label_fraction=0.1, random_state=0, **SMALL_MODEL)
    out = labeler.fit_transform(data)
    keep = labeler._keep_mask(data, labeler.label_seed_)
    assert keep.sum() == 4 * 200  # four whole episodes keep their actions
    assert out.is_labelled("actions")
    np.testing.assert_array_equal(out.actions[keep], data.actions[keep])  # fill="missing" keeps the labels
    rmse = float(np.sqrt(((out.actions[~keep] - data.actions[~keep]) ** 2).mean()))
    # Measured 0.137 (0.099 where the angular velocity is not clipped at +-8, which hides the action); random
    # actions have standard deviation 1.15.
    assert rmse < 0.3, rmse
    assert out.actions.min() >= -2.0 and out.actions.max() <= 2.0
    entry = out.metadata["transforms"][-1]
    assert entry["transformer"] == "InverseDynamicsLabeler" and entry["n_labelled"] == int((~keep).sum())


def test_inverse_dynamics_fills_masked_actions(pendulum_data):
    data = pendulum_data.subset(np.arange(40))
    keep = np.repeat(np.arange(40) % 5 == 0, 200)  # 8 labelled episodes
    masked = data.without_actions(keep=keep)
    assert masked.n_labelled("actions") == keep.sum()
    labeler = InverseDynamicsLabeler(n_steps=2000, random_state=1, **SMALL_MODEL)
    out = labeler.fit(masked).transform(masked)
    assert out.is_labelled("actions") and out.label_mask("actions") is None
    np.testing.assert_array_equal(out.actions[keep], data.actions[keep])
    rmse = float(np.sqrt(((out.actions[~keep] - data.actions[~keep]) ** 2).mean()))
    assert rmse < 0.3, rmse  # same bound as above (twice the labelled episodes here)
    relabelled = InverseDynamicsLabeler(n_steps=2000, random_state=1, fill="all", **SMALL_MODEL).fit_transform(masked)
    assert not np.array_equal(relabelled.actions[keep], data.actions[keep])  # "all" replaces the logged actions too
    np.testing.assert_array_equal(relabelled.actions[~keep], out.actions[~keep])


def test_inverse_dynamics_classifies_discrete_actions():
    """A deterministic 2-D world: s' = s + delta[a]; the classifier must read a from s' - s."""
    deltas = np.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0], [0.0, 0.0]])
    rng = np.random.default_rng(0)
    episodes = []
    for _ in range(30):
        actions = rng.integers(0, len(deltas), size=40)
        start = rng.uniform(-10, 10, size=2)
        states = start + np.concatenate([[[0.0, 0.0]], np.cumsum(deltas[actions], axis=0)])
        episodes.append({"observations": states, "actions": actions, "rewards": np.zeros(40)})
    data = Dataset.from_episodes(episodes, discrete_actions=len(deltas))
    labeler = InverseDynamicsLabeler(n_steps=1000, label_fraction=0.2, random_state=0, **SMALL_MODEL)
    out = labeler.fit_transform(data)
    assert labeler.classifier_ and labeler.n_classes_ == 5
    keep = labeler._keep_mask(data, labeler.label_seed_)
    accuracy = float((out.actions[~keep, 0] == data.actions[~keep, 0]).mean())
    assert accuracy > 0.98, accuracy  # measured 1.0: the classes are separated by whole steps
    assert out.discrete_actions == 5 and set(np.unique(out.actions)) <= set(range(5))


# ---------------------------------------------------------------------- 4. reward model
def test_reward_model_recovers_pendulum_rewards_from_one_percent(pendulum_data):
    labeler = RewardModelLabeler(n_steps=1000, label_fraction=0.01, random_state=0, **SMALL_MODEL)
    out = labeler.fit_transform(pendulum_data)
    assert labeler.n_training_rows_ + labeler.n_validation_rows_ == 500
    assert out.is_labelled("rewards")
    keep = labeler._keep_mask(pendulum_data, labeler.label_seed_)
    np.testing.assert_array_equal(out.rewards[keep], pendulum_data.rewards[keep])
    truth = pendulum_data.rewards
    r2 = 1.0 - float(((out.rewards - truth) ** 2).sum() / ((truth - truth.mean()) ** 2).sum())
    assert r2 > 0.995, r2  # measured 0.9991 (1 - R^2 = 0.0009; the bound allows 5x that)


def test_reward_model_refuses_a_dataset_without_actions(pendulum_data):
    data = pendulum_data.subset([0, 1])
    with pytest.raises(ValueError, match="actions"):
        RewardModelLabeler(n_steps=10, **SMALL_MODEL).fit(data.without_actions())
    fitted = RewardModelLabeler(n_steps=10, **SMALL_MODEL).fit(data)
    half = np.arange(data.n_transitions) % 2 == 0
    with pytest.raises(ValueError, match="actions are missing in 200 of the 400 rows it labels"):
        fitted.transform(data.without_rewards().without_actions(keep=half))
    # With every reward present there is nothing to fill, so missing actions do not matter.
    np.testing.assert_array_equal(fitted.transform(data.without_actions(keep=half)).rewards, data.rewards)
    # Only the rows to fill need actions: rewards missing where actions are present.
    out = fitted.transform(data.without_actions(keep=half).without_rewards(keep=~half))
    assert out.is_labelled("rewards") and not out.is_labelled("actions")
    np.testing.assert_array_equal(out.rewards[~half], data.rewards[~half])


def test_label_fraction_samples_among_the_labelled_and_only_on_the_fitted_data(pendulum_data):
    """On partly labelled data label_fraction keeps a fraction of the labelled episodes (never a true label
    overwritten); on another dataset it hides nothing and fills only what is missing."""
    data = pendulum_data.subset(range(8))
    lengths = data.episode_lengths()
    labelled_eps = np.array([1, 0, 1, 0, 0, 1, 0, 1], bool)  # 4 of 8 episodes have actions
    partial = data.without_actions(keep=np.repeat(labelled_eps, lengths))
    labeler = InverseDynamicsLabeler(label_fraction=0.5, n_steps=20, random_state=0, **SMALL_MODEL).fit(partial)
    keep = labeler._keep_mask(partial, labeler.label_seed_)
    kept_eps = np.unique(np.repeat(np.arange(8), lengths)[keep])
    assert len(kept_eps) == 2 and labelled_eps[kept_eps].all()
    out = labeler.transform(partial)
    np.testing.assert_array_equal(out.actions[keep], data.actions[keep])
    assert out.metadata["transforms"][-1]["label_fraction_applied"] is True
    other = pendulum_data.subset(range(8, 12))
    again = labeler.transform(other.without_actions(keep=np.repeat([True, False, True, False], other.episode_lengths())))
    record = again.metadata["transforms"][-1]
    assert record["label_fraction_applied"] is False and record["n_labelled"] == other.episode_lengths()[[1, 3]].sum()
    np.testing.assert_array_equal(labeler.transform(other).actions, other.actions)  # nothing hidden, nothing filled


def test_inverse_dynamics_drops_the_log_probs_of_the_actions_it_replaces():
    ds = Dataset.from_episodes(make_episodes((20, 20, 20), obs_dim=3, act_dim=1, log_probs=True), discrete_actions=None)
    assert ds.has_behavior_log_probs
    partial = ds.without_actions(keep=np.arange(ds.n_transitions) < 40)
    out = InverseDynamicsLabeler(n_steps=10, random_state=0, **SMALL_MODEL).fit_transform(partial)
    assert out.is_labelled("actions") and not out.has_behavior_log_probs
    assert out.metadata["transforms"][-1]["dropped"] == "behavior_log_probs"


# ---------------------------------------------------------------------- 5. pipelines, clone, save and load
def test_ot_labeller_and_iql_pipeline_fit_predict_save_load(tmp_path):
    data = pendulum_shaped_dataset(n_episodes=6, length=40, seed=3)
    unlabelled = data.without_rewards()
    expert = data.subset([0])  # a Dataset held as a parameter travels in the model file
    pipe = make_pipeline(OTRewardLabeler(expert, device="cpu"), IQL(**SMALL_IQL))
    pipe.fit(unlabelled, iql__n_steps=50, iql__progress=False)
    labeler = pipe.named_steps["otrewardlabeler"]
    observations = data.observations[:16]
    actions = pipe.predict(observations)
    assert actions.shape == (16, 1) and np.isfinite(actions).all()

    pipe.save(tmp_path / "ot_iql.pt")
    loaded = offrl.load(tmp_path / "ot_iql.pt")
    np.testing.assert_array_equal(loaded.predict(observations), actions)
    loaded_labeler = loaded.named_steps["otrewardlabeler"]
    np.testing.assert_array_equal(loaded_labeler.demonstrations_, labeler.demonstrations_)
    np.testing.assert_array_equal(loaded_labeler.demonstration_lengths_, labeler.demonstration_lengths_)
    np.testing.assert_array_equal(loaded_labeler.transform(unlabelled).rewards, labeler.transform(unlabelled).rewards)
    np.testing.assert_array_equal(loaded_labeler.expert.observations, expert.observations)


def test_learned_labellers_in_a_pipeline_save_and_load(pendulum_data, tmp_path):
    data = pendulum_data.subset(np.arange(10))
    rows = np.arange(data.n_transitions)
    unlabelled = data.without_actions(keep=rows < 600).without_rewards(keep=rows % 10 == 0)
    pipe = make_pipeline(InverseDynamicsLabeler(n_steps=200, random_state=0, **SMALL_MODEL),
                         RewardModelLabeler(n_steps=200, random_state=0, **SMALL_MODEL),
                         IQL(**SMALL_IQL))
    pipe.fit(unlabelled, iql__n_steps=50, iql__progress=False)
    observations = data.observations[:16]
    actions = pipe.predict(observations)

    pipe.save(tmp_path / "learned.pt")
    loaded = offrl.load(tmp_path / "learned.pt")
    np.testing.assert_array_equal(loaded.predict(observations), actions)
    for name in ("inversedynamicslabeler", "rewardmodellabeler"):
        original, restored = pipe.named_steps[name], loaded.named_steps[name]
        np.testing.assert_array_equal(restored.predict_labels(data), original.predict_labels(data), err_msg=name)
        for key, value in original.model_.state_dict().items():
            torch.testing.assert_close(restored.model_.state_dict()[key], value, rtol=0, atol=0)
        assert restored.label_seed_ == original.label_seed_
    filled = loaded.named_steps["inversedynamicslabeler"].transform(unlabelled)
    original_filled = pipe.named_steps["inversedynamicslabeler"].transform(unlabelled)
    np.testing.assert_array_equal(filled.actions, original_filled.actions)
    assert loaded.named_steps["rewardmodellabeler"].transform(filled).is_labelled("rewards")


def _same_param(left, right) -> bool:
    if isinstance(left, Dataset):
        return isinstance(right, Dataset) and np.array_equal(left.observations, right.observations)
    if isinstance(left, list):
        return len(left) == len(right) and all(np.array_equal(u, v) for u, v in zip(left, right))
    return left == right


@pytest.mark.parametrize("make", [
    lambda data: OTRewardLabeler([data.observations[:10]], epsilon=0.02, top_k=1, device="cpu"),
    lambda data: OTRewardLabeler(data.subset([0]), n_demonstrations=1, device="cpu"),
    lambda data: InverseDynamicsLabeler(n_steps=20, label_fraction=0.5, random_state=4, **SMALL_MODEL),
    lambda data: RewardModelLabeler(n_steps=20, label_fraction=0.5, random_state=4, **SMALL_MODEL),
], ids=["ot-list", "ot-dataset", "inverse-dynamics", "reward-model"])
def test_clone_gives_an_unfitted_copy_with_equal_params(make):
    data = pendulum_shaped_dataset(n_episodes=3, length=20)
    labeler = make(data).fit(data)
    copy = sklearn.base.clone(labeler)
    assert type(copy) is type(labeler)
    with pytest.raises(NotFittedError):
        copy.transform(data)
    params, copied = labeler.get_params(), copy.get_params()
    assert params.keys() == copied.keys()
    for name in params:
        assert _same_param(params[name], copied[name]), name
    assert not [k for k in vars(copy) if k.endswith("_") and not k.startswith("_")]
    np.testing.assert_array_equal(copy.fit_transform(data).rewards, labeler.transform(data).rewards)


@pytest.mark.parametrize("cls", [InverseDynamicsLabeler, RewardModelLabeler])
def test_random_state_repeats_learned_labellers_bit_for_bit(cls, pendulum_data):
    data = pendulum_data.subset(np.arange(5))
    first = cls(n_steps=150, label_fraction=0.5, random_state=7, **SMALL_MODEL).fit(data)
    second = cls(n_steps=150, label_fraction=0.5, random_state=7, **SMALL_MODEL).fit(data)
    other = cls(n_steps=150, label_fraction=0.5, random_state=8, **SMALL_MODEL).fit(data)
    assert first.label_seed_ == second.label_seed_ != other.label_seed_
    for key, value in first.model_.state_dict().items():
        torch.testing.assert_close(second.model_.state_dict()[key], value, rtol=0, atol=0)
    np.testing.assert_array_equal(second.predict_labels(data), first.predict_labels(data))
    assert not np.array_equal(other.predict_labels(data), first.predict_labels(data))
    column = cls.label
    np.testing.assert_array_equal(getattr(second.transform(data), column), getattr(first.transform(data), column))


# ---------------------------------------------------------------------- 6. bad input
def test_ot_refuses_an_expert_of_another_dimension_and_too_large_top_k():
    data = pendulum_shaped_dataset(n_episodes=2, length=10)
    with pytest.raises(ValueError, match=r"observation dimension \[4\] but the dataset has 3"):
        OTRewardLabeler([np.ones((5, 4))]).fit(data)
    with pytest.raises(ValueError, match="top_k=3 exceeds the 2 expert demonstrations"):
        OTRewardLabeler([np.ones((5, 3)), np.ones((6, 3))], top_k=3).fit(data)
    with pytest.raises(ValueError, match="needs expert demonstrations"):
        OTRewardLabeler().fit(data)
    with pytest.raises(ValueError, match="expert episode 0"):
        OTRewardLabeler([np.full((5, 3), np.nan)]).fit(data)


@pytest.mark.parametrize("make", [
    lambda: OTRewardLabeler([np.ones((5, 3))], epsilon=-1),
    lambda: OTRewardLabeler([np.ones((5, 3))], cost="l1"),
    lambda: OTRewardLabeler([np.ones((5, 3))], top_k=0),
    lambda: InverseDynamicsLabeler(label_fraction=0),
    lambda: RewardModelLabeler(label_fraction=0),
    lambda: InverseDynamicsLabeler(fill="some"),
], ids=["epsilon=-1", "cost=l1", "top_k=0", "id-label_fraction=0", "rm-label_fraction=0", "fill=some"])
def test_invalid_params_are_refused_at_fit(make):
    labeler = make()  # constructing never checks (scikit-learn's convention)
    with pytest.raises(InvalidParameterError):
        labeler.fit(pendulum_shaped_dataset(n_episodes=2, length=10))


@pytest.mark.parametrize("labeler", [OTRewardLabeler([np.ones((5, 3))]), InverseDynamicsLabeler(),
                                     RewardModelLabeler()], ids=["ot", "inverse-dynamics", "reward-model"])
def test_transform_before_fit_is_refused(labeler):
    with pytest.raises(NotFittedError):
        labeler.transform(pendulum_shaped_dataset(n_episodes=2, length=10))
