"""Offline hyper-parameter search: `offrl tune CONFIG --objective FQE --trials N`.

A sweep's grid tries every combination; `tune` lets optuna's TPE sampler
choose the next one from the results so far, and stops a trial early when its
intermediate scores lag the median of the earlier trials (optuna's
MedianPruner).  The score is an OPE estimate of the trained policy's value
from the logged data (or the lower end of its confidence interval), so the
search itself never touches the environment.  Where the config names an
evaluation env, each finished policy is also rolled out once, and that true
score is stored next to the trial but never shown to the sampler: it measures
how good the OPE-driven choice was (the report's regret).

The config is a sweep YAML.  A list of values is a categorical choice (the
sweep's grid); a mapping `{low: 1e-4, high: 1e-2, log: true}` (with `step:`
for evenly spaced values) is a range.  Each (dataset, algorithm) pair is one
optuna study; its state lives in optuna's storage (SQLite at OUT/optuna.db by
default), so rerunning the same command resumes and runs only the trials still
missing.  Each trial writes OUT/trials/<number>/ (result.json, train.csv,
model.pt).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import numbers
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import yaml

from offrl.sweep import (
    ConfigError,
    SweepConfig,
    UniqueKeyLoader,
    _eval_env,
    _label_dataset,
    _learner_class,
    _load_dataset,
    _make_algorithm,
    _node_lines,
    _preset,
    _safe_name,
    runs_on,
    _save_model,
    _write_json,
    load_config,
    parse_config,
)

__all__ = ["ParamRange", "TuneConfig", "TuneResult", "load_tune_config", "search_space", "tune", "tune_report",
           "add_tune_parser", "run_tune_command"]

_RANGE_KEYS = {"low", "high", "log", "step"}
# Entries of an algorithm's mapping that are not hyper-parameters (the sweep reads them itself).
_NOT_PARAMS = {"algorithm", "labelers", "online"}
# Options of `offrl.ope.evaluate` an objective may set; everything else goes to the objective's model.
_EVALUATE_OPTIONS = {"interval", "alpha", "n_bootstrap", "horizon", "reward_bound", "weight_bound", "bandwidth"}
# The marginal estimators: their ratio settings (offrl.ope.marginal.MARGINAL_PARAMS) go to evaluate as
# marginal_params.
_MARGINAL = {"MIS", "SNMIS", "MDR", "MQL"}
# What tune sets itself, and from what.
_SET_BY_TUNE = {"gamma": "the config's ope.gamma (default 0.99)", "random_state": "the seed (--seed)"}
# Estimators that weigh logged actions by the behaviour policy: its log-probabilities are computed once per study.
_WEIGHTED = {"IS", "PDIS", "WIS", "WPDIS", "DR", "WDR"}
_STATES = ("COMPLETE", "PRUNED", "FAIL", "RUNNING")


# ---------------------------------------------------------------------------- config
@dataclass(frozen=True)
class ParamRange:
    """A hyper-parameter's range: optuna samples floats (log-uniformly with `log`) or, for an
    integer hyper-parameter, integers; `step` spaces the values evenly."""

    low: float
    high: float
    log: bool = False
    step: float | None = None
    integer: bool = False

    def distribution(self) -> Any:
        from optuna.distributions import FloatDistribution, IntDistribution

        if self.integer:
            return IntDistribution(int(self.low), int(self.high), log=self.log, step=int(self.step or 1))
        return FloatDistribution(float(self.low), float(self.high), log=self.log,
                                 step=None if self.step is None else float(self.step))


@dataclass
class TuneConfig:
    """A validated sweep config and the ranges `tune` samples: label -> param -> ParamRange."""

    sweep: SweepConfig
    ranges: dict[str, dict[str, ParamRange]] = field(default_factory=dict)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def load_tune_config(config: Any, check_datasets: bool = True) -> TuneConfig:
    """A sweep config (a YAML path, a mapping as loaded from YAML, or a SweepConfig) with its ranges.

    Ranges are taken out before the sweep's own validation (which knows only
    grids) and stand there as the two ends `[low, high]`, so both ends are
    checked against the algorithm's rules like any grid value.  Every problem
    is a ConfigError naming the file, line and key.
    """
    if isinstance(config, TuneConfig):
        return config
    if isinstance(config, SweepConfig):
        sweep = config
        _check_offline(sweep, lambda key, message: ConfigError(sweep.source, None, key, message))
        return TuneConfig(sweep, {})
    if isinstance(config, Mapping):
        raw, source, lines, default_name = copy.deepcopy(dict(config)), "<config>", {}, "sweep"
    elif isinstance(config, (str, os.PathLike)):
        raw, source, lines = _read_yaml(Path(config))
        default_name = _safe_name(Path(config).stem)
    else:
        raise TypeError(f"config must be a sweep YAML path, a mapping or a SweepConfig, got {type(config).__name__}")

    def fail(key: str, message: str) -> ConfigError:
        parts = key.split(".")
        line = None
        while line is None and parts:
            line = lines.get(".".join(parts))
            parts = parts[:-1]
        return ConfigError(source, line, key, message)

    stripped, ranges = _split_ranges(raw, fail)
    try:
        sweep = parse_config(stripped, source=source, lines=lines, check_datasets=check_datasets,
                             default_name=default_name)
    except ConfigError as err:
        raise _range_error(err, ranges, fail) from None
    _check_offline(sweep, fail)
    typed = {label: {param: _typed_range(sweep, label, param, spec, fail) for param, spec in params.items()}
             for label, params in ranges.items()}
    return TuneConfig(sweep, {label: params for label, params in typed.items() if params})


def _read_yaml(path: Path) -> tuple[Any, str, dict[str, int]]:
    """The raw YAML and its keys' lines; a YAML problem is the sweep's own ConfigError (line and key)."""
    if not path.exists():
        raise FileNotFoundError(f"sweep config {path} does not exist")
    text = path.read_text()
    try:
        node = yaml.compose(text, Loader=UniqueKeyLoader)
        raw = yaml.load(text, Loader=UniqueKeyLoader)
    except yaml.YAMLError:
        load_config(path, check_datasets=False)  # raises the ConfigError that names the line and key
        raise
    return raw, str(path), (_node_lines(node) if node is not None else {})


def _split_ranges(raw: Any, fail: Callable[[str, str], ConfigError]) -> tuple[Any, dict[str, dict[str, dict]]]:
    """The config with each range replaced by its two ends (a grid the sweep validates), and the ranges."""
    ranges: dict[str, dict[str, dict]] = {}
    algorithms = raw.get("algorithms") if isinstance(raw, dict) else None
    if not isinstance(algorithms, dict):
        return raw, ranges
    for label, params in algorithms.items():
        if not isinstance(params, dict):
            continue
        for param, spec in params.items():
            if param in _NOT_PARAMS or not isinstance(spec, dict) or set(spec) == {"grid"}:
                continue
            key = f"algorithms.{label}.{param}"
            spec = _parse_range(spec, key, fail)
            _check_numeric(params.get("algorithm", label), param, key, fail)
            ranges.setdefault(str(label), {})[str(param)] = spec
            params[param] = [spec["low"], spec["high"]]
    return raw, ranges


def _check_numeric(name: Any, param: str, key: str, fail: Callable[[str, str], ConfigError]) -> None:
    """A range on a hyper-parameter that is not a number is refused as such (before its ends are checked as
    values); an unknown algorithm or hyper-parameter is left to the sweep's own message."""
    try:
        default = _learner_class(str(name))().get_params().get(param)
    except (KeyError, ImportError):
        return
    if isinstance(default, (bool, np.bool_, str, list, tuple, dict)):
        raise fail(key, f"{name}.{param} is not a number (its default is {default!r}), so it takes no range; "
                        "list its values instead (a categorical choice)")


