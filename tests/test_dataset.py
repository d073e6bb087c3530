"""The in-memory Dataset: constructors, episode maths, validation, persistence and sampling."""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import assert_same_columns, make_episodes
from offrl.datasets import Dataset
from offrl.datasets.core import atomic_write_path


def brute_force_returns_to_go(rewards, starts, gamma):
    out = np.zeros(len(rewards))
    for s, e in zip(starts[:-1], starts[1:]):
        acc = 0.0
        for t in range(e - 1, s - 1, -1):
            acc = rewards[t] + gamma * acc
            out[t] = acc
    return out


def indexed_dataset(n=50, episode_length=10, log_probs=True):
    """Row i: observation [i, -i], next observation [i + 0.5, -i - 0.5], reward 2i, action i / n."""
    i = np.arange(n, dtype=np.float32)
    return Dataset.from_arrays(
        observations=np.stack([i, -i], 1),
        actions=(i / n)[:, None],
        rewards=2 * i,
        terminals=np.zeros(n),
        timeouts=(np.arange(n) % episode_length == episode_length - 1),
        next_observations=np.stack([i + 0.5, -i - 0.5], 1),
        behavior_log_probs=-i if log_probs else None,
    )


# ------------------------------------------------------------------ constructors


def test_from_episodes_minari_style(episodes):
    ds = Dataset.from_episodes(episodes)
    lengths = [len(ep["actions"]) for ep in episodes]
    assert ds.n_transitions == sum(lengths) == len(ds)
    assert ds.n_episodes == len(episodes)
    assert ds.observation_dim == 3 and ds.action_dim == 1
    np.testing.assert_array_equal(ds.episode_lengths(), lengths)
    np.testing.assert_array_equal(ds.episode_starts, np.concatenate([[0], np.cumsum(lengths)]))
    for i, ep in enumerate(episodes):
        s, e = ds.episode_starts[i], ds.episode_starts[i + 1]
        np.testing.assert_array_equal(ds.observations[s:e], ep["observations"][:-1])
        np.testing.assert_array_equal(ds.next_observations[s:e], ep["observations"][1:])
        np.testing.assert_array_equal(ds.actions[s:e], ep["actions"])
        np.testing.assert_array_equal(ds.rewards[s:e], ep["rewards"])
        np.testing.assert_array_equal(ds.behavior_log_probs[s:e], ep["behavior_log_probs"])
        terminal = bool(ep["terminations"][-1])
        assert ds.terminals[e - 1] == float(terminal) and ds.timeouts[e - 1] == float(not terminal)
        assert not ds.terminals[s : e - 1].any() and not ds.timeouts[s : e - 1].any()
    assert ds.has_behavior_log_probs
    assert all(col.dtype == np.float32 for col in (ds.observations, ds.actions, ds.rewards, ds.terminals))


def test_from_episodes_with_next_observations_and_flag_defaults():
    rng = np.random.default_rng(3)
    eps = [
        {
            "observations": rng.normal(size=(4, 2)),
            "next_observations": rng.normal(size=(4, 2)),
            "actions": rng.normal(size=4),  # 1-d actions become one column
            "rewards": rng.normal(size=(4, 1)),  # (T, 1) rewards are accepted
            "terminals": [0, 0, 0, 1],
        },
        {  # no flag at all: the episode counts as cut by a time limit
            "observations": rng.normal(size=(2, 2)),
            "next_observations": rng.normal(size=(2, 2)),
            "actions": rng.normal(size=2),
            "rewards": rng.normal(size=2),
        },
        {  # terminated and truncated on the same step: gymnasium semantics, a true terminal
            "observations": rng.normal(size=(3, 2)),
            "next_observations": rng.normal(size=(3, 2)),
            "actions": rng.normal(size=3),
            "rewards": rng.normal(size=3),
            "terminations": [0, 0, 1],
            "truncations": [0, 0, 1],
        },
    ]
    ds = Dataset.from_episodes(eps)
    assert ds.action_dim == 1 and ds.n_episodes == 3
    np.testing.assert_array_equal(ds.next_observations, np.concatenate([e["next_observations"] for e in eps]).astype(np.float32))
    np.testing.assert_array_equal(ds.terminals, [0, 0, 0, 1, 0, 0, 0, 0, 1])
    np.testing.assert_array_equal(ds.timeouts, [0, 0, 0, 0, 0, 1, 0, 0, 0])
    assert not ds.has_behavior_log_probs


