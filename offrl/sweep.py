"""Benchmark sweeps: datasets x algorithms x hyper-parameter grid x seeds.

A YAML config is validated as a whole before any run starts (errors name the
file, line and key): every hyper-parameter of every grid point against the
estimator's declared rules, every environment against gymnasium's registry,
every name that becomes a folder against `check_path_name`, and no YAML key
twice.  Each run owns a directory holding its resolved config and hash,
training/eval CSVs, a checkpoint, the model and `result.json`; a run whose
`result.json` matches its config hash (and the parameters, defaults included,
that the code would build it with now) is skipped, and an interrupted run
resumes its checkpoint, so a stopped sweep resumes where it left off.  What a
different configuration left in a run's directory is removed before it
trains.  One process at a time writes a run's directory (it holds the
directory's lock; a sweep that finds a run locked by another process takes
its other runs first and waits for that one last), and pool workers die with
the sweep's process.  Runs
execute in a local process pool or as Ray tasks, with the same outputs.

OPE asked for with `run_sweep(..., ope=[...])` (`offrl sweep --ope FQE,DR`)
is kept out of the run hash: a finished run whose result lacks a requested
estimator is not trained again; its saved model is loaded and only the
missing estimates are added to its `result.json`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import itertools
import json
import numbers
import os
import re
import shutil
import signal
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import yaml

from offrl.datasets.core import atomic_write_path
from offrl.datasets.files import LockTimeoutError, check_inside, check_path_name, wait_for_lock

__all__ = ["ConfigError", "SweepConfig", "UniqueKeyLoader", "load_config", "parse_config", "expand_runs", "run_sweep",
           "select_runs", "execute_run", "run_lock_path", "runs_on", "env_problem", "parse_ope_estimators",
           "ope_settings", "ope_missing"]

_TOP_KEYS = {"name", "datasets", "algorithms", "seeds", "steps", "eval", "ope", "checkpoint_every", "device",
             "threads_per_run", "out", "log_every", "presets"}
_EVAL_KEYS = {"every", "episodes", "env"}
_OPE_KEYS = {"estimators", "gamma", "rollouts", "fqe_params", "mb_params", "marginal_params"}
# The estimators' own settings in the `ope:` block: FQE's (also the Q of DR, WDR and MDR), ModelBased's (MB and the
# model-based CDFs) and the marginal ratios' (MIS, SNMIS, MDR, MQL).  They change no training, so unlike the other
# `ope:` keys they do not enter the run hash.
_OPE_PARAM_KEYS = ("fqe_params", "mb_params", "marginal_params")
_UNHASHED_OPE_KEYS = _OPE_PARAM_KEYS
_OPE_DEFAULTS = {"estimators": ["FQE"], "gamma": 0.99, "rollouts": 10}
# Settings the `ope:` block sets itself (gamma) or the run does (its seed), so fqe_params and mb_params may not.
_FQE_FIXED = {"gamma": "ope.gamma", "horizon": "the logged episodes", "random_state": "the run's seed"}
_DATASET_KEYS = {"spec", "eval_env", "build", "label"}
# What a dataset's `build:` mapping may set for an offrl: dataset (the budget of `offrl datasets build`).
_BUILD_OPTIONS = {"seed", "n_transitions", "sac_steps", "eval_every", "eval_episodes", "ref_episodes", "sac_params",
                  "n_envs", "env_id", "expert"}
# Hyper-parameters the sweep sets itself, and from what.
_SWEEP_PARAMS = {"random_state": "seeds", "device": "device", "n_steps": "steps"}
# What an algorithm's `online:` mapping may set (offline then online: `fit_online` after `fit`).
_ONLINE_KEYS = {"steps", "strategy", "offline_data", "n_envs", "eval_every", "buffer_size"}
# Learners with no offline phase: allowed only with `online:`, trained from scratch by their own `fit_online`.
_ONLINE_LEARNERS = ("SAC",)


class ConfigError(ValueError):
    """A sweep config problem, located by file, line and key."""

    def __init__(self, source: str, line: int | None, key: str, message: str) -> None:
        where = f"{source}:{line + 1}" if line is not None else source
        super().__init__(f"{where}: {key or '<top>'}: {message}")
        self.source, self.line, self.key = source, line, key


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A YAML mapping names one key twice (PyYAML would silently keep the last)."""

    def __init__(self, key: Any, first_line: int, node: Any, mark: Any) -> None:
        super().__init__("while constructing a mapping", node.start_mark,
                         f"found duplicate key {key!r} (first on line {first_line + 1})", mark)
        self.key, self.first_line = key, first_line


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, refusing a mapping that names a key twice (e.g. two `IQL:` under `algorithms:`)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: merged keys may be overridden
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line)
                except TypeError:  # an unhashable key: SafeLoader's own error says so
                    continue
                if first != key_node.start_mark.line:
                    raise DuplicateKeyError(key, first, node, key_node.start_mark)
        return super().construct_mapping(node, deep)


def _node_lines(node: Any, prefix: str = "", lines: dict[str, int] | None = None) -> dict[str, int]:
    """Map dotted key paths ('algorithms.IQL.expectile', 'datasets.0') to 0-based YAML line numbers."""
    lines = {} if lines is None else lines
    lines.setdefault(prefix, node.start_mark.line)
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
            lines.setdefault(path, key_node.start_mark.line)
            _node_lines(value_node, path, lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            path = f"{prefix}.{i}" if prefix else str(i)
            lines[path] = item.start_mark.line
            _node_lines(item, path, lines)
    return lines


@dataclass
class SweepConfig:
    """A validated sweep: what to run, and where each key came from."""

    name: str
    datasets: list[dict[str, Any]]
    algorithms: dict[str, dict[str, Any]]  # label -> {"algorithm": name, "grid": {param: [values]}}
    seeds: list[int]
    steps: int
    eval: dict[str, Any]
    ope: dict[str, Any] | None
    checkpoint_every: int | None = None
    device: str = "cpu"
    threads_per_run: int = 1
    log_every: int = 100
    presets: bool = True
    out: str | None = None
    source: str = "<config>"
    raw: dict[str, Any] = field(default_factory=dict)
    # Estimators asked for on top of the config (`--ope`): they replace `ope.estimators` but, unlike the `ope:`
    # block, stay out of the run hash, so asking for them never retrains a run.
    ope_request: list[str] | None = None


def load_config(path: str | os.PathLike, check_datasets: bool = True, *,
                algorithms: str | Sequence[str] | None = None, datasets: str | Sequence[str] | None = None,
                seeds: str | Sequence[int] | None = None) -> SweepConfig:
    """Read and validate a sweep YAML file (a key given twice in one mapping is an error).

    `algorithms`, `datasets` and `seeds` select part of it (`select_runs`); then only the selected data are
    checked, so data the selection leaves out need not exist.
    """
    if algorithms is not None or datasets is not None or seeds is not None:
        whole = load_config(path, check_datasets=False)
        return select_runs(whole, algorithms=algorithms, datasets=datasets, seeds=seeds, check_datasets=check_datasets)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"sweep config {path} does not exist")
    text = path.read_text()
    node = None
    try:
        node = yaml.compose(text, Loader=UniqueKeyLoader)
        raw = yaml.load(text, Loader=UniqueKeyLoader)
    except DuplicateKeyError as err:
        line = err.problem_mark.line
        lines = _node_lines(node) if node is not None else {}
        key = next((k for k, v in lines.items() if v == err.first_line and k.rsplit(".", 1)[-1] == str(err.key)),
                   str(err.key))
        raise ConfigError(str(path), line, key, f"duplicate key {err.key!r} (first on line {err.first_line + 1}); "
                          "YAML would keep only the last one, so give each key once") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        raise ConfigError(str(path), None if mark is None else mark.line, "", f"invalid YAML ({err})") from err
    lines = _node_lines(node) if node is not None else {}
    return parse_config(raw, source=str(path), lines=lines, check_datasets=check_datasets,
                        default_name=_safe_name(path.stem))


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _safe_name(text: str, fallback: str = "sweep") -> str:
    """`text` made a safe file name: odd characters and a leading dot become '_' (for names the sweep derives)."""
    name = re.sub(r"[^A-Za-z0-9_.+-]", "_", text)
    name = "_" + name[1:] if name.startswith(".") else name
    return name or fallback


def env_problem(env_id: Any) -> str | None:
    """Why `env_id` cannot be an evaluation env (None when it can): 'auto', None or a registered gymnasium id.

    A `package:Env-vN` id imports the package first, as `gymnasium.make` does.
    """
    if env_id is None or env_id == "auto":
        return None
    if not isinstance(env_id, str) or not env_id:
        return f"must be a gymnasium id, 'auto' (the dataset's env) or null (no evaluation), got {env_id!r}"
    import gymnasium as gym

    module, sep, name = env_id.rpartition(":")
    if sep:
        try:
            importlib.import_module(module)
        except ImportError as err:
            return f"{env_id!r} needs the module {module!r}, which cannot be imported ({err}); install it"
    try:
        gym.spec(name)
    except gym.error.Error as err:
        return (f"{env_id!r} is not a registered gymnasium environment ({err}); use a registered id such as "
                "'Pendulum-v1', 'auto' (the dataset's env) or null (no evaluation)")
    return None


