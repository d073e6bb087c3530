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

from offrl import _html
from offrl.datasets.core import atomic_write_path

__all__ = ["results_frame", "score_table", "iqm", "stratified_bootstrap_iqm", "write_report", "figure_to_html",
           "ope_selection"]


def _run_dirs(out_dir: Path) -> list[Path]:
    """The run directories under `out_dir/runs` and those sweep.json lists, each once (by resolved path)."""
    sweep = out_dir / "sweep.json"
    dirs = [p.parent for p in out_dir.glob("runs/**/config.json")]
    if sweep.exists():
        with open(sweep) as f:
            dirs += [Path(d) for d in json.load(f).get("runs", [])]
    unique: dict[Path, Path] = {}
    for d in dirs:
        unique.setdefault(d.resolve(), d)
    return sorted(unique.values())


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
        row = {k: v for k, v in result.items() if k not in ("history", "online_history", "ope", "params", "hash")}
        if not Path(str(row.get("dir", ""))).is_dir():  # written from another working directory: where it is now
            row["dir"] = str(run_dir)
        row["params"] = json.dumps(result.get("params", {}), sort_keys=True)
        for name, value in (result.get("ope") or {}).items():
            if isinstance(value, dict):
                if "value" in value:  # an estimate, with its interval (the selection by lower bound reads it)
                    row[f"ope_{name}"] = value.get("value")
                    row[f"ope_{name}_ci_low"] = value.get("ci_low")
                    row[f"ope_{name}_ci_high"] = value.get("ci_high")
            elif name not in _OPE_NOTES:
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
    # Runs that went online add their columns (empty for the others); a sweep without any keeps today's columns.
    columns += [c for c in _ONLINE_COLUMNS if c in frame]
    ordered = columns + [c for c in frame.columns if c not in columns]
    return frame[ordered].sort_values(["dataset", "variant", "seed"]).reset_index(drop=True)


# Words beside a run's OPE estimates (offrl.sweep), said in the report rather than as a column of every run.
_OPE_NOTES = {"no_truth"}

# Result fields of a run that went online after its offline phase (offrl.sweep, `online:`).
_ONLINE_COLUMNS = ["offline_score", "dip_score", "strategy", "online_steps", "offline_return", "dip_return",
                   "switch_step"]


def _online_variants(results: Any) -> set[str]:
    """The variants whose runs went online (their rows carry online_steps)."""
    if "online_steps" not in results:
        return set()
    return set(results.loc[results["online_steps"].notna(), "variant"])


def _mean_std(values: np.ndarray) -> str:
    """'mean ± std' over seeds; the mean alone for one seed (a spread of one run is no spread)."""
    values = np.asarray(values, float)
    if len(values) < 2:
        return f"{np.mean(values):.1f}"
    return f"{np.mean(values):.1f} ± {np.std(values):.1f}"


def score_table(results: Any, value: str = "score") -> Any:
    """CORL-style table: mean ± std over seeds (the mean alone for one seed) of the last and the best
    evaluation, per dataset x algorithm."""
    import pandas as pd

    ok = results[results["status"] == "ok"]
    if ok.empty:
        return pd.DataFrame()
    metric = "score" if ok[f"final_{value}"].notna().any() else "return"
    online = _online_variants(ok)
    rows = []
    for (dataset, variant), group in ok.groupby(["dataset", "variant"], sort=True):
        final, best = group[f"final_{metric}"].to_numpy(float), group[f"best_{metric}"].to_numpy(float)
        row = {"dataset": dataset, "algorithm": variant, "last": _mean_std(final), "best": _mean_std(best),
               "seeds": len(group)}
        if variant in online:  # offline then online: where the online phase started, and its dip
            for part in ("offline", "dip"):
                values = group[f"{part}_{metric}"].to_numpy(float)
                row[part] = _mean_std(values) if np.isfinite(values).any() else ""
        rows.append(row)
    table = pd.DataFrame(rows)
    parts = ["last", "best"] + (["offline", "dip"] if online else [])
    pivots = {}
    for part in parts:
        pivot = table.pivot(index="dataset", columns="algorithm", values=part)
        pivot.columns = [f"{c} ({part})" for c in pivot.columns]
        pivots[part] = pivot
    combined = pd.concat(pivots.values(), axis=1)
    order = []
    for variant in sorted(table["algorithm"].unique()):
        names = ["offline", "last", "best", "dip"] if variant in online else ["last", "best"]
        order += [f"{variant} ({part})" for part in names]
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


