"""Shared fixtures: small datasets and files written in D4RL's exact HDF5 layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from offrl.datasets import Dataset

# ------------------------------------------------------------------ D4RL layout

# Flags of the small D4RL-layout files below (14 rows):
#   rows 0-3   episode cut by the time limit (timeout at 3)
#   rows 4-6   episode that terminates (terminal at 6)
#   rows 7-9   episode whose last step is BOTH terminal and timeout (counts as a terminal: terminal wins everywhere)
#   row  10    one-step episode cut by the time limit
#   rows 11-13 episode still running when the file ends (no flag on the last row)
D4RL_N = 14
D4RL_TERMINAL_ROWS = (6, 9)
D4RL_TIMEOUT_ROWS = (3, 9, 10)
D4RL_OBS_DIM = 3
D4RL_ACT_DIM = 2


def write_d4rl_hdf5(path: str | Path, arrays: dict[str, Any], metadata: dict[str, Any] | None = None) -> Path:
    """Write `arrays` with h5py exactly as D4RL lays out its files.

    Keys may be nested with '/', e.g. 'infos/action_log_probs' becomes the
    dataset `action_log_probs` inside group `infos`; `metadata` entries become
    scalar datasets under `metadata/` (strings stored as bytes, as D4RL does).
    """
    import h5py

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        for key, value in arrays.items():
            f.create_dataset(key, data=value)
        for key, value in (metadata or {}).items():
            f.create_dataset(f"metadata/{key}", data=value.encode() if isinstance(value, str) else value)
    return path


def d4rl_arrays(*, float64: bool, next_observations: bool, column_rewards: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Arrays of a small D4RL-style file with the flags described at the top of this module.

    Observations are distinct per row (row i starts with i) so that tests can
    tell which row a transition came from.
    """
    rng = np.random.default_rng(seed)
    dtype = np.float64 if float64 else np.float32
    n = D4RL_N
    observations = rng.normal(size=(n, D4RL_OBS_DIM)).astype(dtype)
    observations[:, 0] = np.arange(n)
    terminals = np.zeros(n, bool)
    terminals[list(D4RL_TERMINAL_ROWS)] = True
    timeouts = np.zeros(n, bool)
    timeouts[list(D4RL_TIMEOUT_ROWS)] = True
    arrays: dict[str, np.ndarray] = {
        "observations": observations,
        "actions": rng.uniform(-1, 1, size=(n, D4RL_ACT_DIM)).astype(dtype),
        "rewards": rng.normal(1.0, 0.5, size=n).astype(dtype),
        "terminals": terminals,
        "timeouts": timeouts,
        "infos/action_log_probs": rng.normal(-1.0, 0.3, size=n).astype(dtype),
        "infos/qpos": rng.normal(size=(n, 6)).astype(dtype),
        "infos/qvel": rng.normal(size=(n, 6)).astype(dtype),
    }
    if column_rewards:  # some D4RL files (medium-replay) store rewards/terminals as (N, 1)
        arrays["rewards"] = arrays["rewards"][:, None]
        arrays["terminals"] = arrays["terminals"][:, None]
    if next_observations:
        next_obs = rng.normal(size=(n, D4RL_OBS_DIM)).astype(dtype)
        next_obs[:, 0] = np.arange(n) + 0.5
        arrays["next_observations"] = next_obs
    return arrays


def d4rl_qlearning_reference(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """D4RL's own `qlearning_dataset(env, dataset)` (terminate_on_end=False), transcribed.

    https://github.com/Farama-Foundation/D4RL/blob/master/d4rl/__init__.py
    """
    n = arrays["rewards"].shape[0]
    obs_, next_obs_, action_, reward_, done_ = [], [], [], [], []
    for i in range(n - 1):
        obs = arrays["observations"][i].astype(np.float32)
        new_obs = arrays["observations"][i + 1].astype(np.float32)
        action = arrays["actions"][i].astype(np.float32)
        reward = np.float32(np.ravel(arrays["rewards"][i])[0])
        done_bool = bool(np.ravel(arrays["terminals"][i])[0])
        final_timestep = bool(arrays["timeouts"][i])
        if final_timestep:
            continue
        obs_.append(obs)
        next_obs_.append(new_obs)
        action_.append(action)
        reward_.append(reward)
        done_.append(done_bool)
    return {
        "observations": np.array(obs_),
        "actions": np.array(action_),
        "next_observations": np.array(next_obs_),
        "rewards": np.array(reward_),
        "terminals": np.array(done_, dtype=np.float32),
    }


@pytest.fixture
def d4rl_float32_file(tmp_path):
    """(path, arrays): float32 file with next_observations and infos/action_log_probs."""
    arrays = d4rl_arrays(float64=False, next_observations=True, column_rewards=False)
    path = write_d4rl_hdf5(
        tmp_path / "hopper_medium-v2.hdf5", arrays, metadata={"algorithm": "SAC", "iteration": 42}
    )
    return path, arrays


@pytest.fixture
def d4rl_replay_file(tmp_path):
    """(path, arrays): medium-replay style float64 file, (N, 1) rewards/terminals, no next_observations.

    Named as D4RL names it, inside tmp_path/d4rl, so `D4RL_DATASET_DIR` can point there.
    """
    arrays = d4rl_arrays(float64=True, next_observations=False, column_rewards=True, seed=1)
    path = write_d4rl_hdf5(tmp_path / "d4rl" / "hopper_medium_replay-v2.hdf5", arrays)
    return path, arrays


@pytest.fixture
def isolated_d4rl_dirs(tmp_path, monkeypatch):
    """Point D4RL_DATASET_DIR at tmp_path/d4rl and HOME at an empty dir (so ~/.d4rl is empty too)."""
    d4rl_dir = tmp_path / "d4rl"
    d4rl_dir.mkdir(exist_ok=True)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("D4RL_DATASET_DIR", str(d4rl_dir))
    monkeypatch.setenv("HOME", str(home))
    return d4rl_dir


# ------------------------------------------------------------------ Minari

@pytest.fixture
def minari_dir(tmp_path, monkeypatch):
    """An empty Minari datasets directory in $MINARI_DATASETS_PATH."""
    path = tmp_path / "minari"
    path.mkdir()
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(path))
    return path


