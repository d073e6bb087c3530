"""Dataset transformers: scikit-learn transformers whose input and output are Datasets.

A labeller (rewards, actions) or any other rewrite of logged data subclasses
`DatasetTransformer` and implements `_transform(dataset) -> Dataset` (and
`_fit(dataset)` when it learns something).  In a `Pipeline` ahead of an
algorithm it rewrites the training data at `fit`; at `predict` the pipeline
hands it raw observations, which `transform` passes through unchanged, so
the algorithm sees the observations the environment gives.

Fitted state (every public `*_` attribute) is saved in offrl model files
without pickles: JSON values, tuples, numpy arrays and scalars, torch
tensors, Datasets, fitted estimators, and `nn.Module`s (rebuilt by
`_build_fitted_modules` and then loaded from their state dicts).  See
`FittedStateMixin` for the protocol, which fine-tuning strategies and other
offrl objects can reuse.

This module is part of the data layer: it never imports `offrl.algos`.
Estimators held as parameters (a value function for `PotentialShaping`) are
used through their public methods only.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Mapping

import numpy as np
import sklearn.base
from sklearn.exceptions import NotFittedError
from sklearn.utils.validation import check_is_fitted

from offrl.datasets.core import Dataset

__all__ = [
    "DatasetTransformer",
    "FittedStateMixin",
    "RewardScaler",
    "PotentialShaping",
    "is_fitted_estimator",
    "clone_keeping_fitted_params",
]


def is_fitted_estimator(value: Any) -> bool:
    """True for an estimator instance (has `fit` and `get_params`) that scikit-learn considers fitted."""
    if isinstance(value, type) or not (hasattr(value, "fit") and hasattr(value, "get_params")):
        return False
    try:
        check_is_fitted(value)
    except (NotFittedError, TypeError):
        return False
    return True


def clone_keeping_fitted_params(estimator: Any) -> Any:
    """`sklearn.base.clone`, except that parameters holding a *fitted* estimator are kept as they are.

    A guide policy or a pre-trained value function passed as a parameter is
    part of the configuration, not something the outer estimator's `fit`
    learns; plain `clone` would replace it by an unfitted copy.  The clone
    shares the fitted parameter object with the original (as scikit-learn
    shares non-estimator parameters' copies), so do not fit it in place.
    Everything else is cloned exactly as scikit-learn does.  Use it as
    `__sklearn_clone__ = clone_keeping_fitted_params`.
    """
    klass = type(estimator)
    params = estimator.get_params(deep=False)
    new_params = {
        name: value if is_fitted_estimator(value) else sklearn.base.clone(value, safe=False)
        for name, value in params.items()
    }
    new = klass(**new_params)
    if hasattr(estimator, "_metadata_request"):
        new._metadata_request = sklearn.base.clone(estimator._metadata_request)
    if hasattr(estimator, "_skl_callbacks"):
        new._skl_callbacks = estimator._skl_callbacks
    set_params = new.get_params(deep=False)
    for name, value in new_params.items():
        if set_params[name] is not value:
            raise RuntimeError(
                f"cannot clone {klass.__name__}: its __init__ does not store parameter {name!r} unchanged; "
                "__init__ must only assign each argument to the attribute of the same name"
            )
    if hasattr(estimator, "_sklearn_output_config"):
        new._sklearn_output_config = copy.deepcopy(estimator._sklearn_output_config)
    return new


class FittedStateMixin:
    """The fitted-state protocol of offrl model files, for objects that are not algorithms.

    `_get_fitted_state()` returns attribute name -> value for every public
    `*_` attribute.  Values may be JSON values, tuples, numpy arrays and
    scalars, torch tensors, Datasets, estimators, or `nn.Module`s.
    `_set_fitted_state(values, module_states)` receives the decoded values
    and, for each `nn.Module` attribute, its state dict: it sets the values,
    calls `_build_fitted_modules()` (which must create those modules, e.g.
    from the dimensions just restored) and loads the state dicts.  Override
    both when the attributes alone do not describe the fitted state.
    """

    def _get_fitted_state(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k.endswith("_") and not k.startswith("_")}

    def _set_fitted_state(self, values: Mapping[str, Any], module_states: Mapping[str, Mapping[str, Any]]) -> None:
        for name, value in values.items():
            setattr(self, name, value)
        if not module_states:
            return
        self._build_fitted_modules()
        for name, state in module_states.items():
            module = getattr(self, name, None)
            if not hasattr(module, "load_state_dict"):
                raise ValueError(
                    f"the model file has module state for {type(self).__name__}.{name}, but "
                    f"{type(self).__name__}._build_fitted_modules() did not create a module called {name!r}"
                )
            module.load_state_dict(state)

    def _build_fitted_modules(self) -> None:
        """Create the `nn.Module` attributes (architecture only) before their saved weights are loaded."""
        raise NotImplementedError(
            f"{type(self).__name__} has nn.Module attributes in its fitted state; it must implement "
            "_build_fitted_modules() to create them (from its parameters and restored attributes) "
            "so that a model file can load"
        )


class DatasetTransformer(FittedStateMixin, sklearn.base.TransformerMixin, sklearn.base.BaseEstimator):
    """Base of transformers of Datasets (reward labellers, action labellers, reward rewrites).

    Subclasses implement `_transform(dataset) -> Dataset` and, when they learn
    from data, `_fit(dataset, **fit_params)` storing `*_` attributes.  Set the
    class attribute `requires_fit = False` for a transformer that can
    transform without being fitted.

    - `fit(X, y=None, **fit_params)`: `X` is a Dataset or a load spec
      (`offrl.datasets.load`); returns self.  Records `observation_dim_`, so
      transforming a dataset of another task is refused with a clear error.
    - `transform(X)`: a Dataset (or load spec) is transformed; anything else
      (raw observations at predict time in a Pipeline) is returned unchanged.
    - `fit_transform(X, y=None, **fit_params)`.

    Parameters holding a fitted estimator are kept fitted by `clone`.
    """

    requires_fit: bool = True

    # ------------------------------------------------------------------ hooks
    def _fit(self, dataset: Dataset, **fit_params: Any) -> None:
        """Learn from `dataset` (store `*_` attributes); nothing by default."""
        if fit_params:
            raise TypeError(f"{type(self).__name__}.fit got unexpected options {sorted(fit_params)}")

    def _transform(self, dataset: Dataset) -> Dataset:
        raise NotImplementedError(f"{type(self).__name__} must implement _transform(dataset) -> Dataset")

    # ------------------------------------------------------------------ scikit-learn API
    def fit(self, X: Any, y: None = None, **fit_params: Any) -> "DatasetTransformer":
        """Learn what `transform` needs from the Dataset `X` (or a load spec); `y` is unused."""
        dataset = _as_dataset(X, type(self).__name__, "fit")
        self._fit(dataset, **fit_params)
        self.observation_dim_ = int(dataset.observation_dim)
        return self

    def transform(self, X: Any) -> Any:
        """The transformed Dataset for a Dataset or load spec; any other input passes through unchanged."""
        if not isinstance(X, (Dataset, str, os.PathLike)):
            return X
        dataset = _as_dataset(X, type(self).__name__, "transform")
        if self.requires_fit and not self.__sklearn_is_fitted__():
            raise NotFittedError(
                f"This {type(self).__name__} instance is not fitted yet; call fit(dataset) before transform(dataset)"
            )
        fitted_dim = getattr(self, "observation_dim_", None)
        if fitted_dim is not None and dataset.observation_dim != fitted_dim:
            raise ValueError(
                f"{type(self).__name__} was fitted on observations of dimension {fitted_dim} but the dataset has "
                f"{dataset.observation_dim}; fit it on data of the same task"
            )
        out = self._transform(dataset)
        if not isinstance(out, Dataset):
            raise TypeError(f"{type(self).__name__}._transform must return a Dataset, got {type(out).__name__}")
        return out

    def fit_transform(self, X: Any, y: None = None, **fit_params: Any) -> Any:
        """`fit(X).transform(X)`, loading a load spec only once."""
        dataset = _as_dataset(X, type(self).__name__, "fit_transform")
        return self.fit(dataset, y, **fit_params).transform(dataset)

    def __sklearn_is_fitted__(self) -> bool:
        return not self.requires_fit or hasattr(self, "observation_dim_")

    def __sklearn_tags__(self) -> Any:
        tags = super().__sklearn_tags__()
        tags.requires_fit = bool(self.requires_fit)
        return tags

    __sklearn_clone__ = clone_keeping_fitted_params

    # ------------------------------------------------------------------ helpers for subclasses
    def _record(self, dataset: Dataset, **info: Any) -> Dataset:
        """Append {"transformer": class name, **info} to `dataset.metadata["transforms"]` and return `dataset`.

        Call it on the new Dataset `_transform` returns (every Dataset owns a copy of its metadata dict), so the
        input's metadata is untouched; `info` must be JSON values, as `Dataset.save` writes metadata as JSON.
        """
        entry = {"transformer": type(self).__name__, **info}
        dataset.metadata["transforms"] = list(dataset.metadata.get("transforms", [])) + [entry]
        return dataset


def _as_dataset(X: Any, owner: str, method: str) -> Dataset:
    if isinstance(X, Dataset):
        return X
    if isinstance(X, (str, os.PathLike)):
        from offrl.datasets import load

        return load(X)
    raise TypeError(f"{owner}.{method} needs an offrl Dataset or a dataset load spec, got {type(X).__name__}")


class RewardScaler(DatasetTransformer):
    """Rewards rescaled by a factor fitted on the training data: `rewards * scale_ + shift`.

    `method` picks the statistic that becomes `target` after scaling:
    - "return_range": max minus min episode return (IQL's locomotion scaling
      uses target=1000);
    - "std": the standard deviation of the rewards;
    - "max_abs": the largest absolute reward;
    - "none": no scaling (scale_ = 1, only `shift` is added; AntMaze's -1).

    The fitted `scale_` is fixed at `fit`, so the same factor applies to any
    dataset transformed later and travels with the model file.
    """

    METHODS = ("return_range", "std", "max_abs", "none")

    def __init__(self, method: str = "std", target: float = 1.0, shift: float = 0.0) -> None:
        self.method = method
        self.target = target
        self.shift = shift

    def _fit(self, dataset: Dataset, **fit_params: Any) -> None:
        super()._fit(dataset, **fit_params)
        dataset.require_labels("rewards", context="RewardScaler")
        if self.method not in self.METHODS:
            raise ValueError(f"method must be one of {self.METHODS}, got {self.method!r}")
        if not isinstance(self.target, (int, float, np.number)) or not np.isfinite(self.target) or self.target <= 0:
            raise ValueError(f"target must be a positive number, got {self.target!r}")
        if self.method == "none":
            statistic = 1.0
        elif self.method == "return_range":
            returns = dataset.episode_returns()
            statistic = float(returns.max() - returns.min())
        elif self.method == "std":
            statistic = float(dataset.rewards.std())
        else:
            statistic = float(np.abs(dataset.rewards).max())
        if self.method != "none" and not statistic > 0:
            raise ValueError(
                f"RewardScaler(method={self.method!r}) cannot scale: the dataset's statistic is {statistic} "
                "(constant rewards or returns); use method='none' or another method"
            )
        self.scale_ = np.float32(1.0 if self.method == "none" else float(self.target) / statistic)

    def _transform(self, dataset: Dataset) -> Dataset:
        dataset.require_labels("rewards", context="RewardScaler")
        rewards = dataset.rewards * self.scale_ + np.float32(self.shift)
        return self._record(dataset.with_rewards(rewards), scale=float(self.scale_), shift=float(self.shift))


class PotentialShaping(DatasetTransformer):
    """Potential-based reward shaping with a fitted estimator's values (Ng et al., 1999).

    `r' = r + scale * (gamma * (1 - terminal) * phi(s') - phi(s))` with
    `phi(s) = potential.predict_value(s, potential.predict(s))`, the value of
    the potential estimator's own deterministic action.  Shaping of this form
    keeps the optimal policy of the MDP, while a good potential (the critic
    of a policy trained on related data) makes rewards denser.

    `potential` must already be fitted: it is a parameter, so `fit` does not
    train it, `clone` keeps it fitted, and a model file saves it with the
    pipeline.  Values are in the units its critic was trained in; `scale`
    converts them.
    """

    requires_fit = False

    def __init__(self, potential: Any = None, gamma: float = 0.99, scale: float = 1.0,
                 batch_size: int = 65536) -> None:
        self.potential = potential
        self.gamma = gamma
        self.scale = scale
        self.batch_size = batch_size

    def _phi(self, observations: np.ndarray) -> np.ndarray:
        out = np.empty(len(observations), np.float32)
        for start in range(0, len(observations), int(self.batch_size)):
            obs = observations[start:start + int(self.batch_size)]
            value = self.potential.predict_value(obs, self.potential.predict(obs))
            out[start:start + len(obs)] = np.asarray(value, np.float32).reshape(len(obs))
        return out

    def _transform(self, dataset: Dataset) -> Dataset:
        potential = self.potential
        if potential is None or not (hasattr(potential, "predict") and hasattr(potential, "predict_value")):
            raise TypeError(
                f"potential must be a fitted estimator with predict and predict_value (e.g. a fitted IQL), "
                f"got {type(potential).__name__}"
            )
        if not is_fitted_estimator(potential):
            raise NotFittedError(f"potential ({type(potential).__name__}) is not fitted; fit it before shaping with it")
        if not (0.0 <= float(self.gamma) <= 1.0):
            raise ValueError(f"gamma must lie in [0, 1], got {self.gamma!r}")
        if int(self.batch_size) < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size!r}")
        dataset.require_labels("rewards", context="PotentialShaping")
        phi = self._phi(dataset.observations)
        phi_next = self._phi(dataset.next_observations)
        shaping = np.float32(self.gamma) * (1.0 - dataset.terminals) * phi_next - phi
        rewards = dataset.rewards + np.float32(self.scale) * shaping
        return self._record(dataset.with_rewards(rewards.astype(np.float32)), potential=type(potential).__name__,
                            gamma=float(self.gamma), scale=float(self.scale))
