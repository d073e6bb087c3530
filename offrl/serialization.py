"""Model files: JSON config plus tensors, read with `torch.load(weights_only=True)`.

A file holds only plain containers, strings, numbers and tensors, so opening
one never runs code.  Classes are named by import path, and `load` accepts
only offrl estimators and transformers (classes defined inside the `offrl`
package that are algorithms, implement the fitted-state protocol of
`offrl.datasets.transformers.FittedStateMixin`, or are offrl's `Pipeline`)
and scikit-learn's `Pipeline`; a file naming anything else is refused before
anything is imported from it.

Format version 2 (this one) nests estimators: a parameter or fitted
attribute may hold another estimator, fitted or not (a guide policy, the
steps of a Pipeline), saved recursively.  What a parameter (or a fitted
attribute) may hold:

- None, bool, int, float, str; lists; tuples (restored as tuples); dicts
  with string keys;
- numpy arrays and scalars, torch tensors (restored exactly, on the CPU);
- offrl `Dataset`s (stored in full, e.g. expert demonstrations);
- estimators of the allowed classes, recursively (one object referenced
  twice is saved once and restored as one object);
- for fitted attributes of the fitted-state protocol also `nn.Module`s
  (saved as state dicts, rebuilt by the owner's `_build_fitted_modules`).

Anything else (functions, environments, random generators, classes from
outside offrl) is refused at save time with an error naming the parameter.

Layout: the root estimator's entries sit at the top level next to
`format`, `format_version` and `offrl_version`; nested estimators are in
`nested` (ref -> entry) and arrays in `tensors` (ref -> tensor).  An entry is
`class`, `params` (JSON; nested values as {"__offrl__": kind, ...} markers)
and its fitted state: `spec`, `attributes` (JSON) and `state` (state dicts)
for algorithms, `fitted` ({"values": JSON, "modules": state dicts}) for the
fitted-state protocol; Pipelines keep their fitted steps in `params`.
Format 1 files (single estimators, offrl 0.1 before nesting) still load.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import tempfile
import zipfile
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from offrl.datasets.core import Dataset, atomic_write_path

__all__ = [
    "MODEL_FORMAT",
    "MODEL_FORMAT_VERSION",
    "READABLE_FORMAT_VERSIONS",
    "save",
    "save_model",
    "load_model",
    "model_payload",
    "restore_model",
    "restore_state",
]

MODEL_FORMAT = "offrl-model"
MODEL_FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)

_TAG = "__offrl__"
_SKLEARN_PIPELINE = "sklearn.pipeline:Pipeline"


def _json(value: Any) -> str:
    def default(v: Any) -> Any:
        if hasattr(v, "tolist"):
            return v.tolist()
        if isinstance(v, (set, frozenset)):
            return sorted(v)
        raise TypeError(f"{type(v).__name__} value {v!r} cannot be stored in a model file; use plain numbers/strings")

    return json.dumps(value, default=default)


# ---------------------------------------------------------------------- which classes a file may name
def _is_algorithm(cls: type) -> bool:
    from offrl.algos.base import BaseEstimator

    return isinstance(cls, type) and issubclass(cls, BaseEstimator)


def _is_allowed_class(cls: Any) -> bool:
    """offrl estimators/transformers defined inside offrl, offrl's Pipeline, and scikit-learn's Pipeline."""
    import sklearn.base
    import sklearn.pipeline

    from offrl.datasets.transformers import FittedStateMixin

    if cls is sklearn.pipeline.Pipeline:
        return True
    if not (isinstance(cls, type) and issubclass(cls, sklearn.base.BaseEstimator)):
        return False
    module = getattr(cls, "__module__", "") or ""
    if not (module == "offrl" or module.startswith("offrl.")):
        return False
    return _is_algorithm(cls) or issubclass(cls, (FittedStateMixin, sklearn.pipeline.Pipeline))


def _class_name(cls: type, where: str) -> str:
    name = f"{cls.__module__}:{cls.__qualname__}"
    if not (_is_allowed_class(cls) and cls.__qualname__.isidentifier()):
        raise TypeError(
            f"{where} is a {cls.__module__}.{cls.__qualname__}, which a model file cannot hold: model files name only "
            "offrl estimators and transformers (classes defined inside the offrl package) and scikit-learn's "
            "Pipeline, so that loading one never imports other code. Move the class into offrl "
            "(subclass offrl.datasets.transformers.DatasetTransformer for a dataset transformer) "
            "or save its parts separately"
        )
    return name


def _resolve_class(name: Any, where: str = "the model file") -> type:
    """The class a file names, refusing anything outside the allow-list before importing it."""
    import sklearn.pipeline

    refusal = (f"{where} names class {name!r}, which is not an offrl estimator or transformer nor scikit-learn's "
               "Pipeline; refusing to load it (model files may only name those classes)")
    if name == _SKLEARN_PIPELINE:
        return sklearn.pipeline.Pipeline
    if not isinstance(name, str):
        raise ValueError(refusal)
    module_name, sep, qualname = name.partition(":")
    parts = module_name.split(".")
    if (not sep or parts[0] != "offrl" or not qualname.isidentifier() or qualname.startswith("_")
            or not all(p.isidentifier() and not p.startswith("_") for p in parts)):
        raise ValueError(refusal)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{where} names class {name!r}, but this offrl has no module {module_name} ({err}); "
                         "load it with the offrl version that wrote it") from err
    cls = getattr(module, qualname, None)
    if not _is_allowed_class(cls):
        raise ValueError(refusal)
    return cls


# ---------------------------------------------------------------------- writing
class _Writer:
    """Turns estimators into entries and values into JSON-able data, collecting nested entries and tensors."""

    def __init__(self) -> None:
        self.nested: dict[str, dict[str, Any]] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        self._refs: dict[int, str] = {}
        self._alive: list[Any] = []  # keeps memoised objects alive, so their ids stay unique while writing

    def entry(self, estimator: Any, where: str, include_optimizers: bool = False) -> dict[str, Any]:
        cls = type(estimator)
        entry: dict[str, Any] = {"class": _class_name(cls, where)}
        params = estimator.get_params(deep=False)
        entry["params"] = json.dumps({k: self.value(v, f"{where}.{k}") for k, v in params.items()})
        if _is_algorithm(cls):
            if hasattr(estimator, "spec_"):
                entry["spec"] = _json(estimator.spec_)
                entry["attributes"] = _json(estimator._fitted_attributes())
                entry["state"] = {name: obj.state_dict()
                                  for name, obj in estimator._state_objects(include_optimizers).items()}
        elif hasattr(estimator, "_get_fitted_state"):
            values, modules = {}, {}
            for name, value in estimator._get_fitted_state().items():
                if isinstance(value, nn.Module):
                    modules[name] = value.state_dict()
                else:
                    values[name] = self.value(value, f"{where}.{name}")
            entry["fitted"] = {"values": json.dumps(values), "modules": modules}
        return entry

    def _ref(self, value: Any, prefix: str) -> tuple[str, bool]:
        """(ref, new) for an object stored once however often it is referenced."""
        key = id(value)
        if key in self._refs:
            return self._refs[key], False
        ref = f"{prefix}{len(self._refs)}"
        self._refs[key] = ref
        self._alive.append(value)
        return ref, True

    def _tensor(self, tensor: torch.Tensor) -> str:
        ref = f"t{len(self.tensors)}"
        self.tensors[ref] = tensor
        return ref

    def value(self, value: Any, where: str) -> Any:
        if value is None or type(value) in (bool, int, float, str):
            return value
        if isinstance(value, str):  # str subclasses (np.str_) are stored as plain strings
            return str(value)
        if type(value) is list:
            return [self.value(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if type(value) is tuple:
            return {_TAG: "tuple", "items": [self.value(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if type(value) is dict:
            out = {}
            for k, v in value.items():
                if not isinstance(k, str) or k == _TAG:
                    raise TypeError(f"{where} has a dict key {k!r}; dicts in model files need string keys "
                                    f"other than {_TAG!r}")
                out[k] = self.value(v, f"{where}[{k!r}]")
            return out
        if isinstance(value, (np.ndarray, np.generic)):
            array = np.asarray(value)
            try:
                tensor = torch.from_numpy(np.array(array, order="C", copy=True))
            except TypeError as err:
                raise TypeError(f"{where} is a numpy {array.dtype} array, which a model file cannot hold ({err}); "
                                "use a numeric or boolean dtype") from err
            marker = {_TAG: "ndarray", "ref": self._tensor(tensor)}
            if isinstance(value, np.generic):
                marker["scalar"] = True
            return marker
        if isinstance(value, torch.Tensor):
            return {_TAG: "tensor", "ref": self._tensor(value.detach().to("cpu", copy=True))}
        if isinstance(value, Dataset):
            ref, new = self._ref(value, "d")
            if new:
                self.tensors[ref] = _dataset_bytes(value)
            return {_TAG: "dataset", "ref": ref}
        if isinstance(value, nn.Module):
            raise TypeError(
                f"{where} is an nn.Module ({type(value).__name__}); a model file keeps modules only as their own "
                "fitted `*_` attributes (rebuilt by _build_fitted_modules), not as parameters or inside containers"
            )
        if hasattr(value, "get_params") and hasattr(value, "fit") and not isinstance(value, type):
            ref, new = self._ref(value, "e")
            if new:
                self.nested[ref] = {}  # reserve the ref before recursing
                self.nested[ref] = self.entry(value, where)
            return {_TAG: "estimator", "ref": ref}
        raise TypeError(
            f"{where} holds a {type(value).__module__}.{type(value).__qualname__}, which a model file cannot store. "
            "Parameters and fitted attributes may hold None, bool, int, float, str, lists, tuples, dicts with string "
            "keys, numpy arrays and scalars, torch tensors, offrl Datasets and offrl estimators (saved recursively); "
            "pass a plain value (e.g. a dataset load spec or a seed) instead"
        )


def _dataset_bytes(dataset: Dataset) -> torch.Tensor:
    """`Dataset.save`'s .npz (no pickles) as a uint8 tensor, so every column and the metadata travel."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "dataset.npz")
        dataset.save(path)
        with open(path, "rb") as f:
            data = bytearray(f.read())
    return torch.frombuffer(data, dtype=torch.uint8).clone()