def _metric(ok: Any) -> tuple[str, str]:
    """('score', 'normalised score') when the runs have normalised scores, else ('return', 'return')."""
    if "final_score" in ok and ok["final_score"].notna().any():
        return "score", "normalised score"
    return "return", "return"


def _seeds_text(ok: Any) -> str:
    """'2 seeds (0 and 1)', '1 seed (0)', or '1 to 3 seeds' when the runs differ."""
    counts = ok.groupby(["dataset", "variant"])["seed"].nunique()
    if counts.empty:
        return "no seeds"
    low, high = int(counts.min()), int(counts.max())
    if low != high:
        return f"{low} to {high} seeds"
    seeds = sorted(int(s) for s in ok["seed"].unique())
    listed = _html.join_words([str(s) for s in seeds]) if len(seeds) <= 6 else f"{seeds[0]} to {seeds[-1]}"
    return f"{low} seed{'s' if low != 1 else ''} ({listed})"


def _cell_stats(group: Any, metric: str) -> dict[str, Any]:
    final = group[f"final_{metric}"].to_numpy(float)
    best = group[f"best_{metric}"].to_numpy(float)
    stats = {"mean": float(np.mean(final)), "std": float(np.std(final)), "best": float(np.mean(best)),
             "best_std": float(np.std(best)), "seeds": len(group)}
    if "online_steps" in group and group["online_steps"].notna().any():  # offline then online
        for part in ("offline", "dip"):
            column = f"{part}_{metric}"
            values = group[column].to_numpy(float) if column in group else np.full(len(group), np.nan)
            values = values[np.isfinite(values)]
            stats[part] = float(np.mean(values)) if len(values) else float("nan")
            stats[f"{part}_std"] = float(np.std(values)) if len(values) else float("nan")
    return stats


def _online_text(c: dict[str, Any]) -> str:
    """'offline → final' of a variant that went online ('final (from scratch)' without an offline phase)."""
    final = _with_spread(c["mean"], c["std"], c["seeds"])
    if not np.isfinite(c.get("offline", np.nan)):
        return f"{final} (from scratch)"
    return f"{_with_spread(c['offline'], c['offline_std'], c['seeds'])} → {final}"


def _with_spread(mean: float, std: float, seeds: int) -> str:
    return f"{mean:.1f}" if seeds < 2 else f"{mean:.1f} ± {std:.1f}"


