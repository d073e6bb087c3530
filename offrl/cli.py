"""The `offrl` command (docs/cli.md).

Every command turns a user error (a missing or damaged file, an unknown name, a
value out of range) into one line on stderr that says what to do, and exit
status 2: `offrl <command>: error: ...` (e.g. `offrl datasets info: error: ...`).  A command's usage errors are one
line too, and its `--help` ends with an example.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's help, with the example that ends each command's help kept line for line."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("example"):
            return argparse.RawDescriptionHelpFormatter._fill_text(self, text, width, indent)  # type: ignore[arg-type]
        return super()._fill_text(text, width, indent)


class _Parser(argparse.ArgumentParser):
    """argparse whose commands report a usage error in one line, naming `--help`.

    A command group (`offrl`, `offrl datasets`) keeps argparse's usage block,
    which lists the commands to choose from.
    """

    def __init__(self, *args: Any, group: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        self.group = group

    def error(self, message: str) -> Any:  # argparse's hook; exits
        if self.group:
            super().error(message)
        self.exit(2, f"{self.prog}: error: {_one_line(message)}; see `{self.prog} --help`\n")


def _one_line(text: Any) -> str:
    """`text` with every run of whitespace (newlines included) made one space."""
    return " ".join(str(text).split())


def _count(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `low` (a bad value is a usage error naming the option, before any work)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def _device(text: str) -> str:
    """An argparse type: a device name torch can use here ('auto', 'cpu', 'cuda', 'cuda:N', 'mps')."""
    from offrl.algos.params import device_name

    rule = device_name()
    if not rule.ok(text):
        raise argparse.ArgumentTypeError(f"must be {rule.allowed}, got {text!r}")
    if text.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r} was requested but CUDA is not available here; use cpu or auto")
    return text


# Hyper-parameters a command-line option sets, so --set refuses them.
_OPTION_PARAMS = {"n_steps": "--steps", "random_state": "--seed", "device": "--device"}


def _setting(text: str) -> tuple[str, Any]:
    """An argparse type: KEY=VALUE with VALUE read as YAML (numbers, true/false, null or None, [lists])."""
    import yaml

    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"takes KEY=VALUE (e.g. --set expectile=0.8), got {text!r}")
    if key in _OPTION_PARAMS:
        raise argparse.ArgumentTypeError(f"{key} is set with {_OPTION_PARAMS[key]}, not --set")
    raw = raw.strip()
    try:
        value = yaml.safe_load(raw) if raw else None
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or err
        raise argparse.ArgumentTypeError(f"{key}={raw}: the value is not valid YAML ({_one_line(problem)}); write "
                                         "numbers as 0.8, lists as [256,256], booleans as true/false") from None
    if raw == "None":
        value = None  # the Python spelling, as the parameter rules print it
    elif isinstance(value, str) and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+", raw):
        value = float(raw)  # YAML 1.1 reads 3e-4 (no dot) as a string
    return key, value


def _load_dataset(spec: str, download: bool) -> Any:
    """`offrl.datasets.load(spec)`; a missing D4RL or Minari dataset's message also names `--download`."""
    from offrl.datasets import load

    try:
        return load(spec, download=download)
    except FileNotFoundError as err:
        if not download and spec.startswith(("d4rl:", "minari:")):
            raise FileNotFoundError(f"{err}; on the command line: --download") from err
        raise