def _dataset_from_bytes(tensor: torch.Tensor) -> Dataset:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "dataset.npz")
        with open(path, "wb") as f:
            f.write(tensor.numpy().tobytes())
        return Dataset.load(path)


def model_payload(estimator: Any, include_optimizers: bool = False) -> dict[str, Any]:
    """Everything needed to rebuild an estimator and every estimator nested in it, as weights-only-loadable data.

    `include_optimizers` adds the root algorithm's optimiser states (checkpoints).
    """
    import offrl

    writer = _Writer()
    root = writer.entry(estimator, type(estimator).__name__, include_optimizers)
    return {
        "format": MODEL_FORMAT,
        "format_version": MODEL_FORMAT_VERSION,
        "offrl_version": offrl.__version__,
        **root,
        "nested": writer.nested,
        "tensors": writer.tensors,
    }


def save_model(estimator: Any, path: str | os.PathLike, include_optimizers: bool = False) -> None:
    """Write `estimator` atomically to `path` (nothing half written is ever visible there)."""
    payload = model_payload(estimator, include_optimizers)
    with atomic_write_path(path) as tmp:
        torch.save(payload, tmp)


def save(estimator: Any, path: str | os.PathLike) -> None:
    """Save a fitted estimator or Pipeline to `path`; read it back with `offrl.load(path)`."""
    from sklearn.exceptions import NotFittedError
    from sklearn.utils.validation import check_is_fitted

    try:
        check_is_fitted(estimator)
    except NotFittedError as err:
        raise NotFittedError(f"This {type(estimator).__name__} instance is not fitted yet; fit it before saving "
                             "it") from err
    except TypeError as err:
        raise TypeError(f"offrl.save needs an estimator or a Pipeline, got {type(estimator).__name__}") from err
    save_model(estimator, path)