def _parse_range(spec: dict, key: str, fail: Callable[[str, str], ConfigError]) -> dict:
    """A range mapping's numbers, checked: low < high, log only above 0, step dividing high - low."""
    unknown = sorted(map(str, set(spec) - _RANGE_KEYS))
    if unknown:
        if "grid" in spec:
            raise fail(key, "a grid is {grid: [v1, v2, ...]} alone; a range is {low: L, high: H} with optional "
                            f"log: true or step: S; got keys {sorted(map(str, spec))}")
        raise fail(f"{key}.{unknown[0]}", f"unknown range key {unknown[0]!r}; a range is {{low: L, high: H}} with "
                                          "optional log: true or step: S (a list of values is a categorical choice)")
    for end in ("low", "high"):
        if end not in spec:
            raise fail(key, f"a range needs both low and high, e.g. {{low: 1.0e-4, high: 1.0e-2, log: true}}; "
                            f"{end} is missing")
        if not _is_real(spec[end]) or not math.isfinite(spec[end]):
            raise fail(f"{key}.{end}", f"{end} must be a finite number, got {spec[end]!r}")
    low, high = spec["low"], spec["high"]
    if not low < high:
        raise fail(key, f"low must be below high, got low {low!r} and high {high!r} (a single value needs no range)")
    log = spec.get("log", False)
    if not isinstance(log, bool):
        raise fail(f"{key}.log", f"log must be true or false, got {log!r}")
    if log and low <= 0:
        raise fail(f"{key}.low", f"a log range needs low > 0, got {low!r}")
    step = spec.get("step")
    if step is not None:
        if not _is_real(step) or not step > 0:
            raise fail(f"{key}.step", f"step must be a positive number, got {step!r}")
        if log:
            raise fail(key, "a range takes log: true or step, not both (a log scale has no even steps)")
        count = (high - low) / step
        if abs(count - round(count)) > 1e-9 * max(1.0, abs(count)):
            raise fail(f"{key}.step", f"high - low ({high - low!r}) must be a multiple of step ({step!r}), so that "
                                      "high is one of the values")
    return {"low": low, "high": high, "log": log, "step": step}


def _range_error(err: ConfigError, ranges: Mapping[str, Mapping[str, dict]],
                 fail: Callable[[str, str], ConfigError]) -> ConfigError:
    """The sweep's error about a range's end, said of the range ('lr.low', not 'lr[0]')."""
    for label, params in ranges.items():
        for param in params:
            key = f"algorithms.{label}.{param}"
            for i, end in enumerate(("low", "high")):
                if err.key == f"{key}[{i}]":
                    message = str(err).split(f"{err.key}: ", 1)[-1]
                    return fail(f"{key}.{end}", message)
            if err.key == key and "the grid repeats" in str(err):
                return fail(key, "low and high give the same value")
    return err


def _check_offline(sweep: SweepConfig, fail: Callable[[str, str], ConfigError]) -> None:
    for label, algo in sweep.algorithms.items():
        if algo.get("online"):
            raise fail(f"algorithms.{label}.online", "tune scores policies by OPE from the logged data alone, and an "
                                                     "online phase needs the environment; drop online: to tune the "
                                                     "offline phase, or compare online recipes with offrl sweep")


