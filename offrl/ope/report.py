"""`OPEReport`: estimates of several policies by several estimators, with metrics, tables and an HTML page."""

from __future__ import annotations

import math
import os
import re
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from offrl import _html
from offrl.datasets.core import atomic_write_path
from offrl.ope.metrics import selection_metrics
from offrl.ope.results import OPEResult

if TYPE_CHECKING:
    from offrl.ope.distributional import ReturnDistribution

__all__ = ["OPEReport", "estimator_family", "logged_value"]

_FRAME_DIAGNOSTICS = ("interval", "alpha", "interval_guaranteed", "weight_bound_source", "n", "ess", "ess_fraction",
                      "max_weight", "log_max_weight", "dm_value", "ensemble_std", "behavior_policy",
                      "behavior_heldout_loglik", "behavior_insample_loglik", "target_policy", "kernel_bandwidth",
                      "unsupported_mass", "ratio_mass", "negative_weight_share", "flow_residual", "ess_transitions",
                      "warning")


class OPEReport:
    """Results of `offrl.ope.evaluate` / `benchmark`: results[policy][estimator] -> OPEResult.

    `true_values` (policy -> value), when known, enables `metrics()` and the
    estimated-vs-true plot.  `k` and `safety_threshold` set the defaults of
    the selection metrics.  `distributions` (policy -> estimator ->
    `ReturnDistribution`, e.g. from `offrl.ope.distributional.evaluate_distributions`)
    adds the return CDFs: `select(risk="cvar")`, `distribution_frame()`, and a
    CDF plot and a table of risk measures in the HTML page.
    """

    def __init__(
        self,
        results: Mapping[str, Mapping[str, OPEResult]],
        true_values: Mapping[str, float] | None = None,
        *,
        k: int = 1,
        safety_threshold: float | None = None,
        metadata: Mapping[str, Any] | None = None,
        distributions: Mapping[str, Mapping[str, "ReturnDistribution"]] | None = None,
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
        self.distributions = {str(p): dict(d) for p, d in (distributions or {}).items()}
        unknown = [p for p in self.distributions if p not in self.results]
        if unknown:
            raise ValueError(f"distributions has policies {unknown} that the results lack; pass the distributions of "
                             f"the same policies")
        for per_policy in self.distributions.values():
            for name, dist in per_policy.items():
                if not (hasattr(dist, "cdf") and hasattr(dist, "grid") and hasattr(dist, "cvar")):
                    raise TypeError(f"distributions[...][{name!r}] must be a ReturnDistribution, got "
                                    f"{type(dist).__name__}")

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

    @property
    def distribution_estimators(self) -> list[str]:
        """The distributional estimators (CD-SNIS, ...) in the order they appear."""
        names: list[str] = []
        for per_policy in self.distributions.values():
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
        """Per-estimator selection metrics against the true values (a DataFrame indexed by estimator).

        With k >= 2 and the logged data's value in the metadata ("data value", set by `evaluate`), SCOPE-RL's
        SharpeRatio@k (`sharpe@k`) is included."""
        import pandas as pd

        if self.true_values is None:
            raise ValueError("metrics need true values: pass true_values=... (or use offrl.ope.benchmark)")
        k = self.k if k is None else int(k)
        threshold = self.safety_threshold if safety_threshold is None else safety_threshold
        data_value = self.metadata.get("data value")  # the logged data's value: SharpeRatio@k's baseline J(pi_b)
        # SharpeRatio@k divides by the spread of the top k's true values: it needs k >= 2
        behavior_value = float(data_value) if _finite(data_value) and k >= 2 else None
        rows = {}
        for estimator in self.estimators:
            est = self.estimates(estimator)
            true = {p: self.true_values[p] for p in est}
            if len(est) < 1:
                continue
            row = selection_metrics(est, true, k=min(k, len(est)), safety_threshold=threshold,
                                    behavior_value=behavior_value)
            row["coverage"] = float(np.mean([self.results[p][estimator].ci_low <= true[p] <= self.results[p][estimator].ci_high
                                             for p in est]))
            rows[estimator] = row
        frame = pd.DataFrame.from_dict(rows, orient="index")
        frame.index.name = "estimator"
        return frame

    def select(self, k: int = 1, by: str | None = None, criterion: str = "value", risk: str | None = None
               ) -> list[str]:
        """The k policies with the highest estimate of estimator `by` (default: FQE if present, else the first).

        criterion="ci_low" ranks by the lower confidence bound (a cautious choice).  `risk`: None or "mean"
        ranks by the estimated value as above; "lcb" by the lower confidence bound of `by`'s value; "cvar" by
        the CVaR (the mean of the worst `cvar_alpha` share of returns) of distributional estimator `by`
        (default: the first in `distributions`), or by its interval's end with criterion "ci_low" / "ci_high".
        """
        if int(k) < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if risk in (None, "mean"):
            by = by or ("FQE" if "FQE" in self.estimators else self.estimators[0])
            values = self.estimates(by, criterion)
        elif risk == "lcb":
            if criterion not in ("value", "ci_low"):
                raise ValueError(f"risk='lcb' ranks by the lower confidence bound; criterion={criterion!r} contradicts it")
            by = by or ("FQE" if "FQE" in self.estimators else self.estimators[0])
            values = self.estimates(by, "ci_low")
        elif risk == "cvar":
            values = self.distribution_estimates(by, "cvar", criterion)
        else:
            raise ValueError(f"risk must be None, 'mean', 'lcb' or 'cvar', got {risk!r}")
        order = sorted(values, key=lambda p: -values[p])
        return order[: int(k)]

    def distribution_estimates(self, estimator: str | None = None, statistic: str = "cvar",
                               criterion: str = "value") -> dict[str, float]:
        """policy -> a statistic ("mean", "variance", "cvar", "iqr") of distributional estimator `estimator`
        (default: the first), its point estimate or its interval's `ci_low` / `ci_high`."""
        if not self.distributions:
            raise ValueError("this report has no return distributions; pass distributions=... to OPEReport (from "
                             "offrl.ope.distributional.evaluate_distributions) to rank by a risk measure")
        names = self.distribution_estimators
        estimator = names[0] if estimator is None else estimator
        if estimator not in names:
            raise ValueError(f"{estimator!r} has no return distributions in this report; the distributional "
                             f"estimators are {names}")
        if criterion not in ("value", "ci_low", "ci_high"):
            raise ValueError(f"criterion must be 'value', 'ci_low' or 'ci_high', got {criterion!r}")
        if statistic not in ("mean", "variance", "cvar", "iqr"):
            raise ValueError(f"statistic must be 'mean', 'variance', 'cvar' or 'iqr', got {statistic!r}")
        position = ("value", "ci_low", "ci_high").index(criterion)
        out = {}
        for policy, per_policy in self.distributions.items():
            dist = per_policy.get(estimator)
            if dist is None:
                continue
            value = _distribution_statistics(dist)[_statistic_key(dist, statistic)][position]
            if not _finite(value):
                raise ValueError(f"{estimator}'s {statistic} {criterion} of {policy} is not finite ({value}); "
                                 f"estimate the distribution with n_bootstrap > 0 for intervals")
            out[policy] = float(value)
        return out

    def distribution_frame(self) -> Any:
        """One row per (policy, distributional estimator, statistic): value, ci_low, ci_high."""
        import pandas as pd

        rows = []
        for policy, per_policy in self.distributions.items():
            for estimator, dist in per_policy.items():
                for statistic, (value, low, high) in _distribution_statistics(dist).items():
                    rows.append({"policy": policy, "estimator": estimator, "statistic": statistic,
                                 "value": float(value), "ci_low": float(low), "ci_high": float(high)})
        return pd.DataFrame(rows, columns=["policy", "estimator", "statistic", "value", "ci_low", "ci_high"])

    def to_csv(self, path: str | os.PathLike) -> None:
        """Write `to_frame()` as CSV (atomically)."""
        frame = self.to_frame()
        with atomic_write_path(path, suffix=".csv") as tmp:
            frame.to_csv(tmp, index=False)

    def __repr__(self) -> str:
        return f"OPEReport(policies={self.policies}, estimators={self.estimators}, true_values={self.true_values is not None})"

    def __str__(self) -> str:
        """The summary in words, then one row per policy ("value [low, high]" per estimator), then pi_b."""
        text = self.summary() + "\n\n" + self.to_table().to_string()
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

    # ------------------------------------------------------------------ reading aids
    def to_table(self) -> Any:
        """One row per policy, one column per estimator, each cell "value [low, high]" (text);
        a "true value" column first when true values are known ("value ± std error" when known)."""
        import pandas as pd

        rows = {}
        se = self._true_std_errors()
        for policy, per_policy in self.results.items():
            row: dict[str, str] = {}
            if self.true_values is not None:
                row["true value"] = _html.fmt(self.true_values[policy]) + (
                    f" ± {_html.fmt(se[policy])}" if policy in se else "")
            for estimator in self.estimators:
                r = per_policy.get(estimator)
                row[estimator] = "" if r is None else _html.interval_text(r.value, r.ci_low, r.ci_high)
            rows[policy] = row
        frame = pd.DataFrame.from_dict(rows, orient="index")
        frame.index.name = "policy"
        return frame

    def assess_estimators(self) -> Any:
        """How far to trust each estimator on this data: a DataFrame indexed by estimator with its `family`,
        `verdict` ("trustworthy", "use with care" or "uninformative") and `reason` (plain sentences).

        Read from the results' diagnostics (effective sample size of the importance weights, interval widths
        against the spread between policies, FQE's ensemble spread, the behaviour model's over-fitting,
        unsupported actions) and, with true values, from `metrics()` (rank correlation, regret, coverage).
        """
        import pandas as pd

        rows = {}
        for name, a in self._assessments().items():
            rows[name] = {"family": _FAMILIES[a.family][0], "verdict": _VERDICTS[a.verdict],
                          "reason": "; ".join(a.all_reasons()) if a.verdict else a.why(),
                          "policies_uninformative": ", ".join(a.bad_policies)}
        frame = pd.DataFrame.from_dict(rows, orient="index")
        frame.index.name = "estimator"
        return frame

    def summary(self) -> str:
        """The report in words: which policy is best and by how much, and which estimators to trust and why."""
        paragraphs = self._summary_paragraphs()
        lines = []
        for item in paragraphs:
            if isinstance(item, list):
                lines.extend(f"- {text}" for text in item)
            else:
                lines.append(item)
        return "\n".join(lines)

    def _metrics_or_none(self) -> Any:
        if self.true_values is None:
            return None
        try:
            return self.metrics()
        except ValueError:  # e.g. a non-finite estimate: no metrics, the rest of the report stands
            return None

    def _true_std_errors(self) -> dict[str, float]:
        se = self.metadata.get("true_value_std_error")
        if not isinstance(se, Mapping):
            return {}
        return {str(k): float(v) for k, v in se.items() if _finite(v)}

    def _unit(self) -> tuple[str, str]:
        """('episodes', 'episode') for episodic estimators, ('rounds', 'round') for bandit logs."""
        episodic = any("horizon" in r.diagnostics for per in self.results.values() for r in per.values())
        return ("episodes", "episode") if episodic else ("rounds", "round")

    def _horizon(self) -> int | None:
        for per_policy in self.results.values():
            for r in per_policy.values():
                h = r.diagnostics.get("horizon")
                if isinstance(h, (int, np.integer)) and h > 0:
                    return int(h)
        return None

    def _level(self) -> str:
        first = next(iter(next(iter(self.results.values())).values()))
        return f"{100 * (1 - first.alpha):g}% {first.interval}".strip()

    def _assessments(self) -> dict[str, "_Assessment"]:
        metrics = self._metrics_or_none()
        units, unit = self._unit()
        horizon = self._horizon()
        out: dict[str, _Assessment] = {}
        for estimator in self.estimators:
            results = {p: per[estimator] for p, per in self.results.items() if estimator in per}
            first = next(iter(results.values()))
            family = estimator_family(estimator, first.diagnostics)
            a = _Assessment(estimator, family)
            values = np.array([r.value for r in results.values()], np.float64)
            finite_values = values[np.isfinite(values)]
            spread = float(np.ptp(finite_values)) if len(finite_values) > 1 else 0.0
            levels: dict[str, int] = {p: 0 for p in results}
            unbounded = [p for p, r in results.items() if not (_finite(r.ci_low) and _finite(r.ci_high))]
            # importance weights: effective sample size
            ess = {p: float(r.diagnostics["ess"]) for p, r in results.items() if _finite(r.diagnostics.get("ess"))}
            n = int(first.diagnostics.get("n", 0) or 0)
            if ess:
                for p, e in ess.items():
                    frac = e / n if n else 1.0
                    levels[p] = 2 if (e < 3 or (frac < 0.02 and e < 30)) else 1 if (e < 10 or (frac < 0.1 and e < 100)) else 0
                low_ess = [p for p in ess if levels[p] > 0]
                e_values = np.array(list(ess.values()))
                ess_text = _about(float(np.median(e_values)))
                spread_text = (f" ({_html.fmt(e_values.min(), 2)} to {_html.fmt(e_values.max(), 2)} across the "
                               f"{len(e_values)} policies)" if len(e_values) > 1 and np.ptp(e_values) >= 0.5 else "")
                steps = f"on these {horizon}-step {units}, " if horizon and horizon >= 20 else ""
                core = f"{steps}the effective sample size of the importance weights is about {ess_text} of {n}{spread_text}"
                worst = max(levels.values())
                if family == "dr" and low_ess:
                    dm = {p: r.diagnostics.get("dm_value") for p, r in results.items()}
                    gaps = [abs(r.value - float(dm[p])) / max(abs(float(dm[p])), 1e-12) for p, r in results.items()
                            if _finite(dm[p])]
                    close = bool(gaps) and float(np.median(gaps)) < 0.05
                    if close:
                        for p in low_ess:
                            levels[p] = 1
                        a.reasons.append((1, f"{core}, so the importance-weighted correction is close to nothing: "
                                             f"the estimate stays within {_html.fmt(100 * float(np.median(gaps)), 2)}% "
                                             f"of the fitted model's value and adds no evidence of its own"))
                    else:
                        a.reasons.append((max(levels[p] for p in low_ess),
                                          f"{core}, so the weighted part of each estimate rests on "
                                          f"{_rest_on(float(np.median(e_values)), unit)}"))
                elif worst > 0:
                    a.reasons.append((max(levels[p] for p in low_ess),
                                      f"{core}, so the weighted part of each estimate rests on "
                                      f"{_rest_on(float(np.median(e_values)), unit)}"))
                else:
                    text = f"the effective sample size of the importance weights is about {ess_text} of {n} {units}"
                    a.positives.append((text, text))
            if unbounded:
                for p in unbounded:
                    levels[p] = 2
                note = first.diagnostics.get("interval_note", "")
                why = " (a self-normalised estimate with an effective sample size below 2 has none)" if "below 2" in str(note) else ""
                which = "for any policy" if len(unbounded) == len(results) else f"for {_html.join_words(unbounded)}"
                a.reasons.append((2, f"no finite interval is given {which}{why}"))
            # the estimator's own uncertainty against the differences it must resolve
            widths = np.array([r.ci_high - r.ci_low for r in results.values() if _finite(r.ci_low) and _finite(r.ci_high)])
            if len(results) > 1 and spread > 0 and len(widths) and float(np.median(widths)) > spread:
                a.raise_to(1, f"the intervals (typically {_html.fmt(float(np.median(widths)))} wide) are wider than "
                              f"the spread of the estimates across the policies ({_html.fmt(spread)}), so the "
                              f"policies cannot be told apart")
            elif len(results) > 1 and spread > 0 and len(widths) == len(results):
                a.positives.append(("the intervals are narrow next to the differences between the policies",
                                    f"the intervals (typically {_html.fmt(float(np.median(widths)))} wide) are narrow "
                                    f"next to the spread of the estimates across the policies ({_html.fmt(spread)})"))
            ens = np.array([float(r.diagnostics["ensemble_std"]) for r in results.values()
                            if _finite(r.diagnostics.get("ensemble_std"))])
            if family == "model":
                text = "no importance weights are used, so long episodes and rare actions cannot make the estimate collapse"
                a.positives.insert(0, (text, text))
            if family == "marginal":
                self._assess_marginal(a, results)
            if len(ens) and np.max(ens) > 0:
                if len(results) > 1 and spread > 0 and float(np.median(ens)) > 0.5 * spread:
                    a.raise_to(1, f"the ensemble members disagree by about {_html.fmt(float(np.median(ens)))}, "
                                  f"large next to the spread between the policies ({_html.fmt(spread)})")
                else:
                    a.positives.append(("the ensemble members agree",
                                        f"the ensemble members agree within {_html.fmt(float(np.median(ens)))} "
                                        f"(median standard deviation)"))
            mass = max((float(r.diagnostics.get("unsupported_mass") or 0.0) for r in results.values()), default=0.0)
            if mass > 0.01:
                a.raise_to(1, f"a policy puts up to {mass:.0%} of its action probability where the data has no "
                              f"actions; importance weights cannot see that part")
            heldout = first.diagnostics.get("behavior_heldout_loglik")
            insample = first.diagnostics.get("behavior_insample_loglik")
            if family in ("is", "pdis", "dr") and _finite(heldout) and _finite(insample) and insample - heldout > 1.0:
                a.raise_to(1, f"the estimated behaviour policy over-fits (log-likelihood {_html.fmt(insample)} nats per "
                              f"transition in-sample, {_html.fmt(heldout)} held-out), which biases the weights")
            if first.diagnostics.get("interval_guaranteed") is False:
                a.notes.append("the intervals use the observed range of the weights or rewards (no guaranteed bound "
                               "was given), so they can be too narrow")
            a.diag_verdict = max(a.verdict, sorted(levels.values(), reverse=True)[(len(levels) + 1) // 2 - 1])
            # against the true values
            if metrics is not None and estimator in metrics.index:
                row = metrics.loc[estimator]
                a.truth = _truth_text(row, self.k, len(results))
                rho = float(row.get("spearman", np.nan))
                regret = float(row.get(f"regret@{self.k}", np.nan))
                rel = float(row.get("relative_error", np.nan))
                coverage = float(row.get("coverage", np.nan))
                if len(results) >= 3 and _finite(rho) and rho < 0.5:
                    a.raise_truth(1, f"against the true values the policies are ranked poorly (Spearman {rho:.2f})")
                if _finite(regret) and regret > 0.25:
                    a.raise_truth(1, f"against the true values, choosing by these estimates loses {regret:.0%} of the "
                                     f"range between the worst and the best policy (regret@{self.k})")
                if _finite(rel) and rel > 0.5:
                    a.raise_truth(1, f"against the true values the estimates are off by {rel:.0%} on average")
                if len(results) >= 2 and _finite(coverage) and coverage < 0.5:
                    covered = int(round(coverage * len(results)))
                    a.raise_truth(1, f"the intervals are too narrow: they contain only {covered} of the "
                                     f"{len(results)} true values")
            a.levels = levels
            ordered = sorted(levels.values(), reverse=True)
            a.verdict = max(a.verdict, ordered[(len(ordered) + 1) // 2 - 1])
            a.bad_policies = [p for p, lv in levels.items() if lv == 2] if a.verdict < 2 else []
            out[estimator] = a
        return out

    @staticmethod
    def _assess_marginal(a: "_Assessment", results: Mapping[str, OPEResult]) -> None:
        """Learned occupancy ratios: their mass, sign and spread say whether the feature class fits the data."""
        text = "the weights are learned occupancy ratios, with no product over steps"
        a.positives.insert(0, (text, text))
        mass = {p: float(r.diagnostics["ratio_mass"]) for p, r in results.items() if _finite(r.diagnostics.get("ratio_mass"))}
        off = [p for p, m in mass.items() if abs(m - 1.0) > 0.2]
        if off:
            worst = max(off, key=lambda p: abs(mass[p] - 1.0))
            a.raise_to(1, f"the learned ratios' total mass is {_html.fmt(mass[worst], 2)} of the 1.0 it must be "
                          f"(for {_html.join_words(off)}): the features cannot express the occupancy ratio or the data "
                          f"do not cover the policy")
        negative = {p: float(r.diagnostics.get("negative_weight_share") or 0.0) for p, r in results.items()}
        if max(negative.values(), default=0.0) > 0.1:
            a.raise_to(1, f"up to {max(negative.values()):.0%} of the learned ratios are negative, which a density "
                          f"ratio cannot be")
        frac = [float(r.diagnostics["ess_fraction"]) for r in results.values() if _finite(r.diagnostics.get("ess_fraction"))]
        if frac and min(frac) < 0.01:
            a.raise_to(1, f"the ratios concentrate on few transitions (effective sample size down to "
                          f"{min(frac):.1%} of the transitions)")

    def _chosen_estimator(self) -> str:
        """The most trustworthy estimator: best verdict, then fitted models before DR before IS, then report order."""
        assessed = self._assessments()
        order = {"model": 0, "dr": 1, "marginal": 1, "is": 2, "pdis": 2, "other": 3}
        names = self.estimators
        return min(names, key=lambda e: (assessed[e].verdict, order[assessed[e].family], names.index(e)))

    def _weights_text(self) -> str:
        """Why the importance weights collapsed (or exploded), from the log of the largest weight; '' if they did not."""
        logs = [float(r.diagnostics["log_max_weight"]) for per in self.results.values() for r in per.values()
                if _finite(r.diagnostics.get("log_max_weight"))]
        if not logs:
            return ""
        unit = self._unit()[1]
        top = max(logs)
        if top < math.log(1e-3):
            raw_zero = any(re.search(r"max weight 0(?![.\d])", str(r.diagnostics.get("warning", "")))
                           for per in self.results.values() for r in per.values())
            horizon = self._horizon()
            over = f"over {horizon} steps " if horizon else ""
            text = (f"Why the weights fail here: every {unit}'s importance weight is vanishingly small (the largest "
                    f"is about {_power_of_ten(top)}). An {unit}'s weight multiplies one probability ratio per step, "
                    f"and the evaluated policies rarely take actions close to the logged ones, so {over}the products "
                    f"collapse and whichever weight is least small decides the estimate.")
            plain = [e for e in self.estimators if e.lower() in ("is", "pdis", "ipw")]
            if plain:
                text += (f" {_html.join_words(plain)} {'does' if len(plain) == 1 else 'do'} not renormalise the "
                         f"weights, so {'its' if len(plain) == 1 else 'their'} estimates are pulled towards 0.")
            if raw_zero:
                text += (" The raw warnings' \"max weight 0\" is that largest weight rounded to zero: tiny in "
                         "absolute terms, yet still far larger than all the others.")
            return text
        if top > math.log(1e6):
            return (f"The largest {unit} weight is about {_power_of_ten(top)}: a single {unit} can outweigh all the "
                    f"others.")
        return ""

    def _summary_paragraphs(self) -> list[Any]:
        """Sentences (str) and one bullet list (list[str]) for the summary box and `summary()`."""
        assessed = self._assessments()
        chosen = self._chosen_estimator()
        verdict = assessed[chosen].verdict
        est = self.estimates(chosen)
        policies = list(est)
        level = self._level()
        paragraphs: list[Any] = []
        res = {p: self.results[p][chosen] for p in policies}
        if len(policies) == 1:
            p = policies[0]
            paragraphs.append(f"{chosen} estimates the value of {p} at {_interval(res[p])} ({level} interval).")
        else:
            ranked = sorted(policies, key=lambda p: -est[p])
            best, second = ranked[0], ranked[1]
            why = ("the most trustworthy estimator here" if verdict == 0 else
                   "the least doubtful estimator here, though none is fully trustworthy on this data" if verdict == 1
                   else "though no estimator is trustworthy on this data, so this ranking is a guess")
            text = (f"{best} looks best of the {len(policies)} policies by {chosen}, {why}: {_interval(res[best])}, "
                    f"against {_interval(res[second])} for the runner-up, {second} (estimate [{level} interval] "
                    f"of the discounted value).")
            if res[best].ci_low > res[second].ci_high:
                text += " Its interval lies above the runner-up's, so the order is clear."
            else:
                text += " The two intervals overlap, so the data do not settle which of the two is better."
            others = [e for e in self.estimators if e != chosen and assessed[e].verdict < 2
                      and len(self.estimates(e)) == len(policies)]
            agree = [e for e in others if max(self.estimates(e), key=self.estimates(e).get) == best]
            disagree = {e: max(self.estimates(e), key=self.estimates(e).get) for e in others if e not in agree}
            if agree:
                text += f" {_html.join_words(agree)} {'agrees' if len(agree) == 1 else 'agree'}."
            for e, p in disagree.items():
                text += f" {e} prefers {p}."
            paragraphs.append(text)
            baseline = next((p for p in policies if p != best and _is_bc(p)), None)
            compare = []
            if baseline is not None:
                diff = est[best] - est[baseline]
                compare.append(f"{best} is estimated {_html.fmt(abs(diff))} {'above' if diff >= 0 else 'below'} "
                               f"BC ({baseline}: {_interval(res[baseline])})")
            data_value = self.metadata.get("data value")
            if _finite(data_value):
                diff = est[best] - float(data_value)
                compare.append(f"{_html.fmt(abs(diff))} {'above' if diff >= 0 else 'below'} the logged "
                               f"{self._unit()[0]}' own discounted return ({_html.fmt(float(data_value))})")
            if compare:
                paragraphs.append(f"By {chosen}, " + "; and ".join(compare) + ".")
        if self.true_values is not None:
            truth = self.true_values
            true_best = max(truth, key=truth.get)
            se = self._true_std_errors()
            how = self.metadata.get("true values")
            source = f" ({how})" if how else ""

            def shown(p: str) -> str:
                return _html.fmt(truth[p]) + (f" ± {_html.fmt(se[p])}" if p in se else "")

            if len(policies) == 1:
                paragraphs.append(f"Its true value{source} is {shown(policies[0])}.")
            else:
                picked = max(est, key=est.get)
                if picked == true_best:
                    paragraphs.append(f"The true values{source} confirm it: {picked} {shown(picked)}, the best.")
                else:
                    paragraphs.append(f"By the true values{source} the best is {true_best} ({shown(true_best)}); "
                                      f"{picked}'s true value is {shown(picked)}.")
        groups: dict[int, dict[str, list[str]]] = {0: {}, 1: {}, 2: {}}
        for name, a in assessed.items():
            why = a.why()
            # the true values said more than the diagnostics: say that too
            truth = next((t for _, t in a.truth_reasons if t != why), "") if a.verdict > a.diag_verdict else ""
            groups[a.verdict].setdefault(why + (f"; and {truth}" if truth else ""), []).append(name)
        bullets = []
        for v, label in ((0, "Trustworthy here"), (1, "Use with care"), (2, "Uninformative here")):
            for why, names in groups[v].items():
                bullets.append(f"{label}: {_html.join_words(names)}" + (f", because {why}." if why else "."))
        paragraphs.append(bullets)
        return paragraphs

    # ------------------------------------------------------------------ HTML
    def _figure_estimates(self) -> str:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        assessed = self._assessments()
        policies, estimators = self.policies, self.estimators
        width = 0.8 / max(len(estimators), 1)
        fig, ax = plt.subplots(figsize=(max(9.0, 1.3 * len(policies) + 3), 4.8))
        x = np.arange(len(policies))
        unbounded_x = []
        for j, est in enumerate(estimators):
            vals, lows, highs, xs = [], [], [], []
            for i, p in enumerate(policies):
                r = self.results[p].get(est)
                if r is None:
                    continue
                xs.append(x[i] - 0.4 + width * (j + 0.5))
                vals.append(r.value)
                lows.append(r.value - r.ci_low if _finite(r.ci_low) else 0.0)
                highs.append(r.ci_high - r.value if _finite(r.ci_high) else 0.0)
                if not (_finite(r.ci_low) and _finite(r.ci_high)):
                    unbounded_x.append((xs[-1], j))
            faded = assessed[est].verdict == 2
            label = est + (" (uninformative)" if faded else "")
            ax.errorbar(xs, vals, yerr=[lows, highs], fmt="o", capsize=3, label=label, color=f"C{j}",
                        alpha=0.35 if faded else 1.0, mfc="none" if faded else f"C{j}")
        for xv, j in unbounded_x:
            ax.axvline(xv, color=f"C{j}", ls=":", lw=1, alpha=0.6)
        if self.true_values is not None:
            ax.scatter(x, [self.true_values[p] for p in policies], marker="_", s=1400, linewidths=2.5, color="black",
                       zorder=5, label="true value")
        ax.set_xticks(x)
        ax.set_xticklabels(policies, rotation=20 if len(policies) > 6 else 0, ha="right" if len(policies) > 6 else "center")
        ax.set_ylabel("estimated discounted value")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=9, ncol=min(6, len(estimators) + 1), loc="upper center", bbox_to_anchor=(0.5, -0.1),
                  frameon=False)
        fig.tight_layout()
        return _html.png_base64(fig, dpi=110)

    def _figure_scatter(self) -> str:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        assessed = self._assessments()
        estimators = self.estimators
        n = len(estimators)
        cols = min(n, 3)
        rows = math.ceil(n / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(3.7 * cols, 3.3 * rows), squeeze=False)
        metrics = self._metrics_or_none()
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
            rho = metrics.loc[est, "spearman"] if metrics is not None and est in metrics.index else float("nan")
            ax.set_title(f"{est}: {_VERDICTS[assessed[est].verdict]}, Spearman {rho:.2f}", fontsize=9.5)
            ax.set_xlabel("true value")
            ax.set_ylabel("estimate")
        for ax in axes.ravel()[n:]:
            ax.axis("off")
        fig.tight_layout()
        return _html.png_base64(fig, dpi=100)

    def _figure_cdfs(self, estimator: str) -> str:
        """Every policy's estimated return CDF by one distributional estimator, on one axis."""
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8.5, 4.4))
        low = min(float(per[estimator].grid[0]) for per in self.distributions.values() if estimator in per)
        high = max(float(per[estimator].grid[-1]) for per in self.distributions.values() if estimator in per)
        pad = 0.03 * max(high - low, 1e-9)
        for j, (policy, per_policy) in enumerate(self.distributions.items()):
            dist = per_policy.get(estimator)
            if dist is None:
                continue
            x = np.concatenate([[low - pad], dist.grid, [high + pad]])
            y = np.concatenate([[0.0], dist.cdf, [dist.cdf[-1]]])
            # beyond ten policies the colours repeat: the line style then tells them apart
            ax.step(x, y, where="post", color=f"C{j % 10}", ls=("-", "--", ":")[(j // 10) % 3], lw=1.6, label=policy)
        ax.set_xlabel("discounted return")
        ax.set_ylabel("estimated P(return <= x)")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(estimator, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9, loc="upper left", frameon=False)
        fig.tight_layout()
        return _html.png_base64(fig, dpi=100)

    def _distribution_table_html(self) -> str:
        """Mean, variance, CVaR and interquartile range of each policy's return, per distributional estimator."""
        alphas = sorted({float(d.cvar_alpha) for per in self.distributions.values() for d in per.values()})
        cvar_head = f"CVaR {alphas[0]:.0%}" if len(alphas) == 1 else "CVaR"
        header = ["policy", "estimator", "mean", "variance", cvar_head, "interquartile range"]
        rows = []
        for policy, per_policy in self.distributions.items():
            for estimator, dist in per_policy.items():
                stats = _distribution_statistics(dist)
                cells = []
                for statistic in ("mean", "variance", "cvar", "iqr"):
                    value, low, high = stats[_statistic_key(dist, statistic)]
                    cell = (_html.interval_cell(value, low, high) if _finite(low) and _finite(high)
                            else _html.esc(_html.fmt(value)))
                    if statistic == "cvar" and len(alphas) > 1:
                        cell += f" <span class='ci'>(worst {float(dist.cvar_alpha):.0%})</span>"
                    cells.append(cell)
                rows.append([_html.esc(policy), _html.esc(estimator)] + cells)
        levels = sorted({float(d.alpha) for per in self.distributions.values() for d in per.values()})
        level = ", ".join(f"{100 * (1 - a):g}%" for a in levels)
        worst = f"the worst {alphas[0]:.0%}" if len(alphas) == 1 else "the worst share of returns given in the cell"
        caption = (f"Each policy's discounted return read from its estimated distribution: mean, variance, CVaR (the "
                   f"mean of {worst} of returns; higher is safer) and interquartile range (the spread of the middle "
                   f"half), each as value [low, high] with {level} percentile-bootstrap intervals over episodes. "
                   f"select(risk='cvar') ranks the policies by the CVaR.")
        return _html.table(header, rows, caption=_html.esc(caption), numeric=[False, False, True, True, True, True])

    def _estimates_table_html(self) -> str:
        assessed = self._assessments()
        se = self._true_std_errors()
        header = ["policy"]
        if self.true_values is not None:
            header.append("true value")
        for e in self.estimators:
            a = assessed[e]
            header.append(f"{_html.esc(e)}<span class='sub {_CSS[a.verdict]}'>{_VERDICTS[a.verdict]}</span>")
        best_of = {}
        for e in self.estimators:
            values = self.estimates(e)
            if assessed[e].verdict < 2 and len(values) > 1:
                best_of[e] = max(values, key=values.get)
        rows = []
        for p, per_policy in self.results.items():
            row = [_html.esc(p)]
            if self.true_values is not None:
                row.append(_html.esc(_html.fmt(self.true_values[p]) + (f" ± {_html.fmt(se[p])}" if p in se else "")))
            for e in self.estimators:
                r = per_policy.get(e)
                if r is None:
                    row.append("")
                    continue
                cell = _html.interval_cell(r.value, r.ci_low, r.ci_high)
                if best_of.get(e) == p:
                    cell = f"<b>{cell}</b>"
                if assessed[e].levels.get(p, 0) == 2:
                    cell = f"<span class='dim'>{cell}</span>"
                row.append(cell)
            rows.append(row)
        level = self._level()
        truth = ""
        if self.true_values is not None:
            truth = (" True value: " + _html.esc(self.metadata.get("true values", "from on-policy roll-outs"))
                     + (", ± its standard error" if se else "") + ".")
        caption = (f"Each cell: the estimate of the policy's discounted value and its {_html.esc(level)} interval, "
                   f"as value [low, high]. Bold: the highest estimate of each estimator that is not uninformative; "
                   f"grey: estimates judged uninformative (see below).{truth}")
        numeric = [False] + [True] * (len(header) - 1)
        return _html.table(header, rows, caption=caption, numeric=numeric)

    def _trust_html(self) -> str:
        """A verdict table (one row per estimator), then one paragraph per estimator family: what its estimators
        do, why they are (not) to be trusted here, and the warnings they raised, each said once."""
        assessed = self._assessments()
        metrics = self._metrics_or_none()
        units, unit = self._unit()
        n_policies = len(self.policies)
        header = ["estimator", "verdict", "effective sample size"]
        if metrics is not None:
            header += ["Spearman", f"regret@{self.k}", "intervals containing the true value", "mean relative error"]
        rows = []
        for name, a in assessed.items():
            ess = [float(self.results[p][name].diagnostics["ess"]) for p in self.policies
                   if name in self.results[p] and _finite(self.results[p][name].diagnostics.get("ess"))]
            n = next((self.results[p][name].diagnostics.get("n") for p in self.policies if name in self.results[p]), None)
            ess_text = (f"{_about(float(np.median(ess)))} of {n}" if ess and n else
                        "no weights" if a.family == "model" else "n/a")
            row = [_html.esc(name),
                   f"<span class='{_CSS[a.verdict]}'>{_VERDICTS[a.verdict]}</span>"
                   f"<span class='sub'>{_html.esc(_FAMILIES[a.family][0])}</span>", _html.esc(ess_text)]
            if metrics is not None:
                m = metrics.loc[name] if name in metrics.index else {}
                coverage = m.get("coverage", np.nan)
                rel = m.get("relative_error", np.nan)
                row += [_html.esc(_html.fmt(m.get("spearman", np.nan), 3)),
                        _html.esc(_html.fmt(m.get(f"regret@{self.k}", np.nan), 3)),
                        _html.esc(f"{int(round(float(coverage) * n_policies))} of {n_policies}" if _finite(coverage) else "n/a"),
                        _html.esc(f"{100 * float(rel):.0f}%" if _finite(rel) else "n/a")]
            rows.append(row)
        caption = (f"Verdicts read from each estimator's diagnostics: the effective sample size of its importance "
                   f"weights (median over the policies, of the {units} used), its interval widths against the "
                   f"differences between the policies, its ensemble spread, the behaviour model's fit")
        if metrics is not None:
            caption += (f"; and from the true values: Spearman's rank correlation of the estimates with them (1: the "
                        f"same order), regret@{self.k} (the true value lost by choosing the top-{self.k} by the "
                        f"estimate, as a share of the range from the worst to the best policy; 0: no loss), how many "
                        f"intervals contain the true value, and the mean relative error")
        parts = [_html.table(header, rows, caption=_html.esc(caption) + ".",
                             numeric=[False, False] + [True] * (len(header) - 2))]
        families: dict[str, list[str]] = {}
        for name, a in assessed.items():
            families.setdefault(a.family, []).append(name)
        parts.append("<h3>Why, by estimator family</h3>")
        explained_weights = False
        for family, names in families.items():
            title, what = _FAMILIES[family]
            verdicts = {assessed[n].verdict for n in names}
            if len(verdicts) == 1:
                v = verdicts.pop()
                head = f"<span class='{_CSS[v]}'>{_VERDICTS[v]}</span>"
            else:
                head = ", ".join(f"{_html.esc(n)} <span class='{_CSS[assessed[n].verdict]}'>"
                                 f"{_VERDICTS[assessed[n].verdict]}</span>" for n in names)
            plural = len(names) > 1
            intro = what.format(They="They" if plural else "It", they="they" if plural else "it",
                                s="" if plural else "s", unit=unit) + "." if what else ""
            said: dict[str, list[str]] = {}
            for n in names:
                a = assessed[n]
                if not a.verdict:
                    texts = [long for _, long in a.positives[:3]] or [a.why()]
                else:
                    texts = [t for _, t in a.reasons]
                    if a.verdict > a.diag_verdict or not texts:  # the true values decided it: say how
                        texts += [t for _, t in a.truth_reasons]
                for t in texts + a.notes:
                    said.setdefault(t, []).append(n)
            items = []
            for text, who in said.items():
                everyone = len(who) == len(names)
                body = text
                prefix = "" if everyone else f"{_html.join_words(who)}: "
                items.append(_html.esc(prefix + body[0].upper() + body[1:] + "."))
            for n in names:
                if assessed[n].bad_policies:
                    items.append(_html.esc(f"{n} is uninformative for {_html.join_words(assessed[n].bad_policies)}."))
            weights = "" if explained_weights else self._weights_text()
            if weights and family in ("is", "pdis", "dr"):
                items.append(_html.esc(weights))
                explained_weights = True
            warned = self._family_warnings(family)
            if warned:
                items.append("Warnings raised: " + "; ".join(
                    f"\u201c{_html.esc(msg)}\u201d ({_html.esc(_html.join_words(ests))}, "
                    f"{_html.esc(_policies_text(pols, n_policies))})" for msg, ests, pols in warned) + ".")
            parts.append(f"<p class='family'><b>{_html.esc(title[0].upper() + title[1:])} "
                         f"({_html.esc(_html.join_words(names))}):</b> {head}. {_html.esc(intro)}</p>"
                         + ("<ul class='reasons'>" + "".join(f"<li>{i}</li>" for i in items) + "</ul>" if items else ""))
        return "".join(parts)

    def _family_warnings(self, family: str) -> list[tuple[str, list[str], list[str]]]:
        """The estimators' own warnings in this family, each core message once (without its numbers)."""
        grouped: dict[str, tuple[list[str], list[str]]] = {}
        for policy, per_policy in self.results.items():
            for name, r in per_policy.items():
                text = r.diagnostics.get("warning")
                if not text or estimator_family(name, r.diagnostics) != family:
                    continue
                for part in str(text).split("; "):
                    core = re.sub(r"\s*\((effective sample size|log weight)[^)]*\)\s*$", "", part).strip()
                    ests, pols = grouped.setdefault(core, ([], []))
                    if name not in ests:
                        ests.append(name)
                    if policy not in pols:
                        pols.append(policy)
        return [(msg, ests, pols) for msg, (ests, pols) in grouped.items()]

    def _settings_html(self) -> str:
        items = []
        for key, value in self.metadata.items():
            if key == "true_value_std_error":
                continue  # shown next to each true value
            items.append(f"<li><b>{_html.esc(key)}</b>: {_html.esc(_setting_text(value))}</li>")
        behaviour = self._behaviour_summary()
        if behaviour and "behaviour policy" not in self.metadata:
            items.append(f"<li>{_html.esc(behaviour)}</li>")
        elif behaviour and "log-likelihood" in behaviour and "log-likelihood" not in str(self.metadata["behaviour policy"]):
            items.append(f"<li>{_html.esc(behaviour)}</li>")
        return f"<ul class='settings'>{''.join(items)}</ul>" if items else ""

    def _raw_html(self) -> str:
        frame = self.to_frame()
        warnings_col = frame.pop("warning") if "warning" in frame else None
        constant = [c for c in frame.columns if c not in ("policy", "estimator") and frame[c].nunique(dropna=False) == 1]
        same = ", ".join(f"{c} {_setting_text(frame[c].iloc[0])}" for c in constant)
        shown = frame.drop(columns=constant)
        inner = (f"<p>The same for every row: {_html.esc(same)}.</p>" if same else "") + _html.raw_table(shown)
        parts = [_html.details("All numbers: one row per policy and estimator", inner)]
        if warnings_col is not None:
            grouped: dict[str, list[str]] = {}
            for (policy, estimator), text in zip(zip(frame["policy"], frame["estimator"]), warnings_col):
                if isinstance(text, str) and text:
                    grouped.setdefault(text, []).append(f"{policy} / {estimator}")
            if grouped:
                items = "".join(f"<li>{_html.esc(msg)} <span class='dim'>({_html.esc(', '.join(who))})</span></li>"
                                for msg, who in grouped.items())
                parts.append(_html.details("The estimators' warnings as they wrote them", f"<ul>{items}</ul>"))
        return "".join(parts)

    def summary_html(self) -> str:
        """`summary()` as HTML paragraphs and a list (no box), e.g. for another page's summary."""
        items = []
        for item in self._summary_paragraphs():
            if isinstance(item, list):
                items.append("<ul>" + "".join(f"<li>{_html.esc(t)}</li>" for t in item) + "</ul>")
            else:
                items.append(f"<p>{_html.esc(item)}</p>")
        return "".join(items)

    def section_html(self, level: int = 2) -> str:
        """The estimates table and which estimators to trust (with the grouped warnings), as HTML under headings
        of `level`, without plots: for embedding in another page (the quickstart's report.html)."""
        h, sub = f"h{level}", f"h{level + 1}"
        distributions = (f"<{h}>Return distributions</{h}>" + self._distribution_table_html()
                         if self.distributions else "")
        return (f"<{h}>Estimates</{h}>" + self._estimates_table_html() + distributions
                + f"<{h}>Which estimators to trust, and why</{h}>"
                + self._trust_html().replace("<h3>", f"<{sub}>").replace("</h3>", f"</{sub}>"))

    def to_html(self, path: str | os.PathLike, title: str = "Off-policy evaluation report") -> None:
        """A self-contained page (inline CSS and base64 PNGs, no network fetches, no scripts) made for reading:
        a summary in words first, one row per policy with "value [low, high]" per estimator, which estimators to
        trust and why (warnings grouped per estimator family), captioned plots, the settings, and every number in
        collapsed blocks.  It fits a 1280-px-wide window without scrolling sideways."""
        level = self._level()
        parts = ["<section class='summary' id='summary'><h2>Summary</h2>" + self.summary_html() + "</section>",
                 self.section_html(level=2)]
        parts.append("<h2>Plots</h2>")
        truth = "; black bars: the true values" if self.true_values is not None else ""
        parts.append(f"<figure><img alt='estimates with intervals per policy' "
                     f"src='data:image/png;base64,{self._figure_estimates()}'><figcaption>Figure 1. Each policy's "
                     f"estimates with their {_html.esc(level)} intervals{truth}. Faded, hollow markers: estimators "
                     f"judged uninformative on this data; dotted vertical lines: estimates without a finite interval."
                     f"</figcaption></figure>")
        if self.true_values is not None:
            parts.append(f"<figure><img alt='estimated against true values' "
                         f"src='data:image/png;base64,{self._figure_scatter()}'><figcaption>Figure 2. Each "
                         f"estimator's estimates against the true values, one point per policy, with intervals; "
                         f"dashed: estimate = true value. An estimator that ranks the policies well keeps the points "
                         f"rising from left to right (its Spearman correlation is in the title).</figcaption></figure>")
        number = 3 if self.true_values is not None else 2
        for estimator in self.distribution_estimators:
            parts.append(f"<figure><img alt='estimated return distributions by {_html.esc(estimator)}' "
                         f"src='data:image/png;base64,{self._figure_cdfs(estimator)}'><figcaption>Figure {number}. "
                         f"The cumulative distribution function of each policy's discounted return, estimated by "
                         f"{_html.esc(estimator)}: the share of episodes whose return is at most x. A curve further "
                         f"right is better; a curve that rises early has a risk of low returns (its CVaR, the mean "
                         f"of the worst returns, is in the return-distribution table).</figcaption></figure>")
            number += 1
        settings = self._settings_html()
        if settings:
            parts += ["<h2>Settings</h2>", settings]
        parts.append(self._raw_html())
        with atomic_write_path(path, suffix=".html") as tmp:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(_html.page(title, parts))

    def _repr_html_(self) -> str:
        return f"<div>{self.summary_html()}{self._estimates_table_html()}</div>"


# ---------------------------------------------------------------------- reading aids
_VERDICTS = ("trustworthy", "use with care", "uninformative")
_CSS = ("good", "care", "bad")

# family -> (title, what its estimators do, in plain terms; '{unit}' is episode or round)
_FAMILIES = {
    "model": ("fitted models", "{They} learn{s} the evaluated policy's values (FQE) or a model of the environment (MB) "
                               "from the logged data and read{s} the value off it, with no importance weights; "
                               "{they} can be biased where a policy goes where the data does not"),
    "dr": ("doubly robust", "{They} start{s} from a fitted model's value and add{s} an importance-weighted correction "
                            "of its errors; the correction is only as informative as the weights"),
    "is": ("importance sampling", "{They} reweight{s} each logged {unit} by how much more or less likely the evaluated "
                                  "policy was to take its actions than the logging policy; unbiased with exact "
                                  "logging probabilities, but the weight of a whole {unit} is a product over its steps"),
    "pdis": ("per-decision importance sampling", "{They} reweight{s} each reward by the probability ratio of the "
                                                 "actions taken up to that step; less variance than whole-{unit} "
                                                 "weights, but the same product over steps"),
    "marginal": ("marginal importance sampling", "{They} reweight{s} each logged transition by a learned ratio of "
                                                 "the evaluated policy's state-action occupancy to the data's, so no "
                                                 "product over steps enters; the ratios are only as good as their "
                                                 "feature class and the data's coverage"),
    "other": ("other estimators", ""),
}
_FAMILY_OF_NAME = {"fqe": "model", "mb": "model", "dm": "model", "dr": "dr", "wdr": "dr", "sndr": "dr",
                   "switch-dr": "dr", "dr-os": "dr", "is": "is", "wis": "is", "ipw": "is", "snipw": "is",
                   "pdis": "pdis", "wpdis": "pdis", "mis": "marginal", "snmis": "marginal", "mdr": "marginal",
                   "mql": "model"}


def estimator_family(name: str, diagnostics: Mapping[str, Any] | None = None) -> str:
    """'model', 'dr', 'is', 'pdis', 'marginal' or 'other': by the estimator's short name, else by its diagnostics."""
    family = _FAMILY_OF_NAME.get(str(name).lower())
    if family is not None:
        return family
    diagnostics = diagnostics or {}
    if "dm_value" in diagnostics:
        return "dr"
    if "ess" in diagnostics:
        return "is"
    if "ensemble_std" in diagnostics or "member_values" in diagnostics:
        return "model"
    return "other"


class _Assessment:
    """One estimator's verdict: levels per policy (0 fine, 1 care, 2 uninformative), reasons, positives, notes."""

    def __init__(self, estimator: str, family: str) -> None:
        self.estimator = estimator
        self.family = family
        self.verdict = 0
        self.diag_verdict = 0  # before the true values
        self.reasons: list[tuple[int, str]] = []  # read from the diagnostics
        self.truth_reasons: list[tuple[int, str]] = []  # from the true values
        self.positives: list[tuple[str, str]] = []  # (short, with numbers)
        self.notes: list[str] = []
        self.levels: dict[str, int] = {}
        self.bad_policies: list[str] = []
        self.truth = ""

    def raise_to(self, level: int, text: str) -> None:
        self.verdict = max(self.verdict, level)
        self.reasons.append((level, text))

    def raise_truth(self, level: int, text: str) -> None:
        self.verdict = max(self.verdict, level)
        self.truth_reasons.append((level, text))

    def why(self) -> str:
        """The main reason for the verdict (the first at its level, diagnostics first), or the main positives."""
        if self.verdict > 0:
            for level, text in self.reasons + self.truth_reasons:
                if level >= self.verdict:
                    return text
            return (self.reasons + self.truth_reasons)[0][1]
        return _html.join_words([short for short, _ in self.positives[:3]]) if self.positives else \
            "no problem shows in the diagnostics"

    def all_reasons(self) -> list[str]:
        return [text for _, text in self.reasons + self.truth_reasons]


def _statistic_key(dist: Any, statistic: str) -> str:
    return f"cvar_{float(dist.cvar_alpha):g}" if statistic == "cvar" else statistic


def _distribution_statistics(dist: Any) -> dict[str, tuple[float, float, float]]:
    """A distribution's statistics with intervals; those it lacks (a distribution built by hand) computed, without."""
    stats = dict(getattr(dist, "statistics", {}) or {})
    computed = {"mean": dist.mean, "variance": dist.variance, _statistic_key(dist, "cvar"): dist.cvar,
                "iqr": dist.interquartile_range}
    for key, fn in computed.items():
        if key not in stats:
            stats[key] = (float(fn()), math.nan, math.nan)
    return stats


def _finite(value: Any) -> bool:
    try:
        return value is not None and not isinstance(value, bool) and math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _about(ess: float) -> str:
    return _html.fmt(ess, 2) if ess < 10 else f"{ess:.0f}"


def _rest_on(ess: float, unit: str) -> str:
    if ess < 1.5:
        return f"a single logged {unit}"
    if ess < 3:
        return f"one or two logged {unit}s"
    if ess < 10:
        return f"a handful of logged {unit}s"
    return f"about {ess:.0f} logged {unit}s"


def _power_of_ten(log_value: float) -> str:
    exponent = log_value / math.log(10)
    return f"10^{exponent:.0f}"


def _is_bc(name: str) -> bool:
    lower = name.lower()
    return lower == "bc" or re.match(r"bc[-_@ (\[]", lower) is not None


def _interval(r: OPEResult) -> str:
    return _html.interval_text(r.value, r.ci_low, r.ci_high)


def _policies_text(policies: list[str], total: int) -> str:
    if len(policies) == total and total > 1:
        return f"all {total} policies"
    return _html.join_words(policies)


def _truth_text(row: Any, k: int, n: int) -> str:
    parts = []
    rho = row.get("spearman", np.nan)
    if n >= 2 and _finite(rho):
        parts.append(f"Spearman {float(rho):.2f}")
    regret = row.get(f"regret@{k}", np.nan)
    if _finite(regret):
        parts.append(f"regret@{k} {_html.fmt(float(regret), 3)}")
    coverage = row.get("coverage", np.nan)
    if _finite(coverage):
        parts.append(f"intervals contain {int(round(float(coverage) * n))} of {n} true values")
    rel = row.get("relative_error", np.nan)
    if _finite(rel):
        parts.append(f"mean relative error {100 * float(rel):.0f}%")
    return ", ".join(parts)


def _setting_text(value: Any) -> str:
    if isinstance(value, Mapping):
        return ", ".join(f"{k} {_setting_text(v)}" for k, v in value.items())
    if isinstance(value, (float, np.floating)):
        return _html.fmt(float(value))
    return str(value)


def logged_value(dataset: Any, gamma: float, horizon: int | None = None) -> float:
    """The logged episodes' own mean discounted return (the data's value, to compare the policies with);
    put it in an OPEReport's metadata as "data value" and the summary says how the best policy compares."""
    from offrl.ope.results import check_gamma, check_horizon

    gamma = check_gamma(gamma)
    horizon = check_horizon(horizon)
    if dataset.n_episodes == 0:
        raise ValueError("the dataset has no episodes")
    t = dataset.timesteps()  # step within the episode, the Dataset's one place for it
    discounted = np.asarray(dataset.rewards, np.float64) * gamma ** t.astype(np.float64)
    if horizon is not None:
        discounted = np.where(t < horizon, discounted, 0.0)
    return float(np.add.reduceat(discounted, np.asarray(dataset.episode_starts[:-1])).mean())