# ---------------------------------------------------------------------- reading
MODEL_FIX = "the file is damaged or was written by another offrl version: re-save the model (or load it with the " \
            "offrl version that wrote it)"
# What restoring a damaged entry raises from inside torch, json or an estimator's _build.
_RESTORE_ERRORS = (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError)


def _damaged(source: str, where: str, problem: str, fix: str = MODEL_FIX) -> ValueError:
    return ValueError(f"{source}: {where}: {problem}; {fix}")


def _a(value: Any) -> str:
    """'an int', 'a list': the type of `value` with its article."""
    name = type(value).__name__
    return ("an " if name[:1] in "aeiou" else "a ") + name


def _describe(err: BaseException) -> str:
    if isinstance(err, KeyError):
        return f"missing entry {err.args[0]!r}" if err.args else "a missing entry"
    return f"{type(err).__name__}: {err}"


def _json_field(entry: Mapping[str, Any], key: str, kind: type, source: str, where: str, fix: str = MODEL_FIX) -> Any:
    """`entry[key]` decoded from JSON text, or a ValueError naming the file, the entry and the field."""
    if key not in entry:
        raise _damaged(source, where, f"the entry has no {key!r}", fix)
    text = entry[key]
    if not isinstance(text, str):
        raise _damaged(source, where, f"{key!r} is {_a(text)}, not JSON text", fix)
    try:
        value = json.loads(text)
    except ValueError as err:
        raise _damaged(source, where, f"{key!r} is not valid JSON ({err})", fix) from err
    if not isinstance(value, kind):
        raise _damaged(source, where, f"{key!r} holds {_a(value)}, not a {kind.__name__}", fix)
    return value