def _datasets_info(args: argparse.Namespace) -> int:
    from offrl.datasets import normalized_score

    ds = _load_dataset(args.spec, args.download)
    lengths = ds.episode_lengths()
    rows = [
        ("dataset", ds.metadata.get("name", args.spec)),
        ("transitions", f"{ds.n_transitions:,}"),
        ("episodes", f"{ds.n_episodes:,}"),
        ("observation dim", ds.observation_dim),
        ("action dim", ds.action_dim if ds.discrete_actions is None else f"discrete ({ds.discrete_actions} actions)"),
        ("terminals / timeouts", f"{int(ds.terminals.sum()):,} / {int(ds.timeouts.sum()):,}"),
        ("episode length", f"mean {lengths.mean():.1f}, min {lengths.min()}, max {lengths.max()}"),
    ]
    for name in ds.missing_labels():
        rows.append((f"missing {name}", f"{ds.n_transitions - ds.n_labelled(name):,} of {ds.n_transitions:,} rows"))
    transforms = [t for t in ds.metadata.get("transforms", []) if isinstance(t, dict)]
    if transforms:
        rows.append(("transforms", ", ".join(str(t.get("transformer")) + (f" ({t['labels']})" if "labels" in t else "")
                                             for t in transforms)))
    relabelled = [t.get("transformer") for t in transforms if t.get("labels") == "rewards"]
    if ds.is_labelled("rewards"):
        returns = ds.episode_returns()
        rows.append(("episode return", f"mean {returns.mean():.3f} ± {returns.std():.3f}, min {returns.min():.3f}, "
                                       f"max {returns.max():.3f}"))
        try:
            if relabelled:  # the reference scores are in the environment's rewards, not the labeller's
                raise ValueError
            scores = normalized_score(ds, returns)
            rows.append(("normalised score",
                         f"mean {scores.mean():.1f}, min {scores.min():.1f}, max {scores.max():.1f}"))
        except ValueError:
            reason = f"rewards labelled by {relabelled[-1]}" if relabelled else "no reference scores"
            rows.append(("normalised score", f"n/a ({reason})"))
    else:
        rows.append(("episode return", "n/a (rewards missing)"))
    rows.append(("behaviour log-probs", "present" if ds.has_behavior_log_probs else "absent"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _print_selection(selection: Any, paths: dict[str, Any]) -> None:
    """The OPE-based selection table, compact (every column is in ope_selection.csv)."""
    if selection is None or selection.empty:
        return
    shown = ["dataset", "estimator", "selected", "regret", "selected_by_lcb", "lcb_regret", "best_run", "rank_corr"]
    print(f"OPE-based selection (every column in {paths['ope_selection']}):")
    print(selection[shown].to_string(index=False, float_format=lambda v: f"{v:.3g}", na_rep=""))


def _sweep(args: argparse.Namespace) -> int:
    from offrl.report import ope_selection, score_table, write_report
    from offrl.sweep import load_config, run_sweep

    # Every problem of the config (of the selected part, with a selection) is reported here, before any run.
    config = load_config(args.config, algorithms=args.algorithms, datasets=args.datasets, seeds=args.seeds)
    out = args.out or config.out or f"offrl-results/{config.name}"
    results = run_sweep(config, backend=args.backend, workers=args.workers, address=args.address, out=out,
                        progress=not args.no_progress, ope=args.ope)
    paths = write_report(out, title=config.name)
    table = score_table(results) if len(results) else None
    if table is not None and not table.empty:
        print(table.to_string())
    _print_selection(ope_selection(results) if len(results) else None, paths)
    n_failed = int((results["status"] == "failed").sum()) if len(results) else 0
    print(f"{len(results)} runs ({n_failed} failed); results in {paths['results']}, report in {paths['html']}")
    return 1 if n_failed else 0


def _quickstart(args: argparse.Namespace) -> int:
    from offrl.quickstart import run_quickstart

    run_quickstart(out=args.out, steps=args.steps, workers=args.workers, ope_rollouts=args.ope_rollouts,
                   progress=not args.no_progress)
    return 0


def _report(args: argparse.Namespace) -> int:
    from offrl.report import ope_selection, results_frame, score_table, write_report

    if not os.path.isdir(args.dir):
        raise FileNotFoundError(f"{args.dir} is not a directory; pass a sweep output directory")
    paths = write_report(args.dir, title=args.title)
    results = results_frame(args.dir)
    table = score_table(results)
    if not table.empty:
        print(table.to_string())
    _print_selection(ope_selection(results) if len(results) else None, paths)
    print(f"wrote {paths['results']}, {paths['table']}, {paths['iqm']} and {paths['html']}")
    return 0


def _datasets_build(args: argparse.Namespace) -> int:
    from offrl.builder import build

    sac_params = {}
    if args.learning_starts is not None:
        sac_params["learning_starts"] = args.learning_starts
    report = build(args.name, n_transitions=args.transitions, seed=args.seed, sac_steps=args.sac_steps,
                   eval_every=args.eval_every, sac_params=sac_params or None, env_id=args.env_id,
                   data_dir=args.data_dir, device=args.device, force=args.force, progress=not args.no_progress,
                   threads=args.threads or None, expert=args.expert)
    print()
    print(report.format())
    return 0


def _datasets_list(args: argparse.Namespace) -> int:
    from offrl.datasets.built import DATASET_VERSION, KINDS, known_datasets, list_built, offrl_data_dir

    root = args.data_dir or offrl_data_dir()
    everything = list_built(args.data_dir, all_versions=True)
    built = [row for row in everything if row.get("config", {}).get("version") == DATASET_VERSION]
    print(f"built under {root}:")
    if not built:
        print("  (none yet; build one with `offrl datasets build pendulum-medium-v1`)")
    for row in built:
        config = row.get("config", {})
        expert = "" if config.get("expert", "final") == "final" else f", expert {config['expert']}"
        print(f"  {row['name']:<32} seed {config.get('seed', '?')}, SAC {config.get('sac_steps', 0):,} steps{expert}  "
              f"{row['n_transitions']:>10,} transitions {row['n_episodes']:>7,} episodes  "
              f"return {row['return_mean']:9.2f}  normalised {row['normalized_score_mean']:6.1f}  {row['dataset_id']}")
    if len(everything) > len(built):
        print(f"  ({len(everything) - len(built)} more of an older builder recipe, which `offrl:` loads ignore; "
              f"rebuild them with `offrl datasets build`)")
    print(f"\nknown (offrl datasets build <env>-<kind>-v<N>; kinds: {', '.join(KINDS)}, or '*' for all):")
    for row in known_datasets():
        print(f"  {row['name']:<40} {row['env_id']:<26} default SAC {row['sac_steps']:>9,} steps, "
              f"{row['n_transitions']:,} transitions per kind")
    print("  any other gymnasium continuous-control env by name, or --env-id for an explicit id")
    return 0


# ---------------------------------------------------------------------- train / evaluate / export / convert
_SCHEMES = ("d4rl", "minari", "offrl")
# What `offrl train` writes into its --out folder (removed by --force before a fresh run).
_TRAIN_FILES = ("checkpoint.pt", "model.pt", "train.csv", "eval.csv")
_TRAIN_CONFIG = "train_config.json"


def _algorithm_class(name: str) -> type:
    """The offline algorithm called `name`, in any case and with '+', '-', '_' ignored ('td3+bc' is TD3PlusBC)."""
    from offrl import algos
    from offrl.sweep import available_algorithms

    def key(text: str) -> str:
        return re.sub(r"[^a-z0-9]", "", text.lower().replace("+", "plus"))

    names = available_algorithms()
    found = {key(n): n for n in names} | {key(n).replace("plus", ""): n for n in names}
    if key(name) not in found:
        raise ValueError(f"unknown algorithm {name!r}; use one of {', '.join(names)} (any case)")
    return getattr(algos, found[key(name)])


def _dataset_label(spec: str) -> str:
    """A folder name for the dataset of `spec`: the name after the scheme, or a file's stem."""
    from offrl.datasets.files import check_path_name

    scheme, sep, rest = spec.partition(":")
    text = rest if sep and scheme in _SCHEMES else Path(spec).stem
    label = re.sub(r"[^A-Za-z0-9_.+-]", "-", text).lstrip(".-") or "dataset"
    return check_path_name(label, "the dataset's folder name")


def _spec_key(spec: str) -> str:
    """`spec` as a resumed run compares it: a file path made absolute, a scheme spec as written."""
    scheme, sep, _ = spec.partition(":")
    return spec if sep and scheme in _SCHEMES else str(Path(spec).expanduser().resolve())


def _env_problem(env_id: str, option: str, fix: str) -> None:
    """Refuse an env id gymnasium cannot make (the sweep's check), ending with this command's `fix`."""
    from offrl.sweep import env_problem

    problem = env_problem(env_id)
    if problem:
        head, sep, _ = problem.partition("; use a registered id")  # the sweep's fix names YAML values
        raise ValueError(f"{option} {env_id!r}: {head}; {fix}" if sep else f"{option} {env_id!r}: {problem}")


def _check_env_fits(env: Any, env_id: str, observation_dim: int, action_dim: int | None, discrete: int | None,
                    what: str, fix: str) -> None:
    """Refuse an env whose observation or action space does not fit `what` (a model or a dataset)."""
    import gymnasium as gym

    obs_shape = getattr(env.observation_space, "shape", None)
    if obs_shape is not None and tuple(obs_shape) != (observation_dim,):
        raise ValueError(f"{what} has {observation_dim}-d observations but {env_id}'s have shape {tuple(obs_shape)}; "
                         f"{fix}")
    space = env.action_space
    if isinstance(space, gym.spaces.Discrete) and discrete is not None and int(space.n) != discrete:
        raise ValueError(f"{what} has {discrete} discrete actions but {env_id} has {int(space.n)}; {fix}")
    if isinstance(space, gym.spaces.Discrete) != (discrete is not None):
        kind = "discrete" if discrete is not None else "continuous"
        raise ValueError(f"{what} has {kind} actions but {env_id}'s action space is {space}; {fix}")
    if isinstance(space, gym.spaces.Box) and action_dim is not None and tuple(space.shape) != (action_dim,):
        raise ValueError(f"{what} has {action_dim}-d actions but {env_id}'s have shape {tuple(space.shape)}; {fix}")


def _check_settings(cls: type, settings: list[tuple[str, Any]]) -> dict[str, Any]:
    """The --set values as a dict, each checked against the hyper-parameter's declared rule (before any work)."""
    from offrl.algos.params import param_rules

    valid = cls().get_params(deep=False)
    rules = param_rules(cls)
    out: dict[str, Any] = {}
    for key, value in settings:
        if key in out:
            raise ValueError(f"--set {key} is given twice; give each hyper-parameter once")
        if key not in valid:
            names = ", ".join(sorted(set(valid) - set(_OPTION_PARAMS)))
            raise ValueError(f"--set {key}: {cls.__name__} has no hyper-parameter {key!r}; valid ones: {names}")
        rule = rules.get(key)
        if rule is not None and not rule.ok(value):
            raise ValueError(f"--set {key}={value!r}: {cls.__name__}'s {key} must be {rule.allowed}")
        out[key] = value
    return out


def _as_json(value: Any) -> Any:
    """`value` as it reads back from JSON (tuples become lists), for comparing a run's settings."""
    return json.loads(json.dumps(value, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v)))


def _check_resumable(out: Path, config: dict[str, Any]) -> None:
    """Refuse to resume a run whose algorithm, dataset, hyper-parameters or length differ from this command's."""
    path = out / _TRAIN_CONFIG
    try:
        old = json.loads(path.read_text())
    except FileNotFoundError:
        return  # a checkpoint written by fit() itself: its class is checked when it is read
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} cannot be read ({_one_line(err)}); train afresh with --force or another "
                         "--out") from err
    if not isinstance(old, dict):
        raise ValueError(f"{path} is not a run's settings; train afresh with --force or another --out")
    differ = []
    for key in ("algorithm", "dataset", "steps"):
        if old.get(key) != config[key]:
            differ.append(f"{key} {old.get(key)!r}, not {config[key]!r}")
    old_params, new_params = old.get("params") or {}, config["params"]
    for key in sorted(set(old_params) | set(new_params)):
        if key != "device" and old_params.get(key) != new_params.get(key):
            differ.append(f"{key}={old_params.get(key)!r}, not {new_params.get(key)!r}")
    if differ:
        raise ValueError(f"--resume: the run in {out} was started with {'; '.join(differ)}; resume with the "
                         f"arguments it was started with (see {path}), or train afresh with --force or another --out")
    if old.get("threads") not in (None, config["threads"]):
        print(f"note: the run started with {old['threads']} torch threads and this session has {config['threads']} "
              "(--threads), so its CPU result may differ in the last bits from an uninterrupted run")


