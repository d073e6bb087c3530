"""Model files: JSON config plus tensors, read with `torch.load(weights_only=True)`.

A file holds only plain containers, strings, numbers and tensors, so opening
one never runs code.  The estimator class is named by its import path and
must live inside the `offrl` package and be an offrl estimator, so a file
cannot make `load` import anything else.
"""

from __future__ import annotations

import importlib
import io
import json
import os
from typing import Any

import torch

from offrl.datasets.core import atomic_write_path

__all__ = ["MODEL_FORMAT", "MODEL_FORMAT_VERSION", "save_model", "load_model", "model_payload", "restore_model"]

MODEL_FORMAT = "offrl-model"
MODEL_FORMAT_VERSION = 1


def _json(value: Any) -> str:
    def default(v: Any) -> Any:
        if hasattr(v, "tolist"):
            return v.tolist()
        if isinstance(v, (set, frozenset)):
            return sorted(v)
        raise TypeError(f"{type(v).__name__} value {v!r} cannot be stored in a model file; use plain numbers/strings")

    return json.dumps(value, default=default)


def model_payload(estimator: Any, include_optimizers: bool = False) -> dict[str, Any]:
    """Everything needed to rebuild a fitted estimator, as weights-only-loadable data."""
    import offrl

    cls = type(estimator)
    params = estimator.get_params(deep=False)
    state = {name: obj.state_dict() for name, obj in estimator._state_objects(include_optimizers).items()}
    return {
        "format": MODEL_FORMAT,
        "format_version": MODEL_FORMAT_VERSION,
        "offrl_version": offrl.__version__,
        "class": f"{cls.__module__}:{cls.__qualname__}",
        "params": _json(params),
        "spec": _json(estimator.spec_),
        "attributes": _json(estimator._fitted_attributes()),
        "state": state,
    }


def save_model(estimator: Any, path: str | os.PathLike, include_optimizers: bool = False) -> None:
    """Write `estimator` atomically to `path`."""
    payload = model_payload(estimator, include_optimizers)
    with atomic_write_path(path) as tmp:
        torch.save(payload, tmp)


def _resolve_class(name: str) -> type:
    from offrl.algos.base import BaseEstimator

    module_name, _, qualname = name.partition(":")
    if not (module_name == "offrl" or module_name.startswith("offrl.")) or not qualname.isidentifier():
        raise ValueError(f"model file names class {name!r}, which is not an offrl estimator; refusing to load it")
    cls = getattr(importlib.import_module(module_name), qualname, None)
    if not (isinstance(cls, type) and issubclass(cls, BaseEstimator)):
        raise ValueError(f"model file names {name!r}, which is not an offrl estimator class")
    return cls


def restore_model(payload: dict[str, Any], device: str = "auto", source: str = "<payload>") -> Any:
    """Rebuild an estimator from `model_payload` output."""
    if not isinstance(payload, dict) or payload.get("format") != MODEL_FORMAT:
        raise ValueError(f"{source} is not an offrl model file; save models with estimator.save(path)")
    if payload.get("format_version") != MODEL_FORMAT_VERSION:
        raise ValueError(
            f"{source} has model format {payload.get('format_version')} (offrl {payload.get('offrl_version')}); "
            f"this offrl reads format {MODEL_FORMAT_VERSION}. Load it with a matching offrl version and re-save it"
        )
    cls = _resolve_class(payload["class"])
    params = json.loads(payload["params"])
    if device != "auto" or "device" in params:
        params["device"] = device if device != "auto" else params.get("device", "auto")
    params = {k: tuple(v) if isinstance(v, list) and k.endswith("_dims") else v for k, v in params.items()}
    estimator = cls(**params)
    estimator._restore(json.loads(payload["spec"]), payload["state"], json.loads(payload["attributes"]))
    return estimator


def load_model(path: str | os.PathLike, device: str = "auto") -> Any:
    """Load a model file written by `save_model` / `estimator.save`."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no model file at {path}; save one with estimator.save(path)")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(f"{path} could not be read as an offrl model file ({err})") from err
    return restore_model(payload, device=device, source=path)


def payload_bytes(payload: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()