def _state_mismatch(estimator: Any, state: Mapping[str, Any]) -> str | None:
    """The first saved tensor that does not fit the estimator as its spec builds it (None if all fit)."""
    objects = estimator._state_objects(include_optimizers=True)
    for name, saved in state.items():
        if name not in objects:
            return f"state holds {name!r}, which {type(estimator).__name__} does not have"
        module = objects[name]
        if not isinstance(module, nn.Module):
            continue
        expected = module.state_dict()
        missing = [k for k in expected if k not in saved]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            return f"state[{name!r}] lacks the tensor {missing[0]!r}{more}"
        for key, tensor in saved.items():
            if key not in expected:
                return f"state[{name!r}] holds {key!r}, which {type(estimator).__name__}.{name} does not have"
            if not isinstance(tensor, torch.Tensor):
                return f"state[{name!r}][{key!r}] is {_a(tensor)}, not a tensor"
            if tuple(tensor.shape) != tuple(expected[key].shape):
                return (f"state[{name!r}][{key!r}] has shape {list(tensor.shape)} where the saved spec builds "
                        f"{list(expected[key].shape)}")
    return None


def restore_state(estimator: Any, entry: Mapping[str, Any], source: str, where: str, fix: str = MODEL_FIX) -> None:
    """Load an algorithm entry's fitted state (`spec`, `state`, `attributes`) into `estimator`.

    A missing field, a value of the wrong type, a tensor missing, extra or of
    the wrong shape raises ValueError naming `source`, the entry and `fix`,
    never a KeyError or a size mismatch from inside torch.
    """
    spec = _json_field(entry, "spec", dict, source, where, fix)
    attributes = _json_field(entry, "attributes", dict, source, where, fix)
    state = entry.get("state")
    if not isinstance(state, dict):
        raise _damaged(source, where, f"'state' is {_a(state) if 'state' in entry else 'missing'}, not a mapping "
                                      "of state dicts", fix)
    for name, value in state.items():
        if not isinstance(value, Mapping):
            raise _damaged(source, where, f"state[{name!r}] is {_a(value)}, not a state dict", fix)
    if hasattr(estimator, "upgrade_state"):  # names written by older offrl versions
        state = estimator.upgrade_state(state)
    try:
        estimator._restore(spec, state, attributes)
    except _RESTORE_ERRORS as err:
        try:  # which part does not fit: the spec, or a tensor of the state?
            estimator._build_all(spec)
        except _RESTORE_ERRORS as spec_err:
            problem = f"its spec does not build a {type(estimator).__name__} ({_describe(spec_err)})"
        else:
            problem = _state_mismatch(estimator, state) or _describe(err)
        raise _damaged(source, where, problem, fix) from err


