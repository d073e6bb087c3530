"""OPE with an estimated behaviour policy: the old default model against the new one, on built Pendulum data.

For each built dataset (medium-replay: SAC's replay buffer, uniform-random
steps then SAC at many stages; medium-expert: two SAC policies' data) the
logged behaviour log-probabilities are dropped and pi_b is estimated by

- old: `BehaviorPolicy(density="gaussian", n_components=1, n_folds=1)`, the
  default before issue 11 (one Gaussian, not truncated to the action box,
  scored on the rows it was fitted on);
- new: `BehaviorPolicy()`, today's default (3-component tanh-Gaussian
  mixture in the action box, 2-fold cross-fitting over episodes);

and, as the reference, the logged (true) log-probabilities are used as is.
IS, PDIS, WIS, WPDIS, DR and WDR then estimate the value of candidate
policies (SAC snapshots of the build's own run, BC on the data, the uniform
policy; taken from benchmarks/ope_pendulum.py) whose true values come from
on-policy roll-outs.  DR/WDR share one FQE per (dataset, policy), so the
behaviour model is the only thing that changes between columns.  Printed:
per dataset and estimator, |estimate - true| averaged over the policies and
the Spearman rank correlation, and the log-likelihood of each behaviour model
(the mean logged log-probability is the true behaviour's: no model can beat
it on average).  The old model is scored in-sample as it is used; its
held-out figure comes from the same family fitted with 2 folds.

    OFFRL_DATA_DIR=/tmp/offrl-ope-data python benchmarks/ope_behavior.py --out /tmp/ope-behavior

medium-expert holds 2M transitions; `--episodes` draws that many of its
episodes (half from each policy) so the default budget runs in minutes.
The dataset build (SAC on Pendulum-v1, 15k steps) takes a few minutes the first time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ope_pendulum import built_dataset, candidate_policies  # noqa: E402

MODELS = ("old", "new", "logged")


def subsample_halves(dataset, n_episodes: int, seed: int):
    """`n_episodes` episodes, half from the first half of the rows and half from the second (the two sources)."""
    if n_episodes <= 0 or n_episodes >= dataset.n_episodes:
        return dataset
    starts = dataset.episode_starts[:-1]
    first = np.flatnonzero(starts < dataset.n_transitions // 2)
    second = np.flatnonzero(starts >= dataset.n_transitions // 2)
    rng = np.random.default_rng(seed)
    pick = np.concatenate([rng.choice(first, min(len(first), n_episodes // 2), replace=False),
                           rng.choice(second, min(len(second), n_episodes - n_episodes // 2), replace=False)])
    return dataset.subset(np.sort(pick))


def behaviour_models(dataset, seeds) -> tuple[dict, dict]:
    """model -> one behaviour estimate per fit seed (old, new; logged once), and mean log-likelihoods (nats/row)."""
    from offrl.ope import BehaviorPolicy
    from offrl.ope.behavior import BehaviorEstimate, estimate_behavior

    bare = dataset.without_behavior_log_probs()
    estimates: dict[str, list] = {"old": [], "new": []}
    keys = ("old_in", "old_family_heldout", "new_in", "new_heldout", "old_s", "new_s")
    figures: dict[str, list] = {k: [] for k in keys}
    for seed in seeds:
        old = BehaviorPolicy(density="gaussian", n_components=1, n_folds=1, random_state=seed)
        new = BehaviorPolicy(random_state=seed)
        t0 = time.perf_counter()
        estimates["old"].append(estimate_behavior(bare, old))
        t1 = time.perf_counter()
        estimates["new"].append(estimate_behavior(bare, new))
        t2 = time.perf_counter()
        old_cv = BehaviorPolicy(density="gaussian", n_components=1, n_folds=2, random_state=seed).fit(bare)
        values = (old.insample_log_likelihood_, old_cv.heldout_log_likelihood_, new.insample_log_likelihood_,
                  new.heldout_log_likelihood_, t1 - t0, t2 - t1)
        for key, value in zip(keys, values):
            figures[key].append(value)
    logged = dataset.behavior_log_probs.astype(np.float64)
    estimates["logged"] = [BehaviorEstimate(logged, "logged")]
    loglik = {"logged (true pi_b)": float(logged.mean()), **{k: float(np.mean(v)) for k, v in figures.items()}}
    return estimates, loglik


def _fmt(value: float) -> str:
    return f"{value:.2g}" if abs(value) >= 1e4 else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=["pendulum-medium-replay-v1", "pendulum-medium-expert-v1"])
    parser.add_argument("--episodes", type=int, default=100,
                        help="episodes drawn from a larger dataset, half from each source (0: all)")
    parser.add_argument("--snapshots", type=int, nargs="+", default=[5500, 7000, 7500, 8000, 10000, 15000],
                        help="SAC snapshot steps used as candidate policies")
    parser.add_argument("--bc-steps", type=int, nargs="*", default=[2000])
    parser.add_argument("--no-uniform", action="store_true")
    parser.add_argument("--estimators", nargs="+", default=["IS", "PDIS", "WIS", "WPDIS", "DR", "WDR"])
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--horizon", type=int, default=50,
                        help="evaluation horizon; roll-outs stop there too (Pendulum's limit is 200)")
    parser.add_argument("--n-rollouts", type=int, default=100)
    parser.add_argument("--fqe-steps", type=int, default=3000)
    parser.add_argument("--fqe-critics", type=int, default=1)
    parser.add_argument("--fit-seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="random_state of the behaviour models: each is fitted once per seed, errors averaged")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="episode draw, BC, FQE and roll-outs")
    parser.add_argument("--out", default="ope-behavior")
    args = parser.parse_args()

    import sklearn.base
    import torch

    torch.set_num_threads(args.threads)
    from offrl.evaluation import make_env
    from offrl.ope import OPEReport, make_estimator, true_policy_value
    from offrl.ope.behavior import log_importance_ratios
    from offrl.ope.episodic import _DRFamily

    start = time.perf_counter()
    env = make_env("Pendulum-v1")
    horizon = args.horizon or None
    truth_cache: dict[str, dict] = {}
    rows, logliks, per_policy = [], {}, []
    for name in args.datasets:
        full, run_dir = built_dataset(name)
        dataset = subsample_halves(full, args.episodes, args.seed)
        print(f"[{name}] {dataset.n_episodes} episodes, {dataset.n_transitions} transitions "
              f"(of {full.n_episodes} / {full.n_transitions})", flush=True)
        policies = candidate_policies(dataset, run_dir, args.snapshots, args.bc_steps, not args.no_uniform, args.seed)
        truth = {}
        for pname, policy in policies.items():
            key = pname if not pname.startswith("bc@") else f"{name}/{pname}"  # BC depends on the data
            if key not in truth_cache:
                truth_cache[key] = true_policy_value(env, policy, args.gamma, args.n_rollouts, horizon, args.seed,
                                                     dataset)
            truth[pname] = truth_cache[key]["value"]
        print(f"[{name}] true values {({k: round(v, 1) for k, v in truth.items()})} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
        behaviours, logliks[name] = behaviour_models(dataset, args.fit_seeds)
        print(f"[{name}] log-likelihoods {({k: round(v, 3) for k, v in logliks[name].items()})} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
        ests = [make_estimator(e, gamma=args.gamma, horizon=horizon, interval="t", warn=False,
                               random_state=args.seed) for e in args.estimators]
        fqe_template = make_estimator("FQE", gamma=args.gamma, horizon=horizon, n_steps=args.fqe_steps,
                                      n_critics=args.fqe_critics, device="cpu", random_state=args.seed, interval="t")
        # results[model][fit][policy][estimator]
        results = {m: [{} for _ in behaviours[m]] for m in MODELS}
        for pname, policy in policies.items():
            fqe = None
            if any(isinstance(e, _DRFamily) for e in ests):
                fqe = sklearn.base.clone(fqe_template).fit(dataset, policy=policy)
            for model in MODELS:
                for fit, behaviour in enumerate(behaviours[model]):
                    ratios = log_importance_ratios(dataset, policy, behavior_log_probs_=behaviour)
                    results[model][fit][pname] = {
                        est.name: (est.estimate(dataset, policy, log_ratios=ratios, q_function=fqe)
                                   if isinstance(est, _DRFamily) else est.estimate(dataset, policy, log_ratios=ratios))
                        for est in ests}
            print(f"[{name}] {pname}: true {truth[pname]:.1f}, WDR "
                  + ", ".join(f"{m} {results[m][0][pname]['WDR'].value:.1f}" for m in MODELS
                              if "WDR" in results[m][0][pname])
                  + f" ({time.perf_counter() - start:.0f} s)", flush=True)
        for model in MODELS:
            for fit, fit_results in enumerate(results[model]):
                report = OPEReport(fit_results, true_values=truth)
                metrics = report.metrics()
                for est in report.estimators:
                    values = report.estimates(est)
                    mae = float(np.mean([abs(values[p] - truth[p]) for p in values]))
                    rows.append({"dataset": name, "model": model, "fit": fit, "estimator": est, "mae": mae,
                                 "spearman": float(metrics.loc[est, "spearman"])})
                    per_policy.extend({"dataset": name, "model": model, "fit": fit, "estimator": est, "policy": p,
                                       "estimate": values[p], "true": truth[p]} for p in values)
    elapsed = time.perf_counter() - start

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"rows": rows, "log_likelihoods": logliks, "per_policy": per_policy,
                                                  "true_values": {k: v["value"] for k, v in truth_cache.items()},
                                                  "elapsed_s": elapsed, "args": vars(args)}, indent=1))
    n_fits = len(args.fit_seeds)
    lines = ["| dataset | estimator | mean abs. error: old | new | logged (true pi_b) | Spearman: old | new | logged |",
             "|---|---|---|---|---|---|---|---|"]
    for name in args.datasets:
        for est in args.estimators:
            cells = []
            for model in MODELS:
                sel = [r for r in rows if r["dataset"] == name and r["estimator"] == est and r["model"] == model]
                cells.append((float(np.mean([r["mae"] for r in sel])), float(np.nanmean([r["spearman"] for r in sel]))))
            mae = [_fmt(c[0]) for c in cells]
            best = min(range(2), key=lambda i: cells[i][0])
            mae[best] = f"**{mae[best]}**"
            lines.append(f"| {name} | {est} | " + " | ".join(mae) + " | "
                         + " | ".join(f"{c[1]:.2f}" for c in cells) + " |")
    lines += ["", "| dataset | logged (true pi_b) | old, in-sample (as used) | old family, held-out (2 folds) | "
              "new, in-sample | new, held-out (as used) | fit s old / new |", "|---|---|---|---|---|---|---|"]
    for name, ll in logliks.items():
        lines.append(f"| {name} | {ll['logged (true pi_b)']:.3f} | {ll['old_in']:.3f} | "
                     f"{ll['old_family_heldout']:.3f} | {ll['new_in']:.3f} | {ll['new_heldout']:.3f} | "
                     f"{ll['old_s']:.1f} / {ll['new_s']:.1f} |")
    text = "\n".join(lines)
    (out / "table.md").write_text(text + "\n")
    print("\nmarkdown (old and new averaged over", n_fits, "fit seeds):\n")
    print(text)
    print(f"\nelapsed {elapsed:.0f} s; wrote {out}/summary.json, table.md")


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=UserWarning)  # weight-collapse notes: reported in the table instead
        main()
