"""`offrl ope`: evaluate saved policies on a dataset, write report.html and estimates.csv, print the table."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_ope_parser", "run_ope"]


def _policy_arg(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--policy takes NAME=PATH (a file written by estimator.save), got {text!r}")
    return name, path


def add_ope_parser(commands: Any) -> argparse.ArgumentParser:
    """Register the `ope` subcommand on the `offrl` parser's subparsers."""
    parser = commands.add_parser(
        "ope", help="off-policy evaluation of saved policies on a dataset (report.html, estimates.csv)",
        description="Estimate each policy's discounted value from the logged data with several estimators; "
                    "with --env and --true-values also roll the policies out for their true values and score "
                    "the estimators.")
    parser.add_argument("--dataset", required=True, help="d4rl:<name>, minari:<id>, offrl:<name>, or a .hdf5/.npz path")
    parser.add_argument("--policy", action="append", type=_policy_arg, required=True, metavar="NAME=PATH",
                        help="a policy to evaluate (repeat for several)")
    parser.add_argument("--estimators", nargs="+", default=None,
                        help="FQE IS PDIS WIS WPDIS DR WDR MB (default: all but MB); commas also work")
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--horizon", type=int, default=None, help="steps per episode (default: as logged)")
    parser.add_argument("--interval", default="bootstrap", choices=("bootstrap", "t", "hoeffding", "bernstein"))
    parser.add_argument("--alpha", type=float, default=0.05, help="1 - confidence level (default 0.05)")
    parser.add_argument("--fqe-steps", type=int, default=None, help="FQE gradient steps (default 20000)")
    parser.add_argument("--env", default=None, help="gymnasium id for true values by roll-outs")
    parser.add_argument("--true-values", action="store_true", help="compute true values in --env and score the estimators")
    parser.add_argument("--n-rollouts", type=int, default=50, help="roll-outs per policy for true values")
    parser.add_argument("--k", type=int, default=1, help="k of regret@k and precision@k")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", required=True, help="output directory")
    parser.set_defaults(func=run_ope)
    return parser


def run_ope(args: argparse.Namespace) -> int:
    from pathlib import Path

    from offrl.datasets import load as load_dataset
    from offrl.ope.api import evaluate, resolve_policies
    from offrl.ope.harness import benchmark

    if args.true_values and not args.env:
        raise ValueError("--true-values needs --env <gymnasium id> to roll the policies out")
    names = [name for name, _ in args.policy]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"policy names must be unique, got {duplicates} more than once")
    estimators = None
    if args.estimators:
        estimators = [e for item in args.estimators for e in item.split(",") if e]
    dataset = load_dataset(args.dataset)
    policies = resolve_policies(dict(args.policy))
    fqe_params: dict[str, Any] = {"device": args.device}
    if args.fqe_steps is not None:
        fqe_params["n_steps"] = args.fqe_steps
    kwargs = dict(interval=args.interval, alpha=args.alpha, fqe_params=fqe_params, mb_params={"device": args.device},
                  k=args.k, random_state=args.seed)
    if args.true_values:
        report = benchmark(args.env, dataset, policies, gamma=args.gamma, n_rollouts=args.n_rollouts,
                           estimators=estimators, horizon=args.horizon, seed=args.seed, **kwargs)
    else:
        report = evaluate(policies, dataset, estimators, gamma=args.gamma, horizon=args.horizon, **kwargs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report.to_csv(out / "estimates.csv")
    report.to_html(out / "report.html", title=f"Off-policy evaluation on {args.dataset}")
    print(report)
    if report.true_values is not None:
        metrics = report.metrics()
        with open(out / "metrics.csv", "w") as f:
            metrics.to_csv(f)
        print()
        print(metrics.to_string(float_format=lambda v: f"{v:.4g}"))
    print(f"\nwrote {out / 'report.html'} and {out / 'estimates.csv'}")
    return 0
