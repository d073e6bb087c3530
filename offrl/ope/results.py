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

Hoeffding and Bernstein ("concentration") intervals need a range, and for an
importance-weighted estimator the range is set by the weights:

- Plain means (IS, PDIS, IPW, DR, ...): R is the range of the per-sample
  terms, e.g. [min(0, W a), max(0, W b)] for w r with rewards in [a, b] and
  weights in [0, W].
- Self-normalised ratios (WIS, SNIPW, and each step's ratio of WPDIS, WDR,
  SNDR): the estimand is sum_k E[w_k X_k] / E[w_k] with X_k in [a_k, b_k]
  and 0 <= w_k <= W_k.  A linearised interval around the ratio is not a valid
  concentration bound (its range ignores max w / mean w), so each ratio is
  bounded through its numerator and denominator: N_k = E[w_k (X_k - a_k)],
  range W_k (b_k - a_k), and D_k = E[w_k], range W_k, each bounded two-sided at
  level delta / (2K) (a union bound over the 2K events), so that with
  probability at least 1 - delta every N_k in [N_lo, N_hi] and D_k in
  [D_lo, D_hi], whence (N_k >= 0, D_k > 0)

      a_k + max(N_lo, 0) / D_hi  <=  E[w_k X_k] / E[w_k]  <=  a_k + N_hi / D_lo

  (upper end b_k when D_lo <= 0), intersected with [a_k, b_k]; the K ratios'
  intervals are summed.  High-confidence off-policy evaluation (Thomas,
  Theocharous & Ghavamzadeh 2015) bounds the numerator alone and relies on
  E[w] = 1; bounding D as well keeps the interval valid when E[w] != 1
  (estimated behaviour policy, unsupported actions).  The width grows as the
  effective sample size falls, as it must: once D_lo <= 0 the upper end is b_k.
  A column whose weight is identically 1 (e.g. the direct-method part of
  SNDR) is a plain mean, bounded at level delta / K.

W is the user's `weight_bound` (a guaranteed range) or, without one, the
largest observed weight; then the result's diagnostics say so
(``weight_bound_source``), because the observed maximum is not a guaranteed
range and the interval can undercover when rare large weights were not seen.
The reward range is `reward_bound` or the observed rewards, reported the same
way, and DR-type estimators also use the observed range of the reward model's
predictions (``q_range_source``).  ``interval_guaranteed`` is True only when
every range was given.

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
    "ColumnRanges",
    "ratio_concentration_interval",
    "check_gamma",
    "check_alpha",
]

INTERVALS = ("bootstrap", "t", "hoeffding", "bernstein")
CONCENTRATION = ("hoeffding", "bernstein")
OBSERVED_WEIGHTS = "observed maximum weight (not a guaranteed range)"
OBSERVED_REWARDS = "observed range of the logged rewards (not a guaranteed range)"
OBSERVED_Q = "observed range of the reward model's predictions on the logged data (not a guaranteed range)"


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