def test_from_arrays_splits_episodes_on_flags():
    n = 9
    obs = np.arange(2 * n, dtype=np.float64).reshape(n, 2)
    terminals = np.array([0, 0, 1, 0, 0, 0, 0, 0, 0])
    timeouts = np.array([0, 0, 0, 0, 1, 0, 0, 0, 0])
    ds = Dataset.from_arrays(obs, np.zeros((n, 1)), np.ones(n), terminals, timeouts, next_observations=obs + 100)
    np.testing.assert_array_equal(ds.episode_starts, [0, 3, 5, 9])
    # the final, unflagged episode is cut by the end of the log: a timeout
    np.testing.assert_array_equal(ds.timeouts, [0, 0, 0, 0, 1, 0, 0, 0, 1])
    np.testing.assert_array_equal(ds.terminals, terminals)
    assert ds.observations.dtype == np.float32


def test_from_arrays_without_next_observations_follows_d4rl():
    n = 10
    obs = np.arange(n, dtype=np.float32)[:, None]
    terminals = np.zeros(n)
    terminals[6] = 1
    timeouts = np.zeros(n)
    timeouts[3] = 1
    ds = Dataset.from_arrays(obs, np.zeros(n), np.arange(n), terminals, timeouts, behavior_log_probs=-np.arange(n))
    kept = [0, 1, 2, 4, 5, 6, 7, 8]  # timeout row 3 and the cut final row 9 have no successor
    np.testing.assert_array_equal(ds.observations[:, 0], kept)
    np.testing.assert_array_equal(ds.next_observations[:, 0], np.array(kept) + 1)
    np.testing.assert_array_equal(ds.rewards, kept)
    np.testing.assert_array_equal(ds.behavior_log_probs, -np.array(kept))
    np.testing.assert_array_equal(ds.episode_starts, [0, 3, 6, 8])
    np.testing.assert_array_equal(ds.terminals, [0, 0, 0, 0, 0, 1, 0, 0])
    np.testing.assert_array_equal(ds.timeouts, [0, 0, 1, 0, 0, 0, 0, 1])


def test_pandas_round_trip(dataset):
    df = dataset.to_pandas()
    assert len(df) == dataset.n_transitions
    assert {"episode_id", "step", "obs_0", "obs_2", "action_0", "reward", "terminal", "timeout", "next_obs_2",
            "behavior_log_prob"} <= set(df.columns)
    np.testing.assert_array_equal(df["step"].to_numpy()[: dataset.episode_lengths()[0]], np.arange(dataset.episode_lengths()[0]))
    back = Dataset.from_pandas(df)
    assert_same_columns(dataset, back)


def test_from_pandas_custom_columns_and_contiguity():
    df = pd.DataFrame(
        {
            "ep": [7, 7, 7, 3, 3],
            "x": [0.0, 1.0, 2.0, 3.0, 4.0],
            "u": [0.1, 0.2, 0.3, 0.4, 0.5],
            "r": [1.0, 1.0, 1.0, 2.0, 2.0],
            "done": [0, 0, 1, 0, 0],
        }
    )
    ds = Dataset.from_pandas(
        df, observation_columns=["x"], action_columns=["u"], reward_column="r", terminal_column="done", episode_column="ep"
    )
    # first episode terminal (all rows kept), second cut by the log's end (its last row is dropped)
    np.testing.assert_array_equal(ds.episode_starts, [0, 3, 4])
    np.testing.assert_array_equal(ds.next_observations[:, 0], [1.0, 2.0, 3.0, 4.0])
    np.testing.assert_array_equal(ds.terminals, [0, 0, 1, 0])
    np.testing.assert_array_equal(ds.timeouts, [0, 0, 0, 1])
    shuffled = df.iloc[[0, 3, 1, 4, 2]]
    with pytest.raises(ValueError, match="ep.*contiguous"):
        Dataset.from_pandas(shuffled, observation_columns=["x"], action_columns=["u"], reward_column="r", episode_column="ep")
    with pytest.raises(ValueError, match="no column"):
        Dataset.from_pandas(df, observation_columns=["nope"], action_columns=["u"], reward_column="r")
    with pytest.raises(ValueError, match="reward column"):
        Dataset.from_pandas(df, observation_columns=["x"], action_columns=["u"])