def _typed_range(sweep: SweepConfig, label: str, param: str, spec: Mapping[str, Any],
                 fail: Callable[[str, str], ConfigError]) -> ParamRange:
    """The range as the hyper-parameter's type: integers for an integer hyper-parameter, floats otherwise."""
    name = sweep.algorithms[label]["algorithm"]
    default = _learner_class(name)().get_params()[param]
    key = f"algorithms.{label}.{param}"
    numbers_ = [spec["low"], spec["high"]] + ([spec["step"]] if spec["step"] is not None else [])
    _check_numeric(name, param, key, fail)
    integer = _is_int(default) or (default is None and all(_is_int(v) for v in numbers_))
    if integer and not all(_is_int(v) for v in numbers_):
        raise fail(key, f"{name}.{param} is an integer, so low, high and step must be integers, got "
                        f"{ {k: spec[k] for k in ('low', 'high', 'step') if spec[k] is not None} }")
    return ParamRange(low=spec["low"], high=spec["high"], log=spec["log"], step=spec["step"], integer=integer)


def _encode_choice(value: Any) -> Any:
    """A grid value as an optuna choice: JSON text for a list-valued one (hidden_dims), so storage keeps it."""
    return json.dumps(list(value)) if isinstance(value, (list, tuple)) else value


def search_space(config: TuneConfig, label: str, dataset: Mapping[str, Any] | None = None
                 ) -> tuple[dict[str, Any], dict[str, Any], dict[str, dict[Any, Any]]]:
    """(distributions, fixed params, decoding) of one algorithm entry on one dataset.

    Grid lists of two or more values are categorical choices, ranges are
    float or integer distributions, single values and the dataset's preset
    are fixed (an explicit setting overrides the preset).  `decoding` maps a
    categorical's stored choice back to its value (a list-valued one is
    stored as JSON text).
    """
    from optuna.distributions import CategoricalDistribution

    sweep = config.sweep
    algo = sweep.algorithms[label]
    ranges = config.ranges.get(label, {})
    preset = _preset(algo["algorithm"], dataset["spec"]) if (dataset is not None and sweep.presets) else {}
    space: dict[str, Any] = {}
    fixed: dict[str, Any] = dict(preset)
    decoding: dict[str, dict[Any, Any]] = {}
    for param in sorted(algo["grid"]):
        values = algo["grid"][param]
        if param in ranges:
            space[param] = ranges[param].distribution()
            fixed.pop(param, None)
        elif len(values) > 1:
            choices = [_encode_choice(v) for v in values]
            space[param] = CategoricalDistribution(choices)
            decoding[param] = dict(zip(choices, values))
            fixed.pop(param, None)
        else:
            fixed[param] = values[0]
    return space, fixed, decoding


# ---------------------------------------------------------------------------- checks
def _check_objective(objective: Any) -> str:
    from offrl.ope.api import estimator_key

    if not isinstance(objective, str):
        raise TypeError(f"objective must be an OPE estimator's name such as 'FQE', got {objective!r}")
    return estimator_key(objective)  # ValueError listing the estimators


def _check_storage(storage: Any) -> None:
    if storage is None:
        return
    if not isinstance(storage, str) or not storage:
        raise TypeError(f"storage must be a database URL such as 'sqlite:///tune.db', got {storage!r}")
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(storage)
    except (ArgumentError, ValueError) as err:
        raise ValueError(f"storage {storage!r} is not a database URL ({err}); use e.g. sqlite:///path/optuna.db or "
                         "postgresql://user@host/db") from None
    if url.drivername.startswith("sqlite") and url.database not in (None, "", ":memory:"):
        folder = Path(url.database).expanduser().resolve().parent
        if not folder.is_dir():
            raise ValueError(f"storage {storage!r}: the folder {folder} does not exist; create it or use another path")


def _check_study_name(name: Any) -> None:
    if name is None:
        return
    if not isinstance(name, str) or not name.strip() or len(name) > 400 or not name.isprintable():
        raise ValueError(f"study_name must be a non-empty printable string of at most 400 characters, got {name!r}")


def _check_count(name: str, value: Any, low: int, none: bool = False) -> None:
    if none and value is None:
        return
    if not _is_int(value) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}{' or None' if none else ''}, got {value!r}")


def _split_objective_params(key: str, params: Mapping[str, Any] | None, device: str) -> tuple[dict, dict, dict]:
    """(evaluate options, FQE params, ModelBased params) from `objective_params`; unknown names are refused."""
    from offrl.ope import FQE, ModelBased
    from offrl.ope.marginal import MARGINAL_PARAMS, check_marginal_params

    params = dict(params or {})
    marginal: dict[str, Any] = {}
    if key in _MARGINAL:  # the ratio features and ridge; MDR's Q is an FQE with the remaining parameters
        marginal = check_marginal_params({k: params.pop(k) for k in list(params) if k in MARGINAL_PARAMS},
                                         "objective_params")
    model = ModelBased if key == "MB" else FQE
    valid = set(model().get_params()) | set(MARGINAL_PARAMS) if key in _MARGINAL else set(model().get_params())
    for name in params:
        if name in _SET_BY_TUNE:
            raise ValueError(f"objective_params: {name} is set by tune, from {_SET_BY_TUNE[name]}")
        if name not in valid and name not in _EVALUATE_OPTIONS:
            raise ValueError(f"objective_params: {model.__name__} (the {key} objective's model) has no parameter "
                             f"{name!r}; valid: {sorted((valid - set(_SET_BY_TUNE)) | _EVALUATE_OPTIONS)}")
    options = {k: v for k, v in params.items() if k in _EVALUATE_OPTIONS}
    model_params = {k: v for k, v in params.items() if k not in _EVALUATE_OPTIONS}
    from offrl.algos.params import check_params

    try:  # bad values are refused now, not in the middle of the first trial
        estimator = model(**model_params)
        check_params(estimator)
        if hasattr(estimator, "check_params"):  # rules across parameters
            estimator.check_params()
    except (TypeError, ValueError) as err:
        raise ValueError(f"objective_params: {err}") from None
    if "device" in valid:
        model_params.setdefault("device", device)
    if marginal:
        options["marginal_params"] = marginal
    return (options, {} if key == "MB" else model_params, model_params if key == "MB" else {})