# ------------------------------------------------------------------ small datasets

def make_episodes(
    lengths=(5, 3, 7, 4),
    *,
    obs_dim: int = 3,
    act_dim: int = 1,
    terminal: tuple[bool, ...] | None = None,
    log_probs: bool = True,
    seed: int = 0,
) -> list[dict[str, np.ndarray]]:
    """Minari-style episodes: T + 1 observations, T actions/rewards/terminations/truncations."""
    rng = np.random.default_rng(seed)
    terminal = terminal if terminal is not None else tuple(i % 2 == 1 for i in range(len(lengths)))
    episodes = []
    for t, term in zip(lengths, terminal):
        ep = {
            "observations": rng.normal(size=(t + 1, obs_dim)).astype(np.float32),
            "actions": rng.uniform(-1, 1, size=(t, act_dim)).astype(np.float32),
            "rewards": rng.normal(size=t).astype(np.float32),
            "terminations": np.array([False] * (t - 1) + [term]),
            "truncations": np.array([False] * (t - 1) + [not term]),
        }
        if log_probs:
            ep["behavior_log_probs"] = rng.normal(-1.0, 0.5, size=t).astype(np.float32)
        episodes.append(ep)
    return episodes


@pytest.fixture
def episodes():
    return make_episodes()


@pytest.fixture
def dataset(episodes):
    return Dataset.from_episodes(
        episodes,
        action_low=-1.0,
        action_high=1.0,
        metadata={"name": "toy", "ref_min_score": -5.0, "ref_max_score": 5.0},
    )


def assert_same_columns(a: Dataset, b: Dataset) -> None:
    """Every column, the episode offsets and the log-prob presence are exactly equal."""
    for key in ("observations", "actions", "rewards", "terminals", "timeouts", "next_observations", "episode_starts"):
        np.testing.assert_array_equal(getattr(a, key), getattr(b, key), err_msg=key)
        assert getattr(a, key).dtype == getattr(b, key).dtype, key
    assert a.has_behavior_log_probs == b.has_behavior_log_probs
    if a.has_behavior_log_probs:
        np.testing.assert_array_equal(a.behavior_log_probs, b.behavior_log_probs)


def pendulum_shaped_dataset(n_episodes: int = 8, length: int = 50, seed: int = 0) -> Dataset:
    """Random transitions shaped like Pendulum-v1 (3-d observations, one action in [-2, 2])."""
    rng = np.random.default_rng(seed)
    episodes = []
    for _ in range(n_episodes):
        theta = rng.uniform(-np.pi, np.pi, size=length + 1)
        obs = np.stack([np.cos(theta), np.sin(theta), rng.uniform(-8, 8, size=length + 1)], axis=1)
        actions = rng.uniform(-2, 2, size=(length, 1))
        rewards = -(theta[:-1] ** 2) - 0.001 * actions[:, 0] ** 2
        episodes.append({"observations": obs, "actions": actions, "rewards": rewards,
                         "truncations": [False] * (length - 1) + [True]})
    return Dataset.from_episodes(episodes, action_low=-2.0, action_high=2.0,
                                 metadata={"name": "pendulum-toy", "env_id": "Pendulum-v1",
                                           "ref_min_score": -1500.0, "ref_max_score": -150.0})


@pytest.fixture(scope="module")
def one_thread():
    """Tiny networks gain nothing from more threads, and a shared CPU punishes OpenMP spinning."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `offrl argv` in process; argparse's usage errors exit through SystemExit."""
    from offrl.cli import main

    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def random_pendulum_npz(path: Path, n_episodes: int) -> Path:
    """A small real Pendulum-v1 dataset (uniform-random actions, 200-step episodes, reference scores -1200 / -150)
    written to `path` with Dataset.save: the sweep tests' data file."""
    import gymnasium as gym

    env = gym.make("Pendulum-v1")
    env.action_space.seed(0)
    episodes = []
    for ep in range(n_episodes):
        obs, _ = env.reset(seed=ep)
        observations, actions, rewards = [obs], [], []
        for _ in range(200):
            action = env.action_space.sample()
            obs, reward, _, _, _ = env.step(action)
            observations.append(obs)
            actions.append(action)
            rewards.append(reward)
        episodes.append({"observations": np.array(observations), "actions": np.array(actions),
                         "rewards": np.array(rewards), "truncations": [False] * 199 + [True]})
    ds = Dataset.from_episodes(episodes, action_low=-2.0, action_high=2.0,
                               metadata={"name": "pendulum-random", "env_id": "Pendulum-v1",
                                         "ref_min_score": -1200.0, "ref_max_score": -150.0})
    ds.save(path)
    return path
