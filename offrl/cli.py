"""The `offrl` command."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence


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

def _datasets_info(args: argparse.Namespace) -> int:
    from offrl.datasets import load, normalized_score

    ds = load(args.spec, download=args.download)
    returns = ds.episode_returns()
    lengths = ds.episode_lengths()
    rows = [
        ("dataset", ds.metadata.get("name", args.spec)),
        ("transitions", f"{ds.n_transitions:,}"),
        ("episodes", f"{ds.n_episodes:,}"),
        ("observation dim", ds.observation_dim),
        ("action dim", ds.action_dim if ds.discrete_actions is None else f"discrete ({ds.discrete_actions} actions)"),
        ("terminals / timeouts", f"{int(ds.terminals.sum()):,} / {int(ds.timeouts.sum()):,}"),
        ("episode length", f"mean {lengths.mean():.1f}, min {lengths.min()}, max {lengths.max()}"),
        (
            "episode return",
            f"mean {returns.mean():.3f} ± {returns.std():.3f}, min {returns.min():.3f}, max {returns.max():.3f}",
        ),
    ]
    try:
        scores = normalized_score(ds, returns)
        rows.append(("normalised score", f"mean {scores.mean():.1f}, min {scores.min():.1f}, max {scores.max():.1f}"))
    except ValueError:
        rows.append(("normalised score", "n/a (no reference scores)"))
    rows.append(("behaviour log-probs", "present" if ds.has_behavior_log_probs else "absent"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from offrl.report import score_table, write_report
    from offrl.sweep import load_config, run_sweep

    config = load_config(args.config)  # every problem of the config is reported here, before any run
    out = args.out or config.out or f"offrl-results/{config.name}"
    results = run_sweep(config, backend=args.backend, workers=args.workers, address=args.address, out=out,
                        progress=not args.no_progress)
    paths = write_report(out, title=config.name)
    table = score_table(results) if len(results) else None
    if table is not None and not table.empty:
        print(table.to_string())
    n_failed = int((results["status"] == "failed").sum()) if len(results) else 0
    print(f"{len(results)} runs ({n_failed} failed); results in {paths['results']}, report in {paths['html']}")
    return 1 if n_failed else 0


def _quickstart(args: argparse.Namespace) -> int:
    from offrl.quickstart import run_quickstart

    run_quickstart(out=args.out, steps=args.steps, workers=args.workers, ope_rollouts=args.ope_rollouts,
                   progress=not args.no_progress)
    return 0


def _report(args: argparse.Namespace) -> int:
    from offrl.report import results_frame, score_table, write_report

    if not os.path.isdir(args.dir):
        raise FileNotFoundError(f"{args.dir} is not a directory; pass a sweep output directory")
    paths = write_report(args.dir, title=args.title)
    table = score_table(results_frame(args.dir))
    if not table.empty:
        print(table.to_string())
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


def build_parser() -> argparse.ArgumentParser:
    from offrl import __version__

    parser = argparse.ArgumentParser(prog="offrl", description="Offline RL and off-policy evaluation.")
    parser.add_argument("--version", action="version", version=f"offrl {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    datasets = commands.add_parser("datasets", help="inspect, build and list datasets")
    datasets_commands = datasets.add_subparsers(dest="datasets_command", required=True)
    info = datasets_commands.add_parser("info", help="summarise a dataset (counts, returns, normalised scores)")
    info.add_argument("spec", help="d4rl:<name>, minari:<id>, offrl:<name>, or a .hdf5/.npz path")
    info.add_argument("--download", action="store_true", help="download a missing D4RL file")
    info.set_defaults(func=_datasets_info)
    build = datasets_commands.add_parser(
        "build", help="build D4RL-style datasets locally: train SAC on a gymnasium env, collect, write Minari files")
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
    build.set_defaults(func=_datasets_build)
    listing = datasets_commands.add_parser("list", help="list built datasets and the envs `build` knows")
    listing.add_argument("--data-dir", default=None, help="cache root (default: $OFFRL_DATA_DIR or ~/.offrl/datasets)")
    listing.set_defaults(func=_datasets_list)

    quick = commands.add_parser("quickstart", help="build pendulum data, train BC/TD3+BC/IQL/CQL, evaluate, OPE, report")
    quick.add_argument("--out", default="offrl-results/quickstart")
    quick.add_argument("--steps", type=_count(1), default=None, help="gradient steps per algorithm (default 5000)")
    quick.add_argument("--workers", type=_count(1), default=2, help="algorithms trained at the same time")
    quick.add_argument("--ope-rollouts", type=_count(1), default=20, help="on-policy roll-outs for each true value")
    quick.add_argument("--no-progress", action="store_true")
    quick.set_defaults(func=_quickstart)

    sweep = commands.add_parser("sweep", help="run a benchmark sweep from a YAML config")
    sweep.add_argument("config", help="sweep YAML (see experiments/)")
    sweep.add_argument("--backend", choices=("local", "ray"), default="local")
    sweep.add_argument("--workers", type=_count(1), default=None, help="parallel runs (default: CPU count)")
    sweep.add_argument("--address", default=None, help="Ray cluster address (ray backend; default: start a local one)")
    sweep.add_argument("--out", default=None, help="output directory (default: offrl-results/<name>)")
    sweep.add_argument("--no-progress", action="store_true")
    sweep.set_defaults(func=_sweep)

    report = commands.add_parser("report", help="aggregate a sweep directory into tables and report.html")
    report.add_argument("dir")
    report.add_argument("--title", default=None)
    report.set_defaults(func=_report)

    from offrl.ope.cli import add_ope_parser

    add_ope_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from offrl.monitor import TrainingDivergedError

    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError, TrainingDivergedError) as err:
        # ValueError: bad input, named; OSError: missing or corrupt files, a lock waited on too long.
        print(f"offrl: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
