"""Sweep reports: a tidy results table, a CORL-style score table, aggregate IQM
with stratified-bootstrap intervals, learning curves and a self-contained HTML page."""

from __future__ import annotations

import base64
import html
import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from offrl.datasets.core import atomic_write_path

__all__ = ["results_frame", "score_table", "iqm", "stratified_bootstrap_iqm", "write_report", "figure_to_html"]


def _run_dirs(out_dir: Path) -> list[Path]:
    sweep = out_dir / "sweep.json"
    dirs = set(p.parent for p in out_dir.glob("runs/**/config.json"))
    if sweep.exists():
        with open(sweep) as f:
            dirs.update(Path(d) for d in json.load(f).get("runs", []))
    return sorted(dirs)


def results_frame(out_dir: str | os.PathLike) -> Any:
    """One row per run: identifiers, status, final/best return and normalised score, OPE estimates."""
    import pandas as pd

    out_dir = Path(out_dir)
    rows = []
    for run_dir in _run_dirs(out_dir):
        result_path, config_path = run_dir / "result.json", run_dir / "config.json"
        if result_path.exists():
            with open(result_path) as f:
                result = json.load(f)
        elif config_path.exists():
            with open(config_path) as f:
                config = json.load(f)
            error = run_dir / "error.txt"
            result = {"dataset": config["dataset"]["label"], "algorithm": config["algorithm"], "label": config["label"],
                      "variant": config["variant"], "params": config["params"], "seed": config["seed"],
                      "steps": config["steps"], "dir": str(run_dir),
                      "status": "failed" if error.exists() else "incomplete",
                      "error": error.read_text().strip().splitlines()[-1] if error.exists() else ""}
        else:
            continue
        row = {k: v for k, v in result.items() if k not in ("history", "ope", "params", "hash")}
        row["params"] = json.dumps(result.get("params", {}), sort_keys=True)
        for name, value in (result.get("ope") or {}).items():
            if isinstance(value, dict):
                row[f"ope_{name}"] = value.get("value")
            else:
                row[f"ope_{name}"] = value
        rows.append(row)
    columns = ["dataset", "algorithm", "variant", "seed", "status", "final_score", "best_score", "final_return",
               "best_return", "dataset_score"]
    frame = pd.DataFrame(rows)
    if frame.empty:
        return pd.DataFrame(columns=columns)
    for column in columns:
        if column not in frame:
            frame[column] = np.nan
    ordered = columns + [c for c in frame.columns if c not in columns]
    return frame[ordered].sort_values(["dataset", "variant", "seed"]).reset_index(drop=True)


def score_table(results: Any, value: str = "score") -> Any:
    """CORL-style table: mean ± std over seeds of the last and the best evaluation, per dataset x algorithm."""
    import pandas as pd

    ok = results[results["status"] == "ok"]
    if ok.empty:
        return pd.DataFrame()
    metric = "score" if ok[f"final_{value}"].notna().any() else "return"
    rows = []
    for (dataset, variant), group in ok.groupby(["dataset", "variant"], sort=True):
        final, best = group[f"final_{metric}"].to_numpy(float), group[f"best_{metric}"].to_numpy(float)
        rows.append({"dataset": dataset, "algorithm": variant,
                     "last": f"{np.mean(final):.1f} ± {np.std(final):.1f}",
                     "best": f"{np.mean(best):.1f} ± {np.std(best):.1f}", "seeds": len(group)})
    table = pd.DataFrame(rows)
    last = table.pivot(index="dataset", columns="algorithm", values="last")
    best = table.pivot(index="dataset", columns="algorithm", values="best")
    last.columns = [f"{c} (last)" for c in last.columns]
    best.columns = [f"{c} (best)" for c in best.columns]
    combined = pd.concat([last, best], axis=1)
    order = [c for pair in zip(last.columns, best.columns) for c in pair]
    return combined[order]


def iqm(scores: np.ndarray) -> float:
    """Interquartile mean: the mean of the middle 50% of scores."""
    from scipy.stats import trim_mean

    return float(trim_mean(np.asarray(scores, float).ravel(), 0.25))


def stratified_bootstrap_iqm(scores_by_dataset: list[np.ndarray], n_boot: int = 2000, confidence: float = 0.95,
                             seed: int = 0) -> tuple[float, float, float]:
    """IQM over all runs and a percentile CI from resampling runs within each dataset (as rliable does)."""
    rng = np.random.default_rng(seed)
    pooled = np.concatenate([np.asarray(s, float) for s in scores_by_dataset])
    stats = np.empty(n_boot)
    for b in range(n_boot):
        stats[b] = iqm(np.concatenate([s[rng.integers(0, len(s), len(s))] for s in scores_by_dataset]))
    alpha = (1 - confidence) / 2
    return iqm(pooled), float(np.quantile(stats, alpha)), float(np.quantile(stats, 1 - alpha))


