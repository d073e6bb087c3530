"""Print an offline-then-online sweep's curves as a text table: mean normalised score over seeds (± std) at the
switch (the last offline evaluation) and at chosen online steps, the dip (and how far it fell below the offline
score), the mean over all online evaluations (the area under the online curve) and how many seeds ended above
their offline policy.  For benchmarks/RESULTS.md; the sweep's report.html draws the same curves.

    python experiments/finetune_curves.py offrl-results/finetune_pendulum_cpu --steps 1000,2000,5000,10000,20000
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the sweep's output directory")
    parser.add_argument("--steps", default="1000,2000,5000,10000,20000", help="online steps to show")
    args = parser.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    runs: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for path in sorted(Path(args.out).glob("runs/*/*/*/result.json")):
        result = json.loads(path.read_text())
        if result.get("status") == "ok" and "online_history" in result:
            runs[(result["dataset"], result["variant"])].append(result)

    def cell(values: list[float]) -> str:
        values = [v for v in values if v is not None and np.isfinite(v)]
        return f"{np.mean(values):.1f} ± {np.std(values):.1f}" if values else "-"

    header = (["dataset", "variant", "seeds", "offline"] + [f"{s:,}" for s in steps]
              + ["dip", "offline - dip", "mean of all online evals", "above offline"])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for (dataset, variant), results in sorted(runs.items()):
        columns = []
        for s in steps:
            columns.append(cell([next((r["normalized_score_mean"] for r in res["online_history"] if r["step"] == s),
                                      None) for res in results]))
        offline = [res.get("offline_score") for res in results]
        above = sum(1 for res in results if np.isfinite(res.get("offline_score", np.nan))
                    and res["final_score"] > res["offline_score"])
        scratch = not any(np.isfinite(v) for v in offline if v is not None)
        drop = "-" if scratch else cell([res["offline_score"] - res["dip_score"] for res in results])
        area = cell([float(np.mean([r["normalized_score_mean"] for r in res["online_history"]])) for res in results])
        print("| " + " | ".join([dataset, variant, str(len(results)), "(scratch)" if scratch else cell(offline),
                                 *columns, cell([res.get("dip_score") for res in results]), drop, area,
                                 "-" if scratch else f"{above}/{len(results)}"]) + " |")


if __name__ == "__main__":
    main()
