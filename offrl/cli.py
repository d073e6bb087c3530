"""The `offrl` command."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

import numpy as np


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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as err:
        print(f"offrl: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
