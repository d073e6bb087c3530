"""What every algorithm shares: the scikit-learn estimator shell, the fit loop,
evaluation, logging, checkpoints, save/load and policy export.

An algorithm subclasses `OfflineAlgorithm` (or `BaseEstimator` for online
learners) and provides:

- `_build(spec)`: networks and optimisers as `*_` attributes, from a spec dict
  (dimensions, action bounds, ...) so that `offrl.load` can rebuild them;
- `_update(batch, step) -> dict[str, Tensor]`: one gradient step;
- `_act(obs, deterministic) -> Tensor`: actions for normalised observations;
- optionally `_value(obs, actions) -> Tensor` (critic) and `_extra_columns`.

Speed plumbing shared by every algorithm (see benchmarks/updates.py):
`make_adam` (fused kernels where available), `_autocast()` for
`precision="bf16"` (bf16 matmuls, fp32 master weights and fp32 output layers),
`_maybe_compile(fn)` for `compile=True`; the fit loop keeps the whole dataset
as tensors on the training device and touches Python floats only every
`log_every` steps.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import sklearn.base
import torch
from sklearn.exceptions import NotFittedError
from torch import nn

from offrl.datasets.core import Batch, Dataset, atomic_write_path
from offrl.datasets.samplers import TransitionSampler
from offrl.datasets.transformers import clone_keeping_fitted_params
from offrl.nn import DeterministicPolicy
from offrl.algos.params import (boolean, check_params, choice, compile_option, device_name, integer, layer_sizes, real,
                                seed)
from offrl.monitor import TrainingDivergedError, TrainingMonitor, read_checkpoint, write_checkpoint

__all__ = [
    "BaseEstimator",
    "OfflineAlgorithm",
    "ObservationNormalizer",
    "resolve_device",
    "TrainingDivergedError",
    "make_adam",
    "autocast",
    "PRECISIONS",
]

PRECISIONS = ("fp32", "bf16")


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but CUDA is not available; use device='cpu' or 'auto'")
    return device


def make_adam(params: Iterable[torch.Tensor], lr: float, device: torch.device | str | None = None, *,
              kernel: str = "fused", **kwargs: Any) -> torch.optim.Adam:
    """The one Adam constructor of offrl: `kernel="fused"` (one call for all parameters, where this torch
    supports it on the device, else foreach) or `kernel="foreach"`.

    SAC keeps foreach on the CPU because the recorded dataset builds used it: the two kernels agree only to
    the last bits, and a different bit changes a whole run.
    """
    params = list(params)
    device = torch.device(device) if device is not None else (params[0].device if params else torch.device("cpu"))
    if kernel not in ("fused", "foreach"):
        raise ValueError(f"kernel must be 'fused' or 'foreach', got {kernel!r}")
    if kernel == "fused":
        with contextlib.suppress(RuntimeError, TypeError, ValueError):  # older torch / unsupported device: foreach
            return torch.optim.Adam(params, lr=lr, fused=True, **kwargs)
    return torch.optim.Adam(params, lr=lr, foreach=device.type != "mps", **kwargs)


def cpu_lacks_fast_bf16() -> bool:
    """Whether torch's CPU kernels emulate bf16 here: x86 without AVX-512 (torch's capability "AVX2" or "NO AVX").

    Measured on such a CPU (an AVX2 EPYC, benchmarks/RESULTS.md): bf16 matmuls ran 1.3 GFLOP/s against 68 in
    fp32, and IQL trained 10x slower in bf16.  Other architectures are not judged.
    """
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "NO AVX")


def check_precision(owner: str, precision: str, device: torch.device) -> None:
    """Refuse an unknown `precision`; warn when bf16 would run emulated on this CPU (see `cpu_lacks_fast_bf16`).

    Called once before a training run, offline (`fit`) and online (`fit_online`) alike.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "bf16" and torch.device(device).type == "cpu" and cpu_lacks_fast_bf16():
        warnings.warn(f"{owner}(precision='bf16') on this CPU (torch capability "
                      f"{torch.backends.cpu.get_cpu_capability()}, no AVX-512) runs emulated bf16 kernels, about "
                      "10x slower than fp32 where measured; use precision='fp32' on this machine", stacklevel=3)


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast for `precision="bf16"` (parameters and optimiser state stay fp32), nothing for "fp32"."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision != "bf16":
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


class ObservationNormalizer(nn.Module):
    """(obs - mean) / std with the statistics as buffers, so they are saved and exported with the model."""

    def __init__(self, mean: Any, std: Any) -> None:
        super().__init__()
        self.register_buffer("mean", torch.as_tensor(np.asarray(mean, np.float32)))
        self.register_buffer("std", torch.as_tensor(np.asarray(std, np.float32)))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return (obs - self.mean) / self.std


