"""`OPEResult` and the confidence intervals every estimator reports.

Four interval methods, each with its closed form (n samples X_i, mean m,
sample standard deviation s (ddof=1), level 1 - alpha, delta = alpha):

- ``"t"``: two-sided Student t, m -/+ t_{1 - alpha/2, n-1} s / sqrt(n).
- ``"hoeffding"``: m -/+ R sqrt(log(2/delta) / (2n)), R = b - a the range of
  the per-sample terms (Hoeffding 1963, two-sided).  The width shrinks like
  1/sqrt(n).
- ``"bernstein"``: empirical Bernstein (Maurer & Pontil 2009, Thm 4) made
  two-sided by a union bound over both tails:
  m -/+ [sqrt(2 V log(4/delta) / n) + 7 R log(4/delta) / (3 (n - 1))],
  V the sample variance (ddof=1).  (Maurer & Pontil's log(2/delta) is the
  one-sided statement.)
- ``"bootstrap"``: percentile bootstrap over episodes (rounds for bandits),
  seeded; self-normalised estimators are recomputed on every resample.

Two known mistakes in published OPE code are *not* reproduced here: a
Hoeffding width of ``R sqrt(log(2/delta) / 2 * n)`` (grows with n), and a
one-sided quantile ``t_{1 - alpha}`` for a two-sided t interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from scipy import stats

__all__ = [
    "OPEResult",
    "OPEWarning",
    "INTERVALS",
    "t_interval",
    "hoeffding_interval",
    "bernstein_interval",
    "bootstrap_interval",
    "confidence_interval",
    "check_gamma",
    "check_alpha",
]

INTERVALS = ("bootstrap", "t", "hoeffding", "bernstein")


class OPEWarning(UserWarning):
    """An estimate that is computed but should not be trusted as is (poor overlap, estimated behaviour policy, ...)."""


@dataclass
class OPEResult:
    """One estimate of one policy's value.

    `value` is the point estimate, `std_error` its standard error, and
    [`ci_low`, `ci_high`] the two-sided interval at level 1 - alpha computed
    by `diagnostics["interval"]`.  `method` names the estimator.
    `diagnostics` holds everything else worth knowing: n, effective sample
    size, max weight, how the behaviour policy was obtained, warnings.
    `samples` (not shown in the repr) are the per-episode (per-round) terms
    whose mean is `value` (linearised for self-normalised estimators).
    """

    value: float
    std_error: float
    ci_low: float
    ci_high: float
    method: str
    diagnostics: dict[str, Any] = field(default_factory=dict)
    samples: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def alpha(self) -> float:
        return float(self.diagnostics.get("alpha", 0.05))

    @property
    def interval(self) -> str:
        return str(self.diagnostics.get("interval", ""))

    def to_dict(self) -> dict[str, Any]:
        """Value, error, interval, method and the scalar diagnostics, flat."""
        row: dict[str, Any] = {
            "value": self.value,
            "std_error": self.std_error,
            "ci_low": self.ci_low,
            "ci_high": self.ci_high,
            "method": self.method,
        }
        for key, value in self.diagnostics.items():
            if isinstance(value, (int, float, str, bool, np.integer, np.floating)) or value is None:
                row[key] = value.item() if isinstance(value, np.generic) else value
        return row

    def __str__(self) -> str:
        level = 100 * (1 - self.alpha)
        return (f"{self.method}: {self.value:.4g} ± {self.std_error:.2g} "
                f"({level:g}% {self.interval} CI [{self.ci_low:.4g}, {self.ci_high:.4g}])")


# ---------------------------------------------------------------------- checks
def check_gamma(gamma: Any) -> float:
    try:
        value = float(gamma)
    except (TypeError, ValueError):
        raise ValueError(f"gamma must be a number in (0, 1], got {gamma!r}") from None
    if not (0.0 < value <= 1.0):
        raise ValueError(f"gamma must lie in (0, 1], got {gamma}; use e.g. gamma=0.99 (or 1.0 for undiscounted returns)")
    return value


def check_alpha(alpha: Any) -> float:
    value = float(alpha)
    if not (0.0 < value < 1.0):
        raise ValueError(f"alpha must lie in (0, 1) (e.g. 0.05 for a 95% interval), got {alpha}")
    return value


def check_horizon(horizon: Any) -> int | None:
    if horizon is None:
        return None
    if isinstance(horizon, bool) or not float(horizon).is_integer() or int(horizon) < 1:
        raise ValueError(f"horizon must be a positive integer or None (the logged episode lengths), got {horizon!r}")
    return int(horizon)


def _as_samples(samples: Any) -> np.ndarray:
    x = np.asarray(samples, dtype=np.float64).reshape(-1)
    if len(x) == 0:
        raise ValueError("samples is empty; an interval needs at least one sample")
    if not np.all(np.isfinite(x)):
        raise ValueError("samples contain NaN or inf; check the importance weights and rewards")
    return x


def _range(bound: Any, x: np.ndarray) -> float:
    if bound is None:
        raise ValueError(
            "this interval needs the range of the per-sample terms: pass bound=(low, high) (or its width R), "
            "e.g. via reward_bound=(r_min, r_max) on the estimator"
        )
    if np.ndim(bound) == 0:
        width = float(bound)
    else:
        low, high = (float(b) for b in bound)
        if high < low:
            raise ValueError(f"bound must be (low, high) with low <= high, got {tuple(bound)}")
        width = high - low
    if not width >= 0 or not math.isfinite(width):
        raise ValueError(f"the sample range must be a finite non-negative number, got {bound!r}")
    return width


# ---------------------------------------------------------------------- intervals on a mean
def t_interval(samples: Any, alpha: float = 0.05) -> tuple[float, float]:
    """Two-sided Student t interval: mean -/+ t_{1-alpha/2, n-1} s / sqrt(n)."""
    x = _as_samples(samples)
    alpha = check_alpha(alpha)
    n = len(x)
    m = float(x.mean())
    if n < 2:
        return -math.inf, math.inf
    half = float(stats.t.ppf(1 - alpha / 2, n - 1)) * float(x.std(ddof=1)) / math.sqrt(n)
    return m - half, m + half


def hoeffding_interval(samples: Any, alpha: float = 0.05, bound: Any = None) -> tuple[float, float]:
    """Hoeffding: mean -/+ R sqrt(log(2/alpha) / (2n)) with R the range of the samples (from `bound`)."""
    x = _as_samples(samples)
    alpha = check_alpha(alpha)
    width = _range(bound, x)
    half = width * math.sqrt(math.log(2 / alpha) / (2 * len(x)))
    m = float(x.mean())
    return m - half, m + half


def bernstein_interval(samples: Any, alpha: float = 0.05, bound: Any = None) -> tuple[float, float]:
    """Two-sided empirical Bernstein (Maurer & Pontil 2009):
    mean -/+ [sqrt(2 V log(4/alpha) / n) + 7 R log(4/alpha) / (3 (n - 1))]."""
    x = _as_samples(samples)
    alpha = check_alpha(alpha)
    n = len(x)
    if n < 2:
        return -math.inf, math.inf
    width = _range(bound, x)
    log_term = math.log(4 / alpha)
    half = math.sqrt(2 * float(x.var(ddof=1)) * log_term / n) + 7 * width * log_term / (3 * (n - 1))
    m = float(x.mean())
    return m - half, m + half


def bootstrap_interval(
    samples: Any, alpha: float = 0.05, n_bootstrap: int = 2000, random_state: Any = 0
) -> tuple[float, float]:
    """Percentile bootstrap of the mean (resampling the samples with replacement, seeded)."""
    return RatioComponents(_as_samples(samples)[:, None]).bootstrap_interval(alpha, n_bootstrap, random_state)


def confidence_interval(
    samples: Any,
    method: str = "t",
    alpha: float = 0.05,
    bound: Any = None,
    n_bootstrap: int = 2000,
    random_state: Any = 0,
) -> tuple[float, float]:
    """The interval `method` ("bootstrap", "t", "hoeffding", "bernstein") for the mean of `samples`."""
    if method == "t":
        return t_interval(samples, alpha)
    if method == "hoeffding":
        return hoeffding_interval(samples, alpha, bound)
    if method == "bernstein":
        return bernstein_interval(samples, alpha, bound)
    if method == "bootstrap":
        return bootstrap_interval(samples, alpha, n_bootstrap, random_state)
    raise ValueError(f"interval must be one of {INTERVALS}, got {method!r}")


# ---------------------------------------------------------------------- ratio estimators
class RatioComponents:
    """An estimate of the form  sum_k mean_i(num[i, k]) / mean_i(den[i, k])  (den None: plain means).

    Covers every estimator here: a plain mean (K = 1, no den), WIS/SNIPW
    (K = 1), per-decision weighted estimators (K = horizon) and WDR (K = 2H).
    Rows are the resampling unit (episodes or rounds).  A column whose
    denominators are all zero contributes 0.
    """

    def __init__(self, num: np.ndarray, den: np.ndarray | None = None) -> None:
        self.num = np.asarray(num, dtype=np.float64)
        if self.num.ndim == 1:
            self.num = self.num[:, None]
        self.den = None if den is None else np.asarray(den, dtype=np.float64).reshape(self.num.shape)
        if not np.all(np.isfinite(self.num)) or (self.den is not None and not np.all(np.isfinite(self.den))):
            raise ValueError("the estimator's per-episode terms contain NaN or inf (importance weights overflowed?)")

    @property
    def n(self) -> int:
        return self.num.shape[0]

    def _ratio(self, num_mean: np.ndarray, den_mean: np.ndarray | None) -> np.ndarray:
        if den_mean is None:
            return num_mean.sum(-1)
        safe = np.where(den_mean > 0, den_mean, 1.0)
        return np.where(den_mean > 0, num_mean / safe, 0.0).sum(-1)

    def value(self) -> float:
        den = None if self.den is None else self.den.mean(0)
        return float(self._ratio(self.num.mean(0), den))

    def pseudo_samples(self) -> np.ndarray:
        """Per-row terms whose mean is the estimate: the rows themselves for a mean, the
        linearisation (influence function) V + sum_k (num_ik - V_k den_ik) / mean(den_k) for ratios."""
        if self.den is None:
            return self.num.sum(1)
        num_mean, den_mean = self.num.mean(0), self.den.mean(0)
        ok = den_mean > 0
        safe = np.where(ok, den_mean, 1.0)
        v_k = np.where(ok, num_mean / safe, 0.0)
        infl = np.where(ok, (self.num - v_k * self.den) / safe, 0.0).sum(1)
        return v_k.sum() + infl

    def bootstrap_values(self, n_bootstrap: int = 2000, random_state: Any = 0) -> np.ndarray:
        """The estimate recomputed on `n_bootstrap` resamples of the rows (multinomial counts, vectorised).

        A resample in which a ratio's denominator vanishes although it is
        positive on the full data (every row with weight left out) has no
        estimate: its value is NaN.
        """
        rng = np.random.default_rng(random_state)
        n, k = self.num.shape
        full_den = None if self.den is None else self.den.mean(0) > 0
        out = np.empty(int(n_bootstrap))
        chunk = max(1, min(int(n_bootstrap), int(2e7 // max(n * k, 1)), int(4e7 // max(n, 1))))
        for start in range(0, int(n_bootstrap), chunk):
            b = min(chunk, int(n_bootstrap) - start)
            counts = rng.multinomial(n, np.full(n, 1.0 / n), size=b).astype(np.float64) / n
            num_mean = counts @ self.num
            den_mean = None if self.den is None else counts @ self.den
            values = self._ratio(num_mean, den_mean)
            if den_mean is not None:
                values = np.where(np.any((den_mean <= 0) & full_den, axis=-1), np.nan, values)
            out[start:start + b] = values
        return out

    def bootstrap_interval(self, alpha: float = 0.05, n_bootstrap: int = 2000, random_state: Any = 0
                           ) -> tuple[float, float]:
        alpha = check_alpha(alpha)
        if int(n_bootstrap) < 1:
            raise ValueError(f"n_bootstrap must be at least 1, got {n_bootstrap}")
        values = self.bootstrap_values(n_bootstrap, random_state)
        values = values[np.isfinite(values)]
        if len(values) == 0:
            return -math.inf, math.inf
        low, high = np.quantile(values, [alpha / 2, 1 - alpha / 2])
        return float(low), float(high)


def make_result(
    components: RatioComponents,
    method: str,
    *,
    interval: str = "bootstrap",
    alpha: float = 0.05,
    n_bootstrap: int = 2000,
    random_state: Any = 0,
    bound: Any = None,
    diagnostics: dict[str, Any] | None = None,
    value: float | None = None,
) -> OPEResult:
    """An OPEResult from an estimator's components: value, std error, interval and diagnostics."""
    if interval not in INTERVALS:
        raise ValueError(f"interval must be one of {INTERVALS}, got {interval!r}")
    alpha = check_alpha(alpha)
    diag = dict(diagnostics or {})
    est = components.value() if value is None else float(value)
    pseudo = components.pseudo_samples()
    n = len(pseudo)
    std_error = float(pseudo.std(ddof=1) / math.sqrt(n)) if n > 1 else math.inf
    if interval == "bootstrap":
        low, high = components.bootstrap_interval(alpha, n_bootstrap, random_state)
        diag["n_bootstrap"] = int(n_bootstrap)
    elif interval in ("hoeffding", "bernstein"):
        if bound is None:
            bound = (float(pseudo.min()), float(pseudo.max()))
            diag["bound_source"] = "observed range of the per-sample terms (not a guaranteed bound)"
        diag["bound_low"], diag["bound_high"] = (None, None) if np.ndim(bound) == 0 else (float(bound[0]), float(bound[1]))
        low, high = confidence_interval(pseudo, interval, alpha, bound)
        shift = est - float(pseudo.mean())  # 0 up to rounding
        low, high = low + shift, high + shift
    else:
        low, high = t_interval(pseudo, alpha)
    if components.den is not None and interval != "bootstrap":
        diag["interval_note"] = "linearised self-normalised estimator"
    if components.den is not None and float(diag.get("ess", math.inf)) < 2.0:
        # one episode carries all the weight: a self-normalised estimate then has no usable spread
        low, high, std_error = -math.inf, math.inf, math.inf
        diag["interval_note"] = "undefined: effective sample size below 2"
    diag.update({"interval": interval, "alpha": alpha, "n": n})
    return OPEResult(value=float(est), std_error=std_error, ci_low=float(low), ci_high=float(high),
                     method=method, diagnostics=diag, samples=pseudo)


def effective_sample_size(weights: Any) -> float:
    """(sum w)^2 / sum w^2; n for equal weights, 1 when one weight dominates."""
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    total = float(np.sum(w * w))
    return float(np.sum(w) ** 2 / total) if total > 0 else 0.0


def sample_bound_from_rewards(reward_bound: Sequence[float] | None, scale: float, max_weight: float = 1.0
                              ) -> tuple[float, float] | None:
    """Range of per-sample terms w * G with G = sum of discounted rewards in [scale r_min, scale r_max], 0 <= w <= max_weight."""
    if reward_bound is None:
        return None
    r_min, r_max = (float(b) for b in reward_bound)
    if r_max < r_min:
        raise ValueError(f"reward_bound must be (r_min, r_max) with r_min <= r_max, got {tuple(reward_bound)}")
    low, high = r_min * scale, r_max * scale
    if max_weight == 1.0:
        return low, high
    return min(0.0, low * max_weight, low), max(0.0, high * max_weight, high)