# ---------------------------------------------------------------------- concentration intervals on ratios
@dataclass
class ColumnRanges:
    """The ranges a valid concentration interval on `RatioComponents` needs, one entry per column k.

    Column k holds num[:, k] = den[:, k] * X_k with X_k in [x_low[k], x_high[k]]
    and 0 <= den[:, k] <= weight_bound[k]; weight_bound[k] = nan marks a plain
    mean column (den identically 1), whose num lies in [x_low[k], x_high[k]].
    The ranges must hold for every possible row, not only the logged ones.
    """

    x_low: Any
    x_high: Any
    weight_bound: Any

    def __post_init__(self) -> None:
        self.x_low = np.atleast_1d(np.asarray(self.x_low, np.float64))
        k = self.x_low.shape
        self.x_high = np.broadcast_to(np.asarray(self.x_high, np.float64), k).copy()
        self.weight_bound = np.broadcast_to(np.asarray(self.weight_bound, np.float64), k).copy()
        if not (np.all(np.isfinite(self.x_low)) and np.all(np.isfinite(self.x_high))):
            raise ValueError("ColumnRanges: x_low and x_high must be finite")
        if np.any(self.x_high < self.x_low):
            raise ValueError("ColumnRanges: x_low must not exceed x_high")
        plain = np.isnan(self.weight_bound)
        if np.any(~plain & ~(self.weight_bound > 0)) or np.any(np.isinf(self.weight_bound)):
            raise ValueError("ColumnRanges: weight_bound must be positive and finite (nan for a plain mean column)")

    @property
    def plain(self) -> np.ndarray:
        return np.isnan(self.weight_bound)

    def check(self, num: np.ndarray, den: np.ndarray | None) -> None:
        """Refuse rows that break the ranges (the interval would not be valid)."""
        k = num.shape[1]
        if len(self.x_low) != k:
            raise ValueError(f"ColumnRanges has {len(self.x_low)} columns but the estimator has {k}")
        for col in range(k):
            low, high, top = float(self.x_low[col]), float(self.x_high[col]), float(self.weight_bound[col])
            v = num[:, col]
            d = np.ones_like(v) if den is None else den[:, col]
            if math.isnan(top):
                if not np.all(d == 1.0):
                    raise ValueError(f"ColumnRanges: column {col} is a plain mean (weight_bound nan) but its "
                                     "denominators are not all 1")
                x = v
            else:
                if np.any(d < 0) or np.any(d > top * (1 + 1e-9)):
                    raise ValueError(f"importance weights of column {col} leave [0, {top:.6g}] (largest "
                                     f"{float(d.max()):.6g}); the weight bound must hold for every weight")
                if np.any((d == 0) & (v != 0)):
                    raise ValueError(f"column {col} has a non-zero term with zero weight")
                ok = d > 1e-290  # below that, v / d loses precision (subnormal numbers)
                x = v[ok] / d[ok]
            tol = 1e-9 * (1.0 + max(abs(low), abs(high)))
            if len(x) and (float(x.min()) < low - tol or float(x.max()) > high + tol):
                raise ValueError(f"per-sample terms of column {col} range over [{float(x.min()):.6g}, "
                                 f"{float(x.max()):.6g}], outside their bound [{low:.6g}, {high:.6g}]; check "
                                 "reward_bound against the logged rewards")


def _mean_bounds(samples: np.ndarray, method: str, alpha: float, width: float) -> tuple[float, float]:
    if method == "hoeffding":
        return hoeffding_interval(samples, alpha, width)
    if method == "bernstein":
        return bernstein_interval(samples, alpha, width)
    raise ValueError(f"a concentration interval is one of {CONCENTRATION}, got {method!r}")


def ratio_concentration_interval(
    num: Any, den: Any, ranges: ColumnRanges, method: str = "hoeffding", alpha: float = 0.05
) -> tuple[float, float]:
    """A valid Hoeffding / empirical-Bernstein interval for sum_k E[num_k] / E[den_k].

    Each ratio is bounded through its numerator and denominator with a union
    bound over all 2K one-column events (see the module docstring):
    with probability >= 1 - alpha the interval holds sum_k E[den_k X_k] / E[den_k]
    (a column whose E[den_k] = 0 counts as 0).  Plain mean columns
    (weight_bound nan) get a two-sided bound at level alpha / K.
    """
    alpha = check_alpha(alpha)
    num = np.asarray(num, np.float64)
    num = num[:, None] if num.ndim == 1 else num
    den = None if den is None else np.asarray(den, np.float64).reshape(num.shape)
    ranges.check(num, den)
    n, k = num.shape
    total_low = total_high = 0.0
    for col in range(k):
        a, b, w_max = float(ranges.x_low[col]), float(ranges.x_high[col]), float(ranges.weight_bound[col])
        if math.isnan(w_max):
            lo, hi = _mean_bounds(num[:, col], method, alpha / k, b - a)
        else:
            d = den[:, col]
            shifted = np.maximum(num[:, col] - a * d, 0.0)  # d (X - a) >= 0 (rounding aside)
            n_lo, n_hi = _mean_bounds(shifted, method, alpha / (2 * k), w_max * (b - a))
            d_lo, d_hi = _mean_bounds(d, method, alpha / (2 * k), w_max)
            lo = a + max(n_lo, 0.0) / d_hi if d_hi > 0 else a
            hi = a + n_hi / d_lo if d_lo > 0 else b
        lo, hi = min(max(lo, a), b), max(min(hi, b), a)
        if den is not None and not den[:, col].any():  # the estimate counts a column without weight as 0
            lo, hi = min(lo, 0.0), max(hi, 0.0)
        total_low += lo
        total_high += hi
    return total_low, total_high


