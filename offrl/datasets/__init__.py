"""The data layer: every way logged data gets into or out of offrl.

It imports nothing from the algorithms (or anything else above it): datasets
made by the D4RL-recipe builder (`offrl.builder`, which trains SAC) are read
here through `offrl.datasets.built`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from offrl.datasets.built import list_built, load_built, offrl_data_dir
from offrl.datasets.core import Batch, Dataset
from offrl.datasets.d4rl import D4RL_REF_SCORES, d4rl_ref_scores
from offrl.datasets.minari import load_minari, to_minari

__all__ = ["Dataset", "Batch", "load", "load_built", "list_built", "to_minari", "normalized_score", "reference_scores",
           "offrl_data_dir"]


def load(spec: str | os.PathLike, download: bool = False, **kwargs: Any) -> Dataset:
    """Load a dataset from a spec.

    - `"d4rl:hopper-medium-replay-v2"`: D4RL file from `$D4RL_DATASET_DIR` or
      `~/.d4rl/datasets` (downloaded only with `download=True`);
    - a path to a `.hdf5` file in D4RL's layout (`kwargs`: `action_low`,
      `action_high`, the action space's bounds, which D4RL files lack; known
      D4RL environments get theirs, [-1, 1]);
    - `"minari:mujoco/hopper/medium-v0"`: a local Minari dataset (the bounds
      come from its action space);
    - `"offrl:pendulum-medium-v1"`: a dataset built by `offrl datasets build`
      (`kwargs`: the budget it was built with, see `load_built`; to build it
      on first use call `offrl.builder.load_or_build`);
    - a path to a `.npz` file written by `Dataset.save`.

    Paths may use `~` and environment variables (`$OFFRL_DATA_DIR/dual/demos.npz`), so sweep configs can
    name files under the data directory.
    """
    from offrl.datasets import d4rl

    spec = os.fspath(spec)
    scheme, sep, rest = spec.partition(":")
    if sep and scheme == "d4rl":
        path = d4rl.find_d4rl_file(rest)
        if path is None:
            if not download:
                raise FileNotFoundError(d4rl.missing_d4rl_message(rest))
            path = d4rl.download_d4rl(rest)
        return d4rl.read_d4rl_hdf5(path, name=rest, **kwargs)
    if sep and scheme == "minari":
        return load_minari(rest, download=download, **kwargs)
    if sep and scheme == "offrl":
        if "build" in kwargs:
            raise TypeError(f"load({spec!r}, build=...) is gone: load reads built datasets only; build on first use "
                            f"with offrl.builder.load_or_build({rest!r}, ...) or `offrl datasets build {rest}`")
        return load_built(rest, **kwargs)
    path = Path(os.path.expandvars(spec)).expanduser()
    if path.suffix in (".hdf5", ".h5"):
        if not path.exists():
            raise FileNotFoundError(f"no D4RL-layout file at {path}; check the path")
        return d4rl.read_d4rl_hdf5(path, **kwargs)
    if path.suffix == ".npz":
        if kwargs:
            raise TypeError(f"load({spec!r}) takes no keyword arguments for a .npz file (it holds its own action "
                            f"bounds), got {sorted(kwargs)}")
        return Dataset.load(path)
    raise ValueError(
        f"cannot load {spec!r}: use 'd4rl:<name>', 'minari:<dataset id>', 'offrl:<name>', "
        "or a path to a .hdf5 (D4RL layout) or .npz (Dataset.save) file"
    )


def reference_scores(name_or_dataset: Any) -> tuple[float, float]:
    """(ref_min_score, ref_max_score) for a Dataset, a metadata dict or a D4RL name."""
    meta = None
    if isinstance(name_or_dataset, Dataset):
        meta = name_or_dataset.metadata
    elif isinstance(name_or_dataset, dict):
        meta = name_or_dataset
    if meta is not None:
        if meta.get("ref_min_score") is not None and meta.get("ref_max_score") is not None:
            return float(meta["ref_min_score"]), float(meta["ref_max_score"])
        name = meta.get("name", "")
    else:
        name = str(name_or_dataset)
    name = name.split(":", 1)[-1]
    scores = d4rl_ref_scores(name)
    if scores is None:
        raise ValueError(
            f"no reference scores for {name!r}: known D4RL envs are {sorted(D4RL_REF_SCORES)}; "
            "pass a Dataset whose metadata has ref_min_score and ref_max_score (Minari and offrl-built datasets do)"
        )
    return scores


def normalized_score(name_or_dataset: Any, returns: Any) -> Any:
    """100 * (return - ref_min) / (ref_max - ref_min), for a scalar or an array of returns."""
    low, high = reference_scores(name_or_dataset)
    score = 100.0 * (np.asarray(returns, dtype=np.float64) - low) / (high - low)
    return float(score) if score.ndim == 0 else score