def aggregate_iqm(results: Any, n_boot: int = 2000, seed: int = 0) -> Any:
    import pandas as pd

    ok = results[results["status"] == "ok"]
    metric = "final_score" if ok["final_score"].notna().any() else "final_return"
    rows = []
    for variant, group in ok.groupby("variant", sort=True):
        strata = [g[metric].to_numpy(float) for _, g in group.groupby("dataset")]
        strata = [s[np.isfinite(s)] for s in strata if np.isfinite(s).any()]
        if not strata:
            continue
        value, low, high = stratified_bootstrap_iqm(strata, n_boot=n_boot, seed=seed)
        rows.append({"algorithm": variant, "iqm": value, "ci_low": low, "ci_high": high, "metric": metric,
                     "runs": int(sum(len(s) for s in strata)), "datasets": len(strata)})
    return pd.DataFrame(rows)


def figure_to_html(fig: Any, alt: str) -> str:
    """A matplotlib figure as an inline <img> (base64 PNG), so the page fetches nothing."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    encoded = base64.b64encode(buffer.getvalue()).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{encoded}"/>'


def _learning_curves(out_dir: Path, results: Any) -> list[str]:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    images = []
    ok = results[results["status"] == "ok"]
    for dataset, group in ok.groupby("dataset", sort=True):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        plotted = False
        for variant, runs in group.groupby("variant", sort=True):
            curves = []
            for run_dir in runs["dir"]:
                with open(Path(run_dir) / "result.json") as f:
                    history = json.load(f).get("history", [])
                if history:
                    curves.append(history)
            if not curves:
                continue
            key = "normalized_score_mean" if np.isfinite(curves[0][-1].get("normalized_score_mean", np.nan)) else "return_mean"
            length = min(len(c) for c in curves)
            steps = np.array([r["step"] for r in curves[0][:length]])
            values = np.array([[r[key] for r in c[:length]] for c in curves])
            mean, std = values.mean(0), values.std(0)
            ax.plot(steps, mean, label=variant)
            ax.fill_between(steps, mean - std, mean + std, alpha=0.2)
            ax.set_ylabel("normalised score" if key.startswith("normalized") else "return")
            plotted = True
        if plotted:
            ax.set_title(dataset)
            ax.set_xlabel("gradient steps")
            ax.legend(fontsize=8)
            images.append(figure_to_html(fig, f"learning curves on {dataset}"))
        plt.close(fig)
    return images


_STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}th{background:#f3f3f3}h1,h2{font-weight:600}
.failed{color:#b00}"""


def write_report(out_dir: str | os.PathLike, title: str | None = None, extra_html: str = "") -> dict[str, Path]:
    """Write results.csv, table.csv, iqm.csv and report.html into `out_dir`; return their paths."""
    out_dir = Path(out_dir)
    results = results_frame(out_dir)
    paths = {"results": out_dir / "results.csv", "table": out_dir / "table.csv", "iqm": out_dir / "iqm.csv",
             "html": out_dir / "report.html"}
    with atomic_write_path(paths["results"]) as tmp:
        results.to_csv(tmp, index=False)
    table = score_table(results) if not results.empty else None
    iqm_frame = aggregate_iqm(results) if not results.empty and (results["status"] == "ok").any() else None
    with atomic_write_path(paths["table"]) as tmp:
        (table if table is not None else results.head(0)).to_csv(tmp)
    with atomic_write_path(paths["iqm"]) as tmp:
        (iqm_frame if iqm_frame is not None else results.head(0)).to_csv(tmp, index=False)
    parts = [f"<h1>{html.escape(title or out_dir.name)}</h1>",
             f"<p>{len(results)} runs: {int((results['status'] == 'ok').sum()) if len(results) else 0} finished, "
             f"{int((results['status'] == 'failed').sum()) if len(results) else 0} failed.</p>"]
    if table is not None and not table.empty:
        parts += ["<h2>Normalised score (mean ± std over seeds; last and best evaluation)</h2>", table.to_html(escape=True)]
    if iqm_frame is not None and not iqm_frame.empty:
        parts += ["<h2>Aggregate IQM across datasets (95% stratified bootstrap CI)</h2>",
                  iqm_frame.to_html(index=False, float_format=lambda v: f"{v:.2f}")]
    if len(results) and (results["status"] == "ok").any():
        parts += ["<h2>Learning curves (mean ± std over seeds)</h2>"] + _learning_curves(out_dir, results)
    parts.append(extra_html)
    if len(results):
        failed = results[results["status"] != "ok"]
        if not failed.empty:
            parts += ["<h2 class='failed'>Failed or incomplete runs</h2>",
                      failed[["dataset", "variant", "seed", "status", "error"]].to_html(index=False, escape=True)]
        parts += ["<h2>All runs</h2>", results.drop(columns=["dir"], errors="ignore").to_html(index=False, escape=True,
                                                                                            float_format=lambda v: f"{v:.3f}")]
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title or out_dir.name)}</title>"
            f"<style>{_STYLE}</style></head><body>{''.join(parts)}</body></html>")
    with atomic_write_path(paths["html"]) as tmp, open(tmp, "w") as f:
        f.write(page)
    return paths
