"""Evaluation of OPE on Pendulum: true values by roll-outs vs estimates, with DOPE's metrics.

Builds (or reuses) an offrl Pendulum dataset, takes candidate policies of
spread quality (SAC snapshots of the build's own run, BC trained on the data
for a few step counts, and the uniform random policy), computes each
policy's true discounted value by on-policy roll-outs, runs the estimators and
prints the metrics table plus a markdown summary for benchmarks/RESULTS.md.

    OFFRL_DATA_DIR=/tmp/offrl-ope-data python benchmarks/ope_pendulum.py --out /tmp/ope-pendulum

The defaults are the configuration recorded in benchmarks/RESULTS.md.

The dataset build (SAC on Pendulum-v1, 15k steps) takes a few minutes the first time.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np


def uniform_policy(low: float, high: float):
    from offrl.ope import TargetPolicy

    rng = np.random.default_rng(0)
    log_density = -math.log(high - low)
    return TargetPolicy(
        "stochastic",
        log_prob=lambda obs, actions: np.full(len(obs), log_density),
        sample=lambda obs: rng.uniform(low, high, size=(len(obs), 1)).astype(np.float32),
        name="uniform",
    )


def built_dataset(name: str):
    """The offrl dataset `name`, built first if needed, and the directory of the SAC run that made it."""
    from offrl.builder import build as build_datasets
    from offrl.datasets import load

    build = build_datasets(name, progress=False)
    return load(f"offrl:{name}"), Path(build.run_dir)


def candidate_policies(dataset, run_dir: Path, snapshots, bc_steps, uniform: bool = True, seed: int = 0) -> dict:
    """Candidate policies of spread quality: SAC snapshots of the build's run, BC on `dataset`, uniform random."""
    import offrl
    from offrl.algos import BC

    policies = {}
    for step in snapshots:
        path = run_dir / "snapshots" / f"step_{step:09d}.pt"
        if not path.exists():
            raise SystemExit(f"no SAC snapshot at step {step} in {run_dir / 'snapshots'}")
        policies[f"sac@{step}"] = offrl.load(path, device="cpu")
    for steps in bc_steps:
        policies[f"bc@{steps}"] = BC(n_steps=steps, device="cpu", random_state=seed).fit(dataset, progress=False)
    if uniform:
        low, high = float(dataset.action_low[0]), float(dataset.action_high[0])
        policies["uniform"] = uniform_policy(low, high)
    return policies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="pendulum-medium-replay-v1")
    parser.add_argument("--snapshots", type=int, nargs="+", default=[5500, 6500, 7000, 7500, 7750, 8000, 10000, 12500, 15000],
                        help="SAC snapshot steps used as candidate policies")
    parser.add_argument("--bc-steps", type=int, nargs="*", default=[2000], help="BC policies trained for these step counts")
    parser.add_argument("--no-uniform", action="store_true", help="leave the uniform random policy out")
    parser.add_argument("--estimators", nargs="+",
                        default=["FQE", "DR", "WDR", "PDIS", "WPDIS", "WIS", "IS", "MB", "MIS", "SNMIS", "MDR"])
    parser.add_argument("--distributional", nargs="*", default=["CD-SNIS"],
                        help="distributional estimators whose return CDFs go into the report")
    parser.add_argument("--marginal-features", type=int, default=100, help="random Fourier features of the MWL ratios")
    parser.add_argument("--marginal-ridge", type=float, default=None, help="MWL ridge (default: the library's)")
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--horizon", type=int, default=200,
                        help="evaluation horizon, Pendulum's time limit (0: as logged, with stationary FQE)")
    parser.add_argument("--n-rollouts", type=int, default=100)
    parser.add_argument("--fqe-steps", type=int, default=10_000)
    parser.add_argument("--fqe-critics", type=int, default=3)
    parser.add_argument("--fqe-tau", type=float, default=0.05)
    parser.add_argument("--fqe-lr", type=float, default=3e-4)
    parser.add_argument("--fqe-hidden", type=int, nargs="+", default=[256, 256])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="ope-pendulum")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from offrl.ope import benchmark

    start = time.perf_counter()
    dataset, run_dir = built_dataset(args.dataset)
    print(f"dataset {dataset} (built in {run_dir})", flush=True)
    policies = candidate_policies(dataset, run_dir, args.snapshots, args.bc_steps, not args.no_uniform, args.seed)

    fqe_params = {"n_steps": args.fqe_steps, "n_critics": args.fqe_critics, "tau": args.fqe_tau, "lr": args.fqe_lr,
                  "hidden_dims": tuple(args.fqe_hidden), "device": "cpu", "random_state": args.seed}
    report = benchmark("Pendulum-v1", dataset, policies, gamma=args.gamma, n_rollouts=args.n_rollouts,
                       estimators=args.estimators, horizon=args.horizon or None, seed=args.seed, fqe_params=fqe_params,
                       marginal_params={"n_features": args.marginal_features, "ridge": args.marginal_ridge},
                       distributional=args.distributional or None,
                       random_state=args.seed, verbose=True)
    elapsed = time.perf_counter() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report.to_csv(out / "estimates.csv")
    report.to_html(out / "report.html", title=f"OPE on {args.dataset}")
    metrics = report.metrics()
    metrics.to_csv(out / "metrics.csv")
    metrics_k3 = report.metrics(k=3)
    metrics_k3.to_csv(out / "metrics_k3.csv")
    print(report)
    print(metrics.to_string(float_format=lambda v: f"{v:.3f}"))
    summary = {"dataset": args.dataset, "n_transitions": dataset.n_transitions, "n_episodes": dataset.n_episodes,
               "policies": list(policies), "true_values": report.true_values,
               "true_value_std_error": report.metadata["true_value_std_error"],
               "metrics": json.loads(metrics.to_json(orient="index")), "elapsed_s": elapsed, "args": vars(args)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print("\nmarkdown:\n")
    print("| estimator | Spearman | regret@1 | normalised abs. error | relative error | CI coverage |")
    print("|---|---|---|---|---|---|")
    for name, row in metrics.iterrows():
        print(f"| {name} | {row['spearman']:.2f} | {row['regret@1']:.3f} | {row['normalized_abs_error']:.3f} | "
              f"{row['relative_error']:.3f} | {row['coverage']:.2f} |")
    print("\n| estimator | precision@3 | regret@3 | SharpeRatio@3 |")
    print("|---|---|---|---|")
    for name, row in metrics_k3.iterrows():
        print(f"| {name} | {row['precision@3']:.2f} | {row['regret@3']:.3f} | {row.get('sharpe@3', float('nan')):.2f} |")
    print(f"\nelapsed {elapsed:.0f} s; wrote {out}/report.html, estimates.csv, metrics.csv, summary.json")


if __name__ == "__main__":
    main()
