"""Metrics of OPE quality over a set of candidate policies (DOPE's and SCOPE-RL's definitions).

All take the estimated values and the true values of the same policies, in
the same order (arrays, or dicts keyed by policy name).

- `relative_error`: |V_hat - V| / |V|, per policy.
- `absolute_error`: |V_hat - V|, divided by (max V - min V) with normalize=True (DOPE).
- `mean_squared_error`: mean (V_hat - V)^2, divided by (max V - min V)^2 with normalize=True.
- `spearman_rank_correlation`: Spearman's rho between V_hat and V (ties get average ranks).
- `regret_at_k`: (max V - max of V over the top-k policies by V_hat) / (max V - min V)  (DOPE).
- `precision_at_k`: |top-k by V_hat  ∩  top-k by V| / k.
- `sharpe_ratio_at_k`: SCOPE-RL's SharpeRatio@k, the risk-return score of the top-k policies by V_hat:
  max(best@k - J(pi_b), 0) / std@k, with best@k and std@k (ddof=1, as SCOPE-RL's code) the maximum and
  standard deviation of the true values of those k policies and J(pi_b) the behaviour policy's value
  (nan for k = 1).
- `safety_errors`: with safe meaning value >= threshold,
  type I error rate = share of truly safe policies estimated unsafe,
  type II error rate = share of truly unsafe policies estimated safe
  (SCOPE-RL's convention; a rate is 0 when its denominator is empty).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
from scipy import stats

__all__ = [
    "relative_error",
    "absolute_error",
    "mean_squared_error",
    "normalized_mse",
    "spearman_rank_correlation",
    "regret_at_k",
    "precision_at_k",
    "sharpe_ratio_at_k",
    "safety_errors",
    "selection_metrics",
]


def _pair(estimates: Any, true_values: Any) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(estimates, Mapping) and isinstance(true_values, Mapping):
        missing = [k for k in estimates if k not in true_values]
        if missing:
            raise ValueError(f"true_values lacks policies {missing}")
        keys = list(estimates)
        est = np.array([float(estimates[k]) for k in keys])
        true = np.array([float(true_values[k]) for k in keys])
    else:
        est = np.asarray(list(estimates.values()) if isinstance(estimates, Mapping) else estimates, np.float64).reshape(-1)
        true = np.asarray(list(true_values.values()) if isinstance(true_values, Mapping) else true_values,
                          np.float64).reshape(-1)
    if len(est) != len(true):
        raise ValueError(f"estimates has {len(est)} policies but true_values has {len(true)}")
    if len(est) == 0:
        raise ValueError("no policies to compare")
    if not (np.all(np.isfinite(est)) and np.all(np.isfinite(true))):
        raise ValueError("estimates and true values must be finite")
    return est, true


def _value_range(true: np.ndarray) -> float:
    span = float(true.max() - true.min())
    if span <= 0:
        raise ValueError("all true values are equal, so the normalised metric is undefined")
    return span


def relative_error(estimates: Any, true_values: Any) -> np.ndarray:
    """|V_hat - V| / |V| per policy."""
    est, true = _pair(estimates, true_values)
    if np.any(true == 0):
        raise ValueError("relative error is undefined for a true value of 0; use absolute_error")
    return np.abs(est - true) / np.abs(true)


def absolute_error(estimates: Any, true_values: Any, normalize: bool = False) -> np.ndarray:
    """|V_hat - V| per policy, divided by the true values' range with normalize=True (DOPE)."""
    est, true = _pair(estimates, true_values)
    err = np.abs(est - true)
    return err / _value_range(true) if normalize else err


def mean_squared_error(estimates: Any, true_values: Any, normalize: bool = False) -> float:
    """mean (V_hat - V)^2; with normalize=True divided by (max V - min V)^2."""
    est, true = _pair(estimates, true_values)
    mse = float(np.mean((est - true) ** 2))
    return mse / _value_range(true) ** 2 if normalize else mse


def normalized_mse(estimates: Any, true_values: Any) -> float:
    return mean_squared_error(estimates, true_values, normalize=True)


def spearman_rank_correlation(estimates: Any, true_values: Any) -> float:
    """Spearman's rho between estimated and true values (nan for fewer than 2 policies or constant inputs)."""
    est, true = _pair(estimates, true_values)
    if len(est) < 2 or np.all(est == est[0]) or np.all(true == true[0]):
        return float("nan")
    return float(stats.spearmanr(est, true).statistic)


def _top_k(values: np.ndarray, k: int) -> np.ndarray:
    # stable: among ties, the earlier policy first
    return np.argsort(-values, kind="stable")[:k]


