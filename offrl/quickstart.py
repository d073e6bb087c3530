"""`offrl quickstart`: offrl's whole loop on a laptop, with no download.

1. build pendulum-medium-replay (SAC + D4RL's recipe; cached after the first time);
2. train BC, TD3+BC, IQL and CQL on pendulum-medium-replay with a short budget
   (the same sweep as experiments/quickstart.yaml);
3. evaluate each policy in Pendulum-v1 (return and normalised score);
4. estimate each policy's value with the OPE suite and compare with its true
   value from on-policy roll-outs;
5. write results.csv, ope.csv and report.html to offrl-results/quickstart/.
"""

from __future__ import annotations

import copy
import html
import time
from pathlib import Path
from typing import Any

__all__ = ["QUICKSTART_CONFIG", "run_quickstart"]

DATASET = "pendulum-medium-replay-v1"
ENV_ID = "Pendulum-v1"

# Mirrored by experiments/quickstart.yaml (a test keeps the two equal).
QUICKSTART_CONFIG: dict[str, Any] = {
    "name": "quickstart",
    "datasets": [f"offrl:{DATASET}"],
    # CQL evaluates its critics on 3 x n_action_samples sampled actions per state, the quickstart's critical path:
    # bf16 autocast triples its CPU speed, and 5 samples instead of 10 double it again at the same final score
    # on this data (benchmarks/RESULTS.md, "Quickstart").
    "algorithms": {"BC": {}, "TD3PlusBC": {}, "IQL": {}, "CQL": {"precision": "bf16", "n_action_samples": 5}},
    "seeds": [0],
    "steps": 5000,
    "eval": {"every": 1000, "episodes": 10},
    "log_every": 250,
    "threads_per_run": 1,
}

OPE_ESTIMATORS = ("FQE", "PDIS", "WPDIS", "DR", "WDR")
FQE_STEPS = 5000


