"""Writing Datasets as Minari datasets and reading them back, through the real `minari` package."""

from __future__ import annotations

import gymnasium as gym
import minari
import numpy as np
import pytest
from minari.data_collector import EpisodeBuffer

from conftest import assert_same_columns, make_episodes
from offrl.datasets import Dataset, load, normalized_score, to_minari
from offrl.datasets.minari import load_minari

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def pendulum_dataset(log_probs=True):
    # Pendulum-v1: 3-d observations, one action in [-2, 2]; episodes of both kinds
    eps = make_episodes((6, 4, 9, 3), obs_dim=3, act_dim=1, terminal=(False, True, False, True), log_probs=log_probs)
    for ep in eps:
        ep["actions"] = ep["actions"] * 2.0
    return Dataset.from_episodes(
        eps,
        action_low=-2.0,
        action_high=2.0,
        metadata={"name": "pendulum-toy", "ref_min_score": -1500.0, "ref_max_score": -150.0},
    )


def test_round_trip_with_env(minari_dir):
    ds = pendulum_dataset()
    to_minari(ds, "test/foo-v0", env="Pendulum-v1")
    assert (minari_dir / "test" / "foo-v0").is_dir()

    # minari itself reads it: T + 1 observations per episode, Minari's flags
    md = minari.load_dataset("test/foo-v0")
    assert md.total_episodes == ds.n_episodes and md.total_steps == ds.n_transitions
    for ep, mine in zip(md.iterate_episodes(), ds):
        assert len(ep.observations) == len(ep.actions) + 1
        np.testing.assert_array_equal(ep.observations[:-1], mine["observations"])
        np.testing.assert_array_equal(ep.observations[-1], mine["next_observations"][-1])
        np.testing.assert_array_equal(ep.terminations, mine["terminals"] > 0)
        np.testing.assert_array_equal(ep.truncations, mine["timeouts"] > 0)
        np.testing.assert_array_equal(ep.infos["action_log_probs"], mine["behavior_log_probs"])
    assert md.storage.metadata["ref_min_score"] == -1500.0
    assert minari.get_normalized_score(md, np.array([-150.0])) == pytest.approx(1.0)

    back = load("minari:test/foo-v0")
    assert_same_columns(ds, back)
    assert back.has_behavior_log_probs
    np.testing.assert_array_equal(back.terminals, ds.terminals)  # terminals and timeouts stay apart
    np.testing.assert_array_equal(back.timeouts, ds.timeouts)
    assert back.terminals.sum() == 2 and back.timeouts.sum() == 2
    assert (back.metadata["ref_min_score"], back.metadata["ref_max_score"]) == (-1500.0, -150.0)
    assert back.metadata["env_id"] == "Pendulum-v1" and back.metadata["max_episode_steps"] == 200
    np.testing.assert_array_equal(back.action_low, [-2.0])
    np.testing.assert_array_equal(back.action_high, [2.0])
    returns = back.episode_returns()
    np.testing.assert_allclose(normalized_score(back, returns), 100 * (returns + 1500.0) / 1350.0)


def test_round_trip_with_spaces_keeps_reference_scores(minari_dir):
    ds = pendulum_dataset(log_probs=False)
    to_minari(
        ds,
        "test/spaces-v0",
        observation_space=gym.spaces.Box(-np.inf, np.inf, (3,), np.float32),
        action_space=gym.spaces.Box(-2.0, 2.0, (1,), np.float32),
    )
    back = load("minari:test/spaces-v0")
    assert_same_columns(ds, back)
    assert not back.has_behavior_log_probs
    # Minari itself drops reference scores when it has no environment; offrl records them anyway
    assert (back.metadata["ref_min_score"], back.metadata["ref_max_score"]) == (-1500.0, -150.0)
    assert "env_id" not in back.metadata


def test_explicit_reference_scores_override_metadata(minari_dir):
    ds = pendulum_dataset()
    to_minari(ds, "test/scores-v0", env="Pendulum-v1", ref_min_score=-10.0, ref_max_score=10.0)
    back = load_minari("test/scores-v0")
    assert (back.metadata["ref_min_score"], back.metadata["ref_max_score"]) == (-10.0, 10.0)


