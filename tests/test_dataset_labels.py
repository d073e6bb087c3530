"""Datasets with missing rewards or actions: wholly or per row, filled, kept through every transformation,
and refused with a clear error wherever a missing label would be needed."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import make_episodes, write_d4rl_hdf5
from offrl.datasets import Dataset
from offrl.datasets.core import FORMAT_VERSION, MASKED_FORMAT_VERSION


def assert_same_labels(a: Dataset, b: Dataset) -> None:
    """Columns, episode offsets and label state are exactly equal."""
    for key in ("observations", "terminals", "timeouts", "next_observations", "episode_starts"):
        np.testing.assert_array_equal(getattr(a, key), getattr(b, key), err_msg=key)
    assert a.action_dim == b.action_dim and a.missing_labels() == b.missing_labels()
    for name in ("rewards", "actions"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            np.testing.assert_array_equal(x, y, err_msg=name)
            assert x.dtype == y.dtype == np.float32
        mx, my = a.label_mask(name), b.label_mask(name)
        assert (mx is None) == (my is None), name
        if mx is not None:
            np.testing.assert_array_equal(mx, my, err_msg=name)


@pytest.fixture
def masked(dataset):
    """The toy dataset with rewards missing in every third row and actions missing in rows 2..5."""
    n = dataset.n_transitions
    rewards = dataset.rewards.copy()
    reward_mask = np.arange(n) % 3 != 0
    rewards[~reward_mask] = np.nan  # unlabelled rows may hold NaN in the input
    action_mask = ~((np.arange(n) >= 2) & (np.arange(n) < 6))
    actions = dataset.actions.copy()
    actions[~action_mask] = 7.0  # ... or any placeholder, even outside the action bounds
    return Dataset(observations=dataset.observations, actions=actions, rewards=rewards, terminals=dataset.terminals,
                   timeouts=dataset.timeouts, next_observations=dataset.next_observations,
                   episode_starts=dataset.episode_starts, behavior_log_probs=dataset.behavior_log_probs,
                   action_low=-1.0, action_high=1.0, reward_mask=reward_mask, action_mask=action_mask,
                   metadata=dataset.metadata)


# ------------------------------------------------------------------ building


def test_masked_rows_are_stored_as_zero_and_reported(dataset, masked):
    n = dataset.n_transitions
    reward_mask = masked.label_mask("rewards")
    assert reward_mask.dtype == bool and reward_mask.sum() == n - len(range(0, n, 3))
    np.testing.assert_array_equal(masked.rewards[reward_mask], dataset.rewards[reward_mask])
    np.testing.assert_array_equal(masked.rewards[~reward_mask], 0.0)  # no NaN in the stored column
    np.testing.assert_array_equal(masked.actions[2:6], 0.0)
    assert np.isfinite(masked.rewards).all() and np.isfinite(masked.actions).all()
    assert not masked.is_labelled("rewards") and not masked.is_labelled("actions")
    assert masked.missing_labels() == ["rewards", "actions"] and masked.n_labelled("actions") == n - 4
    assert dataset.label_mask("rewards") is None and dataset.is_labelled("actions") and dataset.missing_labels() == []
    with pytest.raises(ValueError, match="label name must be one of"):
        dataset.label_mask("terminals")
    with pytest.raises(ValueError):
        masked.label_mask("rewards")[0] = True  # the mask is read-only
    text = repr(masked)
    assert "rewards missing in 7 rows" in text and "actions missing in 4 rows" in text
    assert "missing" not in repr(dataset)


def test_wholly_missing_rewards_and_actions():
    obs = np.arange(12, dtype=np.float32).reshape(6, 2)
    ds = Dataset.from_arrays(obs, None, None, timeouts=[0, 0, 1, 0, 0, 1], next_observations=obs + 1, action_dim=3)
    assert ds.rewards is None and ds.actions is None and ds.action_dim == 3
    np.testing.assert_array_equal(ds.label_mask("rewards"), np.zeros(6, bool))
    assert ds.missing_labels() == ["rewards", "actions"]
    assert "rewards missing" in repr(ds) and "actions missing" in repr(ds)
    # the action dimension comes from the bounds or a discrete space when not given
    assert Dataset.from_arrays(obs, None, np.zeros(6), action_low=[-1, -1], action_high=[1, 1]).action_dim == 2
    assert Dataset.from_arrays(obs, None, np.zeros(6), discrete_actions=4).action_dim == 1
    with pytest.raises(ValueError, match="actions is None .* pass action_dim="):
        Dataset.from_arrays(obs, None, np.zeros(6))
    with pytest.raises(ValueError, match="actions is None .* pass action_dim="):
        Dataset.from_arrays(obs, None, np.zeros(6), action_low=-1.0, action_high=1.0)  # scalar bounds: no dim
    with pytest.raises(ValueError, match="action_dim is 2 but actions has 1 columns"):
        Dataset.from_arrays(obs, np.zeros(6), np.zeros(6), action_dim=2)
    # a mask that is all False is the same as a missing column; all True is a labelled one
    none = Dataset.from_arrays(obs, np.zeros((6, 1)), np.ones(6), reward_mask=np.zeros(6, bool), action_mask=np.ones(6))
    assert none.rewards is None and none.is_labelled("actions") and none.label_mask("actions") is None


def test_mask_and_value_errors_name_the_field():
    obs = np.zeros((6, 2))
    rewards = np.arange(6.0)
    rewards[4] = np.nan
    with pytest.raises(ValueError, match=r"rewards contains NaN or inf at row 4.*reward_mask="):
        Dataset.from_arrays(obs, np.zeros(6), rewards)
    ds = Dataset.from_arrays(obs, np.zeros(6), rewards, next_observations=obs, reward_mask=np.arange(6) != 4)
    assert ds.label_mask("rewards").tolist() == [True] * 4 + [False, True] and ds.rewards[4] == 0.0
    with pytest.raises(ValueError, match=r"reward_mask has shape \(5,\); expected one flag per transition"):
        Dataset.from_arrays(obs, np.zeros(6), np.zeros(6), next_observations=obs, reward_mask=np.ones(5, bool))
    with pytest.raises(ValueError, match="action_mask must be a boolean array"):
        Dataset.from_arrays(obs, np.zeros(6), np.zeros(6), action_mask=np.full(6, 0.5))
    with pytest.raises(ValueError, match="reward_mask marks 6 rows as labelled but rewards is None"):
        Dataset.from_arrays(obs, np.zeros(6), None, next_observations=obs, reward_mask=np.ones(6, bool))
    actions = np.zeros((6, 1))
    actions[1] = np.inf
    with pytest.raises(ValueError, match="actions contains NaN or inf at row 1"):
        Dataset.from_arrays(obs, actions, np.zeros(6), action_mask=np.arange(6) != 2)


def test_row_numbers_survive_dropped_rows():
    # without next_observations, cut rows are dropped: the masks follow their rows
    obs = np.arange(8, dtype=np.float32)[:, None]
    mask = np.array([1, 0, 1, 1, 0, 1, 1, 1], bool)
    ds = Dataset.from_arrays(obs, np.zeros(8), np.where(mask, 1.0, np.nan), timeouts=[0, 0, 0, 1, 0, 0, 0, 1],
                             reward_mask=mask)
    kept = ds.observations[:, 0].astype(int)
    np.testing.assert_array_equal(kept, [0, 1, 2, 4, 5, 6])
    np.testing.assert_array_equal(ds.label_mask("rewards"), mask[kept])


def test_unlabelled_actions_skip_action_space_checks():
    obs = np.zeros((4, 2))
    obs = dict(observations=obs, next_observations=obs)
    # bounds [1, 2] exclude the stored placeholder 0 of unlabelled rows
    ds = Dataset.from_arrays(actions=[1.5, 0.0, 2.0, 9.0], rewards=np.zeros(4), **obs, action_low=1.0, action_high=2.0,
                             action_mask=[True, False, True, False])
    np.testing.assert_array_equal(ds.actions[:, 0], [1.5, 0.0, 2.0, 0.0])
    with pytest.raises(ValueError, match=r"actions\[3, 0\] = 9 lies outside"):
        Dataset.from_arrays(actions=[1.5, 0.0, 2.0, 9.0], rewards=np.zeros(4), **obs, action_low=1.0, action_high=2.0,
                            action_mask=[True, False, True, True])
    ds = Dataset.from_arrays(actions=[0, 7, 2, 1], rewards=np.zeros(4), **obs, discrete_actions=3, action_mask=[1, 0, 1, 1])
    assert ds.n_labelled("actions") == 3
    with pytest.raises(ValueError, match="actions has value 7.0 at row 1"):
        Dataset.from_arrays(actions=[0, 7, 2, 1], rewards=np.zeros(4), **obs, discrete_actions=3)


def test_from_episodes_with_missing_labels_round_trips(masked):
    episodes = list(masked)
    assert "reward_mask" in episodes[0] and "action_mask" in episodes[0]
    back = Dataset.from_episodes(episodes, action_low=-1.0, action_high=1.0)
    assert_same_labels(masked, back)
    unlabelled = masked.without_rewards().without_actions()
    episodes = list(unlabelled)
    assert episodes[0]["rewards"] is None and episodes[0]["actions"] is None and "reward_mask" not in episodes[0]
    assert_same_labels(unlabelled, Dataset.from_episodes(episodes, action_dim=1))
    with pytest.raises(ValueError, match="action_dim="):
        Dataset.from_episodes(episodes)


def test_from_episodes_mixes_logged_and_unlogged_episodes():
    eps = make_episodes((3, 2, 4), act_dim=2, log_probs=False)
    eps[1] = dict(eps[1], rewards=None)
    eps[2] = dict(eps[2], actions=None)
    ds = Dataset.from_episodes(eps)
    np.testing.assert_array_equal(ds.label_mask("rewards"), [1, 1, 1, 0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(ds.label_mask("actions"), [1, 1, 1, 1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(ds.actions[:5], np.concatenate([eps[0]["actions"], eps[1]["actions"]]))
    assert ds.action_dim == 2
    # an episode with neither label: its length comes from its T + 1 observations
    bare = {"observations": np.zeros((5, 3)), "actions": None, "rewards": None}
    ds = Dataset.from_episodes([bare], action_dim=2)
    assert ds.n_transitions == 4 and ds.missing_labels() == ["rewards", "actions"]
    with pytest.raises(ValueError, match="episode 0 needs 'observations', 'actions' and 'rewards'"):
        Dataset.from_episodes([{"observations": np.zeros((5, 3)), "actions": None}])


# ------------------------------------------------------------------ filling and dropping


def test_with_rewards_and_with_actions(dataset, masked):
    n = dataset.n_transitions
    full = masked.with_rewards(dataset.rewards)
    assert full.is_labelled("rewards") and full.label_mask("rewards") is None
    np.testing.assert_array_equal(full.rewards, dataset.rewards)
    assert full.label_mask("actions") is not None  # the other label is untouched
    assert full.metadata == masked.metadata
    # with a mask only those rows are filled; the values elsewhere are ignored, NaN included
    fill = np.zeros(n, bool)
    fill[[0, 3]] = True
    values = np.full(n, np.nan, np.float32)
    values[[0, 3]] = [10.0, 20.0]
    part = masked.with_rewards(values, mask=fill)
    np.testing.assert_array_equal(part.rewards[[0, 3]], [10.0, 20.0])
    np.testing.assert_array_equal(part.label_mask("rewards"), masked.label_mask("rewards") | fill)
    keep = ~fill
    np.testing.assert_array_equal(part.rewards[keep], masked.rewards[keep])
    # a mask over labelled rows replaces those values and keeps the column labelled
    relabelled = dataset.with_rewards(values, mask=fill)
    assert relabelled.is_labelled("rewards")
    np.testing.assert_array_equal(relabelled.rewards[keep], dataset.rewards[keep])
    # actions fill from nothing
    no_actions = dataset.without_actions()
    assert no_actions.actions is None and no_actions.action_dim == 1
    filled = no_actions.with_actions(dataset.actions)
    np.testing.assert_array_equal(filled.actions, dataset.actions)
    assert filled.is_labelled("actions")
    half = no_actions.with_actions(dataset.actions, mask=np.arange(n) < 5)
    assert half.n_labelled("actions") == 5 and np.all(half.actions[5:] == 0)
    with pytest.raises(ValueError, match="actions has 2 columns but the dataset's action_dim is 1"):
        dataset.with_actions(np.zeros((n, 2)))
    with pytest.raises(ValueError, match="rewards has 3 rows but observations has"):
        masked.with_rewards(np.ones(3))
    with pytest.raises(ValueError, match="rewards contains NaN or inf at row 1"):
        masked.with_rewards(values)  # without a mask every value is taken


def test_without_labels(dataset):
    n = dataset.n_transitions
    keep = np.arange(n) % 2 == 0
    half = dataset.without_rewards(keep=keep)
    np.testing.assert_array_equal(half.label_mask("rewards"), keep)
    quarter = half.without_rewards(keep=np.arange(n) % 4 == 0)
    np.testing.assert_array_equal(quarter.label_mask("rewards"), np.arange(n) % 4 == 0)
    assert half.without_rewards(keep=~keep).rewards is None  # nothing left labelled
    assert dataset.without_actions().actions is None and dataset.without_actions().action_dim == 1


# ------------------------------------------------------------------ refusing


def test_whatever_needs_a_missing_label_says_so(dataset, masked):
    unlabelled = dataset.without_rewards()
    for ds in (unlabelled, masked):
        with pytest.raises(ValueError, match=r"episode_returns needs rewards, .*with_rewards\(.*offrl\.reward_labeling"):
            ds.episode_returns()
        with pytest.raises(ValueError, match="returns_to_go needs rewards"):
            ds.returns_to_go(0.99)
    with pytest.raises(ValueError, match=r"Dataset.tensors/sample needs rewards, but rewards are missing for 7 of 19"):
        masked.sample(4)
    with pytest.raises(ValueError, match="IQL needs actions, but actions are missing .*InverseDynamicsLabeler"):
        dataset.without_actions().require_labels("actions", context="IQL")
    dataset.require_labels("rewards", "actions", context="IQL")  # labelled: no error
    # a label missing wholly is absent from the batch, not zeros
    batch = unlabelled.sample(8, generator=torch.Generator().manual_seed(0))
    assert batch.rewards is None and batch.observations.shape == (8, 3)
    assert "rewards" not in unlabelled.tensors()
    # what does not need the label still works
    mean, _ = masked.observation_stats()
    assert mean.shape == (3,)
    np.testing.assert_array_equal(masked.timesteps(), dataset.timesteps())


def test_to_minari_refuses_missing_labels(minari_dir, dataset):
    from offrl.datasets import to_minari

    with pytest.raises(ValueError, match="to_minari needs rewards"):
        to_minari(dataset.without_rewards(), "test/unlabelled-v0")
    assert not any(minari_dir.iterdir())


def test_timesteps(dataset):
    steps = dataset.timesteps()
    assert steps.dtype == np.int64
    want = np.concatenate([np.arange(n) for n in dataset.episode_lengths()])
    np.testing.assert_array_equal(steps, want)
    np.testing.assert_array_equal(dataset.to_pandas()["step"].to_numpy(), want)


# ------------------------------------------------------------------ keeping the masks


def test_subset_and_concatenate_keep_masks(dataset, masked):
    sub = masked.subset([2, 0])
    rows = np.concatenate([np.arange(*masked.episode_starts[2:4]), np.arange(*masked.episode_starts[0:2])])
    for name in ("rewards", "actions"):
        np.testing.assert_array_equal(sub.label_mask(name), masked.label_mask(name)[rows])
        np.testing.assert_array_equal(getattr(sub, name), getattr(masked, name)[rows])
    # labelled + unlabelled -> masked
    joined = dataset + dataset.without_rewards()
    n = dataset.n_transitions
    np.testing.assert_array_equal(joined.label_mask("rewards"), np.arange(2 * n) < n)
    np.testing.assert_array_equal(joined.rewards[:n], dataset.rewards)
    assert joined.is_labelled("actions")
    both = Dataset.concatenate([dataset.without_rewards(), dataset.without_rewards()])
    assert both.rewards is None
    three = Dataset.concatenate([masked, dataset, dataset.without_actions()])
    np.testing.assert_array_equal(three.label_mask("actions"),
                                  np.concatenate([masked.label_mask("actions"), np.ones(n, bool), np.zeros(n, bool)]))
    assert_same_labels(Dataset.concatenate([masked.subset([0, 1]), masked.subset([2, 3])]), masked)


@pytest.mark.parametrize("variant", ["masked", "no_rewards", "no_actions", "neither"])
def test_save_load_keeps_masks(tmp_path, dataset, masked, variant):
    ds = {"masked": masked, "no_rewards": dataset.without_rewards(), "no_actions": dataset.without_actions(),
          "neither": dataset.without_rewards().without_actions()}[variant]
    path = tmp_path / "d.npz"
    ds.save(path)
    back = Dataset.load(path)
    assert_same_labels(ds, back)
    assert back.metadata == ds.metadata and back.has_behavior_log_probs
    with np.load(path) as data:
        assert json.loads(bytes(data["header"]).decode())["format_version"] == MASKED_FORMAT_VERSION
        assert all(np.isfinite(data[k]).all() for k in data.files if k != "header")


def test_fully_labelled_files_stay_format_1(tmp_path, dataset):
    path = tmp_path / "d.npz"
    dataset.save(path)
    with np.load(path) as data:
        header = json.loads(bytes(data["header"]).decode())
        assert header["format_version"] == FORMAT_VERSION == 1 and "action_dim" not in header
        assert "reward_mask" not in data.files and "action_mask" not in data.files
    # a format-1 file must have its labels: one without them is damaged, not unlabelled
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files if k != "rewards"}
    np.savez(tmp_path / "damaged.npz", **arrays)
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['rewards'\]"):
        Dataset.load(tmp_path / "damaged.npz")
    header["format_version"] = 3
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    np.savez(tmp_path / "future.npz", **arrays)
    with pytest.raises(ValueError, match=r"format 3, this offrl reads formats \[1, 2\]"):
        Dataset.load(tmp_path / "future.npz")


def test_pandas_round_trip_with_missing_labels(dataset, masked):
    df = masked.to_pandas()
    assert df["reward"].isna().sum() == 7 and df["action_0"].isna().sum() == 4
    assert_same_labels(masked, Dataset.from_pandas(df, action_low=-1.0, action_high=1.0))
    neither = dataset.without_rewards().without_actions()
    df = neither.to_pandas()
    assert df["reward"].isna().all() and df["action_0"].isna().all()  # the action columns keep action_dim
    assert_same_labels(neither, Dataset.from_pandas(df))
    # a log without reward or action columns at all
    bare = df.drop(columns=["reward", "action_0"])
    ds = Dataset.from_pandas(bare, reward_column=None, action_columns=(), action_dim=1)
    assert_same_labels(neither, ds)
    with pytest.raises(ValueError, match="action_columns=\\(\\) with action_dim"):
        Dataset.from_pandas(bare, reward_column=None)
    with pytest.raises(ValueError, match="reward_column=... \\(None for a log without rewards\\)"):
        Dataset.from_pandas(bare, action_columns=(), action_dim=1)


def test_from_pandas_rejects_partly_missing_actions():
    df = pd.DataFrame({"obs_0": [0.0, 1.0, 2.0], "action_0": [0.1, np.nan, 0.3], "action_1": [0.1, 0.2, 0.3],
                       "reward": [1.0, np.nan, 1.0], "terminal": [0, 0, 1]})
    with pytest.raises(ValueError, match=r"row 1 has NaN in some but not all of the action columns"):
        Dataset.from_pandas(df)
    df.loc[1, "action_1"] = np.nan
    ds = Dataset.from_pandas(df)
    np.testing.assert_array_equal(ds.label_mask("actions"), [True, False, True])
    np.testing.assert_array_equal(ds.label_mask("rewards"), [True, False, True])
    np.testing.assert_array_equal(ds.actions[1], [0.0, 0.0])


@pytest.mark.filterwarnings("ignore:.*action bounds unknown:UserWarning")
def test_d4rl_file_without_rewards(tmp_path):
    from offrl.datasets.d4rl import read_d4rl_hdf5

    n = 6
    path = write_d4rl_hdf5(tmp_path / "log.hdf5", {
        "observations": np.arange(2 * n, dtype=np.float32).reshape(n, 2),
        "actions": np.zeros((n, 1), np.float32),
        "terminals": np.array([0, 0, 1, 0, 0, 1], bool),
    })
    ds = read_d4rl_hdf5(path)
    assert ds.rewards is None and ds.missing_labels() == ["rewards"] and ds.n_transitions == 6
