"""Reading D4RL's HDF5 layout: flags, qlearning semantics, cache dirs and reference scores."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import D4RL_N, d4rl_qlearning_reference, write_d4rl_hdf5
from offrl.datasets import load, normalized_score, reference_scores
from offrl.datasets.d4rl import D4RL_REF_SCORES, d4rl_filename, d4rl_ref_scores, read_d4rl_hdf5

HOPPER_MIN, HOPPER_MAX = -20.272305, 3234.3  # REFERENCE.md


def test_float32_file_with_next_observations(d4rl_float32_file):
    path, arrays = d4rl_float32_file
    ds = load(str(path))
    # every row is kept: the next observation of each step is in the file
    assert ds.n_transitions == D4RL_N
    np.testing.assert_array_equal(ds.observations, arrays["observations"])
    np.testing.assert_array_equal(ds.actions, arrays["actions"])
    np.testing.assert_array_equal(ds.rewards, arrays["rewards"])
    np.testing.assert_array_equal(ds.next_observations, arrays["next_observations"])
    assert ds.has_behavior_log_probs
    np.testing.assert_array_equal(ds.behavior_log_probs, arrays["infos/action_log_probs"])
    # episodes end at the timeout (3), terminal (6), terminal+timeout (9), timeout (10) and the end of the file
    np.testing.assert_array_equal(ds.episode_starts, [0, 4, 7, 10, 11, 14])
    # row 9 is both terminal and timeout in the file: a terminal (offrl's rule everywhere, as in gymnasium)
    np.testing.assert_array_equal(np.flatnonzero(ds.terminals), [6, 9])
    np.testing.assert_array_equal(np.flatnonzero(ds.timeouts), [3, 10, 13])
    # hopper's action space, which the file does not store
    np.testing.assert_array_equal(ds.action_low, [-1, -1])
    np.testing.assert_array_equal(ds.action_high, [1, 1])
    assert ds.metadata["name"] == "hopper_medium-v2"
    assert (ds.metadata["ref_min_score"], ds.metadata["ref_max_score"]) == (HOPPER_MIN, HOPPER_MAX)
    assert ds.metadata["d4rl_metadata"] == {"algorithm": "SAC", "iteration": 42}


def test_medium_replay_file_matches_d4rl_qlearning_dataset(d4rl_replay_file):
    path, arrays = d4rl_replay_file
    assert arrays["rewards"].shape == (D4RL_N, 1) and arrays["observations"].dtype == np.float64
    assert "next_observations" not in arrays
    ds = read_d4rl_hdf5(path)
    # D4RL's qlearning_dataset, once a row flagged both terminal and timeout (row 9) counts as the terminal it is:
    # D4RL itself drops that row as a timeout, offrl keeps it as a terminal (gymnasium's rule, used everywhere)
    terminal_wins = dict(arrays, timeouts=arrays["timeouts"] & ~arrays["terminals"].reshape(-1))
    reference = d4rl_qlearning_reference(terminal_wins)
    for key in ("observations", "actions", "next_observations", "rewards", "terminals"):
        np.testing.assert_array_equal(getattr(ds, key), reference[key], err_msg=key)
        assert getattr(ds, key).dtype == np.float32, key
    # the kept rows, spelled out: timeout rows 3, 10 and the file's last row 13 are dropped
    kept = [0, 1, 2, 4, 5, 6, 7, 8, 9, 11, 12]
    np.testing.assert_array_equal(ds.observations[:, 0], kept)
    np.testing.assert_array_equal(ds.next_observations[:, 0], np.array(kept) + 1)
    np.testing.assert_array_equal(ds.behavior_log_probs, arrays["infos/action_log_probs"][kept].astype(np.float32))
    # the episode boundaries survive: the step before each dropped timeout row ends its episode as a timeout,
    # and the one-step episode at row 10 disappears
    np.testing.assert_array_equal(ds.episode_starts, [0, 3, 6, 9, 11])
    np.testing.assert_array_equal(np.flatnonzero(ds.timeouts), [2, 10])
    np.testing.assert_array_equal(np.flatnonzero(ds.terminals), [5, 8])
    # terminal rows are kept and, as in D4RL, their next observation is the following row
    assert ds.observations[5, 0] == 6 and ds.next_observations[5, 0] == 7
    assert ds.observations[8, 0] == 9 and ds.next_observations[8, 0] == 10


def test_load_by_name_from_d4rl_dataset_dir(d4rl_replay_file, isolated_d4rl_dirs):
    path, arrays = d4rl_replay_file
    assert path.parent == isolated_d4rl_dirs
    ds = load("d4rl:hopper-medium-replay-v2")
    assert ds.metadata["name"] == "hopper-medium-replay-v2"
    assert ds.metadata["ref_min_score"] == HOPPER_MIN and ds.metadata["ref_max_score"] == HOPPER_MAX
    same = read_d4rl_hdf5(path)
    for key in ("observations", "actions", "rewards", "terminals", "timeouts", "next_observations", "episode_starts"):
        np.testing.assert_array_equal(getattr(ds, key), getattr(same, key))
    # normalised score: 100 * (R - ref_min) / (ref_max - ref_min)
    returns = ds.episode_returns()
    expected = 100.0 * (returns - HOPPER_MIN) / (HOPPER_MAX - HOPPER_MIN)
    np.testing.assert_allclose(normalized_score(ds, returns), expected, rtol=1e-12)
    np.testing.assert_allclose(normalized_score("d4rl:hopper-medium-replay-v2", returns), expected, rtol=1e-12)
    assert normalized_score(ds, HOPPER_MAX) == pytest.approx(100.0)
    assert normalized_score(ds, HOPPER_MIN) == pytest.approx(0.0)
    assert isinstance(normalized_score(ds, 1000.0), float)
    assert normalized_score(ds, 1000.0) == pytest.approx(100 * (1000 + 20.272305) / 3254.572305)


def test_load_by_name_accepts_dashed_file_name(tmp_path, isolated_d4rl_dirs, d4rl_float32_file):
    path, _ = d4rl_float32_file
    (isolated_d4rl_dirs / "walker2d-medium-v2.hdf5").write_bytes(path.read_bytes())
    ds = load("d4rl:walker2d-medium-v2")
    assert ds.n_transitions == D4RL_N
    assert (ds.metadata["ref_min_score"], ds.metadata["ref_max_score"]) == (1.629008, 4592.3)


def test_missing_d4rl_dataset_names_searched_dirs(isolated_d4rl_dirs, tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        load("d4rl:walker2d-expert-v2")
    message = str(info.value)
    assert str(isolated_d4rl_dirs / "walker2d_expert-v2.hdf5") in message
    assert str(tmp_path / "home" / ".d4rl" / "datasets" / "walker2d_expert-v2.hdf5") in message
    assert "download=True" in message and "D4RL_DATASET_DIR" in message
    with pytest.raises(FileNotFoundError, match="no D4RL-layout file"):
        load(str(tmp_path / "nowhere.hdf5"))


@pytest.mark.parametrize("name", ["hopper-medium", "antmaze-umaze-v2", "hopper--v2"])
def test_bad_d4rl_names(name):
    with pytest.raises(ValueError, match="D4RL"):
        d4rl_filename(name)


def test_d4rl_filename():
    assert d4rl_filename("hopper-medium-replay-v2") == "hopper_medium_replay-v2.hdf5"
    assert d4rl_filename("halfcheetah-medium-expert-v2") == "halfcheetah_medium_expert-v2.hdf5"


@pytest.mark.parametrize(
    "name, scores",
    [
        ("halfcheetah-medium-v2", (-280.178953, 12135.0)),
        ("hopper-expert-v2", (-20.272305, 3234.3)),
        ("walker2d-random-v2", (1.629008, 4592.3)),
        ("ant-medium-replay-v2", (-325.6, 3879.7)),
        ("antmaze-umaze-v0", (0.0, 1.0)),
        ("kitchen-complete-v0", (0.0, 4.0)),
        ("pen-human-v1", (96.262799, 3076.8331017826877)),
        ("door-cloned-v1", (-56.512833, 2880.5693087298737)),
        ("hammer-expert-v1", (-274.856578, 12794.134825156867)),
        ("relocate-human-v1", (-6.425911, 4233.877797728884)),
        ("hopper_medium_replay-v2", (-20.272305, 3234.3)),  # a D4RL file stem
    ],
)
def test_reference_scores_match_reference_table(name, scores):
    assert d4rl_ref_scores(name) == scores
    assert reference_scores(name) == scores
    assert reference_scores(f"d4rl:{name}") == scores
    assert normalized_score(name, scores[1]) == pytest.approx(100.0)


def test_reference_score_errors():
    assert d4rl_ref_scores("cartpole-v1") is None
    with pytest.raises(ValueError, match="no reference scores"):
        normalized_score("cartpole-v1", 10.0)
    assert set(D4RL_REF_SCORES) >= {"halfcheetah", "hopper", "walker2d", "ant"}
    assert reference_scores({"ref_min_score": 1.0, "ref_max_score": 3.0}) == (1.0, 3.0)


@pytest.mark.filterwarnings("ignore:.*action bounds unknown:UserWarning")
def test_file_without_timeouts_and_without_reference_scores(tmp_path):
    n = 6
    obs = np.arange(n, dtype=np.float32)[:, None]
    terminals = np.array([0, 0, 1, 0, 0, 0], bool)
    path = write_d4rl_hdf5(
        tmp_path / "my_robot_log.hdf5",
        {"observations": obs, "actions": np.zeros((n, 1), np.float32), "rewards": np.ones(n, np.float32), "terminals": terminals},
    )
    ds = load(str(path))
    # episodes end at the terminal; the last episode is cut by the end of the log, so its final row is dropped
    np.testing.assert_array_equal(ds.observations[:, 0], [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(ds.episode_starts, [0, 3, 5])
    np.testing.assert_array_equal(ds.timeouts, [0, 0, 0, 0, 1])
    assert not ds.has_behavior_log_probs
    assert "ref_min_score" not in ds.metadata
    with pytest.raises(ValueError, match="no reference scores"):
        normalized_score(ds, 1.0)


@pytest.mark.filterwarnings("ignore:.*action bounds unknown:UserWarning")
def test_malformed_files_give_clear_errors(tmp_path):
    n = 5
    base = {
        "observations": np.zeros((n, 2), np.float32),
        "actions": np.zeros((n, 1), np.float32),
        "rewards": np.zeros(n, np.float32),
        "terminals": np.zeros(n, bool),
        "timeouts": np.zeros(n, bool),
    }
    missing = {k: v for k, v in base.items() if k != "actions"}
    with pytest.raises(ValueError, match=r"lacks D4RL key\(s\) \['actions'\]"):
        read_d4rl_hdf5(write_d4rl_hdf5(tmp_path / "a.hdf5", missing))
    short = dict(base, timeouts=np.zeros(n - 1, bool))
    with pytest.raises(ValueError, match=r"timeouts has shape \(4,\) but observations has 5 rows"):
        read_d4rl_hdf5(write_d4rl_hdf5(tmp_path / "b.hdf5", short))
    rewards = np.zeros(n, np.float32)
    rewards[3] = np.nan
    with pytest.raises(ValueError, match="rewards contains NaN or inf at row 3"):
        read_d4rl_hdf5(write_d4rl_hdf5(tmp_path / "c.hdf5", dict(base, rewards=rewards)))
    terminals = np.zeros(n, np.float32)
    terminals[2] = 0.5
    with pytest.raises(ValueError, match="terminals must be 0 or 1, found 0.5 at row 2"):
        read_d4rl_hdf5(write_d4rl_hdf5(tmp_path / "d.hdf5", dict(base, terminals=terminals)))


@pytest.mark.parametrize("name, expected", [
    ("hopper-medium-replay-v2", (-20.272305, 3234.3)),
    ("hopper_medium_replay-v2.hdf5", (-20.272305, 3234.3)),
    ("antmaze-umaze-diverse-v2", (0.0, 1.0)),
    ("door_log.hdf5", None),
    ("ant_rollouts.hdf5", None),
    ("penguin-data-v0", None),
])
def test_reference_scores_only_for_d4rl_names(name, expected):
    from offrl.datasets.d4rl import d4rl_ref_scores

    assert d4rl_ref_scores(name) == expected
