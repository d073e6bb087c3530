"""offrl: offline reinforcement learning and off-policy evaluation with a scikit-learn-style API."""

from __future__ import annotations

import importlib
from typing import Any

from offrl.datasets.core import Dataset

__version__ = "0.1.0"
__all__ = ["Dataset", "load", "algos", "datasets", "__version__"]

_SUBMODULES = ("algos", "datasets", "nn", "ope", "reward_labeling", "online")


def load(path: Any, device: str = "auto") -> Any:
    """Load a model saved with `estimator.save(path)` (JSON config + tensors, never unpickled code)."""
    from offrl.serialization import load_model

    return load_model(path, device=device)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"offrl.{name}")
    raise AttributeError(f"module 'offrl' has no attribute {name!r}")