def run_quickstart(
    out: str | Path = "offrl-results/quickstart",
    steps: int | None = None,
    workers: int = 2,
    ope_rollouts: int = 20,
    gamma: float = 0.99,
    estimators: tuple[str, ...] = OPE_ESTIMATORS,
    progress: bool = True,
) -> dict[str, Path]:
    """Run the quickstart and return the paths it wrote (results, ope, html).

    Datasets are cached in `$OFFRL_DATA_DIR` (default `~/.offrl/datasets`).
    Each policy's OPE runs in this process once a worker is idle, while the
    slowest run (CQL) goes on training in the other worker.
    """
    import warnings

    import torch
    from tqdm.auto import tqdm

    import offrl
    from offrl import ope
    from offrl.builder import build
    from offrl.datasets import load_built
    from offrl.evaluation import make_env
    from offrl.report import write_report
    from offrl.sweep import expand_runs, parse_config, pending_runs, run_sweep

    started = time.time()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    print(f"[1/3] building {DATASET} (cached after the first time) ...", flush=True)
    # Only the dataset the quickstart trains on: `offrl datasets build 'pendulum-*-v1'` adds the other kinds later
    # from the same cached SAC run.  A stale cache is rebuilt.
    build(DATASET, progress=progress, rebuild_stale=True)
    dataset = load_built(DATASET)
    print(f"      {dataset!r} ({time.time() - started:.0f} s)", flush=True)

    config_dict = copy.deepcopy(QUICKSTART_CONFIG)
    if steps is not None:
        config_dict["steps"] = int(steps)
        config_dict["eval"]["every"] = max(int(steps) // 5, 1)
    config = parse_config(config_dict, source="offrl quickstart")
    names = ", ".join(config.algorithms)
    print(f"[2/3] training {names} for {config.steps:,} steps each ({workers} at a time); off-policy evaluation "
          f"({', '.join(estimators)}) of each policy against {ope_rollouts} true roll-outs as workers free up ...",
          flush=True)
    env = make_env(ENV_ID)
    ope_results: dict[str, Any] = {}
    truths: dict[str, dict[str, float]] = {}
    caught: list[str] = []
    threads = torch.get_num_threads()
    left = len(pending_runs(expand_runs(config, out)))  # the runs this sweep will train
    queued: list[dict[str, Any]] = []

    def on_result(result: dict[str, Any]) -> None:
        """Queue each finished run; evaluate the queue once a worker is idle (fewer runs left than
        workers), so that OPE uses a free core instead of slowing down two trainings."""
        nonlocal left
        left -= 1
        if result.get("status") == "ok":
            queued.append(result)
        if left < workers:
            while queued:
                evaluate_offline(queued.pop(0), n_threads=1 if left > 0 else threads)

    def evaluate_offline(result: dict[str, Any], n_threads: int) -> None:
        """OPE of one finished run's policy, in this process."""
        t0 = time.time()
        name = result["variant"]
        policy = offrl.load(Path(result["dir"]) / "model.pt", device="cpu")
        torch.set_num_threads(n_threads)
        try:
            truths[name] = ope.true_policy_value(env, policy, gamma, ope_rollouts, seed=0, dataset=dataset)
            with warnings.catch_warnings(record=True) as records:
                warnings.simplefilter("always", ope.OPEWarning)
                report = ope.evaluate({name: policy}, dataset, list(estimators), gamma,
                                      fqe_params={"n_steps": FQE_STEPS}, random_state=0)
            caught.extend(str(w.message) for w in records if issubclass(w.category, ope.OPEWarning))
        finally:
            torch.set_num_threads(threads)
        ope_results[name] = report.results[name]
        fqe = report.results[name].get("FQE")
        tqdm.write(f"      OPE of {name}: true value {truths[name]['value']:.1f}"
                   + (f", FQE {fqe.value:.1f}" if fqe is not None else "") + f" ({time.time() - t0:.0f} s)")

    results = run_sweep(config, backend="local", workers=workers, out=out, progress=progress,
                        on_result=on_result)
    failed = results[results["status"] != "ok"]
    if len(failed):
        details = "; ".join(f"{r.variant}: {r.error}" for r in failed.itertuples())
        raise RuntimeError(f"quickstart runs failed ({details}); tracebacks are in {out}/runs/*/*/*/error.txt")
    # Runs finished by an earlier, interrupted quickstart are skipped by the sweep: evaluate them now.
    for row in results.itertuples():
        if row.variant not in ope_results:
            evaluate_offline({"status": "ok", "variant": row.variant, "dir": row.dir}, n_threads=threads)
    order = [row.variant for row in results.itertuples()]
    report = ope.OPEReport({name: ope_results[name] for name in order},
                           true_values={name: truths[name]["value"] for name in order},
                           metadata={"true values": f"{ope_rollouts} on-policy roll-outs per policy",
                                     "true_value_std_error": {k: round(v["std_error"], 4) for k, v in truths.items()},
                                     "data value": ope.report.logged_value(dataset, gamma)})
    paths = {"ope": out / "ope.csv", "ope_html": out / "ope.html"}
    report.to_csv(paths["ope"])
    report.to_html(paths["ope_html"], title="Quickstart: off-policy evaluation")
    print(f"      training and OPE done ({time.time() - started:.0f} s)", flush=True)

    print("[3/3] writing the report ...", flush=True)
    extra = _ope_section(report)
    written = write_report(out, title="offrl quickstart: pendulum-medium-replay-v1", extra_html=extra,
                           extra_summary=_ope_summary_html(report))
    paths.update({"results": written["results"], "html": written["html"]})

    table = results[["variant", "final_return", "final_score", "best_score"]].rename(
        columns={"variant": "algorithm", "final_return": "return", "final_score": "normalised score",
                 "best_score": "best score"})
    print()
    print(f"dataset {DATASET}: mean normalised return of its episodes "
          f"{results['dataset_score'].iloc[0]:.1f}")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.1f}"))
    print()
    print(_ope_summary(report))
    # evaluate's per-policy warnings repeat the diagnostics that the summary explains per estimator family
    others = [m for m in dict.fromkeys(caught) if not m.startswith("policy '")]
    if others:
        print()
        print("Other OPE warnings:")
        for message in others:
            print(f"  - {message}")
    print()
    print(f"warnings grouped by estimator family, and plots: {paths['ope_html']}")
    print(f"finished in {time.time() - started:.0f} s; report: {paths['html']}")
    return paths


def _ope_summary(report: Any) -> str:
    """The OPE part of the console summary: the summary in words, then one row per policy."""
    return ("Off-policy evaluation (estimates from the logged data alone, against each policy's true value):\n"
            + report.summary() + "\n\n" + report.to_table().to_string())


def _ope_summary_html(report: Any) -> str:
    """The OPE summary for the top of report.html (`write_report(..., extra_summary=...)`)."""
    return "<h3>Off-policy evaluation of the trained policies</h3>" + report.summary_html()


def _ope_section(report: Any) -> str:
    """The OPE section of report.html: one row per policy, which estimators to trust and why, warnings grouped."""
    truth = html.escape(str(report.metadata.get("true values", "on-policy roll-outs")))
    return ("<h2>Off-policy evaluation of the trained policies</h2>"
            f"<p>Each policy's value estimated from the logged data alone, next to its true discounted value from "
            f"{truth}. The full report, with plots, is <code>ope.html</code>.</p>"
            + report.section_html(level=3))
