"""Read D4RL's HDF5 layout with h5py alone (no dependency on the `d4rl` package)."""

from __future__ import annotations

import os
import re
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from offrl.datasets.core import Dataset, atomic_write_path

__all__ = ["D4RL_REF_SCORES", "D4RL_URL", "read_d4rl_hdf5", "find_d4rl_file", "download_d4rl", "d4rl_ref_scores"]

D4RL_URL = "http://rail.eecs.berkeley.edu/datasets/offline_rl/gym_mujoco_v2/{filename}"

# (ref_min_score, ref_max_score) per environment prefix; every dataset kind of an env shares them.
D4RL_REF_SCORES: dict[str, tuple[float, float]] = {
    "halfcheetah": (-280.178953, 12135.0),
    "hopper": (-20.272305, 3234.3),
    "walker2d": (1.629008, 4592.3),
    "ant": (-325.6, 3879.7),
    "antmaze": (0.0, 1.0),
    "kitchen": (0.0, 4.0),
    "pen": (96.262799, 3076.8331017826877),
    "door": (-56.512833, 2880.5693087298737),
    "hammer": (-274.856578, 12794.134825156867),
    "relocate": (-6.425911, 4233.877797728884),
}

_MUJOCO_ENVS = ("halfcheetah", "hopper", "walker2d", "ant")

# gymnasium environments to evaluate D4RL gym-locomotion policies in (gym's v2 envs need the retired mujoco-py).
# Hopper and HalfCheetah v5 match v2's observations and rewards; Walker2d-v5 changed foot friction; Ant-v5's
# observation is 105-d (v2: 111-d), so Ant has no entry and needs an explicit eval env.
D4RL_EVAL_ENVS = {"hopper": "Hopper-v5", "halfcheetah": "HalfCheetah-v5", "walker2d": "Walker2d-v5"}


_D4RL_NAME = re.compile(
    r"^(?:(halfcheetah|hopper|walker2d|ant)-(?:random|medium|expert|medium-replay|medium-expert|full-replay)"
    r"|(antmaze|kitchen|pen|door|hammer|relocate)-[a-z0-9-]+)-v\d+$"
)


def d4rl_ref_scores(name: str) -> tuple[float, float] | None:
    """Reference (min, max) returns for a D4RL dataset name ('hopper-medium-v2' or its file stem
    'hopper_medium-v2'); None for any other name, so user files never borrow D4RL's scores."""
    stem = os.path.basename(name).lower()
    for suffix in (".hdf5", ".h5"):
        stem = stem.removesuffix(suffix)
    match = _D4RL_NAME.match(stem.replace("_", "-"))
    if match is None:
        return None
    return D4RL_REF_SCORES[match.group(1) or match.group(2)]


def d4rl_filename(name: str) -> str:
    """'hopper-medium-replay-v2' -> 'hopper_medium_replay-v2.hdf5' (D4RL's file naming)."""
    if not name.endswith("-v2"):
        raise ValueError(f"D4RL gym-locomotion names end in -v2 (e.g. hopper-medium-replay-v2); got {name!r}")
    env, _, kind = name[: -len("-v2")].partition("-")
    if env not in _MUJOCO_ENVS or not kind:
        raise ValueError(
            f"{name!r} is not a D4RL gym-locomotion dataset; names look like "
            "<halfcheetah|hopper|walker2d|ant>-<random|medium|expert|medium-replay|medium-expert|full-replay>-v2"
        )
    return f"{env}_{kind.replace('-', '_')}-v2.hdf5"


def d4rl_search_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("D4RL_DATASET_DIR"):
        dirs.append(Path(os.environ["D4RL_DATASET_DIR"]).expanduser())
    dirs.append(Path("~/.d4rl/datasets").expanduser())
    return dirs


def find_d4rl_file(name: str) -> Path | None:
    filename = d4rl_filename(name)
    for directory in d4rl_search_dirs():
        for candidate in (directory / filename, directory / f"{name}.hdf5"):
            if candidate.exists():
                return candidate
    return None