# ------------------------------------------------------------------ episode maths


def test_episode_returns_and_returns_to_go(dataset, episodes):
    expected = np.array([ep["rewards"].astype(np.float64).sum() for ep in episodes])
    np.testing.assert_allclose(dataset.episode_returns(), expected, rtol=1e-6)
    gamma = 0.9
    discounted = np.array([(ep["rewards"] * gamma ** np.arange(len(ep["rewards"]))).sum() for ep in episodes])
    np.testing.assert_allclose(dataset.episode_returns(gamma), discounted, rtol=1e-6)
    for g in (1.0, 0.99, 0.5, 0.0):
        rtg = dataset.returns_to_go(g)
        assert rtg.dtype == np.float32 and rtg.shape == (dataset.n_transitions,)
        np.testing.assert_allclose(rtg, brute_force_returns_to_go(dataset.rewards, dataset.episode_starts, g), rtol=1e-5, atol=1e-6)
    # the return-to-go at each episode's first step is the episode return
    np.testing.assert_allclose(dataset.returns_to_go(gamma)[dataset.episode_starts[:-1]], discounted, rtol=1e-5)


def test_returns_to_go_long_episodes_against_brute_force():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 400, size=30)
    eps = make_episodes(tuple(lengths), terminal=tuple(rng.random(30) < 0.5), log_probs=False, seed=1)
    ds = Dataset.from_episodes(eps)
    for g in (1.0, 0.99):
        np.testing.assert_allclose(
            ds.returns_to_go(g), brute_force_returns_to_go(ds.rewards, ds.episode_starts, g), rtol=1e-5, atol=1e-4
        )


def test_iteration_and_episode_access(dataset, episodes):
    got = list(dataset)
    assert len(got) == dataset.n_episodes
    for ep, original in zip(got, episodes):
        np.testing.assert_array_equal(ep["observations"], original["observations"][:-1])
        np.testing.assert_array_equal(ep["next_observations"], original["observations"][1:])
        np.testing.assert_array_equal(ep["behavior_log_probs"], original["behavior_log_probs"])
        assert set(ep) == {"observations", "actions", "rewards", "terminals", "timeouts", "next_observations", "behavior_log_probs"}
    np.testing.assert_array_equal(dataset.episode(-1)["rewards"], episodes[-1]["rewards"])
    with pytest.raises(IndexError):
        dataset.episode(dataset.n_episodes)


def test_subset(dataset, episodes):
    sub = dataset.subset([2, 0])
    assert sub.n_episodes == 2
    np.testing.assert_array_equal(sub.episode_lengths(), [len(episodes[2]["actions"]), len(episodes[0]["actions"])])
    for got, want in zip(sub, [dataset.episode(2), dataset.episode(0)]):
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
    np.testing.assert_array_equal(dataset.subset([-1]).rewards, episodes[-1]["rewards"])
    assert sub.metadata["name"] == "toy"
    np.testing.assert_array_equal(sub.action_low, dataset.action_low)
    with pytest.raises(ValueError, match="episode_indices"):
        dataset.subset([dataset.n_episodes])
    with pytest.raises(ValueError, match="episode_indices"):
        dataset.subset([])


def test_concatenate_and_add(dataset):
    first, second = dataset.subset([0, 1]), dataset.subset([2, 3])
    for joined in (Dataset.concatenate([first, second]), first + second):
        assert_same_columns(joined, dataset)
        assert joined.n_episodes == dataset.n_episodes
    triple = Dataset.concatenate([dataset, dataset, dataset], metadata={"name": "x3"})
    assert triple.n_transitions == 3 * dataset.n_transitions and triple.n_episodes == 3 * dataset.n_episodes
    assert triple.metadata == {"name": "x3"}
    with pytest.raises(ValueError, match="behavior_log_probs"):
        dataset + dataset.without_behavior_log_probs()
    other_dims = Dataset.from_episodes(make_episodes(obs_dim=4))
    with pytest.raises(ValueError, match="observation/action dims"):
        dataset + other_dims
    with pytest.raises(ValueError, match="empty"):
        Dataset.concatenate([])