def _summary(results: Any, iqm_frame: Any) -> list[str]:
    """The sweep in sentences: what ran, which algorithm is best per dataset, against the data and BC."""
    ok = results[results["status"] == "ok"]
    n_failed = int((results["status"] == "failed").sum())
    n_incomplete = int((results["status"] == "incomplete").sum())
    variants = sorted(results["variant"].unique())
    datasets = sorted(results["dataset"].unique())
    trouble = ", ".join(t for t in (f"{n_failed} failed" if n_failed else "",
                                    f"{n_incomplete} did not finish" if n_incomplete else "") if t)
    lines = [f"{len(results)} training runs: {len(variants)} algorithm variant{'s' if len(variants) != 1 else ''} "
             f"({_html.join_words(variants)}) on {len(datasets)} dataset{'s' if len(datasets) != 1 else ''}, "
             f"{_seeds_text(ok) if len(ok) else 'no finished run'} each; "
             + (f"{trouble} (listed below)." if trouble else "all finished.")]
    if ok.empty:
        return lines
    metric, label = _metric(ok)
    one_seed = int(ok.groupby(["dataset", "variant"])["seed"].nunique().max()) < 2
    bc_variants = set(ok.loc[ok["algorithm"].astype(str).str.upper() == "BC", "variant"])
    for dataset in datasets[:8]:
        group = ok[ok["dataset"] == dataset]
        if group.empty:
            continue
        stats = {v: _cell_stats(g, metric) for v, g in group.groupby("variant")}
        ranked = sorted(stats, key=lambda v: -stats[v]["mean"])
        best = ranked[0]
        b = stats[best]
        where = f"On {dataset}" if len(datasets) > 1 else "Here"
        text = (f"{where}, {best} scores best by the last evaluation's {label}: "
                f"{_with_spread(b['mean'], b['std'], b['seeds'])}"
                + (f" (mean ± std over {b['seeds']} seeds)" if b["seeds"] > 1 else " (one seed)"))
        compare = []
        data = group.get("dataset_score" if metric == "score" else "dataset_return")
        if data is not None and data.notna().any():
            compare.append(f"{float(data.dropna().iloc[0]):.1f} for the data's own episodes")
        bc = [v for v in ranked if v in bc_variants and v != best]
        if bc:
            c = stats[bc[0]]
            compare.append(f"{_with_spread(c['mean'], c['std'], c['seeds'])} for BC"
                           + (f" ({bc[0]})" if bc[0].upper() != "BC" else ""))
        elif best in bc_variants and best.upper() != "BC":
            text += " (a BC variant)"
        if len(ranked) > 1 and ranked[1] not in bc:
            s = stats[ranked[1]]
            compare.append(f"{_with_spread(s['mean'], s['std'], s['seeds'])} for the runner-up, {ranked[1]}")
        if compare:
            text += ", against " + _html.join_words(compare)
        text += "."
        if len(ranked) > 1 and not one_seed:
            s = stats[ranked[1]]
            if b["mean"] - b["std"] > s["mean"] + s["std"]:
                text += f" Its lead over {ranked[1]} is larger than the seed-to-seed spread."
            else:
                text += f" Its lead over {ranked[1]} is within the seed-to-seed spread: not a clear difference."
        online = [v for v in sorted(stats) if "offline" in stats[v]]
        if online:
            parts = []
            for v in online:
                c = stats[v]
                part = (f"{v} {_online_text(c)}" if np.isfinite(c["offline"]) else
                        f"{v} from scratch {_with_spread(c['mean'], c['std'], c['seeds'])}")
                if np.isfinite(c["dip"]):
                    part += f" (dip {c['dip']:.1f})"
                parts.append(part)
            above = [v for v in online if np.isfinite(stats[v]["offline"]) and stats[v]["mean"] > stats[v]["offline"]]
            with_offline = [v for v in online if np.isfinite(stats[v]["offline"])]
            text += (f" Fine-tuned online (last offline → last online {label}): {'; '.join(parts)}."
                     + (f" {len(above)} of {len(with_offline)} end above their offline policy." if with_offline else ""))
        lines.append(text)
    if len(datasets) > 8:
        lines.append(f"(Per-dataset sentences for the first 8 of {len(datasets)} datasets; the table has them all.)")
    if one_seed and len(ok) > 1:
        lines.append("With one seed per algorithm each score is a single training run, so differences of a few points "
                     "may be noise; run more seeds to tell.")
    if iqm_frame is not None and len(iqm_frame) > 1 and len(datasets) > 1:
        top = iqm_frame.sort_values("iqm", ascending=False).iloc[0]
        lines.append(f"Across the {len(datasets)} datasets, {top['algorithm']} has the highest interquartile mean of "
                     f"the final {label}s: {top['iqm']:.1f} [{top['ci_low']:.1f}, {top['ci_high']:.1f}] "
                     f"(95% stratified bootstrap interval over {int(top['runs'])} runs).")
    return lines


