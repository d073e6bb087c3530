"""`OPEReport`: estimates of several policies by several estimators, with metrics, tables and an HTML page."""

from __future__ import annotations

import base64
import html
import io
import math
import os
from typing import Any, Mapping

import numpy as np

from offrl.datasets.core import atomic_write_path
from offrl.ope.metrics import selection_metrics
from offrl.ope.results import OPEResult

__all__ = ["OPEReport"]

_FRAME_DIAGNOSTICS = ("interval", "alpha", "interval_guaranteed", "weight_bound_source", "n", "ess", "ess_fraction",
                      "max_weight", "ensemble_std", "behavior_policy",
                      "behavior_heldout_loglik", "behavior_insample_loglik", "target_policy", "kernel_bandwidth",
                      "unsupported_mass", "warning")


class OPEReport:
    """Results of `offrl.ope.evaluate` / `benchmark`: results[policy][estimator] -> OPEResult.

    `true_values` (policy -> value), when known, enables `metrics()` and the
    estimated-vs-true plot.  `k` and `safety_threshold` set the defaults of
    the selection metrics.
    """

    def __init__(
        self,
        results: Mapping[str, Mapping[str, OPEResult]],
        true_values: Mapping[str, float] | None = None,
        *,
        k: int = 1,
        safety_threshold: float | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        self.results = {str(p): dict(r) for p, r in results.items()}
        if not self.results:
            raise ValueError("an OPEReport needs at least one policy")
        self.true_values = None if true_values is None else {str(k_): float(v) for k_, v in true_values.items()}
        if self.true_values is not None:
            missing = [p for p in self.results if p not in self.true_values]
            if missing:
                raise ValueError(f"true_values lacks policies {missing}")
        self.k = int(k)
        self.safety_threshold = safety_threshold
        self.metadata = dict(metadata or {})

    # ------------------------------------------------------------------ views
    @property
    def policies(self) -> list[str]:
        return list(self.results)

    @property
    def estimators(self) -> list[str]:
        names: list[str] = []
        for per_policy in self.results.values():
            for name in per_policy:
                if name not in names:
                    names.append(name)
        return names

    def estimates(self, estimator: str, criterion: str = "value") -> dict[str, float]:
        """policy -> estimate (or `ci_low` / `ci_high`) of one estimator."""
        if estimator not in self.estimators:
            raise ValueError(f"unknown estimator {estimator!r}; the report has {self.estimators}")
        if criterion not in ("value", "ci_low", "ci_high"):
            raise ValueError(f"criterion must be 'value', 'ci_low' or 'ci_high', got {criterion!r}")
        return {p: float(getattr(r[estimator], criterion)) for p, r in self.results.items() if estimator in r}

    def to_frame(self) -> Any:
        """One row per (policy, estimator): value, std_error, ci_low, ci_high, true_value, error and diagnostics."""
        import pandas as pd

        rows = []
        for policy, per_policy in self.results.items():
            for estimator, result in per_policy.items():
                row: dict[str, Any] = {"policy": policy, "estimator": estimator, "value": result.value,
                                       "std_error": result.std_error, "ci_low": result.ci_low,
                                       "ci_high": result.ci_high}
                if self.true_values is not None:
                    true = self.true_values[policy]
                    row["true_value"] = true
                    row["error"] = result.value - true
                    row["covered"] = bool(result.ci_low <= true <= result.ci_high)
                for key in _FRAME_DIAGNOSTICS:
                    if key in result.diagnostics:
                        row[key] = result.diagnostics[key]
                rows.append(row)
        return pd.DataFrame(rows)

    def metrics(self, k: int | None = None, safety_threshold: float | None = None) -> Any:
        """Per-estimator selection metrics against the true values (a DataFrame indexed by estimator)."""
        import pandas as pd

        if self.true_values is None:
            raise ValueError("metrics need true values: pass true_values=... (or use offrl.ope.benchmark)")
        k = self.k if k is None else int(k)
        threshold = self.safety_threshold if safety_threshold is None else safety_threshold
        rows = {}
        for estimator in self.estimators:
            est = self.estimates(estimator)
            true = {p: self.true_values[p] for p in est}
            if len(est) < 1:
                continue
            row = selection_metrics(est, true, k=min(k, len(est)), safety_threshold=threshold)
            row["coverage"] = float(np.mean([self.results[p][estimator].ci_low <= true[p] <= self.results[p][estimator].ci_high
                                             for p in est]))
            rows[estimator] = row
        frame = pd.DataFrame.from_dict(rows, orient="index")
        frame.index.name = "estimator"
        return frame

    def select(self, k: int = 1, by: str | None = None, criterion: str = "value") -> list[str]:
        """The k policies with the highest estimate of estimator `by` (default: FQE if present, else the first).

        criterion="ci_low" ranks by the lower confidence bound (a cautious choice).
        """
        if int(k) < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        by = by or ("FQE" if "FQE" in self.estimators else self.estimators[0])
        values = self.estimates(by, criterion)
        order = sorted(values, key=lambda p: -values[p])
        return order[: int(k)]

    def to_csv(self, path: str | os.PathLike) -> None:
        """Write `to_frame()` as CSV (atomically)."""
        frame = self.to_frame()
        with atomic_write_path(path, suffix=".csv") as tmp:
            frame.to_csv(tmp, index=False)

    def __repr__(self) -> str:
        return f"OPEReport(policies={self.policies}, estimators={self.estimators}, true_values={self.true_values is not None})"

    def __str__(self) -> str:
        frame = self.to_frame()
        cols = [c for c in ("policy", "estimator", "value", "std_error", "ci_low", "ci_high", "true_value") if c in frame]
        text = frame[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}")
        behaviour = self._behaviour_summary()
        return text + ("\n" + behaviour if behaviour else "")

    def _behaviour_summary(self) -> str:
        """How pi_b was obtained and, for an estimated model, its held-out log-likelihood (one line; '' if unknown)."""
        description = self.metadata.get("behaviour policy")
        heldout = insample = None
        for per_policy in self.results.values():
            for result in per_policy.values():
                description = description or result.diagnostics.get("behavior_policy")
                if heldout is None and result.diagnostics.get("behavior_heldout_loglik") is not None:
                    heldout = float(result.diagnostics["behavior_heldout_loglik"])
                    insample = result.diagnostics.get("behavior_insample_loglik")
        if description is None:
            return ""
        line = f"behaviour policy: {description}"
        if heldout is not None and "held-out" not in str(description):
            line += f"; held-out log-likelihood {heldout:.4g} nats per transition"
        if heldout is not None and insample is not None:
            line += f" (in-sample {float(insample):.4g}: a large gap means the model over-fits)"
        return line

    # ------------------------------------------------------------------ HTML
    def _figure_estimates(self) -> str:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        policies, estimators = self.policies, self.estimators
        width = 0.8 / max(len(estimators), 1)
        fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(policies) + 2), 4.2))
        x = np.arange(len(policies))
        for j, est in enumerate(estimators):
            vals, lows, highs, xs = [], [], [], []
            for i, p in enumerate(policies):
                r = self.results[p].get(est)
                if r is None:
                    continue
                xs.append(x[i] - 0.4 + width * (j + 0.5))
                vals.append(r.value)
                lows.append(r.value - r.ci_low if math.isfinite(r.ci_low) else 0.0)
                highs.append(r.ci_high - r.value if math.isfinite(r.ci_high) else 0.0)
            ax.errorbar(xs, vals, yerr=[lows, highs], fmt="o", capsize=3, label=est)
        if self.true_values is not None:
            ax.scatter(x, [self.true_values[p] for p in policies], marker="_", s=900, color="black", zorder=5,
                       label="true value")
        ax.set_xticks(x)
        ax.set_xticklabels(policies, rotation=30, ha="right")
        ax.set_ylabel("estimated value")
        ax.set_title("Estimates with confidence intervals")
        ax.legend(fontsize=8, ncol=2)
        fig.tight_layout()
        return _png(fig)

    def _figure_scatter(self) -> str:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        estimators = self.estimators
        n = len(estimators)
        cols = min(n, 4)
        rows = math.ceil(n / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 3.2 * rows), squeeze=False)
        metrics = self.metrics()
        true_all = np.array(list(self.true_values.values()))
        lo, hi = true_all.min(), true_all.max()
        for ax, est in zip(axes.ravel(), estimators):
            vals = self.estimates(est)
            t = np.array([self.true_values[p] for p in vals])
            v = np.array(list(vals.values()))
            low = np.array([self.results[p][est].ci_low for p in vals])
            high = np.array([self.results[p][est].ci_high for p in vals])
            yerr = np.nan_to_num(np.stack([v - low, high - v]), posinf=0.0, neginf=0.0)
            ax.errorbar(t, v, yerr=yerr, fmt="o", capsize=2)
            span = max(hi - lo, 1e-9)
            ax.plot([lo - 0.1 * span, hi + 0.1 * span], [lo - 0.1 * span, hi + 0.1 * span], "k--", lw=1)
            rho = metrics.loc[est, "spearman"]
            ax.set_title(f"{est}  (Spearman {rho:.2f})", fontsize=9)
            ax.set_xlabel("true value")
            ax.set_ylabel("estimate")
        for ax in axes.ravel()[n:]:
            ax.axis("off")
        fig.tight_layout()
        return _png(fig)

    def to_html(self, path: str | os.PathLike, title: str = "Off-policy evaluation report") -> None:
        """A self-contained HTML page (inline CSS and base64 PNGs, no network fetches): tables and plots."""
        frame = self.to_frame()
        parts = [
            "<!DOCTYPE html><html><head><meta charset='utf-8'>",
            f"<title>{html.escape(title)}</title>",
            "<style>body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;"
            "font-size:13px}td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}th{background:#f0f0f0}"
            "td:first-child,td:nth-child(2){text-align:left}.warn{color:#a60}</style></head><body>",
            f"<h1>{html.escape(title)}</h1>",
        ]
        if self.metadata:
            items = "".join(f"<li><b>{html.escape(str(k))}</b>: {html.escape(str(v))}</li>" for k, v in self.metadata.items())
            parts.append(f"<ul>{items}</ul>")
        if self.true_values is not None:
            parts.append("<h2>Selection metrics (against true values)</h2>")
            parts.append(self.metrics().to_html(float_format=lambda v: f"{v:.4g}", escape=True))
        behaviour = self._behaviour_summary()
        if behaviour:
            parts.append(f"<h2>Behaviour policy</h2><p>{html.escape(behaviour)}</p>")
        parts.append("<h2>Estimates</h2>")
        shown = [c for c in frame.columns if c != "warning"]
        parts.append(frame[shown].to_html(index=False, float_format=lambda v: f"{v:.4g}", escape=True))
        if "warning" in frame:
            warned = frame.dropna(subset=["warning"])
            if len(warned):
                parts.append("<h2>Warnings</h2><ul class='warn'>")
                parts.extend(f"<li><b>{html.escape(r.policy)} / {html.escape(r.estimator)}</b>: {html.escape(str(r.warning))}</li>"
                             for r in warned.itertuples())
                parts.append("</ul>")
        parts.append("<h2>Estimates per policy</h2>")
        parts.append(f"<img alt='estimates with intervals' src='data:image/png;base64,{self._figure_estimates()}'>")
        if self.true_values is not None:
            parts.append("<h2>Estimated vs true values</h2>")
            parts.append(f"<img alt='estimated vs true' src='data:image/png;base64,{self._figure_scatter()}'>")
        parts.append("</body></html>")
        with atomic_write_path(path, suffix=".html") as tmp:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write("\n".join(parts))

    def _repr_html_(self) -> str:
        return self.to_frame().to_html(index=False)


def _png(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode("ascii")