# ---------------------------------------------------------------------------- one study
class _TrialFailed(Exception):
    """A trial whose outcome is a failure of its own hyper-parameters (recorded, counted, not retried)."""


@dataclass
class _Study:
    """One (dataset, algorithm) pair: its optuna study, data and the pieces every trial shares."""

    name: str
    dir: Path
    dataset_entry: dict[str, Any]
    label: str
    algorithm: str
    space: dict[str, Any]
    fixed: dict[str, Any]
    decoding: dict[str, dict[Any, Any]]
    base_run: dict[str, Any]
    objective: str
    lcb: bool
    gamma: float
    steps: int
    report_every: int
    log_every: int
    seed: int
    options: dict[str, Any]
    fqe_params: dict[str, Any]
    mb_params: dict[str, Any]
    eval_cfg: dict[str, Any]
    ope_cfg: dict[str, Any] | None
    progress: bool
    dataset: Any = None
    raw_dataset: Any = None
    labelers: list = field(default_factory=list)
    env: str | None = None
    behavior: Any = None

    def identity(self) -> dict[str, Any]:
        """What must match for a stored study to be resumed (the seed and trial count may change)."""
        from optuna.distributions import distribution_to_json

        return {"dataset": self.dataset_entry, "algorithm": self.algorithm, "label": self.label,
                "fixed": self.fixed, "space": {k: json.loads(distribution_to_json(d)) for k, d in self.space.items()},
                "labelers": self.base_run.get("labelers"), "steps": self.steps, "objective": self.objective,
                "lcb": self.lcb, "gamma": self.gamma, "report_every": self.report_every, "options": self.options,
                # where the model trains does not change the search
                "fqe_params": {k: v for k, v in self.fqe_params.items() if k != "device"},
                "mb_params": {k: v for k, v in self.mb_params.items() if k != "device"}}

    def prepare(self) -> None:
        """Load (and label) the data once, and the behaviour log-probabilities an IS/DR objective needs."""
        raw = _load_dataset(self.dataset_entry)
        missing = raw.missing_labels()
        if missing:
            raise ValueError(f"dataset {self.dataset_entry['label']!r} lacks {', '.join(missing)}, so no OPE "
                             "estimate of a policy's value can be made from it; tune needs logged rewards and actions")
        self.raw_dataset = raw
        self.labelers, self.dataset = _label_dataset(self.base_run, raw)
        self.env = _eval_env(self.dataset_entry, self.eval_cfg, raw)
        if self.objective in _WEIGHTED and raw.behavior_log_probs is None:
            from offrl.ope.behavior import estimate_behavior

            self.behavior = estimate_behavior(raw).log_probs

    def estimate(self, algo: Any) -> dict[str, float]:
        """The objective's OPE estimate of `algo`'s policy, leaving the training's random streams untouched."""
        import torch

        from offrl import ope

        devices = [algo.device_] if algo.device_.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = ope.evaluate({"policy": algo}, self.raw_dataset, [self.objective], gamma=self.gamma,
                                  behavior=self.behavior, fqe_params=self.fqe_params, mb_params=self.mb_params,
                                  random_state=self.seed, **self.options)
        row = report.to_frame().iloc[0]
        out = {"estimate": float(row["value"]), "ci_low": float(row["ci_low"]), "ci_high": float(row["ci_high"])}
        out["value"] = out["ci_low"] if self.lcb else out["estimate"]
        messages = sorted({str(w.message) for w in caught})
        if messages:
            out["warnings"] = messages
        return out

    def truth(self, algo: Any) -> dict[str, float]:
        """The final policy rolled out as the sweep evaluates it (and its discounted value when the config has
        an ope block): measured for the report, never seen by the sampler."""
        if self.env is None:
            return {}
        result = algo.evaluate(self.env, n_episodes=int(self.eval_cfg["episodes"]), seed=0)
        score = float(result.get("normalized_score_mean", float("nan")))
        out = {"true_return": float(result["return_mean"]), "true_normalized_score": score,
               "true_score": score if math.isfinite(score) else float(result["return_mean"])}
        if self.ope_cfg is not None:
            from offrl.ope import true_policy_value

            value = true_policy_value(self.env, algo, self.gamma, n_rollouts=int(self.ope_cfg["rollouts"]),
                                      seed=10_000 + self.seed, dataset=self.raw_dataset)
            out["true_value"] = float(value["value"])
        return out

    def sample(self, trial: Any) -> dict[str, Any]:
        """The trial's hyper-parameters, drawn by the sampler from the study's distributions."""
        from optuna.distributions import CategoricalDistribution, IntDistribution

        params = {}
        for param, dist in self.space.items():
            if isinstance(dist, CategoricalDistribution):
                params[param] = self.decoding[param][trial.suggest_categorical(param, dist.choices)]
            elif isinstance(dist, IntDistribution):
                params[param] = trial.suggest_int(param, dist.low, dist.high, step=dist.step, log=dist.log)
            else:
                params[param] = trial.suggest_float(param, dist.low, dist.high, step=dist.step, log=dist.log)
        return params

    def run_trial(self, trial: Any) -> float:
        """Train one sampled configuration, reporting the objective every `report_every` steps; pruned when it lags."""
        import optuna

        from offrl.monitor import TrainingDivergedError

        started = time.time()
        params = self.sample(trial)
        trial_dir = self.dir / "trials" / str(trial.number)
        for stale in ("result.json", "model.pt", "train.csv", "eval.csv"):  # a trial number used before (a new db)
            (trial_dir / stale).unlink(missing_ok=True)
        shown_params = {k: (list(v) if isinstance(v, tuple) else v) for k, v in params.items()}
        record: dict[str, Any] = {
            "study": self.name, "trial": trial.number, "state": "RUNNING", "dataset": self.dataset_entry["label"],
            "algorithm": self.algorithm, "label": self.label, "params": shown_params, "objective": self.objective,
            "lcb": self.lcb, "steps": self.steps, "intermediate": [],
        }
        _write_json(trial_dir / "result.json", record)
        run = {**self.base_run, "params": {**self.fixed, **params}}
        algo = _make_algorithm(run)
        pruned_at: list[int] = []

        def report(estimator: Any, step: int, _metrics: Any) -> bool | None:
            if step % self.report_every and step != self.steps:
                return None
            try:
                estimate = self.estimate(estimator)
            except (ValueError, np.linalg.LinAlgError) as err:  # e.g. data that do not cover this policy
                raise _TrialFailed(f"the {self.objective} estimate failed at step {step}: {err}") from err
            record["intermediate"].append({"step": step, **estimate})
            if not math.isfinite(estimate["value"]):
                raise _TrialFailed(f"the {self.objective} estimate is {estimate['value']} at step {step}")
            trial.report(estimate["value"], step)
            _write_json(trial_dir / "result.json", record)
            if step < self.steps and trial.should_prune():  # a trained policy is scored, not pruned
                pruned_at.append(step)
                return False
            return None

        try:
            algo.fit(self.dataset, n_steps=self.steps, log_every=self.log_every, callbacks=[report],
                     log_dir=trial_dir, progress=False)
            if not record["intermediate"]:  # an algorithm whose fit skips callbacks: score the final policy
                report(algo, self.steps, {})
        except (TrainingDivergedError, _TrialFailed) as err:
            record.update(state="FAIL", error=str(err), steps_done=int(getattr(algo, "n_steps_done_", 0)),
                          seconds=time.time() - started)
            trial.set_user_attr("error", str(err))
            _write_json(trial_dir / "result.json", record)
            raise
        _save_model(algo, self.labelers, run, trial_dir / "model.pt")
        record["steps_done"] = int(algo.n_steps_done_)
        record["final_objective"] = record["intermediate"][-1]["value"]
        if pruned_at:
            record.update(state="PRUNED", pruned_at=pruned_at[0], seconds=time.time() - started)
            _write_json(trial_dir / "result.json", record)
            raise optuna.TrialPruned(f"its {self.objective} objective at step {pruned_at[0]} lags the earlier trials")
        truth = self.truth(algo)
        for key, value in truth.items():
            trial.set_user_attr(key, value)
        record.update(truth)
        record.update(state="COMPLETE", seconds=time.time() - started)
        _write_json(trial_dir / "result.json", record)
        return float(record["final_objective"])