def _score_table_html(results: Any) -> str:
    """One row per dataset: the data's own score, then per algorithm the last evaluation (mean ± std over seeds,
    the mean alone for one seed) with the best evaluation under it."""
    ok = results[results["status"] == "ok"]
    metric, label = _metric(ok)
    variants = sorted(ok["variant"].unique())
    counts = ok.groupby(["dataset", "variant"])["seed"].nunique()
    uniform_seeds = counts.nunique() == 1
    data_column = "dataset_score" if metric == "score" else "dataset_return"
    has_data = data_column in ok and ok[data_column].notna().any()
    header = ["dataset"] + (["data<span class='sub'>its own episodes</span>"] if has_data else [])
    header += [_html.esc(v) for v in variants]
    rows = []
    for dataset, group in ok.groupby("dataset", sort=True):
        row = [_html.esc(dataset)]
        if has_data:
            d = group[data_column].dropna()
            row.append(_html.esc(f"{float(d.iloc[0]):.1f}") if len(d) else "")
        stats = {v: _cell_stats(g, metric) for v, g in group.groupby("variant")}
        top = max(stats, key=lambda v: stats[v]["mean"]) if stats else None
        for v in variants:
            if v not in stats:
                row.append("<span class='dim'>no run</span>")
                continue
            c = stats[v]
            last = _html.esc(_online_text(c) if "offline" in c else _with_spread(c["mean"], c["std"], c["seeds"]))
            if v == top and len(stats) > 1:
                last = f"<b>{last}</b>"
            sub = f"best {_with_spread(c['best'], c['best_std'], c['seeds'])}"
            if "dip" in c:
                sub += (f", dip {_with_spread(c['dip'], c['dip_std'], c['seeds'])}" if np.isfinite(c["dip"])
                        else ", dip not measured")
            if not uniform_seeds:
                sub += f", {c['seeds']} seed{'s' if c['seeds'] != 1 else ''}"
            row.append(f"{last}<span class='sub'>{_html.esc(sub)}</span>")
        rows.append(row)
    seeds = _seeds_text(ok)
    spread = ("mean ± std over " + seeds) if counts.max() > 1 else seeds + ", so no spread is shown"
    caption = (f"{label.capitalize()} of each algorithm's policy at the last evaluation ({spread}); under it, the "
               f"best evaluation during training. Bold: the highest per dataset."
               + (" Data: the dataset's own episodes, scored the same way." if has_data else "")
               + (" Variants fine-tuned online show the last offline evaluation → the last online one, and under it "
                  "the dip: the lowest evaluation in the first 10% of the online steps." if _online_variants(ok)
                  else ""))
    return _html.table(header, rows, caption=_html.esc(caption), numeric=[False] + [True] * (len(header) - 1))


def _iqm_table_html(iqm_frame: Any) -> str:
    metric = str(iqm_frame["metric"].iloc[0]).replace("final_", "final ")
    rows = [[_html.esc(r.algorithm), _html.esc(_html.interval_text(r.iqm, r.ci_low, r.ci_high)),
             _html.esc(str(int(r.runs))), _html.esc(str(int(r.datasets)))] for r in iqm_frame.itertuples()]
    caption = (f"Interquartile mean (the mean of the middle 50%) of the {metric} over every run of an algorithm, "
               f"as value [low, high]: a 95% interval from resampling runs within each dataset (rliable's stratified "
               f"bootstrap).")
    return _html.table(["algorithm", "IQM [95% interval]", "runs", "datasets"], rows, caption=_html.esc(caption),
                       numeric=[False, True, True, True])


def _switches(group: Any) -> dict[int, list[str]]:
    """Offline-to-online switch step -> the variants that switch there (runs without an offline phase have none)."""
    if "switch_step" not in group:
        return {}
    switches: dict[int, list[str]] = {}
    for variant, runs in group.groupby("variant", sort=True):
        steps = runs["switch_step"].dropna()
        if len(steps) and int(steps.iloc[0]) > 0:
            switches.setdefault(int(steps.iloc[0]), []).append(str(variant))
    return switches


