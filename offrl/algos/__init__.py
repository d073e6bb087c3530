"""Algorithms, one file per family; imported on first use so `import offrl` stays light."""

from __future__ import annotations

import importlib
from typing import Any

_ALGORITHMS = {
    "BC": "offrl.algos.bc",
    "TD3PlusBC": "offrl.algos.td3_bc",
    "IQL": "offrl.algos.iql",
    "CQL": "offrl.algos.cql",
    "CalQL": "offrl.algos.cql",
    "SAC": "offrl.algos.sac",
    "DiffusionQL": "offrl.algos.diffusion_ql",
    "EDP": "offrl.algos.diffusion_ql",
    "FQL": "offrl.algos.flow_ql",
    "OFQL": "offrl.algos.flow_ql",
    "XQL": "offrl.algos.dual",
    "FDVL": "offrl.algos.dual",
    "ReCOIL": "offrl.algos.dual",
    "Guide": "offrl.algos.guide",
    "RvS": "offrl.algos.rcsl",
    "DecisionTransformer": "offrl.algos.rcsl",
    "MBRCSL": "offrl.algos.mbrcsl",
    "OfflineAlgorithm": "offrl.algos.base",
    "BaseEstimator": "offrl.algos.base",
}

__all__ = sorted(_ALGORITHMS)


def __getattr__(name: str) -> Any:
    if name in _ALGORITHMS:
        return getattr(importlib.import_module(_ALGORITHMS[name]), name)
    raise AttributeError(f"module 'offrl.algos' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
