"""Bad input to the data layer is refused with a message naming the field or file and the fix (issue 11).

One test per fault: each failed on the code before the fix (the fault reproduced) and passes now.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

from conftest import make_episodes, write_d4rl_hdf5
from offrl.datasets import Dataset, load, to_minari
from offrl.datasets.d4rl import find_d4rl_file, read_d4rl_hdf5
from offrl.datasets.minari import load_minari
from offrl.datasets.samplers import MixtureSampler, SegmentSampler, TransitionSampler

pytestmark = pytest.mark.usefixtures("one_thread")

N = 6


def flat(n: int = N, act_dim: int = 1):
    """Observations [i, -i], zero actions, unit rewards, next observations i + 0.5: n rows."""
    i = np.arange(n, dtype=np.float32)
    return np.stack([i, -i], 1), np.zeros((n, act_dim), np.float32), np.ones(n, np.float32), np.stack([i, -i], 1) + 0.5


def d4rl_like(n: int = 20, act_dim: int = 3, low: float = -0.4, high: float = 0.6, seed: int = 0) -> dict:
    """Arrays of a D4RL-layout file whose actions stay inside [low, high], well short of +-1."""
    rng = np.random.default_rng(seed)
    terminals = np.zeros(n, bool)
    timeouts = np.zeros(n, bool)
    timeouts[n // 2 - 1] = True
    return {
        "observations": rng.normal(size=(n, 4)).astype(np.float32),
        "actions": rng.uniform(low, high, size=(n, act_dim)).astype(np.float32),
        "rewards": rng.normal(size=n).astype(np.float32),
        "terminals": terminals,
        "timeouts": timeouts,
    }


def tree(root) -> set[str]:
    return {os.path.relpath(os.path.join(d, name), root) for d, dirs, files in os.walk(root) for name in dirs + files}


# ================================================================== 3. D4RL action bounds


@pytest.mark.parametrize("stem", ["hopper_medium-v2", "walker2d_medium_replay-v2", "antmaze_umaze_diverse-v2",
                                  "pen_human-v1", "kitchen_complete-v0"])
def test_known_d4rl_files_carry_the_true_action_bounds(tmp_path, stem):
    path = write_d4rl_hdf5(tmp_path / f"{stem}.hdf5", d4rl_like())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a known env needs no warning
        ds = load(str(path))
    np.testing.assert_array_equal(ds.action_low, -np.ones(3, np.float32))
    np.testing.assert_array_equal(ds.action_high, np.ones(3, np.float32))


def test_d4rl_name_spec_carries_bounds_into_td3bc_and_iql_specs(tmp_path, isolated_d4rl_dirs):
    from offrl.algos import IQL, TD3PlusBC

    arrays = d4rl_like(n=40)
    write_d4rl_hdf5(isolated_d4rl_dirs / "hopper_medium-v2.hdf5", arrays)
    ds = load("d4rl:hopper-medium-v2")
    assert ds.actions.max() < 0.61 and ds.actions.min() > -0.41  # the data are far from the box's edges
    for algo in (TD3PlusBC(batch_size=8, hidden_dims=(8,), random_state=0),
                 IQL(batch_size=8, hidden_dims=(8,), random_state=0)):
        algo.fit(ds, n_steps=1, progress=False)
        assert algo.spec_["action_low"] == [-1.0] * 3, type(algo).__name__
        assert algo.spec_["action_high"] == [1.0] * 3, type(algo).__name__


def test_other_files_keep_the_data_range_and_warn_how_to_pass_bounds(tmp_path):
    path = write_d4rl_hdf5(tmp_path / "my_robot_log.hdf5", d4rl_like())
    with pytest.warns(UserWarning, match=r"my_robot_log\.hdf5.*action_low=\.\.\., action_high=\.\.\."):
        ds = load(str(path))
    assert ds.action_low is None and ds.action_high is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # bounds given: nothing to warn about
        given = load(str(path), action_low=-2.0, action_high=[2.0, 2.0, 3.0])
    np.testing.assert_array_equal(given.action_low, [-2, -2, -2])
    np.testing.assert_array_equal(given.action_high, [2, 2, 3])
    with pytest.raises(TypeError, match="unexpected"):
        load(str(path), action_lo=-1.0)


def test_known_d4rl_file_with_actions_past_the_bounds_is_clipped_with_a_warning(tmp_path):
    arrays = d4rl_like()
    arrays["actions"][4, 1] = 1.25
    path = write_d4rl_hdf5(tmp_path / "hopper_medium-v2.hdf5", arrays)
    with pytest.warns(UserWarning, match=r"hopper_medium-v2\.hdf5: 1 logged action value.* outside \[-1, 1\].*clipped"):
        ds = load(str(path))
    assert ds.actions[4, 1] == 1.0
    with pytest.raises(ValueError, match=r"hopper_medium-v2\.hdf5: actions\[4, 1\] = 1\.25 lies outside"):
        read_d4rl_hdf5(path, action_low=-1.0, action_high=1.0)  # explicit bounds are checked, never clipped


@pytest.mark.filterwarnings("ignore:env_spec is None:UserWarning")
def test_minari_reader_uses_the_dataset_action_space(minari_dir):
    gym = pytest.importorskip("gymnasium")
    eps = make_episodes((4, 3), obs_dim=3, act_dim=2, log_probs=False)
    for ep in eps:
        ep["actions"] = ep["actions"] * 0.1  # data span ~[-0.1, 0.1]; the space is [-3, 3]
    ds = Dataset.from_episodes(eps)
    to_minari(ds, "test/bounds-v0", observation_space=gym.spaces.Box(-np.inf, np.inf, (3,), np.float32),
              action_space=gym.spaces.Box(-3.0, 3.0, (2,), np.float32))
    back = load("minari:test/bounds-v0")
    np.testing.assert_array_equal(back.action_low, [-3, -3])
    np.testing.assert_array_equal(back.action_high, [3, 3])


# ================================================================== 8. names that become paths


def test_d4rl_name_cannot_download_outside_the_dataset_dir(tmp_path, isolated_d4rl_dirs, monkeypatch):
    import urllib.request

    calls = []

    class FakeResponse:
        headers: dict = {}

        def __init__(self):
            self.chunks = [b"x" * 10]

        def read(self, size):
            return self.chunks.pop() if self.chunks else b""

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def fake_urlopen(url, timeout=None):
        calls.append(url)
        return FakeResponse()

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    (isolated_d4rl_dirs / "hopper_x").mkdir()  # so that '..' after it resolves
    before = tree(tmp_path)
    for name in ("hopper-x/../../escaped-v2", "hopper-x/../../../../escaped-v2"):
        with pytest.raises(ValueError, match=r"D4RL dataset name 'hopper-x/\.\./.*' contains a path separator"):
            load(f"d4rl:{name}", download=True)  # old code: wrote tmp_path/escaped-v2.hdf5, outside the folder
    assert calls == [] and tree(tmp_path) == before


@pytest.mark.parametrize("name", ["hopper-medium/../../x-v2", "../hopper_medium-v2", "/etc/hopper-medium-v2",
                                  "hopper-medium\\..\\x-v2", ".hopper-medium-v2"])
def test_d4rl_read_path_refuses_names_that_leave_the_folder(isolated_d4rl_dirs, name):
    with pytest.raises(ValueError, match="D4RL dataset name"):
        find_d4rl_file(name)
    with pytest.raises(ValueError, match="D4RL dataset name"):
        load(f"d4rl:{name}")


def test_d4rl_read_path_cannot_reach_a_file_outside(tmp_path, isolated_d4rl_dirs):
    outside = write_d4rl_hdf5(tmp_path / "hopper_medium-v2.hdf5", d4rl_like())
    assert outside.parent == isolated_d4rl_dirs.parent
    (isolated_d4rl_dirs / "hopper_x").mkdir()
    with pytest.raises(ValueError, match="D4RL dataset name"):
        load("d4rl:hopper-x/../../hopper_medium-v2")  # old code: read tmp_path/hopper_medium-v2.hdf5


@pytest.mark.parametrize("dataset_id", ["../../evil-v0", "ns/../../evil-v0", "/abs/evil-v0", "ns//evil-v0",
                                        ".hidden/evil-v0", "ns/evil-v0/", ""])
@pytest.mark.filterwarnings("ignore:env_spec is None:UserWarning")
def test_to_minari_refuses_ids_that_leave_the_data_path_before_touching_disk(tmp_path, dataset_id):
    data = tmp_path / "data" / "minari"
    data.mkdir(parents=True)
    ds = Dataset.from_episodes(make_episodes((3, 2), log_probs=False), action_low=-1.0, action_high=1.0)
    before = tree(tmp_path)
    with pytest.raises(ValueError, match="Minari dataset id"):
        to_minari(ds, dataset_id, data_path=data)
    assert tree(tmp_path) == before


@pytest.mark.filterwarnings("ignore:env_spec is None:UserWarning")
def test_to_minari_refuses_an_id_without_version_and_an_env_that_does_not_fit(tmp_path):
    data = tmp_path / "data"
    ds = Dataset.from_episodes(make_episodes((3, 2), log_probs=False), action_low=-1.0, action_high=1.0)  # 3-d obs
    with pytest.raises(ValueError, match=r"must look like \[namespace/\]name-v<N>"):
        to_minari(ds, "test/no-version", data_path=data)  # was: Minari's TypeError int() ... NoneType
    with pytest.raises(ValueError, match="observation space .* does not fit the data's 3-d observations"):
        to_minari(ds, "test/cartpole-v0", env="CartPole-v1", data_path=data)  # was: written without complaint
    assert not (data / "test" / "cartpole-v0").exists()


@pytest.mark.filterwarnings("ignore:env_spec is None:UserWarning")
def test_load_minari_refuses_ids_that_leave_the_data_path(tmp_path):
    gym = pytest.importorskip("gymnasium")
    elsewhere = tmp_path / "elsewhere"
    ds = Dataset.from_episodes(make_episodes((3, 2), log_probs=False), action_low=-1.0, action_high=1.0)
    to_minari(ds, "test/foo-v0", data_path=elsewhere, observation_space=gym.spaces.Box(-np.inf, np.inf, (3,)),
              action_space=gym.spaces.Box(-1.0, 1.0, (1,)))
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(ValueError, match=r"Minari dataset id '\.\./elsewhere/test/foo-v0'.*'\.\.'"):
        load_minari("../elsewhere/test/foo-v0", data_path=root)  # old code: read the dataset outside root
    with pytest.raises(ValueError, match="Minari dataset id"):
        load(f"minari:{elsewhere}/test/foo-v0")


def test_check_minari_id_accepts_namespaced_ids():
    from offrl.datasets.minari import check_minari_id

    assert check_minari_id("mujoco/hopper/medium-v0") == "mujoco/hopper/medium-v0"
    assert check_minari_id("D4RL/door/human-v2") == "D4RL/door/human-v2"
    with pytest.raises(TypeError, match="Minari dataset id must be a string"):
        check_minari_id(3)


# ================================================================== 10. inconsistent episodes


@pytest.mark.parametrize("flag", ["terminals", "timeouts"])
def test_from_arrays_refuses_a_flag_inside_an_episode(flag):
    obs, act, rew, nxt = flat()
    flags = {"terminals": None, "timeouts": None, flag: np.array([0, 1, 0, 0, 0, 0])}
    with pytest.raises(ValueError, match=rf"{flag} is set at row 1, inside episode 0 \(rows 0-5\)"):
        Dataset.from_arrays(obs, act, rew, flags["terminals"], flags["timeouts"], nxt, episode_starts=[0, 6])
    columns = {"terminals": np.zeros(N), "timeouts": np.zeros(N), flag: flags[flag]}
    with pytest.raises(ValueError, match=rf"{flag} is set at row 1, inside episode 0"):  # the constructor too
        Dataset(observations=obs, actions=act, rewards=rew, next_observations=nxt, episode_starts=[0, 6], **columns)


def test_from_pandas_refuses_a_terminal_inside_an_episode():
    obs, act, rew, nxt = flat()
    df = Dataset.from_arrays(obs, act, rew, None, None, nxt).to_pandas()
    df.loc[2, "terminal"] = 1.0
    with pytest.raises(ValueError, match=r"terminals is set at row 2, inside episode 0"):
        Dataset.from_pandas(df)


def test_from_pandas_refuses_rows_out_of_time_order():
    obs, act, rew, nxt = flat()
    df = Dataset.from_arrays(obs, act, rew, None, None, nxt, episode_starts=[0, 3]).to_pandas()
    backwards = df.iloc[[2, 1, 0, 3, 4, 5]].reset_index(drop=True)
    with pytest.raises(ValueError, match=r"column 'step' goes from 2 to 1 at row 1 \(episode 0\).*sort"):
        Dataset.from_pandas(backwards)
    no_next = df.drop(columns=[c for c in df.columns if c.startswith("next_obs_")])
    gap = no_next.drop(index=1).reset_index(drop=True)  # steps 0, 2: the next observation would be wrong
    with pytest.raises(ValueError, match=r"column 'step' goes from 0 to 2 at row 1 \(episode 0\).*consecutive"):
        Dataset.from_pandas(gap)
    # opting out reads the rows as they come (the timeout flag, now on the first row, is dropped too)
    without = Dataset.from_pandas(backwards.drop(columns=["timeout"]), step_column=None)
    assert without.observations[0, 0] == 2.0
    assert Dataset.from_pandas(df).n_transitions == N  # in order: fine


def test_terminal_and_timeout_on_one_row_is_a_terminal_everywhere(tmp_path):
    obs, act, rew, nxt = flat()
    terminals = np.array([0, 0, 1, 0, 0, 0])
    timeouts = np.array([0, 0, 1, 0, 0, 1])
    expected_terminals, expected_timeouts = [0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1]
    from_arrays = Dataset.from_arrays(obs, act, rew, terminals, timeouts, nxt)
    episodes = [{"observations": obs[:3], "next_observations": nxt[:3], "actions": act[:3], "rewards": rew[:3],
                 "terminations": terminals[:3], "truncations": timeouts[:3]},
                {"observations": obs[3:], "next_observations": nxt[3:], "actions": act[3:], "rewards": rew[3:],
                 "terminations": terminals[3:], "truncations": timeouts[3:]}]
    from_episodes = Dataset.from_episodes(episodes)
    df = from_arrays.to_pandas()
    df.loc[2, "timeout"] = 1.0
    from_pandas = Dataset.from_pandas(df)
    path = write_d4rl_hdf5(tmp_path / "hopper_medium-v2.hdf5", {
        "observations": obs, "next_observations": nxt, "actions": act, "rewards": rew,
        "terminals": terminals.astype(bool), "timeouts": timeouts.astype(bool)})
    from_d4rl = read_d4rl_hdf5(path)
    for name, ds in (("from_arrays", from_arrays), ("from_episodes", from_episodes), ("from_pandas", from_pandas),
                     ("read_d4rl_hdf5", from_d4rl)):
        np.testing.assert_array_equal(ds.terminals, expected_terminals, err_msg=name)
        np.testing.assert_array_equal(ds.timeouts, expected_timeouts, err_msg=name)
        np.testing.assert_array_equal(ds.episode_starts, [0, 3, 6], err_msg=name)


def test_terminal_and_timeout_row_is_kept_by_the_d4rl_reader_without_next_observations(tmp_path):
    obs, act, rew, _ = flat()
    path = write_d4rl_hdf5(tmp_path / "hopper_medium-v2.hdf5", {
        "observations": obs, "actions": act, "rewards": rew,
        "terminals": np.array([0, 0, 1, 0, 0, 0], bool), "timeouts": np.array([0, 0, 1, 0, 0, 1], bool)})
    ds = read_d4rl_hdf5(path)
    # row 2 ends the MDP: it is kept (no bootstrap, so its next observation is never used); row 5 is a cut
    np.testing.assert_array_equal(ds.observations[:, 0], [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(ds.terminals, [0, 0, 1, 0, 0])
    np.testing.assert_array_equal(ds.timeouts, [0, 0, 0, 0, 1])


@pytest.mark.parametrize("which", ["observations", "actions"])
def test_zero_width_columns_are_refused(tmp_path, which):
    obs, act, rew, nxt = flat()
    arrays = {"observations": obs, "actions": act}
    arrays[which] = np.zeros((N, 0), np.float32)
    with pytest.raises(ValueError, match=rf"{which} has 0 columns"):
        Dataset.from_arrays(arrays["observations"], arrays["actions"], rew)
    with pytest.raises(ValueError, match=rf"{which} has 0 columns"):
        Dataset.from_episodes([{"observations": np.zeros((N + 1, 0)) if which == "observations" else np.zeros((N + 1, 2)),
                                "actions": arrays["actions"], "rewards": rew}])
    path = write_d4rl_hdf5(tmp_path / "hopper_medium-v2.hdf5", dict(d4rl_like(n=N), **{which: arrays[which]}))
    with pytest.raises(ValueError, match=rf"hopper_medium-v2\.hdf5: {which} has 0 columns"):
        read_d4rl_hdf5(path)


@pytest.mark.parametrize("low, high, message", [
    (np.nan, 1.0, r"action_low contains NaN or inf at dimension 0"),
    (-1.0, [1.0, np.inf], r"action_high contains NaN or inf at dimension 1"),
    ([-1.0, 2.0], 1.0, r"action_low\[1\] = 2 is not below action_high\[1\] = 1"),
    (0.5, 0.5, r"action_low\[0\] = 0.5 is not below action_high\[0\] = 0.5"),
    ("low", 1.0, r"action_low must be numbers"),
])
def test_bad_action_bounds_are_refused_at_construction(low, high, message):
    obs, _, rew, nxt = flat()
    act = np.full((N, 2), 0.5, np.float32)
    with pytest.raises(ValueError, match=message):
        Dataset.from_arrays(obs, act, rew, None, None, nxt, action_low=low, action_high=high)


@pytest.mark.parametrize("low, message", [
    ([-1.0, -1.0, -1.0], r"action_low has 3 values but the action space has 2 dimensions"),
    ([[-1.0], [-1.0]], r"action_low has shape \(2, 1\).*one bound per action dimension"),
])
def test_action_bounds_of_the_wrong_length_are_refused(low, message):
    obs, _, rew, nxt = flat()
    with pytest.raises(ValueError, match=message):
        Dataset.from_arrays(obs, np.zeros((N, 2)), rew, None, None, nxt, action_low=low, action_high=1.0)
    with pytest.raises(ValueError, match=r"action_low has 3 values but action_high has 2"):
        Dataset.from_arrays(obs, None, rew, None, None, nxt, action_low=[-1, -1, -1], action_high=[1, 1])


@pytest.mark.parametrize("starts", [[0, 2.5, 6], [0.0, np.nan, 6.0], ["0", "3", "6"], np.array([True, False])])
def test_non_integer_episode_starts_are_refused(starts):
    obs, act, rew, nxt = flat()
    with pytest.raises(ValueError, match="episode_starts must be integer row offsets"):
        Dataset.from_arrays(obs, act, rew, None, None, nxt, episode_starts=starts)
    with pytest.raises(ValueError, match="episode_starts must be integer row offsets"):
        Dataset(observations=obs, actions=act, rewards=rew, terminals=np.zeros(N), timeouts=np.zeros(N),
                next_observations=nxt, episode_starts=starts)
    with pytest.raises(ValueError, match="episode_starts must be integer row offsets"):
        SegmentSampler({"observations": torch.from_numpy(obs)}, starts, batch_size=2, segment_length=2)


def test_integral_float_episode_starts_are_read_exactly():
    obs, act, rew, nxt = flat()
    ds = Dataset.from_arrays(obs, act, rew, None, None, nxt, episode_starts=np.array([0.0, 3.0, 6.0]))
    np.testing.assert_array_equal(ds.episode_starts, [0, 3, 6])


@pytest.mark.parametrize("count, message", [
    (3.7, r"discrete_actions must be a positive integer .*got 3\.7"),
    (True, r"discrete_actions must be a positive integer .*got True"),
    (0, r"discrete_actions must be a positive integer .*got 0"),
    (2**24 + 10, r"discrete_actions = 16777226 exceeds 2\*\*24"),
])
def test_bad_discrete_action_counts_are_refused(count, message):
    obs, act, rew, nxt = flat()
    with pytest.raises(ValueError, match=message):
        Dataset.from_arrays(obs, act, rew, None, None, nxt, discrete_actions=count)


@pytest.mark.parametrize("value, shown", [(1.0000000001, r"1\.0000000001"), (2**24 + 1, "16777217")])
def test_discrete_actions_that_float32_would_change_are_refused(value, shown):
    obs, _, rew, nxt = flat(1)
    actions = np.array([[value]])
    with pytest.raises(ValueError, match=rf"actions has value {shown} at row 0.*float32"):
        Dataset.from_arrays(obs, actions, rew, None, None, nxt, discrete_actions=3)
    with pytest.raises(ValueError, match=rf"episode 0 actions has value {shown} at row 0.*float32"):
        Dataset.from_episodes([{"observations": obs, "next_observations": nxt, "actions": actions, "rewards": rew}],
                              discrete_actions=3)
    with pytest.raises(ValueError, match=rf"actions has value {shown} at row 0.*float32"):
        Dataset(observations=obs, actions=actions, rewards=rew, terminals=[0], timeouts=[1], next_observations=nxt,
                episode_starts=[0, 1], discrete_actions=3)
    ds = Dataset.from_arrays(obs, [[1]], rew, None, None, nxt, discrete_actions=3)
    with pytest.raises(ValueError, match=rf"actions has value {shown} at row 0.*float32"):
        ds.with_actions(actions)
    # a missing (unlabelled) action may hold anything
    masked = Dataset.from_arrays(obs, actions, rew, None, None, nxt, discrete_actions=3, action_mask=[False])
    assert masked.actions is None


# ================================================================== 11. messages instead of raw exceptions


def test_truncated_and_foreign_hdf5_files_name_the_file(tmp_path):
    import h5py

    good = write_d4rl_hdf5(tmp_path / "good.hdf5", d4rl_like())
    data = good.read_bytes()
    (tmp_path / "truncated.hdf5").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"truncated\.hdf5 is not a readable HDF5 file .*download it again"):
        load(str(tmp_path / "truncated.hdf5"))
    (tmp_path / "text.hdf5").write_text("not HDF5 at all")
    with pytest.raises(ValueError, match=r"text\.hdf5 is not a readable HDF5 file"):
        read_d4rl_hdf5(tmp_path / "text.hdf5")
    with h5py.File(tmp_path / "group.hdf5", "w") as f:
        f.create_group("observations")
        f.create_dataset("actions", data=np.zeros((3, 1)))
        f.create_dataset("terminals", data=np.zeros(3))
    with pytest.raises(ValueError, match=r"group\.hdf5: 'observations' is an HDF5 group, not an array"):
        read_d4rl_hdf5(tmp_path / "group.hdf5")
    with h5py.File(tmp_path / "scalar.hdf5", "w") as f:
        f.create_dataset("observations", data=1.0)
        f.create_dataset("actions", data=np.zeros((3, 1)))
        f.create_dataset("terminals", data=np.zeros(3))
    with pytest.raises(ValueError, match=r"scalar\.hdf5: 'observations' is a scalar"):
        read_d4rl_hdf5(tmp_path / "scalar.hdf5")
    strings = dict(d4rl_like(), rewards=np.array([b"a"] * 20))
    with pytest.raises(ValueError, match=r"strings\.hdf5: rewards has non-numeric dtype"):
        read_d4rl_hdf5(write_d4rl_hdf5(tmp_path / "strings.hdf5", strings))
    short = dict(d4rl_like(), actions=np.zeros((19, 3), np.float32))
    with pytest.raises(ValueError, match=r"short\.hdf5: actions has 19 rows but observations has 20"):
        read_d4rl_hdf5(write_d4rl_hdf5(tmp_path / "short.hdf5", short))


def test_broken_npz_files_name_the_file(tmp_path):
    obs, act, rew, nxt = flat()
    ds = Dataset.from_arrays(obs, act, rew, None, None, nxt)
    ds.save(tmp_path / "good.npz")
    data = (tmp_path / "good.npz").read_bytes()
    (tmp_path / "truncated.npz").write_bytes(data[: len(data) // 2])
    (tmp_path / "text.npz").write_text("hello")
    np.save(tmp_path / "array.npy", np.zeros(3))
    os.replace(tmp_path / "array.npy", tmp_path / "array.npz")
    np.savez(tmp_path / "json.npz", header=np.frombuffer(b"{not json", np.uint8))
    np.savez(tmp_path / "keys.npz", header=np.frombuffer(b'{"format_version": 1}', np.uint8), **{
        k: getattr(ds, k) for k in ("observations", "actions", "rewards", "terminals", "timeouts", "next_observations")})
    np.savez(tmp_path / "objects.npz", **dict(np.load(tmp_path / "good.npz"), observations=np.array([{"a": 1}])))
    for name in ("truncated", "text", "array", "json", "keys", "objects"):
        with pytest.raises(ValueError, match=rf"{name}\.npz is not a readable offrl Dataset file .*Dataset\.save"):
            load(str(tmp_path / f"{name}.npz"))
    edited = dict(np.load(tmp_path / "good.npz"))
    edited["rewards"] = edited["rewards"][:-1]
    np.savez(tmp_path / "edited.npz", **edited)
    with pytest.raises(ValueError, match=r"edited\.npz: rewards has 5 rows but observations has 6"):
        Dataset.load(tmp_path / "edited.npz")
    with pytest.raises(TypeError, match=r"load\(.*good\.npz.*\) takes no keyword arguments"):
        load(str(tmp_path / "good.npz"), action_low=-1.0)


@pytest.mark.filterwarnings("ignore:env_spec is None:UserWarning")
def test_minari_read_errors_name_the_dataset(minari_dir):
    gym = pytest.importorskip("gymnasium")
    import minari
    from minari.data_collector import EpisodeBuffer

    rng = np.random.default_rng(0)
    rewards = [1.0, float("nan"), 0.0]
    buffer = EpisodeBuffer(id=0, observations=rng.normal(size=(4, 2)).astype(np.float32),
                           actions=rng.uniform(-1, 1, size=(3, 1)).astype(np.float32), rewards=rewards,
                           terminations=[False, False, True], truncations=[False, False, False])
    minari.create_dataset_from_buffers("test/nan-v0", [buffer], observation_space=gym.spaces.Box(-np.inf, np.inf, (2,)),
                                       action_space=gym.spaces.Box(-1.0, 1.0, (1,)), algorithm_name="x", author="x",
                                       author_email="x@example.com", code_permalink="https://example.com",
                                       description="nan")
    with pytest.raises(ValueError, match=r"Minari dataset 'test/nan-v0': episode 0 rewards contains NaN"):
        load("minari:test/nan-v0")


def test_episodes_of_different_widths_name_the_episode():
    eps = make_episodes((3, 4), obs_dim=3)
    eps[1]["observations"] = np.zeros((5, 4))
    with pytest.raises(ValueError, match=r"episode 1 observations has 4 columns but episode 0 has 3"):
        Dataset.from_episodes(eps)
    eps = make_episodes((3, 4), obs_dim=3)
    eps[1]["next_observations"] = np.zeros((4, 3))
    eps[1]["observations"] = np.zeros((4, 3))
    eps[0]["next_observations"] = np.zeros((3, 5))
    eps[0]["observations"] = np.zeros((3, 5))
    with pytest.raises(ValueError, match=r"episode 1 observations has 3 columns but episode 0 has 5"):
        Dataset.from_episodes(eps)
    eps = make_episodes((3, 4), obs_dim=3)
    eps[0]["next_observations"], eps[0]["observations"] = np.zeros((3, 4)), np.zeros((3, 3))
    with pytest.raises(ValueError, match=r"episode 0 next_observations has 4 columns but observations has 3"):
        Dataset.from_episodes(eps)
    eps = make_episodes((3, 4), act_dim=1)
    eps[1]["actions"] = np.zeros((4, 2))
    with pytest.raises(ValueError, match=r"episode 1 actions has 2 columns but episode 0 has 1"):
        Dataset.from_episodes(eps)


@pytest.mark.parametrize("batch_size", [-1, 0, 2.5, True, "8", None])
def test_sample_refuses_a_bad_batch_size(batch_size):
    obs, act, rew, nxt = flat()
    ds = Dataset.from_arrays(obs, act, rew, None, None, nxt)
    with pytest.raises(ValueError, match=rf"batch_size must be a positive integer, got {batch_size!r}"):
        ds.sample(batch_size)
    assert ds.sample(np.int64(3)).observations.shape == (3, 2)


@pytest.mark.parametrize("batch_size", [-1, 0, 2.5, True])
def test_samplers_refuse_a_bad_batch_size(batch_size):
    obs, act, rew, nxt = flat()
    ds = Dataset.from_arrays(obs, act, rew, None, None, nxt)
    with pytest.raises(ValueError, match="TransitionSampler batch_size must be a positive integer"):
        TransitionSampler.from_dataset(ds, batch_size)
    with pytest.raises(ValueError, match="MixtureSampler batch_size must be a positive integer"):
        MixtureSampler([TransitionSampler.from_dataset(ds, 4)], [1.0], batch_size)
    with pytest.raises(ValueError, match="SegmentSampler batch_size must be a positive integer"):
        SegmentSampler.from_dataset(ds, batch_size, 2)


def test_from_pandas_reads_steps_beyond_float32_exactly():
    import pandas as pd

    n = 4
    df = pd.DataFrame({"obs_0": np.arange(n, dtype=float), "action_0": np.zeros(n), "reward": np.zeros(n),
                       "terminal": [0, 0, 0, 1], "timeout": np.zeros(n), "episode_id": np.zeros(n, int),
                       "step": np.arange(n) + 2**24 + 1})  # float32 would merge 16777217 and 16777218
    assert Dataset.from_pandas(df).n_transitions == n  # was: "steps must be consecutive"