def _from_scratch(group: Any) -> list[str]:
    """The variants that went online without an offline phase (switch at step 0: SAC)."""
    if "switch_step" not in group:
        return []
    return sorted(str(v) for v, runs in group.groupby("variant") if (runs["switch_step"] == 0).any())


def _learning_curves(out_dir: Path, results: Any) -> list[str]:
    """One captioned figure per dataset: evaluation score against gradient steps, mean over seeds (± std band).

    A variant fine-tuned online plots both phases on one axis (online steps after the offline ones), with a
    dashed vertical line labelled "online" at the switch."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    figures = []
    ok = results[results["status"] == "ok"]
    for number, (dataset, group) in enumerate(ok.groupby("dataset", sort=True), start=1):
        fig, ax = plt.subplots(figsize=(10, 4.6))
        plotted = False
        key = None
        seeds_seen = set()
        for i, (variant, runs) in enumerate(group.groupby("variant", sort=True)):
            curves = []
            for run_dir in runs["dir"]:
                path = Path(run_dir) / "result.json"
                if not path.exists():
                    continue
                with open(path) as f:
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
            seeds_seen.add(len(curves))
            ax.plot(steps, mean, label=f"{variant} ({len(curves)} seed{'s' if len(curves) != 1 else ''})",
                    color=f"C{i}", lw=2)
            if len(curves) > 1:
                ax.fill_between(steps, mean - std, mean + std, alpha=0.18, color=f"C{i}")
            plotted = True
        switches = _switches(group) if plotted else {}
        for step in switches:
            ax.axvline(step, color="0.25", ls="--", lw=1.2)
            ax.annotate("online", xy=(step, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -12),
                        textcoords="offset points", fontsize=10, color="0.25")
        if plotted:
            label = "normalised score" if key and key.startswith("normalized") else "return"
            data_column = "dataset_score" if label == "normalised score" else "dataset_return"
            if data_column in group and group[data_column].notna().any():
                ax.axhline(float(group[data_column].dropna().iloc[0]), color="0.4", ls="--", lw=1.2,
                           label="the data's own episodes")
            ax.set_ylabel(label)
            ax.set_xlabel("offline gradient steps, then online environment steps" if "switch_step" in group
                          and group["switch_step"].notna().any() else "gradient steps")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=10, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
            band = ("; shaded: ± one standard deviation over seeds" if max(seeds_seen) > 1
                    else "; one seed each, so no band")
            caption = (f"Figure {number}. {label.capitalize()} of the evaluation episodes during training on "
                       f"{dataset}: the mean over seeds per algorithm{band}; dashed: the data's own episodes.")
            if switches:
                where = "; ".join(f"step {step:,} ({_html.join_words(names)})" for step, names in sorted(switches.items()))
                caption += (f" Dashed vertical line marked online: the switch from offline training to online "
                            f"fine-tuning, at {where}; the online phase's environment steps follow on the same axis.")
            scratch = _from_scratch(group)
            if scratch:
                caption += (f" {_html.join_words(scratch)} learn{'s' if len(scratch) == 1 else ''} online from "
                            "scratch, so {} curve starts at step 0.".format("its" if len(scratch) == 1 else "each"))
            figures.append(_html.figure(fig, f"learning curves on {dataset}", _html.esc(caption), dpi=100))
        else:
            plt.close(fig)
    return figures


def _ope_estimators(results: Any) -> list[str]:
    """The OPE estimators with estimates in the results table (columns ope_<name> with their intervals)."""
    suffix = "_ci_low"
    return [c[len("ope_"):-len(suffix)] for c in results.columns
            if c.startswith("ope_") and c.endswith(suffix) and c[:-len(suffix)] in results]


def _run_name(row: Any) -> str:
    return f"{row['variant']}/seed{int(row['seed'])}"


def _rank_correlation(estimates: np.ndarray, truth: np.ndarray) -> float:
    """Spearman's rank correlation of estimates and true scores; NaN for fewer than 3 runs or a constant side."""
    from scipy.stats import rankdata

    if len(estimates) < 3 or np.unique(estimates).size < 2 or np.unique(truth).size < 2:
        return float("nan")
    return float(np.corrcoef(rankdata(estimates), rankdata(truth))[0, 1])  # Pearson's of the ranks (ties averaged)


