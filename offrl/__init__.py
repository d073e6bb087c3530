"""offrl: offline reinforcement learning and off-policy evaluation with a scikit-learn-style API."""

from __future__ import annotations

import importlib
from typing import Any

from offrl.datasets.core import Dataset

__version__ = "0.1.0"
__all__ = ["Dataset", "load", "save", "Pipeline", "make_pipeline", "algos", "datasets", "__version__"]

_SUBMODULES = ("algos", "datasets", "nn", "ope", "reward_labeling", "online", "pipeline", "builder", "monitor", "evaluation")
# Public names imported on first use, so that `import offrl` stays light.
_LAZY = {"Pipeline": "offrl.pipeline", "make_pipeline": "offrl.pipeline"}


def load(path: Any, device: str = "auto") -> Any:
    """Load a model saved with `estimator.save(path)` or `offrl.save` (JSON config + tensors, never unpickled code).

    A Pipeline comes back with every step fitted; `device` other than "auto" moves every estimator in it there.
    """
    from offrl.serialization import load_model

    return load_model(path, device=device)


def save(estimator: Any, path: Any) -> None:
    """Save a fitted estimator or Pipeline (nested estimators included); read it back with `offrl.load(path)`."""
    from offrl.serialization import save as save_model

    save_model(estimator, path)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"offrl.{name}")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'offrl' has no attribute {name!r}")