def _train(args: argparse.Namespace) -> int:
    import shutil

    import torch

    import offrl
    from offrl.algos.presets import preset_params
    from offrl.datasets.files import wait_for_lock

    cls = _algorithm_class(args.algo)
    settings = _check_settings(cls, args.set or [])
    if args.eval_env == "auto":
        args.eval_env = None  # the dataset's env, as without the option
    if args.eval_env is not None and args.eval_env.lower() != "none":
        _env_problem(args.eval_env, "--eval-env", "pass a registered id such as Pendulum-v1, or --eval-env none")
    default_out = Path("offrl-results", "train", f"{cls.__name__.lower()}-{_dataset_label(args.dataset)}")
    out = Path(args.out) if args.out else default_out
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder")
    if args.resume and args.force:
        raise ValueError("--resume continues the run in --out and --force deletes it; give one of them")
    existing = [name for name in ("checkpoint.pt", "model.pt") if (out / name).exists()]
    if existing and not (args.resume or args.force):
        raise ValueError(f"{out} already holds a run ({', '.join(existing)}); continue it with --resume, start over "
                         "with --force, or give another --out")
    if args.threads:
        torch.set_num_threads(args.threads)

    dataset = _load_dataset(args.dataset, args.download)
    preset = preset_params(cls.__name__, dataset) if args.preset else {}
    params = {**settings, "random_state": args.seed}
    if args.device is not None:
        params["device"] = args.device
    algo = cls.from_preset(dataset, **params) if args.preset else cls(**params)
    algo.check_params()
    n_steps = int(args.steps if args.steps is not None else algo.n_steps)
    checkpoint_every = args.checkpoint_every or max(n_steps // 10, 1)
    eval_env = args.eval_env
    if eval_env is None:
        eval_env = dataset.metadata.get("env_id")
        if eval_env:
            _env_problem(eval_env, "the dataset's env", "pass --eval-env with a registered id, or --eval-env none")
    elif eval_env.lower() == "none":
        eval_env = None
    if eval_env:  # found now, not at the first evaluation
        from offrl.evaluation import make_env

        env = make_env(eval_env)
        try:
            option = "--eval-env" if args.eval_env else "the dataset's env"
            _check_env_fits(env, eval_env, dataset.observation_dim, dataset.action_dim, dataset.discrete_actions,
                            args.dataset, f"{option} must be the env the data comes from (or pass --eval-env none)")
        finally:
            env.close()
    config = {"command": "offrl train", "algorithm": cls.__name__, "dataset": _spec_key(args.dataset),
              "params": _as_json(algo.get_params(deep=False)), "preset": bool(args.preset), "steps": n_steps,
              "checkpoint_every": checkpoint_every, "eval_env": eval_env, "eval_every": args.eval_every,
              "eval_episodes": args.eval_episodes, "threads": torch.get_num_threads(),
              "offrl_version": offrl.__version__}

    name = dataset.metadata.get("name") or args.dataset
    with wait_for_lock(out / "train.lock", f"training in {out}", timeout=None):
        resuming = args.resume and (out / "checkpoint.pt").exists()
        if resuming:
            _check_resumable(out, config)
        elif args.resume:
            print(f"nothing to resume in {out} (no checkpoint.pt): starting at step 0")
        if args.force:
            for file in _TRAIN_FILES:
                (out / file).unlink(missing_ok=True)
            shutil.rmtree(out / "tensorboard", ignore_errors=True)
        from offrl.datasets.core import atomic_write_path

        with atomic_write_path(out / _TRAIN_CONFIG) as tmp, open(tmp, "w") as f:
            json.dump(config, f, indent=2)
        if args.preset:
            shown = {k: v for k, v in preset.items() if k not in settings}
            print(f"{cls.__name__}'s preset for {name}: " + (", ".join(f"{k}={v!r}" for k, v in shown.items())
                                                             if shown else "the defaults (no overrides)"))
        where = f"evaluating in {eval_env}" if eval_env else "no evaluation env (pass --eval-env to evaluate)"
        print(f"training {cls.__name__} on {name} for {n_steps:,} steps, {where}; writing to {out}")
        started = time.time()
        try:
            algo.fit(dataset, n_steps=n_steps, eval_env=eval_env, eval_every=args.eval_every,
                     eval_episodes=args.eval_episodes, log_dir=out, checkpoint_every=checkpoint_every,
                     resume=args.resume, progress=not args.no_progress)
        except KeyboardInterrupt:
            print(f"{args.error_prefix}: interrupted; a checkpoint is written every {checkpoint_every:,} steps to "
                  f"{out / 'checkpoint.pt'}: continue with the same command and --resume", file=sys.stderr)
            return 130
        offrl.save(algo, out / "model.pt")
    seconds = time.time() - started
    print(f"\n{cls.__name__} on {name}: {n_steps:,} steps ({seconds:.1f} s this session)")
    final = algo.history_[-1] if eval_env and algo.history_ else None
    if final is not None:
        score = final.get("normalized_score_mean", float("nan"))
        scored = f", normalised score {score:.1f}" if math.isfinite(score) else ""
        episodes = f"{args.eval_episodes} episode{'s' if args.eval_episodes > 1 else ''}"
        print(f"final evaluation (step {final['step']:,}, {episodes} in {eval_env}): "
              f"return {final['return_mean']:.2f} ± {final['return_std']:.2f}{scored}")
    rows = [("model", f"{out / 'model.pt'}"), ("checkpoint", f"{out / 'checkpoint.pt'}"),
            ("logs", f"{out / 'train.csv'}" + (f", {out / 'eval.csv'}" if eval_env else "")),
            ("settings", f"{out / _TRAIN_CONFIG}")]
    for key, value in rows:
        print(f"{key:<10}  {value}")
    env_hint = "" if eval_env else " --env ENV"
    print(f"next: offrl evaluate {out / 'model.pt'}{env_hint}   or   offrl export {out / 'model.pt'} policy.ts")
    return 0


def _load_model(path: str, device: str = "auto") -> Any:
    """`offrl.load(path)`, with an unreadable file reported in one line that says what to pass instead."""
    import offrl

    if os.path.isdir(path):
        raise ValueError(f"{path} is a folder; pass the model file in it (e.g. {Path(path) / 'model.pt'})")
    try:
        return offrl.load(path, device=device)
    except ValueError as err:
        if str(err).startswith(f"{path} could not be read"):
            raise ValueError(f"{path} is not a readable offrl model file (damaged, or not written by offrl.save / "
                             "estimator.save); pass a model.pt written by `offrl train` or estimator.save") from err
        raise


def _final_step(model: Any) -> Any:
    """The algorithm of a model: itself, or a Pipeline's last step."""
    steps = getattr(model, "steps", None)
    return steps[-1][1] if steps else model


def _evaluate(args: argparse.Namespace) -> int:
    from offrl.datasets import normalized_score
    from offrl.evaluation import make_env

    if args.env == "auto":
        args.env = None  # the model's env, as without the option
    if args.env is not None:
        _env_problem(args.env, "--env", "pass a registered id such as Pendulum-v1")
    model = _load_model(args.model, device=args.device)
    spec = getattr(_final_step(model), "spec_", {}) or {}
    env_id = args.env or spec.get("env_id")
    if not env_id:
        raise ValueError(f"{args.model} names no environment (its training data had no env_id); pass --env ID")
    if args.env is None:
        _env_problem(env_id, "the model's env", "pass --env with a registered id")
    env = make_env(env_id)
    try:
        if "observation_dim" in spec:
            _check_env_fits(env, env_id, spec["observation_dim"], spec.get("action_dim"), spec.get("discrete_actions"),
                            args.model, "pass --env with the env the model was trained for"
                            + (f" ({spec['env_id']})" if spec.get("env_id") else ""))
        result = model.evaluate(env, n_episodes=args.episodes, seed=args.seed)
    finally:
        env.close()
    if "normalized_score_mean" not in result:
        # the model's dataset may be a D4RL one by name; without reference scores there is no normalised score
        with contextlib.suppress(ValueError):
            scores = normalized_score(spec, result["returns"])
            result["normalized_score_mean"], result["normalized_score_std"] = float(scores.mean()), float(scores.std())
    if args.json:
        print(json.dumps({"model": args.model, "env": env_id, "seed": args.seed, **result}))
        return 0
    returns = result["returns"]
    seeds = f"seed {args.seed}" if args.episodes == 1 else f"seeds {args.seed}..{args.seed + args.episodes - 1}"
    print(f"{args.model} in {env_id}, {result['n_episodes']} episode{'s' if args.episodes > 1 else ''} ({seeds})")
    print(f"return            {result['return_mean']:.2f} ± {result['return_std']:.2f}  "
          f"(min {min(returns):.2f}, max {max(returns):.2f}; episode length {result['length_mean']:.1f})")
    if "normalized_score_mean" in result:
        print(f"normalised score  {result['normalized_score_mean']:.1f} ± {result['normalized_score_std']:.1f}")
    else:
        print("normalised score  n/a (the model's dataset has no reference scores)")
    return 0


def _export(args: argparse.Namespace) -> int:
    import warnings

    import torch

    out = Path(args.out)
    if out.is_dir():
        raise ValueError(f"{out} is a folder; give a file name such as {out / 'policy.ts'}")
    if out.exists() and not args.force:
        raise ValueError(f"{out} exists; pass --force to overwrite it, or give another file name")
    if out.exists() and out.resolve() == Path(args.model).resolve():
        raise ValueError(f"{out} is the model file itself; give another file name for the TorchScript policy")
    model = _load_model(args.model, device="cpu")
    try:
        model.export_policy(out)
    except AttributeError as err:
        raise ValueError(f"{args.model} holds a {type(_final_step(model)).__name__}, which has no policy to export "
                         f"({_one_line(err)})") from err
    spec = _final_step(model).spec_
    obs_dim = int(spec["observation_dim"])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript is what runs without offrl
        actions = torch.jit.load(str(out))(torch.zeros(1, obs_dim))  # the file runs, and gives the action shape
    kind = f", {spec['discrete_actions']} discrete actions" if spec.get("discrete_actions") is not None else ""
    shape = ", ".join(["n", *map(str, actions.shape[1:])])
    print(f"wrote {out}: TorchScript mapping observations (n, {obs_dim}) float32 to actions ({shape}){kind}, "
          "deterministic; no offrl needed to run it:")
    print(f"    import torch\n    policy = torch.jit.load({str(out)!r})\n"
          f"    actions = policy(torch.zeros(1, {obs_dim}))  # a batch of raw (unnormalised) observations")
    return 0


def _check_npz_out(path: Path, force: bool) -> None:
    """Refuse, before any work, an .npz output that would not load back or would overwrite a file without --force."""
    if path.suffix != ".npz":
        raise ValueError(f"{path}: an npz output must end in .npz (so `offrl` loads it back); e.g. {path.stem}.npz")
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give a file name such as {path / 'dataset.npz'}")
    if path.exists() and not force:
        raise ValueError(f"{path} exists; pass --force to overwrite it, or give another file name")


def _datasets_convert(args: argparse.Namespace) -> int:
    if args.env is not None:
        _env_problem(args.env, "--env", "pass the registered id of the env the data comes from")
    if args.to == "minari":
        from minari.storage.datasets_root_dir import get_dataset_path

        from offrl.datasets.minari import check_new_minari_id

        check_new_minari_id(args.name)
        path = Path(get_dataset_path(args.name))
        if (path / "data").exists():
            raise ValueError(f"Minari dataset {args.name!r} already exists under {path}; give another name or version, "
                             f"or delete it with `minari delete {args.name}`")
    else:
        path = Path(args.name)
        _check_npz_out(path, args.force)
    dataset = _load_dataset(args.spec, args.download)
    env_id = args.env or (dataset.metadata.get("env_id") if args.to == "minari" else None)
    if env_id:  # Minari writes the env's spaces next to the data: refuse an env that does not fit it
        from offrl.evaluation import make_env

        fix = "pass --env with the registered id of the env the data comes from"
        if not args.env:
            _env_problem(env_id, "the dataset's env", fix)
        env = make_env(env_id)
        try:
            _check_env_fits(env, env_id, dataset.observation_dim, dataset.action_dim, dataset.discrete_actions,
                            args.spec, fix)
        finally:
            env.close()
    if args.to == "minari":
        import warnings

        from offrl.datasets import to_minari

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*eval_env.* is set to None")  # Minari's note: env is used
            to_minari(dataset, args.name, env=args.env)
        print(f"wrote Minari dataset {args.name} ({dataset.n_transitions:,} transitions, {dataset.n_episodes:,} "
              f"episodes) under {path}; load it with offrl.datasets.load('minari:{args.name}')")
    else:
        if args.env is not None:
            dataset.metadata["env_id"] = args.env
        dataset.save(path)
        print(f"wrote {path} ({dataset.n_transitions:,} transitions, {dataset.n_episodes:,} episodes); load it with "
              f"offrl.datasets.load({str(path)!r})")
    return 0


# The labeller flags of `offrl datasets label` (argparse dest -> flag), and the options that set a labeller's
# hyper-parameter (parameter -> option); an option whose parameter the chosen labeller lacks is refused.
_LABELER_FLAGS = {"otr": "--otr", "inverse_dynamics": "--inverse-dynamics", "reward_model": "--reward-model"}
_LABEL_OPTIONS = {"n_demonstrations": "--n-demonstrations", "epsilon": "--epsilon", "top_k": "--top-k",
                  "label_fraction": "--label-fraction", "random_state": "--random-state", "n_steps": "--n-steps"}


def _labeler(args: argparse.Namespace) -> tuple[Any, str]:
    """(the unfitted labeller the flags ask for, its flag), each option checked against its parameter's rule."""
    from offrl.algos.params import param_rules
    from offrl.reward_labeling import InverseDynamicsLabeler, OTRewardLabeler, RewardModelLabeler

    classes = {"otr": OTRewardLabeler, "inverse_dynamics": InverseDynamicsLabeler, "reward_model": RewardModelLabeler}
    dest = next(d for d in _LABELER_FLAGS if getattr(args, d) not in (None, False))
    cls, flag = classes[dest], _LABELER_FLAGS[dest]
    valid, rules = cls().get_params(deep=False), param_rules(cls)
    params: dict[str, Any] = {}
    for key, option in _LABEL_OPTIONS.items():
        value = getattr(args, key)
        if value is None:
            continue
        if key not in valid:
            users = [f for d, f in _LABELER_FLAGS.items() if key in classes[d]().get_params(deep=False)]
            raise ValueError(f"{option} applies to {' and '.join(users)}, not {flag}; drop it")
        rule = rules.get(key)
        if rule is not None and not rule.ok(value):
            raise ValueError(f"{option} {value}: {cls.__name__}'s {key} must be {rule.allowed}")
        params[key] = value
    return cls(**params), flag


def _datasets_label(args: argparse.Namespace) -> int:
    out = Path(args.out)
    _check_npz_out(out, args.force)
    labeler, flag = _labeler(args)  # every option is checked before any data is read
    dataset = _load_dataset(args.spec, args.download)
    label = getattr(labeler, "label", "rewards")
    if flag != "--otr" and labeler.label_fraction is None and dataset.is_labelled(label):
        unit = "episodes'" if labeler.label_unit == "episodes" else "transitions'"
        raise ValueError(f"{args.spec} has all its {label}, so {flag} has none to label; pass --label-fraction F to "
                         f"keep only that fraction of {unit} {label} and label the rest")
    if args.otr is not None:
        labeler.set_params(expert=_load_dataset(args.otr, args.download))
    labelled = labeler.fit_transform(dataset)
    labelled.save(out)
    record = labelled.metadata["transforms"][-1]
    if args.otr is not None:
        n_demos = record["n_demonstrations"]
        detail = f"{n_demos} demonstration{'s' if n_demos != 1 else ''} from {args.otr}"
    else:
        detail = f"trained on {record['n_training_rows']:,} labelled rows"
        if record["label_fraction"] is not None:
            detail += f", label fraction {record['label_fraction']:g}"
    print(f"labelled {record['n_labelled']:,} {record['labels']} with {type(labeler).__name__} ({detail}); wrote "
          f"{out} ({labelled.n_transitions:,} transitions, {labelled.n_episodes:,} episodes); load it with "
          f"offrl.datasets.load({str(out)!r})")
    return 0


def _example(*lines: str) -> str:
    return ("examples:\n" if len(lines) > 1 else "example:\n") + "\n".join(f"  {line}" for line in lines)


_SPEC_HELP = "d4rl:<name>, minari:<id>, offrl:<name>, or a .hdf5/.npz path"


def build_parser() -> argparse.ArgumentParser:
    """The `offrl` argument parser, every command with its options and example."""
    from offrl import __version__
    from offrl.sweep import available_algorithms

    parser = _Parser(prog="offrl", description="Offline RL and off-policy evaluation.", group=True,
                     epilog=_example("offrl quickstart", "offrl train iql d4rl:hopper-medium-v2 --steps 100000",
                                     "offrl COMMAND --help"))
    parser.add_argument("--version", action="version", version=f"offrl {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def command(group: Any, name: str, func: Callable[[argparse.Namespace], int], example: Sequence[str],
                **kwargs: Any) -> argparse.ArgumentParser:
        sub = group.add_parser(name, epilog=_example(*example), **kwargs)
        sub.set_defaults(func=func, command_parser=sub)
        sub.set_defaults(error_prefix=sub.prog)  # errors say which command they come from
        return sub

    datasets = commands.add_parser("datasets", help="inspect, build, list, convert and label datasets", group=True,
                                   epilog=_example("offrl datasets info d4rl:hopper-medium-v2",
                                                   "offrl datasets COMMAND --help"))
    datasets_commands = datasets.add_subparsers(dest="datasets_command", required=True)
    info = command(datasets_commands, "info", _datasets_info, ["offrl datasets info d4rl:hopper-medium-v2"],
                   help="summarise a dataset (counts, returns, normalised scores)")
    info.add_argument("spec", help=_SPEC_HELP)
    info.add_argument("--download", action="store_true", help="download a missing D4RL file")
    build = command(
        datasets_commands, "build", _datasets_build, ["offrl datasets build 'pendulum-*-v1'"],
        help="build D4RL-style datasets locally: train SAC on a gymnasium env, collect, write Minari files")
    build.add_argument("name", help="<env>-<kind>-v<env version>, e.g. hopper-medium-v5 or 'pendulum-*-v1' for all kinds")
    build.add_argument("--transitions", type=_count(1), default=None, help="transitions per collected kind (default: per env)")
    build.add_argument("--sac-steps", type=_count(1), default=None, help="SAC environment steps (default: per env)")
    build.add_argument("--seed", type=_count(0), default=0)
    build.add_argument("--eval-every", type=_count(1), default=None, help="SAC steps between evaluated snapshots")
    build.add_argument("--learning-starts", type=_count(0), default=None, help="SAC random warm-up steps (default 5000)")
    build.add_argument("--expert", choices=("final", "best"), default="final",
                       help="the expert policy: the final SAC policy (D4RL's recipe, default) or the best evaluated "
                            "snapshot (for short budgets whose final policy has fallen back); reuses the same SAC run")
    build.add_argument("--env-id", default=None, help="explicit gymnasium id (its version must match the name's)")
    build.add_argument("--data-dir", default=None, help="cache root (default: $OFFRL_DATA_DIR or ~/.offrl/datasets)")
    build.add_argument("--device", default="auto")
    build.add_argument("--threads", type=_count(0), default=1,
                       help="torch CPU threads during the build (default 1; 0 keeps torch's choice)")
    build.add_argument("--force", action="store_true", help="rebuild from scratch even if cached")
    build.add_argument("--no-progress", action="store_true")
    listing = command(datasets_commands, "list", _datasets_list, ["offrl datasets list"],
                      help="list built datasets and the envs `build` knows")
    listing.add_argument("--data-dir", default=None, help="cache root (default: $OFFRL_DATA_DIR or ~/.offrl/datasets)")
    convert = command(
        datasets_commands, "convert", _datasets_convert,
        ["offrl datasets convert d4rl:hopper-medium-v2 --to minari offrl/hopper-medium-v0",
         "offrl datasets convert minari:offrl/hopper-medium-v0 --to npz hopper-medium.npz"],
        help="write a dataset as a Minari dataset (or an .npz file)",
        description="Load SPEC and write it in another format: a Minari dataset NAME (under $MINARI_DATASETS_PATH, "
                    "default ~/.minari/datasets), or an .npz file (Dataset.save) at the path NAME.")
    convert.add_argument("spec", help=_SPEC_HELP)
    convert.add_argument("--to", required=True, choices=("minari", "npz"), help="the format to write")
    convert.add_argument("name", help="the Minari dataset id ([namespace/]name-v<N>) or the .npz path")
    convert.add_argument("--env", default=None, metavar="ENV",
                         help="gymnasium id the data comes from (default: the dataset's own env_id, if it has one)")
    convert.add_argument("--download", action="store_true", help="download a missing D4RL file")
    convert.add_argument("--force", action="store_true", help="overwrite an existing .npz file")
    label = command(
        datasets_commands, "label", _datasets_label,
        [("offrl datasets label d4rl:hopper-medium-v2 --otr d4rl:hopper-expert-v2 --n-demonstrations 1 "
          "--out hopper-medium-otr.npz"),
         "offrl datasets label hopper-medium.npz --inverse-dynamics --label-fraction 0.1 --out hopper-medium-id.npz",
         "offrl datasets label hopper-medium.npz --reward-model --label-fraction 0.01 --out hopper-medium-rm.npz"],
        help="fill in a dataset's rewards (OTR, a reward model) or actions (inverse dynamics); write an .npz file",
        description="Fit a labeller from offrl.reward_labeling on SPEC, label it and write the result to --out "
                    "(Dataset.save; metadata['transforms'] records the labeller).  --otr: every reward from the "
                    "optimal-transport alignment of each episode to the expert demonstrations EXPERT_SPEC "
                    "(OTRewardLabeler).  --inverse-dynamics: the missing actions, from an inverse-dynamics model "
                    "trained on the rows that have them (InverseDynamicsLabeler).  --reward-model: the missing "
                    "rewards, from a reward model trained on the rows that have them (RewardModelLabeler).  "
                    "--label-fraction hides all but that fraction of the labels first (whole episodes for actions), "
                    "to label a fully labelled dataset as if most labels were missing.")
    label.add_argument("spec", help=_SPEC_HELP)
    labeler_flags = label.add_mutually_exclusive_group(required=True)
    labeler_flags.add_argument("--otr", default=None, metavar="EXPERT_SPEC",
                               help=f"label every reward by optimal transport to these expert demonstrations "
                                    f"({_SPEC_HELP})")
    labeler_flags.add_argument("--inverse-dynamics", action="store_true",
                               help="label the missing actions with an inverse-dynamics model")
    labeler_flags.add_argument("--reward-model", action="store_true",
                               help="label the missing rewards with a reward model")
    label.add_argument("--n-demonstrations", type=int, default=None, metavar="K",
                       help="--otr: use the K best-return expert episodes (default: all)")
    label.add_argument("--epsilon", type=float, default=None, metavar="E",
                       help="--otr: entropic regularisation in cost units (default 0.01; 0: exact OT)")
    label.add_argument("--top-k", type=int, default=None, metavar="K",
                       help="--otr: average each episode's rewards over its K best demonstrations (default 1)")
    label.add_argument("--label-fraction", type=float, default=None, metavar="F",
                       help="--inverse-dynamics/--reward-model: keep only this fraction of the labels, then label "
                            "the rest (default: keep all and label the missing ones)")
    label.add_argument("--random-state", type=int, default=None, metavar="S",
                       help="--inverse-dynamics/--reward-model: seed of the hidden labels and the training")
    label.add_argument("--n-steps", type=int, default=None, metavar="N",
                       help="--inverse-dynamics/--reward-model: training steps at most (default 10,000; training "
                            "stops early when the validation loss stops improving)")
    label.add_argument("--out", required=True, metavar="OUT.npz", help="the .npz file to write")
    label.add_argument("--download", action="store_true", help="download a missing D4RL file")
    label.add_argument("--force", action="store_true", help="overwrite an existing --out file")

    quick = command(commands, "quickstart", _quickstart, ["offrl quickstart --steps 2000"],
                    help="build pendulum data, train BC/TD3+BC/IQL/CQL, evaluate, OPE, report")
    quick.add_argument("--out", default="offrl-results/quickstart")
    quick.add_argument("--steps", type=_count(1), default=None, help="gradient steps per algorithm (default 5000)")
    quick.add_argument("--workers", type=_count(1), default=2, help="algorithms trained at the same time")
    quick.add_argument("--ope-rollouts", type=_count(1), default=20, help="on-policy roll-outs for each true value")
    quick.add_argument("--no-progress", action="store_true")

    algorithms = ", ".join(available_algorithms())
    train = command(
        commands, "train", _train,
        ["offrl train iql d4rl:hopper-medium-v2 --steps 100000 --set expectile=0.8 --out runs/iql-hopper",
         "offrl train iql d4rl:hopper-medium-v2 --steps 100000 --set expectile=0.8 --out runs/iql-hopper --resume"],
        help="train one algorithm on one dataset (logs, checkpoint, model file)",
        description="Train ALGO on DATASET. --out receives train.csv and eval.csv (losses and evaluations), "
                    "checkpoint.pt (every --checkpoint-every steps; --resume continues from it exactly), "
                    f"model.pt (offrl.load reads it) and {_TRAIN_CONFIG} (the settings --resume checks).")
    train.add_argument("algo", help=f"the algorithm: {algorithms} (any case; td3+bc works)")
    train.add_argument("dataset", help=_SPEC_HELP)
    train.add_argument("--steps", type=_count(1), default=None, metavar="N",
                       help="gradient steps (default: the algorithm's n_steps, the paper's 1,000,000)")
    train.add_argument("--set", action="append", type=_setting, metavar="KEY=VALUE",
                       help="a hyper-parameter, VALUE read as YAML (e.g. --set hidden_dims=[256,256]); repeatable")
    train.add_argument("--preset", action="store_true",
                       help="start from the papers' settings for the dataset's family (AntMaze, Adroit, Kitchen); "
                            "--set overrides them")
    train.add_argument("--eval-env", default=None, metavar="ENV",
                       help="gymnasium id to evaluate in (default: the dataset's env, if it names one; none: never)")
    train.add_argument("--eval-every", type=_count(1), default=None, metavar="N",
                       help="steps between evaluations (default steps/10)")
    train.add_argument("--eval-episodes", type=_count(1), default=10, metavar="N",
                       help="episodes per evaluation (default 10)")
    train.add_argument("--checkpoint-every", type=_count(1), default=None, metavar="N",
                       help="steps between checkpoints (default steps/10)")
    train.add_argument("--out", default=None, metavar="DIR",
                       help="output folder (default: offrl-results/train/<algo>-<dataset>)")
    train.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    train.add_argument("--force", action="store_true", help="delete the run in --out and start over")
    train.add_argument("--seed", type=_count(0), default=0, metavar="S",
                       help="random_state of the algorithm (default 0)")
    train.add_argument("--device", type=_device, default=None, metavar="DEVICE",
                       help="auto, cpu, cuda, cuda:N or mps (default auto)")
    train.add_argument("--threads", type=_count(0), default=0, metavar="N",
                       help="torch CPU threads (default 0: torch's choice; a run resumes bit for bit with the same)")
    train.add_argument("--download", action="store_true", help="download a missing D4RL file")
    train.add_argument("--no-progress", action="store_true")

    evaluate = command(
        commands, "evaluate", _evaluate, ["offrl evaluate runs/iql-hopper/model.pt --env Hopper-v5 --episodes 20"],
        help="roll a saved model out: mean return and normalised score",
        description="Roll the deterministic policy of MODEL (a model file or pipeline written by offrl.save or "
                    "`offrl train`) out for --episodes episodes, episode i reset with seed --seed + i.")
    evaluate.add_argument("model", help="a model file (model.pt of `offrl train`, estimator.save, offrl.save)")
    evaluate.add_argument("--env", default=None, metavar="ENV",
                          help="gymnasium id (default: the env of the model's training data)")
    evaluate.add_argument("--episodes", type=_count(1), default=10, metavar="N", help="episodes (default 10)")
    evaluate.add_argument("--seed", type=_count(0), default=0, metavar="S",
                          help="seed of the first episode (default 0)")
    evaluate.add_argument("--device", type=_device, default="auto")
    evaluate.add_argument("--json", action="store_true", help="print one JSON line instead of the summary")

    export = command(
        commands, "export", _export, ["offrl export runs/iql-hopper/model.pt iql-hopper.ts"],
        help="write a saved model's policy as TorchScript (runs without offrl)",
        description="Write the deterministic policy of MODEL as a TorchScript file mapping a batch of raw "
                    "observations to actions; torch.jit.load reads it, with no offrl installed.")
    export.add_argument("model", help="a model file (model.pt of `offrl train`, estimator.save, offrl.save)")
    export.add_argument("out", help="the TorchScript file to write, e.g. policy.ts")
    export.add_argument("--force", action="store_true", help="overwrite an existing file")

    sweep = command(commands, "sweep", _sweep, ["offrl sweep experiments/pendulum_acceptance.yaml --workers 4",
                                                "offrl sweep experiments/pendulum_acceptance.yaml --ope FQE,DR,WPDIS",
                                                "offrl sweep experiments/pendulum_acceptance.yaml --algorithms IQL "
                                                "--seeds 3,4,5"],
                    help="run a benchmark sweep from a YAML config")
    sweep.add_argument("config", help="sweep YAML (see experiments/)")
    sweep.add_argument("--backend", choices=("local", "ray"), default="local")
    sweep.add_argument("--workers", type=_count(1), default=None, help="parallel runs (default: CPU count)")
    sweep.add_argument("--address", default=None, help="Ray cluster address (ray backend; default: start a local one)")
    sweep.add_argument("--out", default=None, help="output directory (default: offrl-results/<name>)")
    sweep.add_argument("--no-progress", action="store_true")

    def ope_names(text: str) -> list[str]:
        from offrl.sweep import parse_ope_estimators

        try:
            return parse_ope_estimators(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    sweep.add_argument("--ope", type=ope_names, default=None, metavar="NAMES",
                       help="OPE estimators, comma-separated (e.g. FQE,DR,WPDIS), run on every trained policy "
                            "against its dataset, in place of the config's ope.estimators; finished runs are not "
                            "trained again, only their missing estimates are computed")
    sweep.add_argument("--algorithms", default=None, metavar="LABELS",
                       help="run only these algorithm labels of the config (comma-separated); each run keeps the "
                            "directory and hash it has in the whole sweep")
    sweep.add_argument("--datasets", default=None, metavar="LABELS",
                       help="run only these dataset labels of the config (comma-separated)")
    sweep.add_argument("--seeds", default=None, metavar="N,...",
                       help="run these seeds in place of the config's (comma-separated, e.g. 3,4,5)")

    report = command(commands, "report", _report, ["offrl report offrl-results/pendulum_acceptance --title 'Pendulum'"],
                     help="aggregate a sweep directory into tables and report.html")
    report.add_argument("dir")
    report.add_argument("--title", default=None)

    from offrl.tune import add_tune_parser

    add_tune_parser(commands)

    from offrl.ope.cli import add_ope_parser

    ope = add_ope_parser(commands)
    ope.set_defaults(command_parser=ope, error_prefix=ope.prog)
    ope.epilog = _example("offrl ope --dataset offrl:pendulum-medium-v1 --policy iql=runs/iql/model.pt "
                          "--env Pendulum-v1 --true-values --out ope-results")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `offrl` with `argv` (default: the process's arguments); the exit status (0 done, 2 a bad input)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the command that got them, in its one line
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    from offrl.monitor import TrainingDivergedError

    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, OSError, TrainingDivergedError) as err:
        # ValueError (InvalidParameterError, NotFittedError too) and TypeError: bad input, named; OSError: missing
        # or corrupt files, a lock waited on too long.  One line, what to do last; never a traceback.
        print(f"{getattr(args, 'error_prefix', 'offrl')}: error: {_one_line(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