def ope_selection(results: Any) -> Any:
    """OPE-based model selection: per dataset and OPE estimator, the run the estimator would pick among the
    finished runs with an estimate, by the highest estimate and by the highest lower confidence bound, and how
    that pick does in truth.

    The true score is the run's last evaluation (normalised score, else return), where an env was evaluated.
    Columns: dataset, estimator, runs, truth (what the true scores are; '' without any), selected, estimate,
    selected_score, regret (the best run's true score minus the pick's), selected_by_lcb ('' when no run has a
    finite lower bound), lcb, lcb_score, lcb_regret, best_run, best_score, rank_corr (Spearman, estimates
    against true scores, over ranked_runs runs with both; NaN below 3).  Without true scores only the picks
    are filled in.
    """
    import pandas as pd

    columns = ["dataset", "estimator", "runs", "truth", "selected", "estimate", "selected_score", "regret",
               "selected_by_lcb", "lcb", "lcb_score", "lcb_regret", "best_run", "best_score", "rank_corr",
               "ranked_runs"]
    if results is None or len(results) == 0 or "status" not in results:
        return pd.DataFrame(columns=columns)
    ok = results[results["status"] == "ok"]
    rows = []
    nan = float("nan")
    for dataset, group in ok.groupby("dataset", sort=True):
        truth_column, truth_label = None, ""
        for column, label in (("final_score", "normalised score"), ("final_return", "return")):
            if column in group and np.isfinite(pd.to_numeric(group[column], errors="coerce")).any():
                truth_column, truth_label = column, label
                break
        for estimator in _ope_estimators(group):
            values = pd.to_numeric(group[f"ope_{estimator}"], errors="coerce").to_numpy(float)
            candidates = group[np.isfinite(values)]
            if candidates.empty:
                continue
            estimates = pd.to_numeric(candidates[f"ope_{estimator}"], errors="coerce").to_numpy(float)
            lows = pd.to_numeric(candidates[f"ope_{estimator}_ci_low"], errors="coerce").to_numpy(float)
            truth = (pd.to_numeric(candidates[truth_column], errors="coerce").to_numpy(float)
                     if truth_column else np.full(len(candidates), nan))
            has_truth = np.isfinite(truth)
            pick = int(np.argmax(estimates))  # the first of equal estimates (runs are in dataset, variant, seed order)
            row: dict[str, Any] = {"dataset": dataset, "estimator": estimator, "runs": len(candidates),
                                   "truth": truth_label if has_truth.any() else "",
                                   "selected": _run_name(candidates.iloc[pick]), "estimate": estimates[pick],
                                   "selected_score": truth[pick]}
            best = float(np.max(truth[has_truth])) if has_truth.any() else nan
            row["regret"] = best - truth[pick] if np.isfinite(truth[pick]) else nan
            if np.isfinite(lows).any():  # an infinite lower bound says nothing, so it picks nothing
                by_lcb = int(np.argmax(np.where(np.isfinite(lows), lows, -np.inf)))
                row.update({"selected_by_lcb": _run_name(candidates.iloc[by_lcb]), "lcb": lows[by_lcb],
                            "lcb_score": truth[by_lcb],
                            "lcb_regret": best - truth[by_lcb] if np.isfinite(truth[by_lcb]) else nan})
            else:
                row.update({"selected_by_lcb": "", "lcb": nan, "lcb_score": nan, "lcb_regret": nan})
            if has_truth.any():
                top = int(np.flatnonzero(has_truth)[np.argmax(truth[has_truth])])
                row.update({"best_run": _run_name(candidates.iloc[top]), "best_score": best})
            else:
                row.update({"best_run": "", "best_score": nan})
            row["rank_corr"] = _rank_correlation(estimates[has_truth], truth[has_truth])
            row["ranked_runs"] = int(has_truth.sum())
            rows.append(row)
    return pd.DataFrame(rows, columns=columns)