def test_observation_stats():
    rng = np.random.default_rng(0)
    obs = rng.normal(3.0, 2.0, size=(500, 3)).astype(np.float32)
    obs[:, 2] = 7.0  # constant column: std floored at eps
    ds = Dataset.from_arrays(obs, np.zeros(500), np.zeros(500), next_observations=obs)
    mean, std = ds.observation_stats(eps=1e-3)
    assert mean.dtype == np.float32 and std.shape == (3,)
    np.testing.assert_allclose(mean, obs.astype(np.float64).mean(0), rtol=1e-5)
    np.testing.assert_allclose(std[:2], obs[:, :2].astype(np.float64).std(0), rtol=1e-5)
    assert std[2] == pytest.approx(1e-3)


def test_with_rewards_and_repr(dataset):
    relabelled = dataset.with_rewards(np.ones(dataset.n_transitions))
    np.testing.assert_array_equal(relabelled.rewards, 1.0)
    np.testing.assert_array_equal(relabelled.observations, dataset.observations)
    with pytest.raises(ValueError, match="rewards has 3 rows"):
        dataset.with_rewards(np.ones(3))
    assert "n_transitions=19" in repr(dataset) and "'toy'" in repr(dataset)


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize("field", ["actions", "rewards", "terminals", "timeouts", "next_observations", "behavior_log_probs"])
def test_mismatched_lengths_name_the_field(field):
    n = 10
    kwargs = dict(
        observations=np.zeros((n, 2)),
        actions=np.zeros((n, 1)),
        rewards=np.zeros(n),
        terminals=np.zeros(n),
        timeouts=np.zeros(n),
        next_observations=np.zeros((n, 2)),
        behavior_log_probs=np.zeros(n),
    )
    kwargs[field] = kwargs[field][:-1]
    with pytest.raises(ValueError, match=f"{field} has 9 rows but observations has 10"):
        Dataset.from_arrays(**kwargs)


@pytest.mark.parametrize(
    "field, with_next",
    [(f, True) for f in ("observations", "actions", "rewards", "next_observations", "behavior_log_probs")]
    # without next_observations they are derived from observations, after validation
    + [(f, False) for f in ("observations", "actions", "rewards", "behavior_log_probs")],
)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_name_field_and_row(field, bad, with_next):
    n = 12
    timeouts = np.zeros(n)
    timeouts[3] = 1  # with derived next_observations rows are dropped: the row reported must be the caller's
    kwargs = dict(
        observations=np.zeros((n, 2)),
        actions=np.zeros((n, 1)),
        rewards=np.zeros(n),
        timeouts=timeouts,
        next_observations=np.zeros((n, 2)) if with_next else None,
        behavior_log_probs=np.zeros(n),
    )
    column = kwargs[field].copy()
    column[7] = bad
    kwargs[field] = column
    with pytest.raises(ValueError, match=rf"{field} contains NaN or inf at row 7\b"):
        Dataset.from_arrays(**kwargs)


def test_three_dimensional_observations_rejected():
    with pytest.raises(ValueError, match=r"observations has shape \(5, 2, 2\)"):
        Dataset.from_arrays(np.zeros((5, 2, 2)), np.zeros(5), np.zeros(5))
    with pytest.raises(ValueError, match="episode 0 observations has shape"):
        Dataset.from_episodes([{"observations": np.zeros((4, 2, 2)), "actions": np.zeros(3), "rewards": np.zeros(3)}])
    with pytest.raises(ValueError, match="episode 0 actions has shape"):
        Dataset.from_episodes([{"observations": np.zeros((4, 2)), "actions": np.zeros((3, 2, 2)), "rewards": np.zeros(3)}])


def test_empty_dataset_rejected():
    with pytest.raises(ValueError, match="observations is empty"):
        Dataset.from_arrays(np.zeros((0, 3)), np.zeros((0, 1)), np.zeros(0))
    with pytest.raises(ValueError, match="episodes is empty"):
        Dataset.from_episodes([])
    with pytest.raises(ValueError, match="episode 0 has no actions"):
        Dataset.from_episodes([{"observations": np.zeros((1, 2)), "actions": np.zeros((0, 1)), "rewards": np.zeros(0)}])