def reward_range(reward_bound: Sequence[float] | None, rewards: Any) -> tuple[float, float, str]:
    """(r_min, r_max, source): `reward_bound` checked against the logged rewards, or their observed range."""
    r = np.asarray(rewards, np.float64).reshape(-1)
    if reward_bound is None:
        if len(r) == 0:
            raise ValueError("no rewards to take a range from; pass reward_bound=(r_min, r_max)")
        return float(r.min()), float(r.max()), OBSERVED_REWARDS
    try:
        low, high = (float(v) for v in reward_bound)
    except (TypeError, ValueError):
        raise ValueError(f"reward_bound must be (r_min, r_max), got {reward_bound!r}") from None
    if not (math.isfinite(low) and math.isfinite(high)) or high < low:
        raise ValueError(f"reward_bound must be finite (r_min, r_max) with r_min <= r_max, got {tuple(reward_bound)}")
    # rewards are stored as float32: 0.1 is kept as 0.10000000149, which must not break a bound of 0.1
    tolerance = 1e-6 * max(1.0, abs(low), abs(high))
    if len(r) and (r.min() < low - tolerance or r.max() > high + tolerance):
        raise ValueError(f"reward_bound={tuple(reward_bound)} but the logged rewards range over "
                         f"[{r.min():.9g}, {r.max():.9g}]; pass a reward_bound that holds for every reward")
    if len(r):
        low, high = min(low, float(r.min())), max(high, float(r.max()))
    return low, high, "given"


def check_weight_bound(weight_bound: Any) -> float | None:
    """None, or a positive finite bound on the importance weights."""
    if weight_bound is None:
        return None
    try:
        value = float(weight_bound)
    except (TypeError, ValueError):
        raise ValueError(f"weight_bound must be a positive number or None, got {weight_bound!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"weight_bound must be a positive finite number (an upper bound on the importance weights), "
                         f"got {weight_bound!r}; leave it None to use the observed maximum weight")
    return value