def download_d4rl(name: str, progress: bool = True) -> Path:
    """Download a D4RL file into the first search dir (temporary file, then rename)."""
    from tqdm.auto import tqdm

    filename = d4rl_filename(name)
    target = d4rl_search_dirs()[0] / filename
    url = D4RL_URL.format(filename=filename)
    with atomic_write_path(target) as tmp:
        with urllib.request.urlopen(url, timeout=60) as response, open(tmp, "wb") as out:
            total = int(response.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"download {filename}", disable=not progress) as bar:
                while chunk := response.read(1 << 20):
                    out.write(chunk)
                    bar.update(len(chunk))
    return target


def missing_d4rl_message(name: str) -> str:
    filename = d4rl_filename(name)
    looked = ", ".join(str(d / filename) for d in d4rl_search_dirs())
    return (
        f"D4RL dataset {name!r} not found; looked in {looked}. Copy {filename} into one of those directories "
        f"(or set D4RL_DATASET_DIR), or call offrl.datasets.load('d4rl:{name}', download=True) to fetch "
        f"{D4RL_URL.format(filename=filename)}"
    )


def read_d4rl_hdf5(path: str | os.PathLike, name: str | None = None) -> Dataset:
    """Read a file in D4RL's layout into a Dataset.

    Episodes end at a terminal or a timeout; a step flagged as both counts
    as a timeout (D4RL's convention).  Without `next_observations` the next
    observation is the following row, and rows cut by a timeout are dropped
    as in D4RL's `qlearning_dataset`, while the episode boundary is kept.
    A file without `rewards` gives a Dataset whose rewards are missing.
    """
    import h5py

    path = Path(path)
    with h5py.File(path, "r") as f:
        # rewards may be absent: an unlabelled log, to be labelled (offrl.reward_labeling) before training
        missing = [k for k in ("observations", "actions", "terminals") if k not in f]
        if missing:
            raise ValueError(f"{path} lacks D4RL key(s) {missing}; expected observations, actions, terminals[, rewards, timeouts]")

        def read(key: str) -> np.ndarray | None:
            if key not in f:
                return None
            dset = f[key]
            if np.issubdtype(dset.dtype, np.floating) and dset.dtype != np.float32:
                # HDF5 converts to float32 while reading, so a float64 copy of
                # the whole column (2x the final size) is never held in memory.
                return dset.astype(np.float32)[()]
            return dset[()]

        observations = read("observations")
        actions = read("actions")
        rewards = read("rewards")
        terminals = read("terminals")
        timeouts = read("timeouts")
        next_observations = read("next_observations")
        log_probs = read("infos/action_log_probs")
        meta: dict[str, Any] = {}
        if "metadata" in f:
            for key, value in f["metadata"].items():
                if isinstance(value, h5py.Dataset) and value.shape == ():
                    item = value[()]
                    meta[key] = item.decode() if isinstance(item, bytes) else (item.item() if hasattr(item, "item") else item)
    n = len(observations)
    for key, column in (("terminals", terminals), ("timeouts", timeouts)):
        if column is not None and (len(column) != n or np.asarray(column).size != n):
            raise ValueError(
                f"{path}: {key} has shape {np.shape(column)} but observations has {n} rows; "
                f"expected ({n},) or ({n}, 1)"
            )
    terminals = np.asarray(terminals).reshape(n)
    timeouts = np.zeros(n, bool) if timeouts is None else np.asarray(timeouts).reshape(n)
    for key, column in (("terminals", terminals), ("timeouts", timeouts)):
        bad = np.flatnonzero((column != 0) & (column != 1))
        if len(bad):
            raise ValueError(f"{path}: {key} must be 0 or 1, found {column[bad[0]]} at row {int(bad[0])}")
    terminals = terminals.astype(bool)
    timeouts = timeouts.astype(bool)
    terminals = terminals & ~timeouts
    name = name or path.stem
    metadata: dict[str, Any] = {"name": name, "source": f"d4rl:{path}"}
    if meta:
        metadata["d4rl_metadata"] = meta
    scores = d4rl_ref_scores(name)
    if scores is not None:
        metadata["ref_min_score"], metadata["ref_max_score"] = scores
        env = os.path.basename(name).lower().replace("_", "-").split("-")[0]
        if env in D4RL_EVAL_ENVS:
            metadata["env_id"] = D4RL_EVAL_ENVS[env]
    return Dataset.from_arrays(
        observations=observations,
        actions=actions,
        rewards=rewards,
        terminals=terminals,
        timeouts=timeouts,
        next_observations=next_observations,
        behavior_log_probs=log_probs,
        metadata=metadata,
    )