def test_actions_outside_box_rejected():
    actions = np.zeros((6, 2))
    actions[3, 1] = 1.5
    with pytest.raises(ValueError, match=r"actions\[3, 1\] = 1\.5 .*action_high = 1"):
        Dataset.from_arrays(np.zeros((6, 2)), actions, np.zeros(6), action_low=-1, action_high=1)
    actions[3, 1] = -2.0
    with pytest.raises(ValueError, match=r"actions\[3, 1\] = -2 .*action_low = -1"):
        Dataset.from_arrays(np.zeros((6, 2)), actions, np.zeros(6), action_low=[-1, -1], action_high=[1, 1])
    # per-dimension bounds: -2 is fine where the low bound is -3
    ds = Dataset.from_arrays(np.zeros((6, 2)), actions, np.zeros(6), action_low=[-1, -3], action_high=[1, 1])
    np.testing.assert_array_equal(ds.action_low, [-1, -3])


def test_discrete_actions_validated():
    ds = Dataset.from_arrays(np.zeros((5, 2)), np.array([0, 1, 2, 1, 0]), np.zeros(5), discrete_actions=3)
    assert ds.discrete_actions == 3 and ds.action_dim == 1
    with pytest.raises(ValueError, match=r"actions has value 3\.0 at row 2.*discrete"):
        Dataset.from_arrays(np.zeros((5, 2)), np.array([0, 1, 3, 1, 0]), np.zeros(5), discrete_actions=3)
    with pytest.raises(ValueError, match=r"actions has value 0\.5 at row 1"):
        Dataset.from_arrays(np.zeros((5, 2)), np.array([0, 0.5, 2, 1, 0]), np.zeros(5), discrete_actions=3)
    with pytest.raises(ValueError, match=r"actions has value -1\.0 at row 0"):
        Dataset.from_arrays(np.zeros((5, 2)), np.array([-1, 0, 2, 1, 0]), np.zeros(5), discrete_actions=3)


@pytest.mark.parametrize("field", ["terminals", "timeouts"])
@pytest.mark.parametrize("with_next", [True, False])
def test_flags_must_be_zero_or_one(field, with_next):
    flags = np.zeros(8)
    flags[4] = 0.5
    kwargs = {field: flags}
    with pytest.raises(ValueError, match=rf"{field} must be 0 or 1, found 0\.5 at row 4"):
        Dataset.from_arrays(np.zeros((8, 2)), np.zeros(8), np.zeros(8), next_observations=np.zeros((8, 2)) if with_next else None, **kwargs)
    flags[4] = 2
    with pytest.raises(ValueError, match=rf"{field} must be 0 or 1, found 2\.0 at row 4"):
        Dataset.from_arrays(np.zeros((8, 2)), np.zeros(8), np.zeros(8), next_observations=np.zeros((8, 2)) if with_next else None, **kwargs)


def test_per_episode_length_mismatch_names_episode_and_field():
    good = make_episodes((3, 3), log_probs=True)
    bad = [dict(ep) for ep in good]
    # one episode a reward short and the next a reward long: totals agree, so only a per-episode check catches it
    bad[0]["rewards"] = good[0]["rewards"][:-1]
    bad[1]["rewards"] = np.append(good[1]["rewards"], 0.0)
    with pytest.raises(ValueError, match="episode 0 rewards has 2 rows but actions has 3"):
        Dataset.from_episodes(bad)
    bad = [dict(ep) for ep in good]
    bad[1]["behavior_log_probs"] = good[1]["behavior_log_probs"][:2]
    with pytest.raises(ValueError, match="episode 1 behavior_log_probs has 2 rows"):
        Dataset.from_episodes(bad)
    bad = [dict(ep) for ep in good]
    bad[1]["observations"] = good[1]["observations"][:2]
    with pytest.raises(ValueError, match="episode 1 has 2 observations for 3 actions"):
        Dataset.from_episodes(bad)
    bad = [dict(ep) for ep in good]
    del bad[1]["behavior_log_probs"]
    with pytest.raises(ValueError, match="episode 1 lacks behavior_log_probs"):
        Dataset.from_episodes(bad)
    with pytest.raises(ValueError, match="episode 0 needs"):
        Dataset.from_episodes([{"observations": np.zeros((2, 1)), "actions": np.zeros(1)}])