def _finished(trial: Any) -> bool:
    """Whether a stored trial used up one of the budget's trials: completed, pruned, or failed by its own
    hyper-parameters (diverged).  A trial cut short by an interrupt (or still running) does not."""
    from optuna.trial import TrialState

    return (trial.state in (TrialState.COMPLETE, TrialState.PRUNED)
            or (trial.state == TrialState.FAIL and "error" in trial.user_attrs))


# ---------------------------------------------------------------------------- tune
@dataclass
class TuneResult:
    """What `tune` did: the trials table, the best trial of each study and the report's files."""

    out: Path
    frame: Any
    studies: list[dict[str, Any]]
    paths: dict[str, Path]

    @property
    def best(self) -> dict[str, Any]:
        """The best trial by the objective (the only study's; with several, the first's)."""
        return self.studies[0]


def tune(
    config: Any,
    objective: str = "FQE",
    trials: int = 20,
    lcb: bool = False,
    storage: str | None = None,
    study_name: str | None = None,
    out: str | os.PathLike | None = None,
    seed: int = 0,
    prune: Any = True,
    report_every: int | None = None,
    progress: bool = True,
    objective_params: Mapping[str, Any] | None = None,
) -> TuneResult:
    """Search the config's hyper-parameters for the best OPE objective, `trials` trials per (dataset, algorithm).

    `objective` is an OPE estimator's name; the trial's score is its estimate
    of the trained policy's value (with `lcb`, the lower end of its confidence
    interval), reported every `report_every` training steps (default: the
    config's `checkpoint_every`, else its `eval.every`, else steps / 4) and
    pruned by optuna's MedianPruner when it lags (`prune=False` never prunes;
    an optuna pruner may be given instead).  The last estimate is the trial's
    value.  Each trial trains with `random_state=seed`; the config's `seeds`
    are not used.  `objective_params` go to the objective's model (FQE's, for
    FQE, DR and WDR, over the config's `ope.fqe_params`; ModelBased's for MB)
    and to `ope.evaluate` (interval, alpha, n_bootstrap, ...).  The study lives in `storage` (default: SQLite at
    OUT/optuna.db, OUT defaulting to offrl-results/<name>/tune) under
    `study_name` (default: the config's name); a rerun resumes it and runs only
    the trials still missing, with the sampler reseeded from `seed` and the
    trials so far (a fixed seed would repeat the first random picks).
    """
    import optuna
    import torch

    key = _check_objective(objective)
    _check_count("trials", trials, 1)
    _check_count("seed", seed, 0)
    _check_count("report_every", report_every, 1, none=True)
    _check_storage(storage)
    _check_study_name(study_name)
    if not isinstance(lcb, bool):
        raise TypeError(f"lcb must be True or False, got {lcb!r}")
    if not isinstance(prune, (bool, optuna.pruners.BasePruner)):
        raise TypeError(f"prune must be True, False or an optuna pruner, got {prune!r}")
    config = load_tune_config(config)
    sweep = config.sweep
    # The config's ope settings for this objective's model (fqe_params, or mb_params for MB; and marginal_params
    # for the marginal estimators) unless objective_params says otherwise.
    ope_block = sweep.ope or {}
    from_config = dict(ope_block.get("mb_params" if key == "MB" else "fqe_params") or {})
    if key in _MARGINAL:
        from_config.update(ope_block.get("marginal_params") or {})
    options, fqe_params, mb_params = _split_objective_params(key, {**from_config, **dict(objective_params or {})},
                                                             sweep.device)
    out_dir = Path(out) if out is not None else Path(sweep.out or Path("offrl-results") / sweep.name) / "tune"
    every = int(report_every or sweep.checkpoint_every or (sweep.raw.get("eval") or {}).get("every")
                or max(sweep.steps // 4, 1))
    pairs = [(entry, label) for entry in sweep.datasets for label, algo in sweep.algorithms.items()
             if runs_on(algo, entry)]
    base_name = study_name or sweep.name
    out_dir.mkdir(parents=True, exist_ok=True)
    url = storage or f"sqlite:///{(out_dir / 'optuna.db').resolve()}"
    gamma = float(sweep.ope["gamma"]) if sweep.ope else 0.99
    studies = []
    for entry, label in pairs:
        single = len(pairs) == 1
        space, fixed, decoding = search_space(config, label, entry)
        algo = sweep.algorithms[label]
        base_run = {"dataset": entry, "algorithm": algo["algorithm"], "label": label, "params": fixed, "seed": seed,
                    "device": sweep.device, "log_every": sweep.log_every}
        if algo.get("labelers"):
            base_run["labelers"] = algo["labelers"]
        studies.append(_Study(
            name=base_name if single else f"{base_name}:{entry['label']}:{label}",
            dir=out_dir if single else out_dir / "studies" / entry["label"] / label,
            dataset_entry=entry, label=label, algorithm=algo["algorithm"], space=space, fixed=fixed,
            decoding=decoding, base_run=base_run, objective=key, lcb=lcb, gamma=gamma, steps=sweep.steps,
            report_every=every, log_every=math.gcd(int(sweep.log_every), every), seed=seed, options=options,
            fqe_params=fqe_params, mb_params=mb_params, eval_cfg=sweep.eval, ope_cfg=sweep.ope, progress=progress))
    verbosity = optuna.logging.get_verbosity()
    threads = torch.get_num_threads()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    torch.set_num_threads(int(sweep.threads_per_run))
    try:
        # Heartbeats mark a killed process's trials failed (so they are run again); optuna calls them experimental.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            storage_ = optuna.storages.RDBStorage(url, heartbeat_interval=60)
        for study in studies:
            _run_study(study, storage_, url, trials, seed, prune)
    finally:
        optuna.logging.set_verbosity(verbosity)
        torch.set_num_threads(threads)
    frame = tune_report(out_dir, title=f"{base_name}: tuned by {key}{' lower bound' if lcb else ''}")
    summaries = [_study_summary(study.dir) for study in studies]
    return TuneResult(out=out_dir, frame=frame, studies=summaries,
                      paths={"md": out_dir / "tune.md", "html": out_dir / "tune.html"})


def _run_study(study: _Study, storage: Any, url: str, trials: int, seed: int, prune: Any) -> None:
    import optuna

    from offrl.monitor import TrainingDivergedError

    identity = json.loads(json.dumps(study.identity(), default=list))  # as storage keeps it (lists, not tuples)
    done = 0
    if study.name in optuna.study.get_all_study_names(storage):
        stored = optuna.load_study(study_name=study.name, storage=storage)
        before = stored.user_attrs.get("identity")
        if before is not None and before != identity:
            changed = sorted(k for k in identity if before.get(k) != identity[k])
            raise ValueError(f"the study {study.name!r} in {_shown_url(url)} was started with another "
                             f"{', '.join(changed)}; rerun with the same config and options to resume it, or give "
                             "another study name or output folder")
        done = sum(_finished(t) for t in stored.trials)
    previous = _read_json(study.dir / "study.json")
    if previous and (previous.get("study_name"), previous.get("storage")) != (study.name, _shown_url(url)):
        # trial folders are numbered per study: another study here would overwrite and mix them
        raise ValueError(f"{study.dir} holds the study {previous.get('study_name')!r} in {previous.get('storage')}; "
                         f"give another --out for the study {study.name!r} in {_shown_url(url)}")
    remaining = trials - done
    if remaining > 0:
        study.prepare()  # the data, before any trial: a dataset OPE cannot use is refused here
    meta = {"study_name": study.name, "storage": _shown_url(url), "dataset": study.dataset_entry["label"],
            "algorithm": study.algorithm, "label": study.label, "objective": study.objective, "lcb": study.lcb,
            "gamma": study.gamma, "steps": study.steps, "report_every": study.report_every, "trials": trials,
            "space": identity["space"], "fixed": identity["fixed"],
            "env": study.env if remaining > 0 else (_read_json(study.dir / "study.json") or {}).get("env")}
    _write_json(study.dir / "study.json", meta)
    if remaining <= 0:
        if study.progress:
            print(f"[tune {study.name}] {done} of {trials} trials done already")
        return
    # A fresh seed for every resumption: a seeded sampler restarted would draw the first random picks again.
    sampler_seed = int(np.random.SeedSequence([seed, done]).generate_state(1)[0])
    pruner = (prune if isinstance(prune, optuna.pruners.BasePruner)
              else optuna.pruners.MedianPruner() if prune else optuna.pruners.NopPruner())
    optuna_study = optuna.create_study(storage=storage, study_name=study.name, direction="maximize",
                                       sampler=optuna.samplers.TPESampler(seed=sampler_seed), pruner=pruner,
                                       load_if_exists=True)
    if "identity" not in optuna_study.user_attrs:
        optuna_study.set_user_attr("identity", identity)

    def after_trial(optuna_study: Any, trial: Any) -> None:
        if study.progress:
            print(f"[tune {study.name}] {_trial_line(study.dir / 'trials' / str(trial.number))}", flush=True)
        if sum(_finished(t) for t in optuna_study.trials) >= trials:  # another process on the storage helped
            optuna_study.stop()

    optuna_study.optimize(study.run_trial, n_trials=remaining, catch=(TrainingDivergedError, _TrialFailed),
                          callbacks=[after_trial])


def _shown_url(url: str) -> str:
    """The storage URL without its password (study.json and messages must not leak it)."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def _trial_line(trial_dir: Path) -> str:
    record = _read_json(trial_dir / "result.json") or {}
    text = f"trial {trial_dir.name}: {str(record.get('state', '?')).lower()}"
    if record.get("final_objective") is not None:
        text += f", objective {record['final_objective']:.4g}"
    if record.get("true_score") is not None:
        text += f", true score {record['true_score']:.4g}"
    if record.get("error"):
        text += f" ({record['error']})"
    return text + f", {json.dumps(record.get('params', {}))}"


# ---------------------------------------------------------------------------- report
def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _study_dirs(out: Path) -> list[Path]:
    if (out / "study.json").exists():
        return [out]
    return sorted(p.parent for p in out.glob("studies/*/*/study.json"))


def _trial_records(study_dir: Path) -> list[dict[str, Any]]:
    records = [_read_json(p) for p in (study_dir / "trials").glob("*/result.json")]
    return sorted((r for r in records if r is not None and _is_int(r.get("trial"))), key=lambda r: r["trial"])


def _study_summary(study_dir: Path) -> dict[str, Any]:
    """The best trial by the objective (completed trials), the best true score, and the regret between them."""
    meta = _read_json(study_dir / "study.json") or {}
    records = _trial_records(study_dir)
    complete = [r for r in records if r.get("state") == "COMPLETE" and r.get("final_objective") is not None]
    summary: dict[str, Any] = {"study": meta.get("study_name"), "dir": study_dir, "dataset": meta.get("dataset"),
                               "algorithm": meta.get("label"), "objective": meta.get("objective"),
                               "lcb": meta.get("lcb"), "n_trials": len(records),
                               "states": {s: sum(r.get("state") == s for r in records) for s in _STATES}}
    if not complete:
        return summary
    best = max(complete, key=lambda r: r["final_objective"])
    summary.update(best_trial=best["trial"], best_params=best["params"], best_objective=best["final_objective"],
                   best_true_score=best.get("true_score"), model=study_dir / "trials" / str(best["trial"]) / "model.pt")
    scored = [r for r in complete if r.get("true_score") is not None and math.isfinite(r["true_score"])]
    if scored and best.get("true_score") is not None:
        top = max(scored, key=lambda r: r["true_score"])
        summary.update(top_trial=top["trial"], top_true_score=top["true_score"],
                       regret=top["true_score"] - best["true_score"])
    return summary


def _summary_lines(summary: Mapping[str, Any]) -> list[str]:
    """The summary in plain sentences (markdown and HTML show the same words)."""
    states = summary["states"]
    counts = [f"{states[s]} {w}" for s, w in (("COMPLETE", "complete"), ("PRUNED", "pruned"), ("FAIL", "failed"),
                                              ("RUNNING", "running or interrupted")) if states[s]]
    objective = f"{summary['objective']}{' lower confidence bound' if summary['lcb'] else ' estimate'}"
    lines = [f"{summary['n_trials']} trials ({', '.join(counts) or 'none yet'}); objective: the {objective}."]
    if "best_trial" not in summary:
        lines.append("No trial has completed yet, so there is no best trial.")
        return lines
    params = ", ".join(f"{k}={v}" for k, v in summary["best_params"].items()) or "no free parameters"
    line = (f"Best trial by the objective: trial {summary['best_trial']} ({params}), objective "
            f"{_fmt(summary['best_objective'])}")
    true = summary.get("best_true_score")
    lines.append(line + (f", true score {_fmt(true)}." if true is not None else "."))
    if "regret" in summary:
        lines.append(f"Best true score among the completed trials: {_fmt(summary['top_true_score'])} (trial "
                     f"{summary['top_trial']}); regret of choosing by the objective: {_fmt(summary['regret'])}.")
    else:
        lines.append("No environment was evaluated, so there are no true scores and no regret.")
    return lines


def _fmt(value: Any) -> str:
    from offrl._html import fmt

    return fmt(value)


def tune_report(out: str | os.PathLike, title: str | None = None) -> Any:
    """The trials table of a tune folder (trial, state, params..., objective, true_score) and OUT/tune.md and
    OUT/tune.html: a summary (the best trial by the objective, its true score, the best true score, the regret)
    and the table."""
    import pandas as pd

    from offrl._html import esc, page, summary_box, table
    from offrl.datasets.core import atomic_write_path

    out = Path(out)
    dirs = _study_dirs(out)
    if not dirs:
        raise FileNotFoundError(f"{out} holds no tune study (no study.json); run `offrl tune CONFIG --out {out}` first")
    several = len(dirs) > 1
    frames, md, body = [], [], []
    first_meta = _read_json(dirs[0] / "study.json") or {}
    title = title or f"{first_meta.get('study_name', out.name)}: hyper-parameter search"
    for study_dir in dirs:
        summary = _study_summary(study_dir)
        rows = []
        for r in _trial_records(study_dir):
            row = {"trial": r["trial"], "state": r.get("state")}
            row.update(r.get("params") or {})
            row.update({"objective": r.get("final_objective", float("nan")),
                        "true_score": r.get("true_score", float("nan")),
                        "true_return": r.get("true_return", float("nan")),
                        "steps_done": r.get("steps_done", float("nan")), "error": r.get("error", "")})
            if "true_value" in r:
                row["true_value"] = r["true_value"]
            rows.append({k: (json.dumps(v) if isinstance(v, list) else v) for k, v in row.items()})
        frame = pd.DataFrame(rows)
        if several:
            frame.insert(0, "algorithm", summary["algorithm"])
            frame.insert(0, "dataset", summary["dataset"])
        frames.append(frame)
        lines = _summary_lines(summary)
        heading = f"{summary['dataset']} / {summary['algorithm']}" if several else ""
        shown = frame.drop(columns=[c for c in ("dataset", "algorithm") if c in frame.columns])
        shown = shown.drop(columns=[c for c in ("error",) if c in shown and not shown[c].astype(bool).any()])
        md += ([f"## {heading}", ""] if heading else []) + [f"- {line}" for line in lines] + [""]
        md += _markdown_table(shown) + [""]
        numeric = [pd.api.types.is_numeric_dtype(shown[c]) for c in shown.columns]
        cells = [[esc(_fmt(v) if isinstance(v, float) else v) for v in row]
                 for row in shown.itertuples(index=False, name=None)]
        caption = ("objective: the last OPE estimate (a pruned trial's at the step it stopped); true score: the "
                   "final policy's normalised score (its return without reference scores) in the evaluation env, "
                   "never seen by the search")
        body += ([f"<h2>{esc(heading)}</h2>"] if heading else []) + [
            summary_box([esc(line) for line in lines], title="Summary" if not heading else f"Summary: {heading}"),
            table([esc(c) for c in shown.columns], cells, caption=esc(caption), row_header=False, numeric=numeric)]
    with atomic_write_path(out / "tune.md") as tmp, open(tmp, "w") as f:
        f.write("\n".join([f"# {title}", "", *md]))
    with atomic_write_path(out / "tune.html") as tmp, open(tmp, "w") as f:
        f.write(page(title, body))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _markdown_table(frame: Any) -> list[str]:
    def cell(value: Any) -> str:
        text = _fmt(value) if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(map(str, frame.columns)) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False, name=None)]
    return lines


# ---------------------------------------------------------------------------- command line
def _setting(text: str) -> tuple[str, Any]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return name, yaml.safe_load(value)
    except yaml.YAMLError:
        return name, value


def add_tune_parser(commands: Any) -> argparse.ArgumentParser:
    """Register `offrl tune` on the `offrl` parser's subparsers (its func, and the error prefix the CLI uses)."""
    from offrl.cli import _count as _positive  # the CLI's integer-option type (cli.build_parser calls this)

    parser = commands.add_parser(
        "tune", help="search a sweep config's hyper-parameters by an OPE estimate (optuna, no env needed)",
        description="Search a sweep config's grid (lists) and ranges ({low, high, log, step}) with optuna's TPE "
                    "sampler, scoring each trial by an OPE estimate from the logged data and pruning trials whose "
                    "intermediate estimates lag.  Rerunning the same command resumes the study.",
        epilog="example:\n  offrl tune experiments/quickstart.yaml --objective FQE --trials 20")
    parser.add_argument("config", help="sweep YAML (see docs/sweeps.md)")
    parser.add_argument("--objective", default="FQE", help="the OPE estimator scoring each trial (default FQE)")
    parser.add_argument("--trials", type=_positive(1), default=20, help="trials per (dataset, algorithm) (default 20)")
    parser.add_argument("--lcb", action="store_true", help="score by the estimate's lower confidence bound")
    parser.add_argument("--storage", default=None, metavar="URL",
                        help="optuna storage (default sqlite:///OUT/optuna.db)")
    parser.add_argument("--study-name", default=None, metavar="S", help="the study's name (default: the config's name)")
    parser.add_argument("--out", default=None, metavar="DIR", help="output folder (default offrl-results/<name>/tune)")
    parser.add_argument("--seed", type=_positive(0), default=0, metavar="S", help="sampler, training and OPE seed")
    parser.add_argument("--no-prune", action="store_true", help="never stop a trial early")
    parser.add_argument("--report-every", type=_positive(1), default=None, metavar="N",
                        help="training steps between objective estimates (default: checkpoint_every, eval.every "
                             "or steps / 4)")
    parser.add_argument("--objective-param", action="append", type=_setting, default=[], metavar="KEY=VALUE",
                        help="an option of the objective's model or of the OPE (e.g. n_steps=5000); repeatable")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=run_tune_command, command_parser=parser, error_prefix=parser.prog)
    return parser


def run_tune_command(args: argparse.Namespace) -> int:
    """`offrl tune`: run the search, print the table and summary; 1 when no trial completed."""
    result = tune(args.config, objective=args.objective, trials=args.trials, lcb=args.lcb, storage=args.storage,
                  study_name=args.study_name, out=args.out, seed=args.seed, prune=not args.no_prune,
                  report_every=args.report_every, progress=not args.no_progress,
                  objective_params=dict(args.objective_param) or None)
    if len(result.frame):
        print(result.frame.drop(columns=["error"], errors="ignore").to_string(index=False))
    for summary in result.studies:
        for line in _summary_lines(summary):
            print(line)
    print(f"report in {result.paths['html']}")
    return 0 if all("best_trial" in s for s in result.studies) else 1