def resolve_log_weight_bound(weight_bound: Any, observed_log_max: float, what: str = "importance weight"
                             ) -> tuple[float, str]:
    """(log W, source): log of the given `weight_bound` (checked against the data) or the observed maximum."""
    value = check_weight_bound(weight_bound)
    if value is None:
        return float(observed_log_max), OBSERVED_WEIGHTS
    if observed_log_max > math.log(value) + 1e-6:  # up to the rounding of stored log-probabilities
        raise ValueError(f"weight_bound={value:.6g} but the largest {what} in the data is "
                         f"{math.exp(min(observed_log_max, 700.0)):.6g}; weight_bound must hold for every weight "
                         "(or leave it None to use the observed maximum)")
    return max(math.log(value), float(observed_log_max)), "given"


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
    ranges: ColumnRanges | None = None,
    diagnostics: dict[str, Any] | None = None,
    value: float | None = None,
) -> OPEResult:
    """An OPEResult from an estimator's components: value, std error, interval and diagnostics.

    Concentration intervals ("hoeffding", "bernstein") of a plain mean use
    `bound`, the range of the per-sample terms (the observed range, flagged in
    the diagnostics, when None).  Those of a self-normalised estimator need
    `ranges` (see `ratio_concentration_interval`); without them they are
    refused, since no valid range is known.
    """
    if interval not in INTERVALS:
        raise ValueError(f"interval must be one of {INTERVALS}, got {interval!r}")
    alpha = check_alpha(alpha)
    diag = dict(diagnostics or {})
    est = components.value() if value is None else float(value)
    pseudo = components.pseudo_samples()
    n = len(pseudo)
    with np.errstate(over="ignore"):  # terms beyond ~1e154 (unnormalised weights over long episodes): inf
        std_error = float(pseudo.std(ddof=1) / math.sqrt(n)) if n > 1 else math.inf
    ratio = components.den is not None
    if interval == "bootstrap":
        low, high = components.bootstrap_interval(alpha, n_bootstrap, random_state)
        diag["n_bootstrap"] = int(n_bootstrap)
    elif interval in CONCENTRATION and ratio:
        if ranges is None:
            raise ValueError(f"{method}: no valid {interval} interval is known for this self-normalised estimator "
                             "(the range of its terms is not available); use interval='bootstrap' or interval='t'")
        low, high = ratio_concentration_interval(components.num, components.den, ranges, interval, alpha)
        diag["bound_low"], diag["bound_high"] = float(ranges.x_low.sum()), float(ranges.x_high.sum())
        diag["interval_note"] = ("bounds on each self-normalised ratio's numerator and denominator (union bound); "
                                 "valid at any effective sample size")
    elif interval in CONCENTRATION:
        observed_terms = bound is None
        if observed_terms:
            bound = (float(pseudo.min()), float(pseudo.max()))
            diag["bound_source"] = "observed range of the per-sample terms (not a guaranteed bound)"
        diag["bound_low"], diag["bound_high"] = (None, None) if np.ndim(bound) == 0 else (float(bound[0]), float(bound[1]))
        low, high = confidence_interval(pseudo, interval, alpha, bound)
        shift = est - float(pseudo.mean())  # 0 up to rounding
        low, high = low + shift, high + shift
    else:
        low, high = t_interval(pseudo, alpha)
        if ratio:
            diag["interval_note"] = "linearised self-normalised estimator"
    if interval in CONCENTRATION:
        observed = {OBSERVED_WEIGHTS, OBSERVED_REWARDS, OBSERVED_Q}
        # terms that are a model's predictions (FQE, model-based, the direct method) are not checked against the
        # reward bound, and their interval covers only the sampling of start states: never guaranteed
        diag["interval_guaranteed"] = "bound_source" not in diag and not diag.get("model_based_terms") and not any(
            diag.get(key) in observed for key in ("weight_bound_source", "reward_bound_source", "q_range_source"))
    if ratio and float(diag.get("ess", math.inf)) < 2.0:
        # one episode carries all the weight: a self-normalised estimate then has no usable spread
        std_error = math.inf
        if interval not in CONCENTRATION:  # the concentration interval stays valid (it is then the whole range)
            low, high = -math.inf, math.inf
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


def value_range(reward_bound: Sequence[float] | None, rewards: Any, discount_sum: float) -> tuple[float, float] | None:
    """Where any policy's value of a start state lies (the per-sample terms of FQE and model-based OPE).

    Every reward in `reward_bound` (checked against the logged `rewards`) and an episode may end after any step:
    [min(r_min, r_min S), max(r_max, r_max S)] with S = `discount_sum`; None without a bound.
    """
    if reward_bound is None:
        return None
    r_min, r_max, _ = reward_range(reward_bound, rewards)
    return return_range(r_min, r_max, np.asarray([discount_sum]))


def return_range(r_min: float, r_max: float, discounts: np.ndarray) -> tuple[float, float]:
    """Range of G = sum_{t<L} gamma^t r_t over every episode length 1 <= L <= H (episodes may end early)."""
    scale = float(np.sum(discounts))
    return min(r_min, r_min * scale), max(r_max, r_max * scale)