def test_bad_episode_starts_rejected():
    with pytest.raises(ValueError, match="episode_starts"):
        Dataset.from_arrays(np.zeros((6, 1)), np.zeros(6), np.zeros(6), episode_starts=[0, 4, 2])
    with pytest.raises(ValueError, match="episode_starts"):
        Dataset.from_arrays(np.zeros((6, 1)), np.zeros(6), np.zeros(6), episode_starts=[1, 4])
    ds = Dataset.from_arrays(np.zeros((6, 1)), np.zeros(6), np.zeros(6), next_observations=np.zeros((6, 1)), episode_starts=[0, 4])
    np.testing.assert_array_equal(ds.episode_starts, [0, 4, 6])


def test_non_numeric_columns_rejected():
    with pytest.raises(ValueError, match="rewards has non-numeric dtype"):
        Dataset.from_arrays(np.zeros((3, 1)), np.zeros(3), np.array(["a", "b", "c"]))


# ------------------------------------------------------------------ persistence


def test_save_load_round_trip_exact(tmp_path, dataset):
    path = tmp_path / "toy.npz"
    dataset.save(path)
    assert sorted(os.listdir(tmp_path)) == ["toy.npz"]  # no temporary file left behind
    back = Dataset.load(path)
    assert_same_columns(dataset, back)
    np.testing.assert_array_equal(back.action_low, dataset.action_low)
    np.testing.assert_array_equal(back.action_high, dataset.action_high)
    assert back.discrete_actions is None
    assert back.metadata == dataset.metadata
    # the loader in offrl.datasets reads it too
    from offrl.datasets import load

    assert_same_columns(load(str(path)), dataset)


def test_save_load_discrete_and_numpy_metadata(tmp_path):
    ds = Dataset.from_arrays(
        np.zeros((5, 2)), np.array([0, 1, 2, 1, 0]), np.arange(5.0), discrete_actions=3,
        metadata={"seed": np.int64(4), "score": np.float32(0.5), "list": np.arange(3)},
    )
    ds.save(tmp_path / "d.npz")
    back = Dataset.load(tmp_path / "d.npz")
    assert back.discrete_actions == 3 and back.action_low is None and not back.has_behavior_log_probs
    assert back.metadata == {"seed": 4, "score": 0.5, "list": [0, 1, 2]}
    assert_same_columns(ds, back)


def test_save_overwrites_atomically(tmp_path, dataset):
    path = tmp_path / "d.npz"
    dataset.save(path)
    smaller = dataset.subset([1])
    smaller.save(path)
    assert_same_columns(Dataset.load(path), smaller)
    assert sorted(os.listdir(tmp_path)) == ["d.npz"]


def test_failed_save_leaves_no_file(tmp_path, dataset):
    bad = Dataset.from_arrays(np.zeros((3, 1)), np.zeros(3), np.zeros(3), metadata={"callback": object()})
    with pytest.raises(TypeError, match="not JSON serialisable"):
        bad.save(tmp_path / "bad.npz")
    assert os.listdir(tmp_path) == []
    # failure at the rename itself: the target is an existing non-empty directory
    target = tmp_path / "taken.npz"
    target.mkdir()
    (target / "keep").write_text("x")
    with pytest.raises(OSError):
        dataset.save(target)
    assert sorted(os.listdir(tmp_path)) == ["taken.npz"]
    assert os.listdir(target) == ["keep"]