def _selection_sentences(selection: Any, limit: int = 8) -> list[str]:
    """The OPE-based selection in words, one sentence per dataset (the first `limit` datasets)."""
    lines = []
    datasets = list(dict.fromkeys(selection["dataset"]))
    for dataset in datasets[:limit]:
        group = selection[selection["dataset"] == dataset]
        where = f" on {dataset}" if len(datasets) > 1 else ""
        if (group["truth"] == "").all():
            picks = [f"{r.estimator} would pick {r.selected} (estimate {_html.fmt(r.estimate)})"
                     for r in group.itertuples()]
            lines.append(f"OPE-based selection{where}: {'; '.join(picks)}. No run was evaluated in an environment, "
                         "so how good these picks are is not known.")
            continue
        picks = []
        for r in group.itertuples():
            text = f"{r.estimator} would pick {r.selected}"
            if np.isfinite(r.selected_score):
                text += f" ({r.truth} {_html.fmt(r.selected_score)}, regret {_html.fmt(r.regret)}"
                text += (f"; rank correlation {r.rank_corr:.2f} over {r.ranked_runs} runs)"
                         if np.isfinite(r.rank_corr) else ")")
            picks.append(text)
        best = group[group["best_run"] != ""].iloc[0]
        lines.append(f"OPE-based selection{where} (by the highest estimate): {'; '.join(picks)}. The best run, "
                     f"{best['best_run']}, scores {_html.fmt(best['best_score'])}; regret is its score minus the "
                     "pick's.")
    if len(datasets) > limit:
        lines.append(f"(OPE-based selection for the first {limit} of {len(datasets)} datasets; the table has them "
                     "all.)")
    return lines


def _ope_selection_html(selection: Any) -> str:
    """The OPE-based selection table: per dataset and estimator, its pick by estimate and by lower bound, each
    with its true score and regret, and the rank correlation of estimates with true scores."""
    def pick_cell(run: str, value: float, what: str, score: float, truth: str) -> str:
        if not run:
            return "<span class='dim'>no finite lower bound</span>"
        sub = f"{what} {_html.fmt(value)}" + (f", {truth} {_html.fmt(score)}" if np.isfinite(score) else "")
        return f"{_html.esc(run)}<span class='sub'>{_html.esc(sub)}</span>"

    def number(value: float, digits: str = "") -> str:
        if not np.isfinite(value):
            return "<span class='dim'>n/a</span>"
        return _html.esc(f"{value:{digits}}" if digits else _html.fmt(value))

    rows = []
    for r in selection.itertuples():
        best = (f"{_html.esc(r.best_run)}<span class='sub'>{_html.esc(f'{r.truth} {_html.fmt(r.best_score)}')}</span>"
                if r.best_run else "<span class='dim'>no true score</span>")
        rows.append([_html.esc(r.dataset), _html.esc(r.estimator),
                     pick_cell(r.selected, r.estimate, "estimate", r.selected_score, r.truth), number(r.regret),
                     pick_cell(r.selected_by_lcb, r.lcb, "lower bound", r.lcb_score, r.truth), number(r.lcb_regret),
                     best, number(r.rank_corr, ".2f"), _html.esc(r.runs)])
    truthless = sorted(set(selection.loc[selection["truth"] == "", "dataset"]))
    caption = ("Which run each OPE estimator would select from the logged data alone: the run with the highest "
               "estimate, and the run with the highest lower confidence bound. Under each pick, its estimate and its "
               "true score: the last evaluation in the environment (normalised score where the dataset has "
               "reference scores, else return). Regret: the best run's true score minus the pick's (0: the "
               "estimator picked the best run). Rank correlation: Spearman's, of the estimates against the true "
               "scores over the runs with both (n/a below 3 runs).")
    if truthless:
        caption += (f" {_html.join_words(truthless)} had no evaluation environment, so only the picks are shown.")
    return _html.table(["dataset", "estimator", "selects (highest estimate)", "regret",
                        "selects (highest lower bound)", "regret", "best run", "rank corr.", "runs"], rows,
                       caption=_html.esc(caption), numeric=[False, False, False, True, False, True, False, True, True])