def parse_config(
    raw: Any,
    source: str = "<config>",
    lines: Mapping[str, int] | None = None,
    check_datasets: bool = True,
    default_name: str = "sweep",
) -> SweepConfig:
    """Validate a config mapping (as loaded from YAML); every problem is a ConfigError.

    Everything a run would trip over is checked here, before any run starts:
    each grid point's hyper-parameters (with the estimator's own rules),
    environments, seeds and counts, and the names that become folders.
    """
    lines = lines or {}

    def fail(key: str, message: str) -> ConfigError:
        lookup = re.sub(r"\[(\d+)\]", r".\1", key)  # 'algorithms.BC.lr[1]' sits on the line of 'algorithms.BC.lr.1'
        line = lines.get(lookup)
        parts = lookup.split(".")
        while line is None and parts:
            parts = parts[:-1]
            line = lines.get(".".join(parts))
        return ConfigError(source, line, key, message)

    def count(key: str, value: Any, low: int = 1) -> int:
        if not _is_int(value) or value < low:
            raise fail(key, f"{key.rsplit('.', 1)[-1]} must be an integer >= {low}, got {value!r}")
        return int(value)

    if not isinstance(raw, dict):
        raise fail("", "the config must be a mapping with datasets, algorithms, seeds and steps")
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        key = sorted(map(str, unknown))[0]
        raise fail(key, f"unknown key {key!r}; allowed keys are {sorted(_TOP_KEYS)}")
    for key in ("datasets", "algorithms", "steps"):
        if key not in raw:
            raise fail("", f"missing required key {key!r}")

    name = raw.get("name")
    if name is None:
        name = _safe_name(default_name)
    else:
        try:
            check_path_name(name, "name")  # the default output folder is offrl-results/<name>
        except (TypeError, ValueError) as err:
            raise fail("name", str(err)) from None
    out = raw.get("out")
    if out is not None and (not isinstance(out, str) or not out):
        raise fail("out", f"out must be a folder path (a string) or null, got {out!r}")

    datasets = _parse_datasets(raw["datasets"], fail, check_datasets)
    algorithms = _parse_algorithms(raw["algorithms"], fail, check_datasets, [d["label"] for d in datasets])

    seeds_raw = raw.get("seeds", [0])
    if _is_int(seeds_raw):
        if seeds_raw < 1:
            raise fail("seeds", "an integer seeds gives the number of seeds and must be at least 1")
        seeds = list(range(seeds_raw))
    elif isinstance(seeds_raw, list) and seeds_raw and all(_is_int(s) for s in seeds_raw):
        seeds = [int(s) for s in seeds_raw]
        bad = [s for s in seeds if not 0 <= s < 2**63]
        if bad:
            raise fail("seeds", f"seeds must be non-negative integers below 2**63 (each is a run's random_state), "
                                f"got {bad[0]}")
        if len(set(seeds)) != len(seeds):
            raise fail("seeds", f"seeds repeat: {seeds}")
    else:
        raise fail("seeds", f"seeds must be a non-empty list of integers or a count, got {seeds_raw!r}")

    steps = count("steps", raw["steps"])

    eval_cfg = raw.get("eval") or {}
    if not isinstance(eval_cfg, dict):
        raise fail("eval", "eval must be a mapping with every, episodes and env")
    bad = set(eval_cfg) - _EVAL_KEYS
    if bad:
        raise fail(f"eval.{sorted(map(str, bad))[0]}", f"unknown eval key; allowed: {sorted(_EVAL_KEYS)}")
    eval_cfg = {"every": eval_cfg.get("every", max(steps // 10, 1)), "episodes": eval_cfg.get("episodes", 10),
                "env": eval_cfg.get("env", "auto")}
    for key in ("every", "episodes"):
        count(f"eval.{key}", eval_cfg[key])
    problem = env_problem(eval_cfg["env"])
    if problem:
        raise fail("eval.env", problem)
    for label, algo in algorithms.items():
        if "online" not in algo:
            continue
        for dataset in datasets:  # going online needs an env to act in: the run's evaluation env
            env = eval_cfg["env"] if dataset["eval_env"] == "auto" else dataset["eval_env"]
            if env is None:
                where = (f"dataset {dataset['label']!r} sets eval_env: null" if dataset["eval_env"] is None
                         else "eval.env is null")
                raise fail(f"algorithms.{label}.online", f"{where}, so there is no environment to fine-tune in; "
                                                         "give an evaluation env or drop online:")

    ope = raw.get("ope")
    if ope is not None:
        if not isinstance(ope, dict):
            raise fail("ope", "ope must be a mapping with estimators, gamma and rollouts")
        bad = set(ope) - _OPE_KEYS
        if bad:
            raise fail(f"ope.{sorted(map(str, bad))[0]}", f"unknown ope key; allowed: {sorted(_OPE_KEYS)}")
        estimator_params = {key: ope[key] for key in _OPE_PARAM_KEYS if key in ope}
        ope = {key: ope.get(key, default) for key, default in _OPE_DEFAULTS.items()}
        if not isinstance(ope["estimators"], list) or not ope["estimators"]:
            raise fail("ope.estimators", "estimators must be a non-empty list of estimator names")
        if not _is_real(ope["gamma"]) or not 0 < ope["gamma"] <= 1:
            raise fail("ope.gamma", f"gamma must be a number in (0, 1], got {ope['gamma']!r}")
        count("ope.rollouts", ope["rollouts"])
        _check_estimators(ope["estimators"], fail)
        for key, value in estimator_params.items():  # only when given, so the ope block of an older config is unchanged
            ope[key] = _check_ope_params(key, value, fail)

    checkpoint_every = raw.get("checkpoint_every")
    if checkpoint_every is not None:
        count("checkpoint_every", checkpoint_every)
    threads = count("threads_per_run", raw.get("threads_per_run", 1))
    log_every = count("log_every", raw.get("log_every", 100))
    presets = raw.get("presets", True)
    if not isinstance(presets, bool):
        raise fail("presets", f"presets must be true or false, got {presets!r}")
    from offrl.algos.params import device_name

    device = raw.get("device", "cpu")
    rule = device_name()
    if not rule.ok(device):
        raise fail("device", f"device must be {rule.allowed}, got {device!r}")
    return SweepConfig(
        presets=presets,
        name=name,
        datasets=datasets,
        algorithms=algorithms,
        seeds=seeds,
        steps=steps,
        eval=eval_cfg,
        ope=ope,
        checkpoint_every=checkpoint_every,
        device=device,
        threads_per_run=threads,
        log_every=log_every,
        out=out,
        source=source,
        raw=raw,
    )


def _build_option_rules() -> dict[str, Any]:
    """What each `build:` option of an offrl: dataset may be (the builder's own checks then apply)."""
    from offrl.algos.params import Rule, choice, integer
    from offrl.datasets.built import EXPERT_CHOICES

    mapping = Rule(lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v),
                   "a mapping of SAC hyper-parameters")
    text = Rule(lambda v: isinstance(v, str) and bool(v), "a gymnasium id")
    return {"seed": integer(0), "n_transitions": integer(1), "sac_steps": integer(1), "eval_every": integer(1),
            "eval_episodes": integer(10), "ref_episodes": integer(10), "n_envs": integer(1), "sac_params": mapping,
            "env_id": text, "expert": choice(*EXPERT_CHOICES)}


def _parse_datasets(value: Any, fail: Any, check: bool) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise fail("datasets", "datasets must be a non-empty list of load specs (d4rl:, minari:, offrl:, paths)")
    out = []
    for i, item in enumerate(value):
        key = f"datasets.{i}"
        if isinstance(item, str):
            item = {"spec": item}
        if not isinstance(item, dict) or not isinstance(item.get("spec"), str) or not item["spec"]:
            raise fail(key, "each dataset is a load spec string or a mapping with a 'spec' string")
        bad = set(item) - _DATASET_KEYS
        if bad:
            raise fail(f"{key}.{sorted(map(str, bad))[0]}", f"unknown dataset key; allowed: {sorted(_DATASET_KEYS)}")
        build = item.get("build", True)
        options: dict[str, Any] = {}
        if isinstance(build, dict):  # build options of an offrl: dataset, e.g. {sac_steps: 200000}
            if not item["spec"].startswith("offrl:"):
                raise fail(f"{key}.build", "build options apply only to offrl: datasets; use true or false")
            bad = set(build) - _BUILD_OPTIONS
            if bad:
                raise fail(f"{key}.build.{sorted(map(str, bad))[0]}",
                           f"unknown build option; allowed: {sorted(_BUILD_OPTIONS)}")
            for option, rule in _build_option_rules().items():
                if option in build and not rule.ok(build[option]):
                    raise fail(f"{key}.build.{option}", f"{option} must be {rule.allowed}, got {build[option]!r}")
            options, build = dict(build), True
        elif not isinstance(build, bool):
            raise fail(f"{key}.build", f"build must be true, false or a mapping of build options, got {build!r}")
        label = item.get("label")
        if label is None:  # derived from the spec (a path, an id): made safe rather than refused
            label = _safe_name(item["spec"].split(":", 1)[-1], fallback="dataset")
        else:
            try:
                check_path_name(label, "label")  # it names the dataset's folder of runs
            except (TypeError, ValueError) as err:
                raise fail(f"{key}.label", str(err)) from None
        eval_env = item.get("eval_env", "auto")
        problem = env_problem(eval_env)
        if problem:
            raise fail(f"{key}.eval_env", problem)
        entry = {"spec": item["spec"], "eval_env": eval_env, "build": build, "label": label}
        if options:
            entry["build_options"] = options
        if check:
            problem = dataset_problem(entry["spec"], build=entry["build"], options=options)
            if problem:
                raise fail(key, problem)
        out.append(entry)
    labels = [d["label"] for d in out]
    if len(set(labels)) != len(labels):
        raise fail("datasets", f"dataset labels repeat: {labels}; give each a distinct 'label'")
    return out


def dataset_problem(spec: str, build: bool = True, options: Mapping[str, Any] | None = None) -> str | None:
    """Why `spec` cannot be loaded, or None if it can (without loading it).

    An `offrl:` dataset is fine when `build` is set and its budget is one the
    builder accepts (it is built on first use), or when it is built with the
    budget `options`.
    """
    from offrl.datasets import d4rl

    scheme, sep, rest = spec.partition(":")
    if sep and scheme == "d4rl":
        try:
            found = d4rl.find_d4rl_file(rest)
        except ValueError as err:
            return str(err)
        return None if found else d4rl.missing_d4rl_message(rest)
    if sep and scheme == "minari":
        from minari.storage.datasets_root_dir import get_dataset_path

        try:
            path = get_dataset_path(rest)
        except Exception as err:  # malformed id
            return f"bad Minari dataset id {rest!r} ({err})"
        if not (Path(path) / "data").exists():
            return f"Minari dataset {rest!r} not found under {path}; run `minari download {rest}` or set MINARI_DATASETS_PATH"
        return None
    if sep and scheme == "offrl":
        from offrl.datasets.built import built_record, parse_name

        try:
            parse_name(rest)
            if build:
                from offrl.builder import check_build

                check_build(rest, **(options or {}))
                return None
            if built_record(rest, **(options or {})) is not None:
                return None
        except (ValueError, TypeError) as err:
            return str(err)
        return f"offrl dataset {rest!r} is not built; run `offrl datasets build {rest}` or set build: true"
    path = Path(os.path.expandvars(spec)).expanduser()
    if path.suffix not in (".hdf5", ".h5", ".npz"):
        return f"cannot load {spec!r}: use d4rl:<name>, minari:<id>, offrl:<name>, or a .hdf5/.npz path"
    return None if path.exists() else f"dataset file {path} does not exist"


def _algorithm_class(name: str) -> type:
    import offrl.algos as algos

    from offrl.algos.base import OfflineAlgorithm

    try:
        cls = getattr(algos, name)
    except (AttributeError, ImportError):
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, OfflineAlgorithm) and cls is not OfflineAlgorithm):
        raise KeyError(name)
    return cls