def test_atomic_write_path_removes_temporary_on_error(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_write_path(target) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"half")
            raise RuntimeError("writer crashed")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["out.bin"]


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no dataset file"):
        Dataset.load(tmp_path / "missing.npz")
    np.savez(tmp_path / "foreign.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="not an offrl Dataset file"):
        Dataset.load(tmp_path / "foreign.npz")


# ------------------------------------------------------------------ sampling


def test_sample_shapes_and_dtypes(dataset):
    batch = dataset.sample(32, generator=torch.Generator().manual_seed(0))
    assert batch.observations.shape == (32, 3) and batch.next_observations.shape == (32, 3)
    assert batch.actions.shape == (32, 1)
    for key in ("rewards", "terminals", "timeouts", "behavior_log_probs"):
        assert getattr(batch, key).shape == (32,), key
    for key in ("observations", "actions", "rewards", "terminals", "timeouts", "next_observations", "behavior_log_probs"):
        tensor = getattr(batch, key)
        assert isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32 and tensor.device.type == "cpu", key
    assert batch.indices.shape == (32,) and batch.indices.dtype == torch.int64
    assert int(batch.indices.min()) >= 0 and int(batch.indices.max()) < dataset.n_transitions
    no_log_probs = dataset.without_behavior_log_probs().sample(4)
    assert no_log_probs.behavior_log_probs is None and no_log_probs.observations.shape == (4, 3)


def test_sample_repeatable_with_seeded_generator(dataset):
    a = [dataset.sample(64, generator=torch.Generator().manual_seed(123)) for _ in range(2)]
    for key in ("indices", "observations", "actions", "rewards", "next_observations", "behavior_log_probs"):
        assert torch.equal(getattr(a[0], key), getattr(a[1], key)), key
    # a stream of batches is repeatable too, and consecutive batches differ
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    s1 = [dataset.sample(16, generator=g1).indices for _ in range(3)]
    s2 = [dataset.sample(16, generator=g2).indices for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(s1, s2))
    assert not torch.equal(s1[0], s1[1])
    other = dataset.sample(64, generator=torch.Generator().manual_seed(124))
    assert not torch.equal(a[0].indices, other.indices)


def test_sampled_rows_are_consistent():
    ds = indexed_dataset()
    batch = ds.sample(256, generator=torch.Generator().manual_seed(0))
    row = batch.observations[:, 0]
    assert torch.equal(batch.observations[:, 1], -row)
    assert torch.equal(batch.next_observations[:, 0], row + 0.5)
    assert torch.equal(batch.next_observations[:, 1], -row - 0.5)
    assert torch.equal(batch.rewards, 2 * row)
    assert torch.equal(batch.behavior_log_probs, -row)
    assert torch.allclose(batch.actions[:, 0], row / 50)
    assert torch.equal(batch.timeouts, (row % 10 == 9).float())
    assert torch.equal(batch.indices.float(), row)
    # many distinct rows are drawn (uniform with replacement over 50 rows)
    assert len(torch.unique(batch.indices)) > 40


def test_sample_does_not_alias_dataset(dataset):
    before = dataset.observations.copy()
    batch = dataset.sample(8, generator=torch.Generator().manual_seed(0))
    batch.observations.add_(1000.0)
    np.testing.assert_array_equal(dataset.observations, before)
    assert dataset.tensors("cpu") is dataset.tensors(torch.device("cpu"))  # cached once per device


def test_row_flagged_terminal_and_timeout_rejected():
    ds = indexed_dataset(log_probs=False)
    terminals, timeouts = ds.terminals.copy(), ds.timeouts.copy()
    terminals[9] = 1.0  # row 9 already ends its episode with a timeout
    with pytest.raises(ValueError, match="both set at row 9"):
        Dataset(observations=ds.observations, actions=ds.actions, rewards=ds.rewards, terminals=terminals,
                timeouts=timeouts, next_observations=ds.next_observations, episode_starts=ds.episode_starts)


def test_from_episodes_rejects_flags_before_the_last_step():
    episode = {"observations": np.zeros((4, 2)), "actions": np.zeros((3, 1)), "rewards": np.zeros(3),
               "terminations": [False, True, False]}
    with pytest.raises(ValueError, match="episode 0 is flagged terminal or truncated at step 1"):
        Dataset.from_episodes([episode])


def test_concatenate_requires_same_action_space(dataset):
    other = Dataset.from_arrays(dataset.observations, dataset.actions, dataset.rewards, dataset.terminals,
                                dataset.timeouts, dataset.next_observations, dataset.behavior_log_probs,
                                action_low=-5.0, action_high=5.0)
    with pytest.raises(ValueError, match="different action space"):
        Dataset.concatenate([dataset, other])
    with pytest.raises(TypeError):
        dataset + 1
