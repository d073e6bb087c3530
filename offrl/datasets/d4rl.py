"""Read D4RL's HDF5 layout with h5py alone (no dependency on the `d4rl` package)."""

from __future__ import annotations

import os
import re
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from offrl.datasets.core import Dataset, atomic_write_path
from offrl.datasets.files import check_inside, check_path_name

__all__ = ["D4RL_REF_SCORES", "D4RL_URL", "D4RL_ACTION_BOUNDS", "read_d4rl_hdf5", "find_d4rl_file", "download_d4rl",
           "d4rl_ref_scores", "d4rl_env"]

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

# The action space of every D4RL environment offrl knows (gym locomotion, AntMaze, Adroit, Kitchen) is the box
# [-1, 1]^d.  D4RL files do not store it, and logged actions need not reach its edges, so the reader sets it.
D4RL_ACTION_BOUNDS: dict[str, tuple[float, float]] = {env: (-1.0, 1.0) for env in D4RL_REF_SCORES}

_MUJOCO_ENVS = ("halfcheetah", "hopper", "walker2d", "ant")

# gymnasium environments to evaluate D4RL gym-locomotion policies in (gym's v2 envs need the retired mujoco-py).
# Hopper and HalfCheetah v5 match v2's observations and rewards; Walker2d-v5 changed foot friction; Ant-v5's
# observation is 105-d (v2: 111-d), so Ant has no entry and needs an explicit eval env.
D4RL_EVAL_ENVS = {"hopper": "Hopper-v5", "halfcheetah": "HalfCheetah-v5", "walker2d": "Walker2d-v5"}


_D4RL_NAME = re.compile(
    r"^(?:(halfcheetah|hopper|walker2d|ant)-(?:random|medium|expert|medium-replay|medium-expert|full-replay)"
    r"|(antmaze|kitchen|pen|door|hammer|relocate)-[a-z0-9-]+)-v\d+$"
)


def d4rl_env(name: str) -> str | None:
    """The D4RL environment ('hopper', 'antmaze', ...) of a D4RL dataset name ('hopper-medium-v2' or its file
    stem 'hopper_medium-v2'); None for any other name, so user files never borrow D4RL's scores or bounds."""
    stem = os.path.basename(name).lower()
    for suffix in (".hdf5", ".h5"):
        stem = stem.removesuffix(suffix)
    match = _D4RL_NAME.match(stem.replace("_", "-"))
    return None if match is None else match.group(1) or match.group(2)


def d4rl_ref_scores(name: str) -> tuple[float, float] | None:
    """Reference (min, max) returns for a D4RL dataset name; None for any other name."""
    env = d4rl_env(name)
    return None if env is None else D4RL_REF_SCORES[env]


def d4rl_filename(name: str) -> str:
    """'hopper-medium-replay-v2' -> 'hopper_medium_replay-v2.hdf5' (D4RL's file naming).

    The name becomes a file name, so '..', separators and leading dots are refused.
    """
    check_path_name(name, "D4RL dataset name")
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
    directory = d4rl_search_dirs()[0]
    target = directory / filename
    check_inside(target, directory, "D4RL dataset name")  # d4rl_filename already refuses such names
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


def read_d4rl_hdf5(path: str | os.PathLike, name: str | None = None, *, action_low: Any = None,
                   action_high: Any = None) -> Dataset:
    """Read a file in D4RL's layout into a Dataset.

    Episodes end at a terminal or a timeout; a step flagged as both is a
    terminal (offrl's rule everywhere, as in gymnasium; D4RL's
    `qlearning_dataset` drops such a row as a timeout instead).  Without
    `next_observations` the next observation is the following row, and rows
    cut by a timeout are dropped as in D4RL's `qlearning_dataset`, while the
    episode boundary is kept.  A file without `rewards` gives a Dataset
    whose rewards are missing.

    Action bounds: `action_low` / `action_high` when given; else [-1, 1] for
    a known D4RL environment (gym locomotion, AntMaze, Adroit, Kitchen; by
    `name`, default the file's stem), whose logged actions beyond it (the
    environment clips them) are clipped with a warning; else none, with a
    warning, and algorithms use the logged actions' range.  Every error
    names the file.
    """
    import h5py

    path = Path(path)
    name = name or path.stem
    try:
        with h5py.File(path, "r") as f:
            arrays, meta = _read_d4rl_arrays(f, path)
    except (FileNotFoundError, PermissionError):
        raise
    except OSError as err:  # h5py's word for a truncated or non-HDF5 file
        raise ValueError(
            f"{path} is not a readable HDF5 file ({err}); it may be truncated (an interrupted download or copy): "
            "delete it and download it again"
        ) from err
    try:
        return _d4rl_dataset(path, name, arrays, meta, action_low, action_high)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err