def write_report(out_dir: str | os.PathLike, title: str | None = None, extra_html: str = "",
                 extra_summary: str = "") -> dict[str, Path]:
    """Write results.csv, table.csv, iqm.csv and report.html into `out_dir` (and ope_selection.csv when runs
    have OPE estimates); return their paths.

    The page opens with a summary in words (what ran, which algorithm is best against the data and BC, the seed
    count, which run each OPE estimator would select), then the score table, the IQM across datasets, captioned
    learning curves, the OPE-based selection, `extra_html` (e.g. an OPE section) and every run's numbers in a
    collapsed block.  `extra_summary` (HTML paragraphs) is added to the summary box.  It fits a 1280-px-wide
    window without scrolling sideways.
    """
    out_dir = Path(out_dir)
    results = results_frame(out_dir)
    paths = {"results": out_dir / "results.csv", "table": out_dir / "table.csv", "iqm": out_dir / "iqm.csv",
             "html": out_dir / "report.html"}
    with atomic_write_path(paths["results"]) as tmp:
        results.to_csv(tmp, index=False)
    any_ok = len(results) > 0 and bool((results["status"] == "ok").any())
    table = score_table(results) if not results.empty else None
    iqm_frame = aggregate_iqm(results) if any_ok else None
    with atomic_write_path(paths["table"]) as tmp:
        (table if table is not None else results.head(0)).to_csv(tmp)
    with atomic_write_path(paths["iqm"]) as tmp:
        (iqm_frame if iqm_frame is not None else results.head(0)).to_csv(tmp, index=False)
    selection = ope_selection(results)
    if not selection.empty:
        paths["ope_selection"] = out_dir / "ope_selection.csv"
        with atomic_write_path(paths["ope_selection"]) as tmp:
            selection.to_csv(tmp, index=False)
    name = title or out_dir.name
    if results.empty:
        summary = [f"No runs found under {out_dir}."]
    else:
        summary = _summary(results, iqm_frame) + _selection_sentences(selection)
    parts = ["<section class='summary' id='summary'><h2>Summary</h2>"
             + "".join(f"<p>{_html.esc(line)}</p>" for line in summary) + extra_summary + "</section>"]
    if any_ok:
        parts += ["<h2>Scores</h2>", _score_table_html(results)]
        if iqm_frame is not None and not iqm_frame.empty and int(iqm_frame["datasets"].max()) > 1:
            parts += ["<h2>Aggregate across datasets</h2>", _iqm_table_html(iqm_frame)]
        parts += ["<h2>Learning curves</h2>"] + _learning_curves(out_dir, results)
    if not selection.empty:
        parts += ["<h2 id='ope-selection'>OPE-based selection</h2>", _ope_selection_html(selection)]
    parts.append(extra_html)
    if len(results):
        failed = results[results["status"] != "ok"]
        if not failed.empty:
            rows = [[_html.esc(r.dataset), _html.esc(r.variant), _html.esc(r.seed), _html.esc(r.status),
                     _html.esc(getattr(r, "error", "") if isinstance(getattr(r, "error", ""), str) else "")]
                    for r in failed.itertuples()]
            parts += ["<h2 class='failed'>Failed or incomplete runs</h2>",
                      _html.table(["dataset", "algorithm", "seed", "status", "error"], rows, row_header=False,
                                  caption="The traceback of a failed run is in its directory's error.txt.")]
        raw = results.drop(columns=["dir"], errors="ignore")
        parts.append(_html.details(f"All runs: one row per run ({len(results)}; the same as results.csv)",
                                   _html.raw_table(raw)))
    with atomic_write_path(paths["html"]) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(_html.page(name, parts))
    return paths
