"""Pick one setting per seed by FQE on the training data, and show what the pick is really worth.

Used for issue 14 (XQL's Gumbel temperature on pendulum medium-replay): every run of a sweep's grid is
scored by FQE (`offrl.ope.evaluate`, the sweep's `--ope FQE` with a shorter fit) on the dataset it was
trained on; per seed the run with the highest estimate is the pick, and its final normalised score (from
the environment, which the pick never sees) is reported next to the best and the mean of the grid.

    python experiments/fqe_pick.py offrl-results/dual_pendulum_20k/runs/pendulum-medium-replay-v1 \\
        --labels XQL,XQL-beta5,XQL-beta10,XQL-beta50 --dataset offrl:pendulum-medium-replay-v1

Each run's estimate is cached as fqe.json next to its result.json (written atomically), so a second call only
prints.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any


def fqe_estimate(run_dir: Path, dataset: Any, n_steps: int, seed: int) -> dict[str, float]:
    """FQE's estimate of the run's final policy on `dataset`, cached in run_dir/fqe.json."""
    cache = run_dir / "fqe.json"
    if cache.exists():
        try:
            cached = json.loads(cache.read_text())
        except (OSError, ValueError) as err:
            raise SystemExit(f"{cache}: unreadable ({err}); delete it to recompute") from None
        if cached.get("n_steps") == n_steps:
            return cached
    import offrl
    from offrl import ope

    policy = offrl.load(run_dir / "model.pt", device="cpu")
    report = ope.evaluate({"policy": policy}, dataset, ["FQE"], 0.99, random_state=seed,
                          fqe_params={"n_steps": n_steps, "device": "cpu"})
    result = next(iter(report.results["policy"].values()))
    out = {"value": float(result.value), "ci_low": float(result.ci_low), "ci_high": float(result.ci_high),
           "n_steps": n_steps}
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=".fqe-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, cache)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, help="a sweep's runs/<dataset> directory")
    parser.add_argument("--labels", required=True, help="comma-separated run labels forming the grid")
    parser.add_argument("--dataset", required=True, help="the spec the runs were trained on")
    parser.add_argument("--n-steps", type=int, default=5000, help="FQE steps (issue 18's selection used 5,000)")
    parser.add_argument("--seeds", default="0,1,2")
    args = parser.parse_args()

    from offrl.datasets import load

    dataset = load(args.dataset)
    labels = [label.strip() for label in args.labels.split(",") if label.strip()]
    picks = []
    for seed in (int(s) for s in args.seeds.split(",")):
        rows = []
        for label in labels:
            run_dir = args.runs / label / f"seed{seed}"
            try:
                score = json.loads((run_dir / "result.json").read_text())["final_score"]
            except (OSError, ValueError, KeyError) as err:
                raise SystemExit(f"{run_dir / 'result.json'}: no finished result ({err})") from None
            rows.append((label, fqe_estimate(run_dir, dataset, args.n_steps, seed)["value"], score))
        for label, estimate, score in rows:
            print(f"seed {seed}  {label:14s} FQE {estimate:9.1f}  score {score:6.1f}")
        pick = max(rows, key=lambda row: row[1])
        picks.append(pick[2])
        print(f"seed {seed}  pick {pick[0]} (score {pick[2]:.1f}); best {max(r[2] for r in rows):.1f}, "
              f"grid mean {statistics.mean(r[2] for r in rows):.1f}")
    print(f"FQE-picked: {statistics.mean(picks):.1f} ± {statistics.pstdev(picks):.1f} "
          f"({' / '.join(f'{p:.1f}' for p in picks)})")


if __name__ == "__main__":
    main()