class _Reader:
    """Rebuilds entries of a format-2 payload; each nested ref is restored once."""

    def __init__(self, payload: dict[str, Any], device: str, source: str) -> None:
        self.nested = payload.get("nested", {})
        self.tensors = payload.get("tensors", {})
        for key, value in (("nested", self.nested), ("tensors", self.tensors)):
            if not isinstance(value, dict):
                raise _damaged(source, "the file", f"{key!r} is {_a(value)}, not a mapping")
        self.device = device
        self.source = source
        self._done: dict[str, Any] = {}
        self._active: set[str] = set()

    def estimator(self, entry: Any, where: str) -> Any:
        if not isinstance(entry, dict) or "class" not in entry or "params" not in entry:
            raise _damaged(self.source, where, "the entry is damaged (no class or params)")
        cls = _resolve_class(entry["class"], f"{self.source} ({where})")
        params = self.value(_json_field(entry, "params", dict, self.source, where), f"{where} parameters")
        if "device" in params and self.device != "auto":
            params["device"] = self.device
        try:
            estimator = cls(**params)
        except TypeError as err:
            raise ValueError(f"{self.source}: {cls.__name__} does not accept the saved parameters of {where} ({err}); "
                             "load it with the offrl version that wrote it") from err
        if "spec" in entry:
            if not _is_algorithm(cls):
                raise ValueError(f"{self.source}: {where} has an algorithm's state but {cls.__name__} is no algorithm")
            restore_state(estimator, entry, self.source, where)
        elif "fitted" in entry:
            if not hasattr(estimator, "_set_fitted_state"):
                raise ValueError(f"{self.source}: {where} has fitted state but {cls.__name__} cannot take it")
            fitted = entry["fitted"]
            if not isinstance(fitted, dict) or not isinstance(fitted.get("modules", {}), dict):
                raise _damaged(self.source, where, "'fitted' is not a mapping of values and module states")
            values = self.value(_json_field(fitted, "values", dict, self.source, f"{where} fitted state"),
                                f"{where} fitted state")
            try:
                estimator._set_fitted_state(values, fitted.get("modules", {}))
            except _RESTORE_ERRORS as err:
                raise _damaged(self.source, f"{where} fitted state", _describe(err)) from err
        return estimator

    def _tensor(self, ref: Any, where: str) -> torch.Tensor:
        tensor = self.tensors.get(ref) if isinstance(ref, str) else None
        if not isinstance(tensor, torch.Tensor):
            raise _damaged(self.source, where, f"it refers to tensor {ref!r}, which the file does not contain")
        return tensor

    def value(self, value: Any, where: str) -> Any:
        if isinstance(value, list):
            return [self.value(v, where) for v in value]
        if not isinstance(value, dict):
            return value
        if _TAG not in value:
            return {k: self.value(v, where) for k, v in value.items()}
        kind, ref = value[_TAG], value.get("ref")
        if kind == "tuple":
            if not isinstance(value.get("items"), list):
                raise _damaged(self.source, where, "a stored tuple has no list of items")
            return tuple(self.value(v, where) for v in value["items"])
        if kind == "ndarray":
            array = self._tensor(ref, where).numpy()
            return array[()] if value.get("scalar") else array
        if kind == "tensor":
            return self._tensor(ref, where)
        if kind == "dataset":
            if ref not in self._done:
                try:
                    self._done[ref] = _dataset_from_bytes(self._tensor(ref, where))
                except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
                    raise _damaged(self.source, where, f"its stored dataset cannot be read ({_describe(err)})") from err
            return self._done[ref]
        if kind == "estimator":
            if ref in self._done:
                return self._done[ref]
            if ref in self._active:
                raise ValueError(f"{self.source}: estimator {ref!r} contains itself; the file is damaged")
            if ref not in self.nested:
                raise _damaged(self.source, where, f"it refers to estimator {ref!r}, which the file does not contain")
            self._active.add(ref)
            try:
                self._done[ref] = self.estimator(self.nested[ref], f"{where} -> {ref}")
            finally:
                self._active.discard(ref)
            return self._done[ref]
        raise ValueError(f"{self.source}: {where} holds a value of unknown kind {kind!r}; load it with the offrl "
                         "version that wrote it")


def _restore_v1(payload: dict[str, Any], device: str, source: str) -> Any:
    """Format 1: one algorithm, params as plain JSON (lists of `*_dims` were tuples)."""
    cls = _resolve_class(payload.get("class"), source)
    if not _is_algorithm(cls):
        raise ValueError(f"format-1 model files hold algorithms only, not {payload['class']!r}")
    where = cls.__name__
    params = _json_field(payload, "params", dict, source, where)
    if device != "auto" or "device" in params:
        params["device"] = device if device != "auto" else params.get("device", "auto")
    params = {k: tuple(v) if isinstance(v, list) and k.endswith("_dims") else v for k, v in params.items()}
    try:
        estimator = cls(**params)
    except TypeError as err:
        raise ValueError(f"{source}: {cls.__name__} does not accept the saved parameters ({err}); load it with the "
                         "offrl version that wrote it") from err
    restore_state(estimator, payload, source, where)
    return estimator


def restore_model(payload: dict[str, Any], device: str = "auto", source: str = "<payload>") -> Any:
    """Rebuild an estimator (with everything nested in it) from `model_payload` output.

    `device` other than "auto" replaces the saved device of every estimator that has a `device` parameter.
    """
    if not isinstance(payload, dict) or payload.get("format") != MODEL_FORMAT:
        raise ValueError(f"{source} is not an offrl model file; save models with estimator.save(path)")
    version = payload.get("format_version")
    if version not in READABLE_FORMAT_VERSIONS:
        raise ValueError(
            f"{source} has model format {version} (offrl {payload.get('offrl_version')}); "
            f"this offrl reads formats {list(READABLE_FORMAT_VERSIONS)}. "
            "Load it with a matching offrl version and re-save it"
        )
    if version == 1:
        return _restore_v1(payload, device, source)
    root = str(payload.get("class", "?")).rpartition(":")[2]
    return _Reader(payload, device, source).estimator(payload, root)


def load_model(path: str | os.PathLike, device: str = "auto") -> Any:
    """Load a model file written by `save_model` / `estimator.save` / `offrl.save`."""
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