class _ExportedPolicy(nn.Module):
    def __init__(self, normalizer: nn.Module, actor: nn.Module) -> None:
        super().__init__()
        self.normalizer = normalizer
        self.actor = actor

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.actor(self.normalizer(obs))


_POSITIVE = real(0, None, closed="neither")
_FRACTION = real(0, 1, closed="right")


class BaseEstimator(sklearn.base.BaseEstimator):
    """scikit-learn estimator shell shared by offline and online algorithms.

    `_param_rules` declares every hyper-parameter's type and range
    (`offrl.algos.params`); `check_params()` applies them, at the start of
    `fit` and before a sweep runs anything.
    """

    _param_rules = {
        "hidden_dims": layer_sizes(), "lr": _POSITIVE, "actor_lr": _POSITIVE, "critic_lr": _POSITIVE,
        "value_lr": _POSITIVE, "alpha_lr": _POSITIVE, "batch_size": integer(1), "gamma": real(0, 1),
        "tau": _FRACTION, "n_steps": integer(0), "normalize_observations": boolean(), "reward_scale": real(),
        "reward_bias": real(), "reward_normalization": choice(None, "return_range", "none"),
        "precision": choice(*PRECISIONS), "compile": compile_option(), "log_every": integer(1),
        "device": device_name(), "random_state": seed(), "n_critics": integer(1),
    }

    # Set by an online fine-tuning strategy for the length of its run (`offrl.online.strategies`), never saved:
    # the size of the random critic subset whose minimum forms the TD target (REDQ / RLPD; None: all critics), and
    # whether the update keeps its offline conservative term (CQL's penalty; WSRL and E2O drop it online).
    _critic_subset: int | None = None
    _conservative: bool = True

    # State names of model files written by older offrl versions: {old module name: new}, and
    # {(module name, old tensor name): new tensor name}.  Applied when a file is loaded.
    _legacy_modules: dict[str, str] = {}
    _legacy_tensors: dict[tuple[str, str], str] = {}

    def check_params(self) -> None:
        """Raise `InvalidParameterError` naming the first hyper-parameter of the wrong type or out of range."""
        check_params(self)

    @classmethod
    def upgrade_state(cls, state: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
        """`state` (module name -> state dict) with the names older offrl versions saved renamed to today's."""
        upgraded: dict[str, dict[str, Any]] = {}
        for module, tensors in state.items():
            module = cls._legacy_modules.get(module, module)
            upgraded[module] = {cls._legacy_tensors.get((module, key), key): value for key, value in tensors.items()}
        return upgraded

    # ------------------------------------------------------------------ hooks
    def _build(self, spec: dict[str, Any]) -> None:
        raise NotImplementedError

    def _act(self, obs: torch.Tensor, deterministic: bool) -> torch.Tensor:
        raise NotImplementedError

    def _value(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        raise AttributeError(f"{type(self).__name__} has no critic, so predict_value is not available")

    def _target_min(self, critic: nn.Module, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """min_i Q_i(s, a) over the ensemble, or over a fresh random subset of `_critic_subset` members (RLPD's
        2 of 10), drawn with the global torch RNG so a seeded run repeats."""
        k = self._critic_subset
        n = int(critic.n_critics)
        if k is None or k >= n:
            return critic(obs, actions).min(0).values
        members = torch.randperm(n, device=obs.device)[:k]
        return critic(obs, actions, members=members).min(0).values

    def _actor_q(self, q: torch.Tensor) -> torch.Tensor:
        """The actor's value of its actions from q (n_critics, ...): the ensemble minimum, or its mean when the
        targets use random subsets (REDQ and RLPD: the subset minimum already keeps the estimate down)."""
        return q.min(0).values if self._critic_subset is None else q.mean(0)

    def _export_actor(self) -> nn.Module:
        """A module mapping normalised observations to deterministic actions (for TorchScript export)."""
        policy = getattr(self, "policy_", None)
        if policy is None:
            raise AttributeError(f"{type(self).__name__} has no policy_ to export")
        return _DeterministicActor(policy)

    # ------------------------------------------------------------------ shared plumbing
    @property
    def device_(self) -> torch.device:
        return resolve_device(getattr(self, "device", "cpu"))

    def _autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast when `precision="bf16"` (parameters and optimiser state stay fp32)."""
        return autocast(getattr(self, "precision", "fp32"), self.device_)

    def _maybe_compile(self, fn: Callable) -> Callable:
        """`torch.compile(fn)` when the `compile` hyper-parameter asks for it (True or a mode name), else `fn`."""
        option = getattr(self, "compile", False)
        if not option:
            return fn
        mode = None if option is True else str(option)  # e.g. "reduce-overhead" for CUDA graphs
        return torch.compile(fn, mode=mode, dynamic=False)

    def _check_fitted(self) -> None:
        if not hasattr(self, "spec_"):
            raise NotFittedError(f"This {type(self).__name__} instance is not fitted yet; call fit(dataset) first")

    def __sklearn_is_fitted__(self) -> bool:
        return hasattr(self, "spec_")

    # scikit-learn's clone would clone (and so un-fit) a nested estimator; a guide policy or an expert model
    # passed as a parameter is an input, not something to re-learn, so the clone shares it.
    __sklearn_clone__ = clone_keeping_fitted_params

    def _make_spec(self, dataset: Dataset) -> dict[str, Any]:
        if getattr(self, "normalize_observations", False):
            mean, std = dataset.observation_stats()
        else:
            mean, std = np.zeros(dataset.observation_dim, np.float32), np.ones(dataset.observation_dim, np.float32)
        spec = {
            "observation_dim": dataset.observation_dim,
            "action_dim": dataset.action_dim,
            "discrete_actions": dataset.discrete_actions,
            "action_low": None if dataset.action_low is None else dataset.action_low.tolist(),
            "action_high": None if dataset.action_high is None else dataset.action_high.tolist(),
            "obs_mean": mean.tolist(),
            "obs_std": std.tolist(),
        }
        if dataset.action_low is None and dataset.discrete_actions is None and dataset.actions is not None:
            # Unknown bounds: use the data's range, widened slightly, so tanh policies can reach every logged action.
            mask = dataset.label_mask("actions")
            labelled = dataset.actions if mask is None else dataset.actions[mask]
            low, high = labelled.min(0), labelled.max(0)
            pad = 1e-3 * np.maximum(high - low, 1.0)
            spec["action_low"], spec["action_high"] = (low - pad).tolist(), (high + pad).tolist()
        for key in ("ref_min_score", "ref_max_score", "env_id", "name"):
            if dataset.metadata.get(key) is not None:
                spec[key] = dataset.metadata[key]
        return spec

    def _build_all(self, spec: dict[str, Any]) -> None:
        self.spec_ = spec
        self.obs_normalizer_ = ObservationNormalizer(spec["obs_mean"], spec["obs_std"]).to(self.device_)
        self._build(spec)

    def _state_objects(self, include_optimizers: bool = False) -> dict[str, Any]:
        objects = {}
        for name, value in vars(self).items():
            if not name.endswith("_") or name.startswith("_"):
                continue
            if isinstance(value, nn.Module) or (include_optimizers and _is_stateful_optimizer(value)):
                objects[name] = value
        return objects

    def _fitted_attributes(self) -> dict[str, Any]:
        attributes = {k: v for k, v in vars(self).items()
                      if k.endswith("_") and not k.startswith("_") and isinstance(v, (int, float, str, bool))
                      and k != "spec_"}
        if isinstance(getattr(self, "online_strategy_", None), dict):  # the fine-tuning strategy and its state
            attributes["online_strategy_"] = self.online_strategy_
        return attributes

    def _restore(self, spec: dict[str, Any], state: Mapping[str, Any], attributes: Mapping[str, Any]) -> None:
        self._build_all(spec)
        if "online_guide_policy_" in state:  # JSRL's guide: a frozen copy of the policy at the switch to online
            self.online_guide_policy_ = copy.deepcopy(self.policy_).requires_grad_(False)
        objects = self._state_objects(include_optimizers=True)
        for name, value in state.items():
            if name not in objects:
                raise ValueError(f"model file has state for {name!r}, which {type(self).__name__} does not have")
            objects[name].load_state_dict(value)
        for name, value in attributes.items():
            setattr(self, name, value)

    def _as_obs_tensor(self, observations: Any) -> tuple[torch.Tensor, bool]:
        self._check_fitted()
        obs = np.ascontiguousarray(observations, dtype=np.float32)  # reversed or strided views too
        single = obs.ndim == 1
        if single:
            obs = obs[None]
        if obs.ndim != 2 or obs.shape[1] != self.spec_["observation_dim"]:
            raise ValueError(
                f"observations has shape {np.asarray(observations).shape}; expected "
                f"({self.spec_['observation_dim']},) or (n, {self.spec_['observation_dim']})"
            )
        return torch.as_tensor(obs, device=self.device_), single

    def _set_training_mode(self, training: bool) -> None:
        """Switch the networks between training and evaluation behaviour (dropout, batch norm).

        Networks without such layers behave the same in both modes, so the
        switch is skipped for them: walking every module twice per `predict`
        was half the cost of one decision at batch size one.
        """
        modules = self._state_objects().values()
        if any(_has_mode_dependent_layers(module) for module in modules):
            for module in modules:
                module.train(training)

    #: Keyword options `predict` passes on to `_act` (return-conditioned policies: "target_return").
    _predict_options: tuple[str, ...] = ()

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def predict(self, observations: Any, deterministic: bool = True, **options: Any) -> np.ndarray:
        """Actions for one observation (obs_dim,) or a batch (n, obs_dim).

        `options` go to the policy where it takes them (e.g. `target_return=` of RvS and DecisionTransformer);
        an option the algorithm does not take raises TypeError.
        """
        unknown = sorted(set(options) - set(self._predict_options))
        if unknown:
            takes = ", ".join(self._predict_options) or "no options"
            raise TypeError(f"{type(self).__name__}.predict got unknown option(s) {unknown}; it takes {takes}")
        obs, single = self._as_obs_tensor(observations)
        self._set_training_mode(False)
        try:
            actions = self._act(self.obs_normalizer_(obs), deterministic, **options).float().cpu().numpy()
        finally:
            self._set_training_mode(True)
        if self.spec_.get("discrete_actions") is not None:
            actions = actions.reshape(len(actions), -1)[:, 0].astype(np.int64)
        return actions[0] if single else actions

    def sample_action(self, observations: Any) -> np.ndarray:
        """Actions sampled from the (stochastic) policy."""
        return self.predict(observations, deterministic=False)

    @torch.no_grad()
    def predict_value(self, observations: Any, actions: Any) -> np.ndarray:
        """Q(s, a) from the algorithm's critic (minimum over the ensemble where there is one).

        Values are in the units the critic was trained in: offline algorithms
        train on `rewards * spec_["reward_scale"] + spec_["reward_bias"]`.
        """
        obs, single = self._as_obs_tensor(observations)
        act = torch.as_tensor(np.ascontiguousarray(actions, np.float32), device=self.device_).reshape(len(obs), -1)
        value = self._value(self.obs_normalizer_(obs), act).float().cpu().numpy()
        return value[0] if single else value

    def make_actor(self, deterministic: bool = True, **options: Any) -> Any:
        """The acting interface of roll-outs (`offrl.evaluation.Actor`): reset, act with the observation and the
        time step, observe the reward.  Stateless policies get a wrapper of `predict`; a policy that keeps
        context across steps (a transformer, a guide handing over mid-episode) overrides this.
        """
        from offrl.evaluation import FunctionActor

        self._check_fitted()
        if options:
            raise TypeError(f"{type(self).__name__}.make_actor takes no options, got {sorted(options)}")
        return FunctionActor(lambda obs: self.predict(obs, deterministic=deterministic))

    def evaluate(self, env: Any, n_episodes: int = 10, seed: int = 0, **actor_options: Any) -> dict[str, Any]:
        """Roll the deterministic policy out in `env` (an env, a gymnasium id, or a vector env).

        `actor_options` go to `make_actor` (e.g. a target return for return-conditioned policies).
        """
        from offrl.evaluation import evaluate_policy

        self._check_fitted()
        return evaluate_policy(self.make_actor(deterministic=True, **actor_options), env, n_episodes=n_episodes,
                               seed=seed, reference=self.spec_)

    def save(self, path: str | os.PathLike) -> None:
        """Write config (JSON) and tensors to `path`; read back with `offrl.load(path)`."""
        from offrl.serialization import save_model

        self._check_fitted()
        save_model(self, path)

    def export_policy(self, path: str | os.PathLike, **options: Any) -> None:
        """Write a TorchScript module mapping raw observations to deterministic actions (no offrl needed).

        `options` go to the algorithm's exporter (FQL: `policy="flow"` exports the multi-step flow).
        """
        import copy

        self._check_fitted()
        module = copy.deepcopy(_ExportedPolicy(self.obs_normalizer_, self._export_actor(**options))).to("cpu").eval()
        module.requires_grad_(False)
        example = torch.zeros(1, self.spec_["observation_dim"])
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript is what runs without offrl
            # Python branches on shapes (one candidate or many) are fixed at export by design; the module is
            # written with shape-free operations, so it takes any batch size (tests check it).
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            scripted = torch.jit.trace(module, example, check_trace=False)
        with atomic_write_path(path) as tmp:
            scripted.save(tmp)


class _DeterministicActor(nn.Module):
    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.policy(obs, deterministic=True, with_log_prob=False)[0]


_MODE_DEPENDENT = (nn.Dropout, nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


def _has_mode_dependent_layers(module: nn.Module) -> bool:
    """Whether `module` holds a layer that computes differently in train and eval mode (cached per module)."""
    cached = module.__dict__.get("_offrl_mode_dependent")
    if cached is None:
        cached = any(isinstance(m, _MODE_DEPENDENT) for m in module.modules())
        module.__dict__["_offrl_mode_dependent"] = cached
    return cached


def _is_stateful_optimizer(value: Any) -> bool:
    return isinstance(value, torch.optim.Optimizer) or isinstance(value, torch.optim.lr_scheduler.LRScheduler)


class OfflineAlgorithm(BaseEstimator):
    """Base of every offline algorithm: `fit(dataset, n_steps)` and the shared training loop.

    Shared hyper-parameters an algorithm may declare in its `__init__` (read
    with defaults, so none is required): `batch_size`, `n_steps`,
    `normalize_observations`, `reward_scale`, `reward_bias`,
    `reward_normalization` (None or "return_range": rewards times
    1000 / (max episode return - min episode return), IQL's locomotion
    scaling), `precision` ("fp32" or "bf16"), `compile`, `device`,
    `random_state`.  The reward transform is computed once from the training
    dataset and stored in `spec_`, so a saved or resumed model uses the same.
    """

    log_every: int = 100
    supports_discrete_actions: bool = False

    @classmethod
    def from_preset(cls, dataset: Any, **overrides: Any) -> "OfflineAlgorithm":
        """An instance with the per-dataset hyper-parameters from `offrl.algos.presets` (e.g. AntMaze's), plus `overrides`."""
        from offrl.algos.presets import preset_params

        params = preset_params(cls.__name__, dataset)
        params.update(overrides)
        return cls(**params)

    # ------------------------------------------------------------------ hooks
    def _update(self, batch: Batch, step: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _reward_affine(self, dataset: Dataset) -> tuple[float, float]:
        """(scale, bias) with which the algorithm trains on `rewards * scale + bias`."""
        scale = float(getattr(self, "reward_scale", 1.0))
        bias = float(getattr(self, "reward_bias", 0.0))
        normalization = getattr(self, "reward_normalization", None)
        if normalization == "return_range":
            returns = dataset.episode_returns()
            span = float(returns.max() - returns.min())
            if span > 0:
                scale *= 1000.0 / span
        elif normalization not in (None, "none"):
            raise ValueError(f"reward_normalization must be None or 'return_range', got {normalization!r}")
        return scale, bias

    def _make_spec(self, dataset: Dataset) -> dict[str, Any]:
        spec = super()._make_spec(dataset)
        spec["reward_scale"], spec["reward_bias"] = self._reward_affine(dataset)
        return spec

    def _transform_rewards(self, dataset: Dataset) -> np.ndarray:
        """Rewards as the algorithm trains on them (the paper's scaling, fixed at the first fit in `spec_`)."""
        spec = getattr(self, "spec_", None) or {}
        if "reward_scale" in spec:
            scale, bias = spec["reward_scale"], spec.get("reward_bias", 0.0)
        else:
            scale, bias = self._reward_affine(dataset)
        return dataset.rewards * np.float32(scale) + np.float32(bias)

    def _extra_columns(self, dataset: Dataset) -> dict[str, np.ndarray]:
        """Per-transition columns beyond the Dataset's (e.g. Monte-Carlo returns); none by default."""
        return {}

    def _training_columns(self, dataset: Dataset) -> dict[str, torch.Tensor]:
        device = self.device_
        normalizer = self.obs_normalizer_
        # A label the algorithm does not need (BC's rewards) is left out when it is not complete.
        with torch.no_grad():
            columns = {
                "observations": normalizer(torch.from_numpy(dataset.observations).to(device)),
                "next_observations": normalizer(torch.from_numpy(dataset.next_observations).to(device)),
            }
            if dataset.is_labelled("actions"):
                columns["actions"] = torch.from_numpy(dataset.actions).to(device)
            if dataset.is_labelled("rewards"):
                rewards = np.ascontiguousarray(self._transform_rewards(dataset), np.float32)
                columns["rewards"] = torch.from_numpy(rewards).to(device)
            columns["terminals"] = torch.from_numpy(dataset.terminals).to(device)
            columns["timeouts"] = torch.from_numpy(dataset.timeouts).to(device)
        if dataset.behavior_log_probs is not None:
            columns["behavior_log_probs"] = torch.from_numpy(dataset.behavior_log_probs).to(device)
        for key, value in self._extra_columns(dataset).items():
            columns[key] = torch.from_numpy(np.ascontiguousarray(value, np.float32)).to(device)
        return columns

    # ------------------------------------------------------------------ fit
    def fit(
        self,
        dataset: Dataset | str,
        y: None = None,
        *,
        n_steps: int | None = None,
        eval_env: Any = None,
        eval_every: int | None = None,
        eval_episodes: int = 10,
        callbacks: Iterable[Callable[[Any, int, dict[str, float]], Any]] = (),
        log_dir: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
        resume: bool = False,
        progress: bool = True,
        log_every: int | None = None,
    ) -> "OfflineAlgorithm":
        """Train for `n_steps` gradient steps (default: the `n_steps` hyper-parameter) and return self.

        `y` is unused: it is there so that scikit-learn's `Pipeline` can fit a
        dataset transformer (a labeller) followed by the algorithm, with fit
        options passed as `Pipeline.fit(ds, iql__n_steps=...)`.

        Losses are logged every `log_every` steps (default: the estimator's
        `log_every`, 100) to the progress bar, `log_dir`/train.csv and
        TensorBoard when installed; between log steps nothing leaves the
        device.  `eval_env` is evaluated every `eval_every` steps
        (`log_dir`/eval.csv; return and normalised score).  With
        `checkpoint_every` a checkpoint is written atomically to
        `log_dir`/checkpoint.pt, and `resume=True` continues from it to the
        same result as an uninterrupted run (`resumed_from_step_` says from
        which step; 0 when it started fresh).  A NaN or inf loss raises
        `TrainingDivergedError` naming the loss and step, before any later
        checkpoint is written.  Callbacks are called as
        `callback(algo, step, metrics)` at each log step, after that step's
        evaluation and checkpoint; returning `False` stops training.  On CPU,
        the same `random_state` (and number of torch threads) repeats a run
        bit for bit.
        """

        from offrl.datasets import load as load_dataset

        self.check_params()

        if isinstance(dataset, (str, os.PathLike)):
            dataset = load_dataset(dataset)
        if not isinstance(dataset, Dataset):
            raise TypeError(f"dataset must be an offrl Dataset or a load spec, got {type(dataset).__name__}")
        n_steps = int(self.n_steps if n_steps is None else n_steps)
        if n_steps < 0:
            raise ValueError(f"n_steps must be non-negative, got {n_steps}")
        log_every = int(log_every if log_every is not None else getattr(self, "log_every", 100))
        if log_every < 1:
            raise ValueError(f"log_every must be at least 1, got {log_every}")
        if checkpoint_every is not None and int(checkpoint_every) < 1:
            raise ValueError(f"checkpoint_every must be a positive number of steps, got {checkpoint_every}")
        if (checkpoint_every or resume) and log_dir is None:
            raise ValueError("checkpoint_every and resume need a log_dir to keep the checkpoint in")
        log_path = None if log_dir is None else Path(log_dir)
        if log_path is not None:
            log_path.mkdir(parents=True, exist_ok=True)
        checkpoint_path = None if log_path is None else log_path / "checkpoint.pt"
        device = self.device_
        check_precision(type(self).__name__, getattr(self, "precision", "fp32"), device)
        if dataset.discrete_actions is not None and not self.supports_discrete_actions:
            raise ValueError(
                f"{type(self).__name__} needs continuous actions but the dataset has a discrete action space "
                f"({dataset.discrete_actions} actions); use a discrete-action method such as BC"
            )

        self._check_labels(dataset)

        # The length of this run, for schedules built in `_build` (IQL's cosine actor LR).
        self._fit_n_steps = n_steps
        generator = torch.Generator(device=device)
        start = 0
        if resume and checkpoint_path is not None and checkpoint_path.exists():
            checkpoint = read_checkpoint(checkpoint_path, self, generator)
            start = self.n_steps_done_ = int(checkpoint["step"])
            self.history_ = list(checkpoint["history"])
            if (self.spec_["observation_dim"], self.spec_["action_dim"]) != (dataset.observation_dim, dataset.action_dim):
                raise ValueError(
                    f"checkpoint {checkpoint_path} was trained on observation/action dims "
                    f"{(self.spec_['observation_dim'], self.spec_['action_dim'])} but the dataset has "
                    f"{(dataset.observation_dim, dataset.action_dim)}; resume on the same dataset or use a new log_dir"
                )
        else:
            seed = _seed_from(getattr(self, "random_state", None))
            torch.manual_seed(seed)
            generator.manual_seed(seed)
            self._build_all(self._make_spec(dataset))
            self.n_steps_done_ = 0
            self.history_ = []
        self.resumed_from_step_ = start
        sampler = self._make_sampler(dataset)
        monitor = TrainingMonitor(self, n_steps, start=start, log_every=log_every, eval_env=eval_env,
                                  eval_every=eval_every, eval_episodes=eval_episodes, callbacks=callbacks,
                                  callbacks_on="log", log_dir=log_path, resume=resume, progress=progress,
                                  checkpoint_path=checkpoint_path)
        self._set_training_mode(True)
        latest: dict[str, torch.Tensor] = {}
        update = self._update
        try:
            for step in range(start, n_steps):
                latest = update(sampler.sample(generator), step)
                done = step + 1
                is_checkpoint = bool(checkpoint_path is not None and checkpoint_every
                                     and (done % checkpoint_every == 0 or done == n_steps))
                if not (is_checkpoint or monitor.needs_host(done)):
                    continue
                self.n_steps_done_ = done

                def checkpoint(done: int = done) -> None:
                    if is_checkpoint:
                        if monitor.last_checked != done:  # never checkpoint a diverged state
                            monitor.finite(latest, done)
                        write_checkpoint(checkpoint_path, self, generator, done)

                if not monitor.after_step(done, latest, before_callbacks=checkpoint):
                    break
        finally:
            monitor.close()
        self.last_metrics_ = {k: float(v) for k, v in latest.items()}
        return self

    # ------------------------------------------------------------------ online fine-tuning
    def fit_online(
        self,
        env: Any,
        n_steps: int,
        *,
        strategy: Any = "naive",
        offline_dataset: Dataset | str | None = None,
        n_envs: int = 1,
        buffer_size: int = 1_000_000,
        exploration_noise: float = 0.1,
        eval_env: Any = None,
        eval_every: int | None = None,
        eval_episodes: int = 10,
        callbacks: Iterable[Callable[[Any, int, dict[str, float]], Any]] = (),
        log_dir: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
        resume: bool = False,
        progress: bool = True,
        log_every: int | None = None,
    ) -> "OfflineAlgorithm":
        """Continue a fitted algorithm online for `n_steps` environment steps; return self.

        The networks, optimisers and training-unit transforms (observation
        normalisation, reward scale) are the offline ones, and the update is
        the offline `_update` on replay batches.  `strategy` is a recipe of
        `offrl.online.strategies`: "naive" (no warm-up, one update per step;
        with `offline_dataset` the replay buffer starts with that data),
        "wsrl", "rlpd", "calql", "jsrl", "e2o", a {name: params} mapping or
        an `OnlineStrategy` instance; `offline_dataset` is the data the
        recipes that sample it (RLPD, Cal-QL) draw from.  The strategy's
        description and state end in `online_strategy_` (saved with the
        model), JSRL's guide in `online_guide_policy_`.  Stochastic policies explore by sampling,
        deterministic ones (TD3+BC) by Gaussian noise of `exploration_noise`
        times the action range's half-width.  Counters and evaluation rows go
        to `online_steps_done_`, `online_history_` etc., so the offline
        `history_` stays as it was.  `log_dir` gets train.csv, eval.csv and
        (with `checkpoint_every`) checkpoint.pt; `resume=True` continues an
        interrupted run exactly.
        """
        from offrl.datasets import load as load_dataset

        self.check_params()
        from offrl.online.loop import FINE_TUNING_NAMES, make_envs, run_online
        from offrl.online.strategies import resolve_strategy

        self._check_fitted()
        check_precision(type(self).__name__, getattr(self, "precision", "fp32"), self.device_)
        if not (self.has_critic and isinstance(getattr(self, "policy_", None), nn.Module)):
            raise ValueError(f"{type(self).__name__} has no policy and critic to continue online; fine-tune an "
                             "algorithm with both (TD3PlusBC, IQL, CQL, CalQL)")
        strategy = resolve_strategy(strategy)
        if isinstance(offline_dataset, (str, os.PathLike)):
            offline_dataset = load_dataset(offline_dataset)
        if offline_dataset is not None:
            self._check_labels(offline_dataset)
        if float(exploration_noise) < 0:
            raise ValueError(f"exploration_noise must be non-negative, got {exploration_noise}")
        self._exploration_noise = float(exploration_noise)
        log_every = int(log_every if log_every is not None else getattr(self, "log_every", 100))
        if (checkpoint_every or resume) and log_dir is None:
            raise ValueError("checkpoint_every and resume need a log_dir to keep the checkpoint in")
        checkpoint_path = None if log_dir is None else Path(log_dir) / "online_checkpoint.pt"
        envs = make_envs(env, n_envs)
        return run_online(
            self, envs, n_steps, strategy=strategy, names=FINE_TUNING_NAMES, start_fresh=lambda: None,
            batch_size=int(getattr(self, "batch_size", 256)), buffer_size=buffer_size, offline_dataset=offline_dataset,
            eval_env=eval_env, eval_every=eval_every, eval_episodes=eval_episodes, callbacks=callbacks,
            log_every=log_every, log_dir=log_dir, checkpoint_path=checkpoint_path if (checkpoint_every or resume) else None,
            checkpoint_every=checkpoint_every, resume=resume, progress=progress,
            seed=_seed_from(getattr(self, "random_state", None)) + 1, desc=f"{type(self).__name__} online")

    @property
    def has_critic(self) -> bool:
        return type(self)._value is not BaseEstimator._value

    def _online_act(self, obs: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Exploration actions for raw observations: a policy sample, or the deterministic action plus noise."""
        policy = self.policy_
        with torch.no_grad():
            obs = self.obs_normalizer_(obs)
            self._set_training_mode(False)
            try:
                if isinstance(policy, DeterministicPolicy):
                    actions = policy(obs)[0]
                    noise = torch.randn(actions.shape, generator=generator, device=actions.device, dtype=actions.dtype)
                    actions = actions + noise * self._exploration_noise * policy.action_scale
                    return policy.clamp_to_bounds(actions), torch.zeros(len(actions), device=obs.device)
                actions, log_probs = policy(obs, deterministic=False, with_log_prob=True)
                return actions, log_probs
            finally:
                self._set_training_mode(True)

    def _online_update(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The offline update on a replay batch, in the training units fixed at the offline fit."""
        spec = self.spec_
        normalizer = self.obs_normalizer_
        with torch.no_grad():
            batch.observations = normalizer(batch.observations)
            batch.next_observations = normalizer(batch.next_observations)
            batch.rewards = batch.rewards * float(spec.get("reward_scale", 1.0)) + float(spec.get("reward_bias", 0.0))
        # Step numbers continue the offline count (TD3's policy delay, schedules that ended stay ended).
        return self._update(batch, int(self.n_steps_done_) + int(self.online_updates_done_))

    def _online_extra_names(self) -> tuple[str, ...]:
        """The names of `_extra_columns` (probed on a one-step episode, so no algorithm has to list them twice)."""
        if type(self)._extra_columns is OfflineAlgorithm._extra_columns:
            return ()
        spec = self.spec_
        one = Dataset(observations=np.zeros((1, spec["observation_dim"])), actions=np.zeros((1, spec["action_dim"])),
                      rewards=np.zeros(1), terminals=np.zeros(1), timeouts=np.ones(1),
                      next_observations=np.zeros((1, spec["observation_dim"])), episode_starts=np.array([0, 1]))
        return tuple(self._extra_columns(one))

    def _online_extras(self, episode: Dataset) -> dict[str, np.ndarray]:
        return {k: np.asarray(v, np.float32) for k, v in self._extra_columns(episode).items()}

    def _make_sampler(self, dataset: Dataset) -> Any:
        """The sampler hook: what `fit` draws each batch from (`sampler.sample(generator)`).

        Default: uniform transitions of the training columns
        (`offrl.datasets.samplers.TransitionSampler`).  Algorithms that learn
        from K-step segments (Decision Transformer: `SegmentSampler`) or from
        a mixture of datasets with fixed fractions per batch (ReCOIL:
        `MixtureSampler`) return another sampler here; `_update` then gets
        that sampler's batches.
        """
        return TransitionSampler(self._training_columns(dataset), int(getattr(self, "batch_size", 256)))

    #: Dataset columns the algorithm learns from; `fit` refuses a dataset where one is missing or masked.
    required_labels: tuple[str, ...] = ("rewards", "actions")

    def _check_labels(self, dataset: Dataset) -> None:
        """Refuse, naming the column and the labeller that fills it, a dataset missing a label this algorithm needs."""
        dataset.require_labels(*self.required_labels, context=type(self).__name__)


def _seed_from(random_state: Any) -> int:
    if random_state is None:
        return int(np.random.SeedSequence().generate_state(1)[0])
    if isinstance(random_state, np.random.RandomState):
        return int(random_state.randint(0, 2**31 - 1))
    if isinstance(random_state, np.random.Generator):
        return int(random_state.integers(0, 2**31 - 1))
    return int(random_state)