def _read_d4rl_arrays(f: Any, path: Path) -> tuple[dict[str, np.ndarray | None], dict[str, Any]]:
    """The D4RL columns of an open HDF5 file (floats as float32) and its scalar `metadata/*` entries."""
    import h5py

    # rewards may be absent: an unlabelled log, to be labelled (offrl.reward_labeling) before training
    missing = [k for k in ("observations", "actions", "terminals") if k not in f]
    if missing:
        raise ValueError(f"{path} lacks D4RL key(s) {missing}; expected observations, actions, terminals[, rewards, timeouts]")

    def read(key: str) -> np.ndarray | None:
        if key not in f:
            return None
        dset = f[key]
        if not isinstance(dset, h5py.Dataset):
            raise ValueError(f"{path}: {key!r} is an HDF5 group, not an array; this is not a file in D4RL's layout")
        if dset.shape == ():
            raise ValueError(f"{path}: {key!r} is a scalar, not one row per transition; this is not a file in D4RL's layout")
        if np.issubdtype(dset.dtype, np.floating) and dset.dtype != np.float32:
            # HDF5 converts to float32 while reading, so a float64 copy of
            # the whole column (2x the final size) is never held in memory.
            return dset.astype(np.float32)[()]
        return dset[()]

    keys = ("observations", "actions", "rewards", "terminals", "timeouts", "next_observations", "infos/action_log_probs")
    arrays = {key: read(key) for key in keys}
    meta: dict[str, Any] = {}
    if "metadata" in f and isinstance(f["metadata"], h5py.Group):
        for key, value in f["metadata"].items():
            if isinstance(value, h5py.Dataset) and value.shape == ():
                item = value[()]
                meta[key] = item.decode() if isinstance(item, bytes) else (item.item() if hasattr(item, "item") else item)
    return arrays, meta


def _d4rl_dataset(path: Path, name: str, arrays: dict[str, np.ndarray | None], meta: dict[str, Any],
                  action_low: Any, action_high: Any) -> Dataset:
    observations, actions = arrays["observations"], arrays["actions"]
    n = len(observations)
    for key in ("terminals", "timeouts"):
        column = arrays[key]
        if column is not None and (len(column) != n or np.asarray(column).size != n):
            raise ValueError(f"{key} has shape {np.shape(column)} but observations has {n} rows; expected ({n},) or ({n}, 1)")
    terminals = np.asarray(arrays["terminals"]).reshape(n)
    timeouts = np.zeros(n, bool) if arrays["timeouts"] is None else np.asarray(arrays["timeouts"]).reshape(n)
    for key, column in (("terminals", terminals), ("timeouts", timeouts)):
        if not (np.issubdtype(column.dtype, np.number) or column.dtype == np.bool_):
            raise ValueError(f"{key} has non-numeric dtype {column.dtype}; expected 0/1 flags")
        bad = np.flatnonzero((column != 0) & (column != 1))
        if len(bad):
            raise ValueError(f"{key} must be 0 or 1, found {column[bad[0]]} at row {int(bad[0])}")
    terminals = terminals.astype(bool)
    timeouts = timeouts.astype(bool) & ~terminals  # terminal wins: no bootstrap whatever the time limit says
    metadata: dict[str, Any] = {"name": name, "source": f"d4rl:{path}"}
    if meta:
        metadata["d4rl_metadata"] = meta
    env = d4rl_env(name)
    if env is not None:
        metadata["ref_min_score"], metadata["ref_max_score"] = D4RL_REF_SCORES[env]
        if env in D4RL_EVAL_ENVS:
            metadata["env_id"] = D4RL_EVAL_ENVS[env]
    bounds_unknown = action_low is None and action_high is None and env is None
    if action_low is None and action_high is None and env is not None:
        action_low, action_high = D4RL_ACTION_BOUNDS[env]
        actions = _clip_to_bounds(path, env, actions, action_low, action_high)
    dataset = Dataset.from_arrays(
        observations=observations,
        actions=actions,
        rewards=arrays["rewards"],
        terminals=terminals,
        timeouts=timeouts,
        next_observations=arrays["next_observations"],
        behavior_log_probs=arrays["infos/action_log_probs"],
        action_low=action_low,
        action_high=action_high,
        metadata=metadata,
    )
    if bounds_unknown:
        warnings.warn(
            f"{path}: action bounds unknown ({name!r} is not a D4RL dataset name), so algorithms will use the "
            "range of the logged actions, which may be narrower than the action space; pass the true bounds as "
            "load(path, action_low=..., action_high=...) or read_d4rl_hdf5(path, action_low=..., action_high=...)",
            UserWarning,
            stacklevel=3,
        )
    return dataset


def _clip_to_bounds(path: Path, env: str, actions: Any, low: float, high: float) -> Any:
    """Actions clipped into a known D4RL action box (the environment applied them clipped), with a warning."""
    values = np.asarray(actions)
    if not np.issubdtype(values.dtype, np.floating):
        return actions  # non-numeric or integer data: the Dataset's own checks report it
    outside = np.isfinite(values) & ((values < low - 1e-6) | (values > high + 1e-6))
    count = int(outside.sum())
    if count == 0:
        return actions
    warnings.warn(
        f"{path}: {count} logged action value(s) lie outside [{low:g}, {high:g}], the action space of D4RL's {env} "
        f"(largest {float(np.abs(values[outside]).max()):.6g}); they were clipped into it, as the environment clips "
        "them; pass action_low/action_high to read them unclipped against other bounds",
        UserWarning,
        stacklevel=4,
    )
    return np.where(outside, np.clip(values, low, high), values)