def _check_k(k: int, n: int) -> int:
    if int(k) < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    return min(int(k), n)


def regret_at_k(estimates: Any, true_values: Any, k: int = 1, normalize: bool = True) -> float:
    """(max V - max of V over the k policies with the highest V_hat), / (max V - min V) when normalize (DOPE)."""
    est, true = _pair(estimates, true_values)
    k = _check_k(k, len(est))
    regret = float(true.max() - true[_top_k(est, k)].max())
    return regret / _value_range(true) if normalize else regret


def precision_at_k(estimates: Any, true_values: Any, k: int = 1) -> float:
    """Share of the top-k policies by V_hat that are among the top-k by V."""
    est, true = _pair(estimates, true_values)
    k = _check_k(k, len(est))
    return len(set(_top_k(est, k).tolist()) & set(_top_k(true, k).tolist())) / k


def sharpe_ratio_at_k(estimates: Any, true_values: Any, k: int, behavior_value: float) -> float:
    """SCOPE-RL's SharpeRatio@k: the return over the behaviour policy of deploying the top-k policies by V_hat,
    per unit of the spread of their true values.

        SharpeRatio@k = max(best@k - J(pi_b), 0) / std@k

    best@k and std@k are the maximum and the standard deviation of the true values of the k policies with the
    highest estimates (ties: the earlier policy first).  std@k uses ddof=1 and the numerator is clipped at 0, as
    SCOPE-RL's code does (its documentation writes the std with 1/k).  So k = 1 gives nan (the std of one value
    is undefined), as in SCOPE-RL; for k >= 2, std@k = 0 gives inf when best@k > J(pi_b) and nan when not.
    k above the number of policies uses them all.
    """
    est, true = _pair(estimates, true_values)
    k = _check_k(k, len(est))
    behavior_value = float(behavior_value)
    if not np.isfinite(behavior_value):
        raise ValueError(f"behavior_value must be finite, got {behavior_value}")
    top = true[_top_k(est, k)]
    gain = max(float(top.max()) - behavior_value, 0.0)
    if k < 2:
        return float("nan")
    std = float(np.std(top, ddof=1))
    if std == 0.0:
        return float("inf") if gain > 0 else float("nan")
    return gain / std


def safety_errors(estimates: Any, true_values: Any, threshold: float) -> dict[str, float]:
    """Type I / II error rates of calling a policy safe (value >= threshold) from its estimate.

    type_i_error_rate: truly safe policies judged unsafe / truly safe policies;
    type_ii_error_rate: truly unsafe policies judged safe / truly unsafe policies.
    Pass lower confidence bounds as `estimates` for a high-confidence safety test.
    """
    est, true = _pair(estimates, true_values)
    safe_true = true >= threshold
    safe_est = est >= threshold
    n_safe, n_unsafe = int(safe_true.sum()), int((~safe_true).sum())
    return {
        "type_i_error_rate": float((safe_true & ~safe_est).sum() / n_safe) if n_safe else 0.0,
        "type_ii_error_rate": float((~safe_true & safe_est).sum() / n_unsafe) if n_unsafe else 0.0,
    }


def selection_metrics(estimates: Any, true_values: Any, k: int = 1, safety_threshold: float | None = None,
                      behavior_value: float | None = None) -> dict[str, float]:
    """Every metric above for one estimator, as a flat dict (relative error averaged over policies);
    `sharpe@k` only when `behavior_value` (the behaviour policy's value) is given."""
    est, true = _pair(estimates, true_values)
    out: dict[str, float] = {}
    out["relative_error"] = float(np.mean(relative_error(est, true))) if np.all(true != 0) else float("nan")
    span = float(true.max() - true.min())
    out["mse"] = mean_squared_error(est, true)
    out["normalized_mse"] = out["mse"] / span ** 2 if span > 0 else float("nan")
    out["normalized_abs_error"] = float(np.mean(np.abs(est - true)) / span) if span > 0 else float("nan")
    out["spearman"] = spearman_rank_correlation(est, true)
    out[f"regret@{k}"] = regret_at_k(est, true, k) if span > 0 else 0.0
    out[f"precision@{k}"] = precision_at_k(est, true, k)
    if behavior_value is not None:
        out[f"sharpe@{k}"] = sharpe_ratio_at_k(est, true, k, behavior_value)
    if safety_threshold is not None:
        errors = safety_errors(est, true, safety_threshold)
        out["type_i_error_rate"] = errors["type_i_error_rate"]
        out["type_ii_error_rate"] = errors["type_ii_error_rate"]
    return out