def test_round_trip_default_spaces_and_data_path(tmp_path):
    # no env, no spaces, explicit data_path instead of the environment variable
    ds = Dataset.from_episodes(make_episodes(obs_dim=5, act_dim=2))
    to_minari(ds, "test/plain-v0", data_path=tmp_path / "m")
    back = load_minari("test/plain-v0", data_path=tmp_path / "m")
    assert_same_columns(ds, back)
    assert back.action_low is None and back.action_high is None
    assert "ref_min_score" not in back.metadata


def test_next_observations_that_differ_round_trip(minari_dir):
    # next_observations that are not the following row (e.g. resets, frame skips, sensor noise)
    rng = np.random.default_rng(5)
    n = 20
    ds = Dataset.from_arrays(
        observations=rng.normal(size=(n, 3)),
        actions=rng.uniform(-2, 2, size=(n, 1)),
        rewards=rng.normal(size=n),
        terminals=np.isin(np.arange(n), [4]),
        timeouts=np.isin(np.arange(n), [11]),
        next_observations=rng.normal(size=(n, 3)),
        behavior_log_probs=rng.normal(size=n),
        metadata={"ref_min_score": 0.0, "ref_max_score": 1.0},
    )
    assert not np.array_equal(ds.next_observations[:-1], ds.observations[1:])
    to_minari(ds, "test/nextobs-v0", env="Pendulum-v1")
    back = load("minari:test/nextobs-v0")
    assert_same_columns(ds, back)
    np.testing.assert_array_equal(back.episode_starts, [0, 5, 12, 20])


def test_discrete_actions_round_trip(minari_dir):
    rng = np.random.default_rng(2)
    eps = [
        {
            "observations": rng.normal(size=(t + 1, 4)).astype(np.float32),
            "actions": rng.integers(0, 2, size=t),
            "rewards": np.ones(t, np.float32),
            "terminations": [False] * (t - 1) + [True],
        }
        for t in (5, 8)
    ]
    ds = Dataset.from_episodes(eps, discrete_actions=2, metadata={"ref_min_score": 0.0, "ref_max_score": 500.0})
    to_minari(ds, "test/cartpole-v0", env="CartPole-v1")
    md = minari.load_dataset("test/cartpole-v0")
    first = next(iter(md.iterate_episodes()))
    assert np.issubdtype(first.actions.dtype, np.integer) and first.actions.shape == (5,)
    back = load("minari:test/cartpole-v0")
    assert back.discrete_actions == 2
    assert_same_columns(ds, back)


def test_collector_style_infos_with_reset_row(minari_dir):
    # Minari's DataCollector stores the reset info too: T + 1 info rows for T steps.
    rng = np.random.default_rng(0)
    buffers = []
    for i, t in enumerate((4, 6)):
        log_probs = rng.normal(size=t + 1).astype(np.float32)
        buffers.append(
            EpisodeBuffer(
                id=i,
                observations=rng.normal(size=(t + 1, 3)).astype(np.float32),
                actions=rng.uniform(-2, 2, size=(t, 1)).astype(np.float32),
                rewards=rng.normal(size=t).tolist(),
                terminations=[False] * t,
                truncations=[False] * (t - 1) + [True],
                infos={"action_log_probs": log_probs},
            )
        )
    minari.create_dataset_from_buffers("test/collector-v0", buffers, env="Pendulum-v1")
    ds = load("minari:test/collector-v0")
    expected = np.concatenate([np.asarray(b.infos["action_log_probs"])[1:] for b in buffers])
    np.testing.assert_array_equal(ds.behavior_log_probs, expected)
    np.testing.assert_array_equal(ds.episode_starts, [0, 4, 10])


def test_missing_minari_dataset(minari_dir):
    with pytest.raises(FileNotFoundError) as info:
        load("minari:test/does-not-exist-v0")
    message = str(info.value)
    assert "test/does-not-exist-v0" in message
    assert str(minari_dir) in message
    assert "minari download" in message and "download=True" in message and "MINARI_DATASETS_PATH" in message