def _learner_class(name: str) -> type:
    """The class of a sweep entry's algorithm: an offline algorithm, or an online-only learner (SAC)."""
    try:
        return _algorithm_class(name)
    except KeyError:
        if name not in _ONLINE_LEARNERS:
            raise
        from offrl import algos

        return getattr(algos, name)


def _is_online_learner(name: str) -> bool:
    return name in _ONLINE_LEARNERS


def available_algorithms() -> list[str]:
    import offrl.algos as algos

    names = []
    for name in algos.__all__:
        try:
            _algorithm_class(name)
        except (KeyError, ImportError):
            continue
        names.append(name)
    return names


def _parse_algorithms(value: Any, fail: Any, check_datasets: bool = True,
                      dataset_labels: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    from offrl.algos.params import InvalidParameterError, check_params

    if not isinstance(value, dict) or not value:
        raise fail("algorithms", "algorithms must be a mapping of algorithm name -> hyper-parameters (a list means a grid)")
    out = {}
    for label, params in value.items():
        key = f"algorithms.{label}"
        try:
            check_path_name(label, "algorithm key")  # it names the runs' folders
        except (TypeError, ValueError) as err:
            raise fail(key, str(err)) from None
        params = {} if params is None else params
        if not isinstance(params, dict):
            raise fail(key, f"the hyper-parameters of {label} must be a mapping of name -> value (a list of values "
                            f"is a grid), got {params!r}")
        params = dict(params)
        name = params.pop("algorithm", label)
        labelers = _parse_labelers(params.pop("labelers", None), f"{key}.labelers", fail, check_datasets)
        only = params.pop("datasets", None)
        if only is not None and not (isinstance(only, list) and only and all(isinstance(d, str) for d in only)):
            raise fail(f"{key}.datasets", f"datasets must be a non-empty list of the dataset labels {label} runs on "
                                          f"(e.g. [hopper-medium-v2]); leave it out to run on every dataset, got "
                                          f"{only!r}")
        unknown = [d for d in only or () if d not in dataset_labels]
        if unknown:
            raise fail(f"{key}.datasets", f"no dataset is labelled {unknown[0]!r}; the config's dataset labels are "
                                          f"{list(dataset_labels)}")
        has_online, online_raw = "online" in params, params.pop("online", None)
        if not isinstance(name, str):
            raise fail(f"{key}.algorithm", f"algorithm must be an algorithm name such as 'IQL', got {name!r}")
        try:
            cls = _learner_class(name)
        except KeyError:
            raise fail(key, f"unknown algorithm {name!r}; available: {available_algorithms()} "
                            f"(and, with an online: block, {', '.join(_ONLINE_LEARNERS)})") from None
        if _is_online_learner(name) and not has_online:
            raise fail(key, f"{name} learns online and needs an online: block (e.g. online: {{steps: 100000}}); "
                            "it has no offline phase to run alone")
        template = cls()
        defaults = template.get_params()
        grid = {}
        for param, spec in params.items():
            pkey = f"{key}.{param}"
            if param in _SWEEP_PARAMS:
                raise fail(pkey, f"{param} is set by the sweep (its {_SWEEP_PARAMS[param]!r}), not per algorithm")
            if param not in defaults:
                raise fail(pkey, f"{name} has no hyper-parameter {param!r}; valid ones: {sorted(defaults)}")
            values, keys = _grid_values(spec, defaults[param], pkey, fail)
            for i, (v, vkey) in enumerate(zip(values, keys)):
                try:
                    check_params(template, {param: v})
                except InvalidParameterError as err:
                    if isinstance(v, dict):  # settings where the hyper-parameter takes none, or a grid miswritten
                        hint = ("a mapping value is a grid only as {grid: [v1, v2, ...]}" if vkey == pkey
                                else f"malformed grid value {v!r}")
                        raise fail(vkey, f"{err}; {hint}") from None
                    raise fail(vkey, str(err)) from None
                if v in values[:i]:
                    raise fail(pkey, f"the grid repeats {v!r}; each value makes one variant, so list it once")
            grid[param] = values
        names = sorted(grid)
        for point in itertools.product(*(grid[n] for n in names)):  # as the runs will build them
            settings = dict(zip(names, point))
            try:
                cls(**settings).check_params()
            except (InvalidParameterError, TypeError, ValueError) as err:
                raise fail(key, f"the grid point {settings}: {err}") from None
        out[label] = {"algorithm": name, "grid": grid}
        if only is not None:  # not hashed: it says which runs exist, not how one trains
            out[label]["datasets"] = list(dict.fromkeys(only))
        if labelers:
            out[label]["labelers"] = labelers
        if has_online:
            if not (_is_online_learner(name) or template.has_critic):
                raise fail(f"{key}.online", f"{name} has no critic to continue online; fine-tune an algorithm with a "
                                            "policy and a critic (TD3PlusBC, IQL, CQL, CalQL)")
            online = _parse_online(online_raw, f"{key}.online", fail, name)
            points = list(itertools.product(*(grid[n] for n in names)))
            for point in points:
                problem = _online_problem(name, {**defaults, **dict(zip(names, point))}, online)
                if problem:
                    raise fail(f"{key}.online.strategy", problem if len(points) == 1 else
                               f"the grid point {dict(zip(names, point))}: {problem}")
            out[label]["online"] = online
    return out


def _parse_online(value: Any, key: str, fail: Any, algorithm: str) -> dict[str, Any]:
    """An algorithm's `online:` mapping, with its defaults filled in (it enters the run hash as resolved).

    `strategy` is kept as written (a name or {name: params}), after `resolve_strategy` has accepted it; an
    online-only learner without one keeps its own recipe (None).
    """
    from offrl.online.strategies import resolve_strategy

    if not isinstance(value, dict):
        raise fail(key, f"online must be a mapping with steps (required), strategy, offline_data, n_envs, "
                        f"eval_every and buffer_size, got {value!r}")
    unknown = set(value) - _ONLINE_KEYS
    if unknown:
        bad = sorted(map(str, unknown))[0]
        raise fail(f"{key}.{bad}", f"unknown online key {bad!r}; allowed: {sorted(_ONLINE_KEYS)}")
    if "steps" not in value:
        raise fail(key, "online needs steps: the number of online environment steps")

    def count(name: str, default: Any = None) -> int:
        number = value.get(name, default)
        if not _is_int(number) or number < 1:
            raise fail(f"{key}.{name}", f"{name} must be an integer >= 1, got {number!r}")
        return int(number)

    steps = count("steps")
    online: dict[str, Any] = {"steps": steps, "n_envs": count("n_envs", 1),
                              "eval_every": count("eval_every", max(steps // 20, 1))}
    if "buffer_size" in value:
        online["buffer_size"] = count("buffer_size")
    offline_data = value.get("offline_data", True)
    if not isinstance(offline_data, bool):
        raise fail(f"{key}.offline_data", f"offline_data must be true or false, got {offline_data!r}")
    online["offline_data"] = offline_data
    strategy = value.get("strategy", None if _is_online_learner(algorithm) else "naive")
    if isinstance(strategy, dict) and len(strategy) == 1:
        (name, params), = strategy.items()
        strategy = {name: {} if params is None else params}
    if strategy is not None:
        try:
            resolved = resolve_strategy(strategy)
        except (ValueError, TypeError) as err:
            raise fail(f"{key}.strategy", str(err)) from None
        if isinstance(strategy, dict):
            (name, params), = strategy.items()
            strategy = {name: dict(params)}
        if not offline_data and resolved.offline_fraction is not None:
            raise fail(f"{key}.offline_data", f"the {resolved.name!r} strategy draws {resolved.offline_fraction:g} "
                                              "of every batch from the offline data; set offline_data: true")
    online["strategy"] = strategy
    first_eval = -(-online["eval_every"] // online["n_envs"]) * online["n_envs"]
    if min(first_eval, steps) > steps / 10:
        warnings.warn(f"{key}.eval_every: the first online evaluation is at step {min(first_eval, steps)}, after the "
                      f"first 10% of the {steps} online steps, so the dip (the lowest score there) cannot be "
                      f"measured; use eval_every <= {steps // 10}", UserWarning, stacklevel=2)
    return online


def _online_problem(algorithm: str, params: Mapping[str, Any], online: Mapping[str, Any]) -> str | None:
    """Why an algorithm with `params` cannot go online with `online`'s strategy (None when it can): what
    `fit_online` would refuse after the offline phase, said before any run starts."""
    from offrl.online.strategies import CalQLFineTuning, resolve_strategy

    cls = _learner_class(algorithm)
    if online.get("strategy") is None:
        return None
    strategy = resolve_strategy(online["strategy"])
    if isinstance(strategy, CalQLFineTuning) and not issubclass(cls, _learner_class("CalQL")):
        return (f"the 'calql' strategy fine-tunes a calibrated critic and needs a CalQL algorithm, not {algorithm}; "
                "use another strategy ('naive', 'wsrl', 'rlpd', 'jsrl', 'e2o')")
    if _is_online_learner(algorithm):  # it builds the critics the strategy asks for
        return None
    n = params.get("n_critics")
    if strategy.n_critics is not None and n != strategy.n_critics:
        return (f"the {strategy.name!r} strategy uses {strategy.n_critics} critics, but {algorithm} is trained with "
                f"{'no critic ensemble' if n is None else n}; set n_critics: {strategy.n_critics} (the recipe "
                "pre-trains its ensemble)")
    if strategy.critic_subset is not None and (n is None or strategy.critic_subset > n):
        return (f"the {strategy.name!r} strategy draws {strategy.critic_subset} critics per update, but {algorithm} "
                f"has {'none' if n is None else n}")
    return None


def _labeler_classes() -> dict[str, type]:
    """The dataset transformers a sweep may put in front of an algorithm, by class name."""
    import offrl.reward_labeling as reward_labeling
    from offrl.datasets.transformers import DatasetTransformer, RewardScaler

    classes = {name: getattr(reward_labeling, name) for name in reward_labeling.__all__}
    classes["RewardScaler"] = RewardScaler
    return {n: c for n, c in classes.items() if isinstance(c, type) and issubclass(c, DatasetTransformer)}


def _parse_labelers(value: Any, key: str, fail: Any, check_datasets: bool = True) -> list[list[Any]]:
    """`labelers:` of an algorithm: a list of {ClassName: {param: value}} applied in order before fitting.

    Returned as [[name, params], ...] (JSON-shaped, so it enters the run hash as written).
    """
    if value is None:
        return []
    from offrl.algos.params import InvalidParameterError, check_params

    items = value if isinstance(value, list) else [value]
    classes = _labeler_classes()
    out = []
    for i, item in enumerate(items):
        ikey = f"{key}.{i}" if isinstance(value, list) else key
        if not (isinstance(item, dict) and len(item) == 1):
            raise fail(ikey, f"each labeler is a one-key mapping {{ClassName: {{param: value}}}}, got {item!r}; "
                             f"available: {sorted(classes)}")
        (name, params), = item.items()
        if name not in classes:
            raise fail(ikey, f"unknown labeler {name!r}; available: {sorted(classes)}")
        params = {} if params is None else params
        if not isinstance(params, dict):
            raise fail(f"{ikey}.{name}", f"the parameters of {name} must be a mapping of name -> value, got {params!r}")
        try:
            labeler = classes[name](**params)
        except TypeError as err:
            raise fail(f"{ikey}.{name}", f"{name}: {err}") from None
        if hasattr(labeler, "_param_rules"):
            try:
                check_params(labeler)
            except InvalidParameterError as err:
                raise fail(f"{ikey}.{name}", str(err)) from None
        if "expert" in labeler.get_params():  # demonstrations: a load spec that must exist now, not at run time
            expert = params.get("expert")
            problem = (f"{name} needs expert demonstrations: expert: <load spec>" if not isinstance(expert, str)
                       else dataset_problem(expert, build=False) if check_datasets else None)
            if problem:
                raise fail(f"{ikey}.{name}.expert", problem)
        out.append([name, dict(params)])
    return out


def make_labelers(specs: Sequence[Sequence[Any]], seed: int | None = None,
                  device: str | None = None) -> list[tuple[str, Any]]:
    """The (step name, transformer) pairs of a run's `labelers`.  A labeller whose config leaves `random_state`
    or `device` unset takes the run's seed and the sweep's device."""
    from offrl.pipeline import _step_names

    classes = _labeler_classes()
    labelers = []
    for name, params in specs:
        labeler = classes[name](**params)
        defaults = labeler.get_params()
        if seed is not None and "random_state" in defaults and "random_state" not in params:
            labeler.set_params(random_state=seed)
        if device is not None and "device" in defaults and "device" not in params:
            labeler.set_params(device=device)
        labelers.append(labeler)
    return list(zip(_step_names(tuple(labelers)), labelers))


def _grid_values(spec: Any, default: Any, key: str, fail: Any) -> tuple[list[Any], list[str]]:
    """The values of one hyper-parameter and the config key of each.

    A list is a grid, except for list-valued hyper-parameters (e.g. hidden_dims), where a list of lists is.
    A mapping is a grid when its one key is `grid`; any other mapping is one value, for the hyper-parameters
    that take a mapping of settings (e.g. `guide`; the caller checks that the hyper-parameter accepts it).
    """
    if isinstance(spec, dict) and set(spec) != {"grid"}:
        return [spec], [key]
    if isinstance(spec, dict):
        spec = spec["grid"]
        if not isinstance(spec, list):
            raise fail(key, "grid must be a list of values")
        values, keys = spec, [f"{key}.grid[{i}]" for i in range(len(spec))]
    elif isinstance(default, (list, tuple)):
        grid = isinstance(spec, list) and spec and all(isinstance(v, list) for v in spec)
        values, keys = (spec, [f"{key}[{i}]" for i in range(len(spec))]) if grid else ([spec], [key])
    else:
        values, keys = (spec, [f"{key}[{i}]" for i in range(len(spec))]) if isinstance(spec, list) else ([spec], [key])
    if not values:
        raise fail(key, "a grid needs at least one value")
    for v, vkey in zip(values, keys):
        if isinstance(v, list) and not isinstance(default, (list, tuple)):  # (a mapping is checked by the caller)
            raise fail(vkey, f"malformed grid value {v!r}; use scalars, e.g. [0.7, 0.9]")
    return [tuple(v) if isinstance(v, list) else v for v in values], keys


def _check_estimators(names: list[Any], fail: Any) -> None:
    """Each name one `offrl.ope.evaluate` accepts (a short or class name, any case), none twice."""
    from offrl.ope.api import estimator_key

    seen: dict[str, Any] = {}
    for i, name in enumerate(names):
        if not isinstance(name, str):
            raise fail(f"ope.estimators.{i}", f"an estimator is given by its name (e.g. FQE), got {name!r}")
        try:
            key = estimator_key(name)
        except ValueError as err:
            raise fail(f"ope.estimators.{i}", f"OPE: {err}") from None
        if key in seen:
            raise fail(f"ope.estimators.{i}", f"{name!r} names the estimator {key} again (as {seen[key]!r}); "
                                              "list each estimator once")
        seen[key] = name


def parse_ope_estimators(names: str | Sequence[str]) -> list[str]:
    """OPE estimator names, as a comma-separated text ('FQE,DR,WPDIS') or a list, checked by the rules of
    `ope.estimators` and returned as `offrl.ope.ESTIMATORS` keys; a ValueError names the first bad one."""
    from offrl.ope.api import estimator_key

    items = names.split(",") if isinstance(names, str) else list(names)
    items = [str(item).strip() for item in items]
    if not items or not all(items):
        raise ValueError(f"give estimator names separated by commas, e.g. FQE,DR, got {names!r}")
    keys: list[str] = []
    for item in items:
        key = estimator_key(item)  # "unknown estimator 'X'; choose from [...]"
        if key in keys:
            raise ValueError(f"{item!r} names the estimator {key} twice; list each estimator once")
        keys.append(key)
    return keys


def _check_ope_params(key: str, value: Any, fail: Any) -> dict[str, Any]:
    """`ope.fqe_params` / `ope.mb_params`: FQE / ModelBased hyper-parameters (e.g. n_steps), checked with the
    estimator's own rules; `ope.marginal_params`: the marginal ratios' settings (features, ridge, ...)."""
    from offrl.algos.params import InvalidParameterError, check_params
    from offrl.ope import FQE, ModelBased
    from offrl.ope.marginal import check_marginal_params

    if key == "marginal_params":
        try:
            return check_marginal_params(value, "ope.marginal_params")
        except ValueError as err:
            raise fail("ope.marginal_params", str(err)) from None
    cls = FQE if key == "fqe_params" else ModelBased
    if not isinstance(value, dict):
        raise fail(f"ope.{key}", f"{key} must be a mapping of {cls.__name__} hyper-parameters, e.g. "
                                 f"{{n_steps: 5000}}, got {value!r}")
    defaults = cls().get_params()
    for name in value:
        if name in _FQE_FIXED:
            raise fail(f"ope.{key}.{name}", f"{name} is set by {_FQE_FIXED[name]}, not {key}")
        if name not in defaults:
            valid = sorted(set(defaults) - set(_FQE_FIXED))
            raise fail(f"ope.{key}.{name}", f"{cls.__name__} has no hyper-parameter {name!r}; valid ones: {valid}")
    try:
        estimator = cls(**value)
        check_params(estimator)
        if hasattr(estimator, "check_params"):
            estimator.check_params()
    except (InvalidParameterError, TypeError, ValueError) as err:
        raise fail(f"ope.{key}", str(err)) from None
    return dict(value)


def ope_settings(config: SweepConfig) -> dict[str, Any] | None:
    """The OPE every run of `config` gets: the `ope:` block, its estimators replaced by `config.ope_request`
    (`--ope`) when given, names as `offrl.ope.ESTIMATORS` keys; None when neither asks for OPE."""
    if config.ope is None and not config.ope_request:
        return None
    base = {**_OPE_DEFAULTS, **(config.ope or {})}
    estimators = config.ope_request or base["estimators"]
    return {"estimators": parse_ope_estimators(estimators), "gamma": float(base["gamma"]),
            "rollouts": int(base["rollouts"]), **{key: dict(base.get(key) or {}) for key in _OPE_PARAM_KEYS}}


# ---------------------------------------------------------------------------- runs
def _names(value: str | Sequence[Any] | None, what: str) -> list[str] | None:
    """A comma-separated string or a sequence of names as a list (None stays None); an empty one is an error."""
    if value is None:
        return None
    names = [n.strip() for n in value.split(",")] if isinstance(value, str) else [str(n) for n in value]
    names = [n for n in names if n]
    if not names:
        raise ValueError(f"{what} must name at least one, got {value!r}")
    return names


def select_runs(config: SweepConfig, algorithms: str | Sequence[str] | None = None,
                datasets: str | Sequence[str] | None = None,
                seeds: str | Sequence[int] | None = None, check_datasets: bool = False) -> SweepConfig:
    """The config restricted to some of its algorithm and dataset labels, and run with the given seeds.

    A selection changes which runs start, not what a run is: each run keeps the directory and hash it has in the
    whole config, so seeds 1-2 of one entry run now and seed 0 later make the same results as the whole sweep
    (and its summary lists every finished run in the output folder).  `seeds` replaces the config's seeds (more
    seeds than the file lists is fine); an unknown label is an error naming the config's own.
    `check_datasets` checks that the selected datasets (and labelers' demonstrations) can be loaded, for a config
    read without that check (`load_config` with a selection does this).
    """
    algo_names, data_names = _names(algorithms, "algorithms"), _names(datasets, "datasets")
    changes: dict[str, Any] = {}
    if algo_names is not None:
        unknown = [n for n in algo_names if n not in config.algorithms]
        if unknown:
            raise ValueError(f"algorithm label(s) {unknown} not in {config.source}; its algorithms are "
                             f"{sorted(config.algorithms)}")
        changes["algorithms"] = {k: v for k, v in config.algorithms.items() if k in algo_names}
    if data_names is not None:
        labels = [d["label"] for d in config.datasets]
        unknown = [n for n in data_names if n not in labels]
        if unknown:
            raise ValueError(f"dataset label(s) {unknown} not in {config.source}; its datasets are {labels}")
        changes["datasets"] = [d for d in config.datasets if d["label"] in data_names]
    if seeds is not None:
        parts = seeds.split(",") if isinstance(seeds, str) else list(seeds)
        try:
            chosen = [int(str(s).strip()) for s in parts if str(s).strip()]
        except ValueError:
            raise ValueError(f"seeds must be integers separated by commas (e.g. 1,2), got {seeds!r}") from None
        bad = [s for s in chosen if not 0 <= s < 2**63]
        if not chosen or bad or len(set(chosen)) != len(chosen):
            raise ValueError(f"seeds must be distinct non-negative integers below 2**63 (each is a run's "
                             f"random_state), got {seeds!r}")
        changes["seeds"] = chosen
    selected = dataclasses.replace(config, **changes)
    if not any(runs_on(a, d) for a in selected.algorithms.values() for d in selected.datasets):
        raise ValueError(f"no run of {config.source} matches: the selected algorithms "
                         f"{sorted(selected.algorithms)} run on none of the selected datasets "
                         f"{[d['label'] for d in selected.datasets]} (see their `datasets:` lists)")
    if check_datasets:
        _check_data(selected)
    return selected


def _check_data(config: SweepConfig) -> None:
    """The load checks `parse_config(check_datasets=True)` makes, on a parsed config's datasets and demonstrations."""
    for dataset in config.datasets:
        problem = dataset_problem(dataset["spec"], build=dataset["build"], options=dataset.get("build_options"))
        if problem:
            raise ConfigError(config.source, None, f"datasets ({dataset['label']})", problem)
    for label, algo in config.algorithms.items():
        for name, params in algo.get("labelers", []):
            if isinstance(params.get("expert"), str):
                problem = dataset_problem(params["expert"], build=False)
                if problem:
                    raise ConfigError(config.source, None, f"algorithms.{label}.labelers.{name}.expert", problem)


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=list).encode()).hexdigest()[:12]


def expand_runs(config: SweepConfig, out_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The cross product of datasets x algorithms x grid points x seeds, as plain dicts.

    Each point is checked once more as the estimator its runs will build (with
    the dataset's preset), and each run directory must lie inside `out_dir`/runs.
    """
    from offrl.algos.params import InvalidParameterError

    out_dir = Path(out_dir)
    runs_root = out_dir / "runs"
    # The `ope:` block enters the hash as it always has (older configs keep their hashes); what only OPE
    # reads (fqe_params, the --ope request) goes to the run beside the hash, as `ope_request`.
    hashed_ope = None if config.ope is None else {k: v for k, v in config.ope.items() if k not in _UNHASHED_OPE_KEYS}
    request = ope_settings(config)
    runs = []
    for dataset in config.datasets:
        for label, algo in config.algorithms.items():
            if not runs_on(algo, dataset):
                continue
            names = sorted(algo["grid"])
            preset = _preset(algo["algorithm"], dataset["spec"]) if config.presets else {}
            points = list(itertools.product(*(algo["grid"][n] for n in names)))
            for values in points:
                grid_point = dict(zip(names, values))
                params = {**preset, **grid_point}  # explicit settings override the per-dataset preset
                if preset:
                    try:
                        _learner_class(algo["algorithm"])(**params).check_params()
                    except (InvalidParameterError, TypeError, ValueError) as err:
                        raise ConfigError(config.source, None, f"algorithms.{label}",
                                          f"with the preset for {dataset['label']} ({preset}): {err}") from None
                    if algo.get("online"):
                        defaults = _learner_class(algo["algorithm"])().get_params()
                        problem = _online_problem(algo["algorithm"], {**defaults, **params}, algo["online"])
                        if problem:
                            raise ConfigError(config.source, None, f"algorithms.{label}.online",
                                              f"with the preset for {dataset['label']} ({preset}): {problem}")
                # A grid's points are told apart by a hash of their settings; a single point keeps the plain label.
                variant = label if len(points) == 1 else f"{label}-{_hash(grid_point)[:8]}"
                for seed in config.seeds:
                    resolved = {
                        "dataset": dataset,
                        "algorithm": algo["algorithm"],
                        "label": label,
                        "params": params,
                        "seed": seed,
                        # an online-only learner has no offline phase
                        "steps": 0 if _is_online_learner(algo["algorithm"]) else config.steps,
                        "eval": config.eval,
                        "ope": hashed_ope,
                        "checkpoint_every": config.checkpoint_every,
                        "device": config.device,
                        "log_every": config.log_every,
                    }
                    if algo.get("labelers"):  # only when present, so the hashes of runs without one never change
                        resolved["labelers"] = algo["labelers"]
                    if algo.get("online"):  # likewise
                        resolved["online"] = algo["online"]
                    config_hash = _hash(resolved)
                    run_dir = runs_root / dataset["label"] / variant / f"seed{seed}"
                    check_inside(run_dir, runs_root, f"the run directory of {dataset['label']}/{variant}/seed{seed}")
                    runs.append({**resolved, "variant": variant, "hash": config_hash, "dir": str(run_dir),
                                 "threads": config.threads_per_run, "ope_request": request})
    return runs


def runs_on(algo: Mapping[str, Any], dataset: Mapping[str, Any]) -> bool:
    """Whether a parsed algorithm entry runs on a parsed dataset entry (its `datasets:` list, when it has one)."""
    return "datasets" not in algo or dataset["label"] in algo["datasets"]


def _preset(algorithm: str, spec: str) -> dict[str, Any]:
    """The papers' per-dataset settings for `algorithm` on the dataset named by `spec` (see offrl.algos.presets)."""
    from offrl.algos.presets import preset_params

    try:
        return preset_params(algorithm, spec.split(":", 1)[-1])
    except ValueError:  # an algorithm without a preset table
        return {}


def _write_json(path: Path, obj: Any) -> None:
    with atomic_write_path(path) as tmp, open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v))


def read_result(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """A run's result.json, or None when it has none (or an unreadable one: the run is then done again)."""
    return _read_json_object(Path(run_dir) / "result.json")


def _read_json_object(path: Path) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, ValueError):  # absent, or damaged by hand or disk
        return None
    return obj if isinstance(obj, dict) else None


_DATASET_CACHE: dict[str, Any] = {}


def _load_dataset(entry: Mapping[str, Any]) -> Any:
    from offrl.datasets import load

    spec = entry["spec"]
    options = dict(entry.get("build_options") or {})
    key = json.dumps([spec, options], sort_keys=True)
    if key not in _DATASET_CACHE:
        if spec.startswith("offrl:") and entry.get("build", True):
            from offrl.builder import load_or_build

            _DATASET_CACHE[key] = load_or_build(spec.split(":", 1)[1], **options)
        else:
            _DATASET_CACHE[key] = load(spec, **options)
    return _DATASET_CACHE[key]


_LABELLED_CACHE: dict[str, Any] = {}


def _label_dataset(run: Mapping[str, Any], dataset: Any) -> tuple[list[tuple[str, Any]], Any]:
    """The run's fitted labellers and the dataset they label, made once per worker process for the same
    dataset, labellers and (for a labeller that takes the run's seed) seed."""
    specs = run.get("labelers") or []
    if not specs:
        return [], dataset
    labelers = make_labelers(specs, seed=run["seed"], device=run.get("device"))
    seeded = any("random_state" in labeler.get_params() and "random_state" not in params
                 for (_, labeler), (_, params) in zip(labelers, specs))
    key = json.dumps([run["dataset"]["spec"], run["dataset"].get("build_options") or {}, specs,
                      run["seed"] if seeded else None], sort_keys=True, default=str)
    if key not in _LABELLED_CACHE:
        for _, labeler in labelers:
            dataset = labeler.fit_transform(dataset)
        _LABELLED_CACHE.clear()  # keep one labelled dataset: they can be large
        _LABELLED_CACHE[key] = (labelers, dataset)
    return _LABELLED_CACHE[key]


def _make_algorithm(run: Mapping[str, Any]) -> Any:
    """The run's estimator, with the sweep's `log_every` unless its params set one."""
    import inspect

    cls = _learner_class(run["algorithm"])
    kwargs = {**run["params"], "random_state": run["seed"], "device": run["device"]}
    log_every = int(run.get("log_every", 100))
    if "log_every" in inspect.signature(cls.__init__).parameters:
        kwargs.setdefault("log_every", log_every)
        return cls(**kwargs)
    algo = cls(**kwargs)
    algo.log_every = log_every  # a class that does not take log_every yet: the fit loop reads the attribute
    return algo


def _eval_env(entry: Mapping[str, Any], eval_cfg: Mapping[str, Any], dataset: Any) -> str | None:
    env = entry.get("eval_env", "auto")
    if env == "auto":
        env = eval_cfg.get("env", "auto")
    if env == "auto":
        env = dataset.metadata.get("env_id")
    return env or None


# How long a run waits for another process writing its directory (another sweep on the same `out`).
RUN_LOCK_TIMEOUT = 24 * 3600.0
# The status of a run another process is writing, when the sweep asked not to wait for it.
_BUSY = "busy"


def run_lock_path(run_dir: str | os.PathLike) -> Path:
    """The lock a process holds while it writes a run's directory."""
    return Path(run_dir) / "run.lock"


def execute_run(run: Mapping[str, Any], wait_if_busy: bool = True) -> dict[str, Any]:
    """Train, evaluate (and optionally OPE) one run; never raises: failures are recorded in the run dir.

    The run holds its directory's lock throughout: a second process given the
    same run (another sweep on the same `out`, a re-run while an old worker is
    still alive) waits for it, then finds its result and skips it.  With
    `wait_if_busy=False` it does not wait: it returns at once with status
    "busy" (the sweep then takes its other runs first and comes back to it).
    """
    run_dir = Path(run["dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    base = {"hash": run["hash"], "dataset": run["dataset"]["label"], "algorithm": run["algorithm"], "label": run["label"],
            "variant": run["variant"], "params": run["params"], "seed": run["seed"], "steps": run["steps"], "dir": str(run_dir)}
    if run.get("labelers"):
        base["labelers"] = run["labelers"]
    if run.get("online"):
        base.update({"strategy": _strategy_name(run), "online_steps": run["online"]["steps"]})
    try:
        with wait_for_lock(run_lock_path(run_dir), f"run {run_dir}", timeout=RUN_LOCK_TIMEOUT if wait_if_busy else 0,
                           say=None if wait_if_busy else lambda line: None):
            return _execute_locked(run, run_dir, base)
    except LockTimeoutError as err:  # nothing of this run was touched
        if not wait_if_busy:
            return {**base, "status": _BUSY}
        return {**base, "status": "failed", "error": str(err)}


def _execute_locked(run: Mapping[str, Any], run_dir: Path, base: dict[str, Any]) -> dict[str, Any]:
    import torch

    existing = read_result(run_dir)
    try:
        resolved = resolved_params(run)
    except Exception:  # parameters the code no longer accepts: recorded like any other failure
        return _record_failure(run_dir, base)
    if existing is not None and result_matches(run, existing, resolved):
        missing = ope_missing(run, existing)
        if missing:  # trained already: add the estimates it lacks, from its saved model
            return _add_ope(run, run_dir, base, existing, missing)
        return {**existing, "skipped": True}
    _clear_other_config(run_dir, run, resolved)
    torch.set_num_threads(int(run.get("threads", 1)))
    _write_json(run_dir / "config.json", {**{k: v for k, v in run.items() if k != "threads"}, "resolved_params": resolved})
    started = time.time()
    online = run.get("online")
    try:
        dataset = _load_dataset(run["dataset"])
        raw_dataset = dataset
        labelers, dataset = _label_dataset(run, dataset)
        algo = _make_algorithm(run)
        env = _eval_env(run["dataset"], run["eval"], dataset)
        if online and env is None:
            raise ValueError(f"the run goes online but dataset {run['dataset']['label']!r} names no environment "
                             "(no env_id in its metadata, no eval_env); give the dataset an eval_env")
        if not _is_online_learner(run["algorithm"]):
            algo.fit(
                dataset,
                n_steps=run["steps"],
                eval_env=env,
                eval_every=run["eval"]["every"],
                eval_episodes=run["eval"]["episodes"],
                log_dir=run_dir,
                checkpoint_every=run.get("checkpoint_every") or run["eval"]["every"],
                resume=True,
                progress=False,
            )
        offline_history = list(getattr(algo, "history_", []))
        if online:
            if not _is_online_learner(run["algorithm"]):
                _save_model(algo, labelers, run, run_dir / "model_offline.pt")
            online_history = _fit_online(algo, run, dataset, env, run_dir / "online")
        _save_model(algo, labelers, run, run_dir / "model.pt")
        result = {**base, "status": "ok", "resolved_params": resolved}
        if online:
            result.update(_online_result(run, offline_history, online_history))
        else:
            result["history"] = offline_history
            if offline_history:
                final, best = offline_history[-1], max(offline_history, key=lambda r: r["return_mean"])
                result.update({
                    "final_return": final["return_mean"], "final_return_std": final["return_std"],
                    "final_score": final["normalized_score_mean"], "best_return": best["return_mean"],
                    "best_score": best["normalized_score_mean"],
                })
        try:
            from offrl.datasets import normalized_score

            # The logged data's score in the environment's own rewards (a labeller's rewards are not scores).
            result["dataset_score"] = float(np.mean(normalized_score(raw_dataset, raw_dataset.episode_returns())))
        except (ValueError, TypeError):
            result["dataset_score"] = float("nan")
        # This process's time only: a run resumed from a checkpoint says from which step, so its time is not
        # read as the whole run's.
        result["train_seconds"] = time.time() - started
        result["resumed_from_step"] = int(getattr(algo, "resumed_from_step_", 0))
        spec = _ope_spec(run)
        if spec:
            try:
                result["ope"] = _logged_data_ope(algo, raw_dataset, env, spec, run["seed"])
            except Exception:  # the trained model is kept: a re-run computes the OPE alone
                _write_json(run_dir / "result.json", result)
                return _ope_failed(run_dir, base)
        (run_dir / "error.txt").unlink(missing_ok=True)
        _write_json(run_dir / "result.json", result)
        return result
    except Exception:
        return _record_failure(run_dir, base)


def _record_failure(run_dir: Path, base: dict[str, Any]) -> dict[str, Any]:
    """Write the exception being handled to the run's error.txt; the failed run's row."""
    text = traceback.format_exc()
    with atomic_write_path(run_dir / "error.txt") as tmp, open(tmp, "w") as f:
        f.write(text)
    return {**base, "status": "failed", "error": text.strip().splitlines()[-1]}


def resolved_params(run: Mapping[str, Any]) -> dict[str, Any]:
    """Every parameter the run's estimator (and labellers) will be built with, defaults included, JSON-shaped.

    The run hash holds the params as written; this catches what the hash cannot: a
    default changed in the code since a result (or a checkpoint) was made.
    """
    template = _learner_class(run["algorithm"])(**run["params"])  # never trained: only its params are read
    resolved = {"algorithm": _plain_params(template)}
    if run.get("labelers"):
        resolved["labelers"] = [[name, _plain_params(labeler)] for name, labeler in
                                make_labelers(run["labelers"], seed=run["seed"], device=run.get("device"))]
    return json.loads(json.dumps(resolved))  # as it reads back from result.json (tuples become lists)


# Set per run by the sweep (the seed, the device, the logging period), not by the algorithm's code.
_RUN_LEVEL_PARAMS = frozenset({"random_state", "device", "log_every"})


def _plain_params(estimator: Any) -> dict[str, Any]:
    params = estimator.get_params(deep=False)
    if params.get("guide") is not None:
        # A GORL guide written as a load spec or a dict of settings: record the Guide it becomes, defaults
        # included, so a changed Guide default (as `normalize` on 2026-12-06) does not reuse older results.
        from offrl.algos.guide import as_guide

        params["guide"] = as_guide(params["guide"])
    return {key: _plain(value) for key, value in sorted(params.items()) if key not in _RUN_LEVEL_PARAMS}


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if hasattr(value, "get_params"):  # a nested estimator (a GORL Guide): its class and its own params
        return {"class": type(value).__name__, "params": _plain_params(value)}
    return {"class": type(value).__name__}  # data objects (a Dataset given in Python): the type is all that is stable


def result_matches(run: Mapping[str, Any], result: Mapping[str, Any], resolved: Mapping[str, Any] | None = None) -> bool:
    """Whether a run's record (its result.json or config.json) belongs to the run as the code would train it now:
    the same config hash and, when the record holds them (those from before 2026-12-04 do not), the same
    resolved params."""
    if result.get("hash") != run["hash"]:
        return False
    stored = result.get("resolved_params")
    if stored is None:
        return True
    return stored == (resolved_params(run) if resolved is None else resolved)


def _clear_other_config(run_dir: Path, run: Mapping[str, Any], resolved: Mapping[str, Any]) -> None:
    """Remove what another configuration of this run left in `run_dir` (its checkpoint, logs, model and result),
    so training starts from scratch rather than resuming a checkpoint trained with other settings.

    An interrupted run of the same configuration (its config.json has this hash and these resolved params)
    keeps everything: its checkpoint resumes.
    """
    previous = _read_json_object(run_dir / "config.json")
    if previous is not None and result_matches(run, previous, resolved):
        return
    lock = run_lock_path(run_dir).name
    for entry in run_dir.iterdir():
        if entry.name == lock:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _save_model(algo: Any, labelers: list[tuple[str, Any]], run: Mapping[str, Any], path: Path) -> None:
    if labelers:  # the model file holds the whole pipeline, so a loaded model labels data the same way
        from offrl.pipeline import Pipeline

        Pipeline([*labelers, (run["algorithm"].lower(), algo)]).save(path)
    else:
        algo.save(path)


def _strategy_name(run: Mapping[str, Any]) -> str:
    """The online recipe's name ('naive', 'rlpd', ...); an online learner's own recipe is its name ('sac')."""
    strategy = run["online"].get("strategy")
    if strategy is None:
        return run["algorithm"].lower()
    return strategy if isinstance(strategy, str) else next(iter(strategy))


def _fit_online(algo: Any, run: Mapping[str, Any], dataset: Any, env: str, log_dir: Path) -> list[dict[str, Any]]:
    """The online phase of a run: fine-tune the fitted `algo` (or train an online learner from scratch) in `env`,
    checkpointing every evaluation so a re-executed run resumes it; returns its evaluation rows."""
    online = run["online"]
    options = {"n_envs": online["n_envs"], "eval_env": env, "eval_every": online["eval_every"],
               "eval_episodes": run["eval"]["episodes"], "log_dir": log_dir, "checkpoint_every": online["eval_every"],
               "resume": True, "progress": False}
    offline_dataset = dataset if online["offline_data"] else None
    if _is_online_learner(run["algorithm"]):
        if "buffer_size" in online:
            algo.set_params(buffer_size=online["buffer_size"])
        algo.fit_online(env, online["steps"], strategy=online.get("strategy"), offline_dataset=offline_dataset,
                        checkpoint_path=log_dir / "online_checkpoint.pt", **options)
        done, history = algo.n_steps_done_, list(algo.history_)
        _fill_normalized_scores(history, dataset)
    else:
        extra = {"buffer_size": online["buffer_size"]} if "buffer_size" in online else {}
        algo.fit_online(env, online["steps"], strategy=online["strategy"], offline_dataset=offline_dataset,
                        **extra, **options)
        done, history = algo.online_steps_done_, list(algo.online_history_)
    if done < online["steps"]:
        raise RuntimeError(f"the online phase stopped at step {done} of {online['steps']}")
    return history


def _fill_normalized_scores(rows: list[dict[str, Any]], dataset: Any) -> None:
    """Normalised scores for rows of a learner built from the env alone (SAC: no reference scores of its
    own), from the dataset's reference scores, so its curve is in the same units as the fine-tuned ones."""
    from offrl.datasets import reference_scores

    try:
        low, high = reference_scores(dataset)
    except (ValueError, TypeError, KeyError):
        return
    for row in rows:
        if not np.isfinite(row.get("normalized_score_mean", np.nan)):
            row["normalized_score_mean"] = 100.0 * (row["return_mean"] - low) / (high - low)
            row["normalized_score_std"] = 100.0 * row["return_std"] / abs(high - low)


def _online_result(run: Mapping[str, Any], offline_history: list[dict[str, Any]],
                   online_history: list[dict[str, Any]]) -> dict[str, Any]:
    """The result fields of an offline-then-online run: the last online evaluation is the final one, the best
    spans both phases, the dip is the lowest score in the first 10% of the online steps, and `history` is
    both phases on one step axis (online steps counted after the offline ones)."""
    nan = float("nan")
    switch = int(run["steps"])
    steps = int(run["online"]["steps"])
    history = ([{**row, "phase": "offline"} for row in offline_history]
               + [{**row, "step": row["step"] + switch, "phase": "online"} for row in online_history])
    result: dict[str, Any] = {
        "history": history, "online_history": online_history, "switch_step": switch, "online_steps": steps,
        "strategy": _strategy_name(run),
        "offline_score": offline_history[-1]["normalized_score_mean"] if offline_history else nan,
        "offline_return": offline_history[-1]["return_mean"] if offline_history else nan,
    }
    early = [row for row in online_history if row["step"] <= 0.1 * steps]
    result["dip_score"] = min((row["normalized_score_mean"] for row in early), default=nan)
    result["dip_return"] = min((row["return_mean"] for row in early), default=nan)
    if online_history:
        final, best = online_history[-1], max(history, key=lambda r: r["return_mean"])
        result.update({"final_return": final["return_mean"], "final_return_std": final["return_std"],
                       "final_score": final["normalized_score_mean"], "best_return": best["return_mean"],
                       "best_score": best["normalized_score_mean"]})
    return result


def _ope_spec(run: Mapping[str, Any]) -> dict[str, Any] | None:
    """The OPE a run is asked for: its `ope_request` (see `ope_settings`), else (a run dict made elsewhere)
    its hashed `ope:` block."""
    if "ope_request" in run:
        return run["ope_request"]
    return run.get("ope")


def _logged_data_ope(algo: Any, raw_dataset: Any, env: str | None, spec: Mapping[str, Any], seed: int,
                     previous: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A run's `result["ope"]`, from the logged data: OPE is scored against roll-outs in the environment's own
    rewards, so labelled rewards (another unit) and labelled actions (no behaviour probabilities) are not used;
    without those labels it is skipped, with the reason."""
    missing = raw_dataset.missing_labels()
    if missing:
        return {"skipped": f"the logged data lacks {', '.join(missing)}, so its estimates would not be in the "
                           "environment's rewards"}
    if previous:
        return _run_ope(algo, raw_dataset, env, spec, seed, previous=previous)
    return _run_ope(algo, raw_dataset, env, spec, seed)


def _ope_stored_settings(spec: Mapping[str, Any]) -> dict[str, Any]:
    """What a run's estimates depend on besides its policy and data, as stored beside them (JSON-shaped)."""
    # mb_params / marginal_params only when set: results stored before they existed keep matching
    extra = {key: dict(spec[key]) for key in ("mb_params", "marginal_params") if spec.get(key)}
    return json.loads(json.dumps({"gamma": float(spec["gamma"]), "rollouts": int(spec["rollouts"]),
                                  "fqe_params": dict(spec.get("fqe_params") or {}), **extra}, default=list))


def _estimate_keys(ope_result: Mapping[str, Any]) -> dict[str, str]:
    """`offrl.ope.ESTIMATORS` key -> the key its estimate is stored under, for the estimates in a result's ope."""
    from offrl.ope.api import estimator_key

    keys = {}
    for name, value in ope_result.items():
        if isinstance(value, dict) and "value" in value:
            try:
                keys[estimator_key(name)] = name
            except ValueError:  # an estimator this version does not know: kept, never asked for
                continue
    return keys


def _reusable_ope(run: Mapping[str, Any], result: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a finished run's ope results that still holds for the OPE it is asked for now: all of it when
    computed with the same settings (a result from before settings were stored was made with the hashed ones
    and FQE's defaults), nothing when they changed."""
    spec = _ope_spec(run)
    stored = result.get("ope")
    if not spec or not isinstance(stored, dict):
        return {}
    settings = stored.get("settings") or {"gamma": float(spec["gamma"]), "rollouts": int(spec["rollouts"]),
                                          "fqe_params": {}}
    return dict(stored) if settings == _ope_stored_settings(spec) else {}


def ope_missing(run: Mapping[str, Any], result: Mapping[str, Any] | None) -> list[str]:
    """The requested OPE estimators a finished run's result lacks (all of them after a change of OPE settings),
    as `offrl.ope.ESTIMATORS` keys; [] when nothing is asked for or the data cannot give estimates."""
    spec = _ope_spec(run)
    if not spec or not result or result.get("status") != "ok":
        return []
    stored = result.get("ope")
    if isinstance(stored, dict) and "skipped" in stored:  # the logged data lacks rewards or actions
        return []
    have = _estimate_keys(_reusable_ope(run, result))
    from offrl.ope.api import estimator_key

    return [key for key in (estimator_key(e) for e in spec["estimators"]) if key not in have]


def _add_ope(run: Mapping[str, Any], run_dir: Path, base: dict[str, Any], existing: dict[str, Any],
             missing: list[str]) -> dict[str, Any]:
    """OPE for a run trained earlier: its model.pt is loaded (never trained again) and only the `missing`
    estimates (and the true value, if it lacks one) are computed and added to its result.json."""
    import torch

    import offrl
    from offrl.pipeline import Pipeline

    torch.set_num_threads(int(run.get("threads", 1)))
    try:
        raw_dataset = _load_dataset(run["dataset"])
        env = _eval_env(run["dataset"], run["eval"], raw_dataset)
        model = offrl.load(run_dir / "model.pt", device=run["device"])
        algo = model.steps[-1][1] if isinstance(model, Pipeline) else model  # the policy, as trained
        previous = _reusable_ope(run, existing)
        result = {**existing, "ope": _logged_data_ope(algo, raw_dataset, env, _ope_spec(run), run["seed"],
                                                      previous=previous)}
    except Exception:
        return _ope_failed(run_dir, base)
    (run_dir / "error.txt").unlink(missing_ok=True)
    _write_json(run_dir / "result.json", result)
    return {**result, "ope_added": missing}


def _ope_failed(run_dir: Path, base: dict[str, Any]) -> dict[str, Any]:
    """Record a failed OPE of a trained run (the traceback in error.txt); its result.json keeps the training."""
    text = traceback.format_exc()
    with atomic_write_path(run_dir / "error.txt") as tmp, open(tmp, "w") as f:
        f.write(text)
    return {**base, "status": "failed", "error": "OPE failed (the trained model is kept; a re-run computes the "
                                                 f"OPE alone): {text.strip().splitlines()[-1]}"}


_NO_TRUTH = "no evaluation environment, so no roll-outs for the true value"


def _estimates(algo: Any, dataset: Any, keys: list[str], gamma: float, seed: int,
               params: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """key -> {value, ci_low, ci_high} of each estimator; one that cannot estimate this policy from these data
    (e.g. ratios with no mass where it goes) gets {error} and the others are kept (computed one by one then)."""
    from offrl import ope

    try:
        report = ope.evaluate({"policy": algo}, dataset, keys, gamma, random_state=seed, **params)
    except (ValueError, np.linalg.LinAlgError) as err:
        if len(keys) == 1:
            return {keys[0]: {"error": f"{type(err).__name__}: {err}"}}
        out: dict[str, Any] = {}
        for key in keys:
            out.update(_estimates(algo, dataset, [key], gamma, seed, params))
        return out
    # results come in the order asked for, so each is stored under the name it was asked by
    return {key: {"value": float(r.value), "ci_low": float(r.ci_low), "ci_high": float(r.ci_high)}
            for key, r in zip(keys, report.results["policy"].values())}


def _run_ope(algo: Any, dataset: Any, env: str | None, ope_cfg: Mapping[str, Any], seed: int,
             previous: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """OPE estimates of this run's policy from its dataset, next to its true discounted value from roll-outs
    (None without an env: the selection then has no truth to be scored against).

    With `previous` (ope results made with the same settings) only the estimators it lacks are computed,
    and its true value is kept.  Each estimate is stored under its `offrl.ope.ESTIMATORS` key.
    """
    from offrl import ope
    from offrl.ope.api import estimator_key

    previous = dict(previous or {})
    have = _estimate_keys(previous)
    todo = [key for key in (estimator_key(e) for e in ope_cfg["estimators"]) if key not in have]
    gamma = float(ope_cfg["gamma"])
    out: dict[str, Any] = {k: v for k, v in previous.items() if k not in ("true_value", "no_truth", "settings")}
    if todo:
        params = {key: dict(ope_cfg.get(key) or {}) for key in _OPE_PARAM_KEYS}  # evaluate's keyword names
        out.update(_estimates(algo, dataset, todo, gamma, seed, params))
    truth = previous.get("true_value")
    if env is None:
        out.update({"true_value": None, "no_truth": _NO_TRUTH})
    elif isinstance(truth, numbers.Real) and np.isfinite(truth):
        out["true_value"] = truth
    else:
        out["true_value"] = ope.true_policy_value(env, algo, gamma, n_rollouts=int(ope_cfg["rollouts"]),
                                                  seed=10_000 + seed, dataset=dataset)["value"]
    out["settings"] = _ope_stored_settings(ope_cfg)
    return out


# ---------------------------------------------------------------------------- executors
# Relative cost of one gradient update (matmul FLOPs at batch 256 with each algorithm's default networks,
# from benchmarks/updates.py), used only to start the longest runs first.
_UPDATE_COST = {"SAC": 5.5, "BC": 1.0, "TD3PlusBC": 4.0, "IQL": 5.5, "CQL": 100.0, "CalQL": 100.0, "DiffusionQL": 25.0,
                "EDP": 15.0, "FQL": 60.0, "OFQL": 17.0, "XQL": 5.5, "FDVL": 5.5, "ReCOIL": 11.0,
                "RvS": 9.0, "DecisionTransformer": 130.0, "MBRCSL": 20.0}


def run_cost(run: Mapping[str, Any]) -> float:
    """A rough relative cost of a run: algorithm cost per update x updates (offline steps, and online steps
    times the recipe's updates per step)."""
    updates = float(run["steps"])
    online = run.get("online")
    if online:
        from offrl.online.strategies import resolve_strategy

        strategy = online.get("strategy")
        utd = resolve_strategy(strategy).utd_ratio if strategy is not None else run["params"].get("utd_ratio", 1)
        updates += float(online["steps"]) * float(utd)
    return _UPDATE_COST.get(run["algorithm"], 5.0) * updates


def run_step(run_dir: str | os.PathLike) -> int:
    """The last training step a run has logged (its train.csv, plus online/train.csv's for a run that went
    online), 0 when it has not logged yet."""
    return _last_logged_step(Path(run_dir) / "train.csv") + _last_logged_step(Path(run_dir) / "online" / "train.csv")


def _last_logged_step(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - 4096))
            last = f.read().decode(errors="replace").strip().splitlines()[-1]
        return int(float(last.split(",", 1)[0]))  # the header line ("step,...") gives 0 below
    except (OSError, ValueError, IndexError):
        return 0


def pending_runs(runs: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The runs without a finished result for their current config, longest first (by `run_cost`), then the
    finished runs that lack requested OPE estimates (they only compute those)."""
    todo, ope_only = [], []
    for run in runs:
        result = read_result(run["dir"]) or {}
        try:
            finished = result_matches(run, result)
        except Exception:  # the run's params no longer build: its worker records why
            finished = False
        if not finished:
            todo.append(dict(run))
        elif ope_missing(run, result):
            ope_only.append(dict(run))
    todo.sort(key=lambda r: -run_cost(r))  # stable: equal costs keep the config's order
    return todo + ope_only


def run_sweep(
    config: SweepConfig | str | os.PathLike,
    backend: str = "local",
    workers: int | None = None,
    address: str | None = None,
    out: str | os.PathLike | None = None,
    progress: bool = True,
    on_result: Callable[[dict[str, Any]], None] | None = None,
    ope: str | Sequence[str] | None = None,
    algorithms: str | Sequence[str] | None = None,
    datasets: str | Sequence[str] | None = None,
    seeds: str | Sequence[int] | None = None,
) -> Any:
    """Run every missing run of the sweep and return the results table (a DataFrame, one row per run).

    Runs start longest first (by algorithm cost x steps), so a slow run does not
    start last and leave the other workers idle.  `on_result` is called in this
    process with each finished run's result as it arrives, while other runs go
    on (e.g. to evaluate finished policies in the meantime).

    `ope` (estimator names, e.g. ["FQE", "DR"] or "FQE,DR") runs OPE on every
    trained policy against the data it was trained on, with or without an
    env, in place of the config's `ope.estimators` (its gamma, rollouts and
    fqe_params still apply).  It does not enter the run hashes: finished runs
    are not trained again, only their missing estimates are computed.

    `algorithms`, `datasets` (labels, a list or comma-separated) and `seeds`
    run part of the sweep (`select_runs`): the runs are those of the whole
    config, and the returned table holds every run found in the output folder.
    """
    from offrl.report import results_frame

    if backend not in ("local", "ray"):
        raise ValueError(f"backend must be 'local' or 'ray', got {backend!r}")
    if workers is not None and (not _is_int(workers) or workers < 1):
        raise ValueError(f"workers must be a positive integer (parallel runs) or None (one per CPU), got {workers!r}")
    if not isinstance(config, SweepConfig):
        config = load_config(config, algorithms=algorithms, datasets=datasets, seeds=seeds)
    elif algorithms is not None or datasets is not None or seeds is not None:
        config = select_runs(config, algorithms=algorithms, datasets=datasets, seeds=seeds)
    if ope is not None:
        config = dataclasses.replace(config, ope_request=parse_ope_estimators(ope))
    out_dir = Path(out or config.out or Path("offrl-results") / config.name)
    runs = expand_runs(config, out_dir)  # checks every run before anything is written
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "sweep.json", {"name": config.name, "source": config.source, "config": config.raw,
                                         "runs": [r["dir"] for r in runs]})
    todo = pending_runs(runs)
    workers = int(workers or os.cpu_count() or 1)
    if backend == "local":
        results = _run_local(todo, workers, progress, len(runs) - len(todo), on_result)
    else:
        results = _run_ray(todo, workers, address, progress, len(runs) - len(todo), on_result)
    failed = [r for r in results if r.get("status") == "failed"]
    for r in failed:
        print(f"run failed: {r['dir']}: {r.get('error')} (traceback in {r['dir']}/error.txt)")
    return results_frame(out_dir)


class _Progress:
    """Collects the finished runs' results (passing each to `on_result`) behind one bar, whose
    postfix counts runs done / failed / running and, every few seconds, the training step each
    running run has logged."""

    def __init__(self, total: int, skipped: int, enabled: bool,
                 on_result: Callable[[dict[str, Any]], None] | None = None) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total + skipped, initial=skipped, desc="sweep", unit="run", disable=not enabled)
        self.enabled = enabled
        self.done = self.failed = 0
        self.skipped = skipped
        self.running: list[dict[str, Any]] = []
        self.results: list[dict[str, Any]] = []
        self.on_result = on_result
        # The in-process sweep's refresher thread shows the bar too: one lock, so a refresh that read the counts
        # before a run finished cannot overwrite the postfix written after it.
        self._lock = threading.RLock()

    def update(self, result: dict[str, Any]) -> None:
        with self._lock:
            if result.get("status") == "failed":
                self.failed += 1
            else:
                self.done += 1
            self.running = [r for r in self.running if r["dir"] != result.get("dir")]
            self.bar.update(1)
            self.show()

    def record(self, result: dict[str, Any]) -> None:
        """A run has finished: keep its result, show it, and hand it to `on_result`."""
        self.results.append(result)
        self.update(result)
        if self.on_result is not None:
            self.on_result(result)

    def show(self) -> None:
        if not self.enabled:
            return
        with self._lock:
            steps = []
            for run in self.running:
                step = run_step(run["dir"])
                if step:
                    total = run["steps"] + (run.get("online") or {}).get("steps", 0)
                    steps.append(f"{run['variant']}/s{run['seed']} {step}/{total}")
            postfix = {"done": self.done, "failed": self.failed, "running": len(self.running),
                       "skipped": self.skipped}
            if steps:
                postfix["steps"] = ", ".join(steps[:4]) + (" ..." if len(steps) > 4 else "")
            self.bar.set_postfix(postfix)

    def close(self) -> None:
        self.bar.close()


_POLL_SECONDS = 2.0
_PARENT_POLL_SECONDS = 1.0
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent_pid: int) -> None:
    """Pool-worker initializer: end this worker as soon as the sweep's process `parent_pid` dies.

    A killed sweep (kill -9, the OOM killer) must not leave workers training
    and writing into run folders that a re-run is about to use.  On Linux the
    kernel sends SIGKILL when the parent dies (prctl PR_SET_PDEATHSIG); a
    watchdog thread that polls the parent's pid covers other systems and a
    parent that died before prctl took effect.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError) as err:  # no prctl: the watchdog alone
            print(f"offrl: cannot tie sweep worker {os.getpid()} to its parent with prctl ({err}); "
                  "watching the parent instead", file=sys.stderr)
    if os.getppid() != parent_pid:  # the parent is already gone
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="offrl-parent-watchdog", daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL_SECONDS)
    os.kill(os.getpid(), signal.SIGKILL)


def _run_local(runs: list[dict[str, Any]], workers: int, progress: bool, skipped: int,
               on_result: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    import concurrent.futures as cf
    import multiprocessing as mp

    view = _Progress(len(runs), skipped, progress, on_result)
    try:
        if workers == 1 or len(runs) <= 1:
            _run_in_this_process(runs, view)
            return view.results
        with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"),
                                    initializer=_die_with_parent, initargs=(os.getpid(),)) as pool:
            # insertion order = submission order
            futures = {pool.submit(execute_run, run, wait_if_busy=False): run for run in runs}
            pending = set(futures)
            while pending:
                # The pool runs the first `workers` unfinished runs of the submission order.
                view.running = [run for fut, run in futures.items() if fut in pending][:workers]
                view.show()
                finished, pending = cf.wait(pending, timeout=_POLL_SECONDS, return_when=cf.FIRST_COMPLETED)
                for fut in finished:
                    result = fut.result()
                    if result["status"] == _BUSY:  # queued again behind every other run, and then waited for
                        run = futures.pop(fut)
                        retry = pool.submit(execute_run, run, wait_if_busy=True)
                        futures[retry] = run
                        pending.add(retry)
                    else:
                        view.record(result)
    finally:
        view.close()
    return view.results


def _run_in_this_process(runs: list[dict[str, Any]], view: _Progress) -> None:
    """Train the runs one after another in this process, recording each result in `view`.

    A daemon thread refreshes the bar's step counts meanwhile (as the pool loop does between polls), so Ctrl-C
    still reaches the training, in the main thread.  Each run sets torch's thread count to its threads_per_run;
    the caller's own count comes back afterwards.
    """
    import torch

    caller_threads = torch.get_num_threads()
    stop = threading.Event()
    refresher = threading.Thread(target=_refresh_until, args=(view, stop), daemon=True)
    if view.enabled:
        refresher.start()
    try:
        queue = [(run, False) for run in runs]
        while queue:
            run, wait = queue.pop(0)
            view.running = [run]
            view.show()
            result = execute_run(run, wait_if_busy=wait)
            if result["status"] == _BUSY:  # another process is writing it: the other runs first
                queue.append((run, True))
            else:
                view.record(result)
    finally:
        stop.set()
        if refresher.is_alive():
            refresher.join()
        torch.set_num_threads(caller_threads)


def _refresh_until(view: _Progress, stop: threading.Event) -> None:
    """Show `view` every `_POLL_SECONDS` until `stop` is set (the in-process sweep's refresher thread)."""
    while not stop.wait(_POLL_SECONDS):
        view.show()


def _run_ray(runs: list[dict[str, Any]], workers: int, address: str | None, progress: bool, skipped: int,
             on_result: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    try:
        import ray
    except ImportError as err:
        raise ImportError("the ray backend needs Ray: pip install 'offrl[ray]'") from err
    started_here = False
    if not ray.is_initialized():
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
        started_here = True
    remote = ray.remote(num_cpus=1)(execute_run)
    view = _Progress(len(runs), skipped, progress, on_result)
    try:
        refs = {remote.remote(run, wait_if_busy=False): run for run in runs}
        pending = list(refs)
        while pending:
            # Ray does not say which tasks have started; the first `workers` unfinished ones is a good guess
            # on a local instance, and the step counts come from run directories this machine can see.
            view.running = [refs[r] for r in pending[:workers]]
            view.show()
            ready, pending = ray.wait(pending, num_returns=1, timeout=_POLL_SECONDS)
            for ref in ready:
                result = ray.get(ref)
                if result["status"] == _BUSY:  # another process is writing it: asked again after the others
                    run = refs.pop(ref)
                    retry = remote.remote(run, wait_if_busy=True)
                    refs[retry] = run
                    pending.append(retry)
                else:
                    view.record(result)
    finally:
        view.close()
        if started_here:
            ray.shutdown()
    return view.results


def iter_results(out_dir: str | os.PathLike) -> Iterable[dict[str, Any]]:
    """Every readable result.json under a sweep directory (a damaged one is skipped: its run is redone)."""
    for path in sorted(Path(out_dir).glob("runs/**/result.json")):
        result = read_result(path.parent)
        if result is not None:
            yield result
