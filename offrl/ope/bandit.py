"""Contextual-bandit (horizon-1) OPE estimators with Open Bandit Pipeline's interface.

Every estimator has `estimate(reward=, action=, pscore=, action_dist=,
position=None, estimated_rewards_by_reg_model=None) -> OPEResult`, plus
OBP's own `estimate_policy_value(...) -> float` and
`estimate_interval(..., alpha, n_bootstrap_samples, random_state) -> dict`,
so that code written against OBP (>= 0.5) runs unchanged and the same inputs
give the same numbers.  Shapes follow OBP: `action_dist` and
`estimated_rewards_by_reg_model` are (n_rounds, n_actions, len_list);
`position` (n_rounds,) is optional when len_list == 1.

With w_i = action_dist[i, a_i, p_i] / pscore_i, q_i(a) = q_hat[i, a, p_i] and
DM_i = sum_a action_dist[i, a, p_i] q_i(a):

- IPW:   mean(w r)                      (weights clipped at `lambda_`)
- SNIPW: mean(w r) / mean(w)
- DM:    mean(DM_i)
- DR:    mean(DM_i + w (r - q_i(a_i)))   (weights clipped at `lambda_`)
- SNDR:  mean(DM_i) + mean(w (r - q_i(a_i))) / mean(w)
- SwitchDR: mean(DM_i + 1{w <= lambda_} w (r - q_i(a_i)))
- DRShrinkage (DRos): mean(DM_i + w' (r - q_i(a_i))), w' = lambda_ w / (w^2 + lambda_)
  (w' = 0 when lambda_ = 0, where OBP computes 0/0 for w = 0).

Hoeffding and Bernstein intervals (`interval=`) use `reward_bound` and
`weight_bound` (an upper bound on pi_e / pi_b) as the ranges they need;
without them the observed rewards and the largest observed weight are used,
and the diagnostics say that these are not guaranteed ranges.  A finite
`lambda_` bounds the correction weights of IPW, DR and Switch-DR by lambda_
and of DRos by sqrt(lambda_) / 2, which is guaranteed.  DR-type estimators
also use the observed range of `estimated_rewards_by_reg_model`.  SNIPW and
SNDR bound each ratio through its numerator and denominator (see
`offrl.ope.results`); the point estimates are OBP's in every case.

`RegressionModel` fits q_hat with any scikit-learn regressor or classifier,
one per position, with OBP's features (context, one-hot action) and
fitting methods ("normal", "iw", "mrdr"), and cross-fits with `n_folds` > 1.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import sklearn.base

from offrl.ope.results import (
    CONCENTRATION,
    OBSERVED_Q,
    OBSERVED_WEIGHTS,
    ColumnRanges,
    OPEResult,
    OPEWarning,
    RatioComponents,
    check_alpha,
    check_weight_bound,
    effective_sample_size,
    make_result,
    reward_range,
    sample_bound_from_rewards,
)

__all__ = [
    "IPW",
    "SNIPW",
    "DirectMethod",
    "DR",
    "SNDR",
    "SwitchDR",
    "DRShrinkage",
    "InverseProbabilityWeighting",
    "SelfNormalizedInverseProbabilityWeighting",
    "DoublyRobust",
    "SelfNormalizedDoublyRobust",
    "SwitchDoublyRobust",
    "DoublyRobustWithShrinkage",
    "RegressionModel",
    "check_bandit_inputs",
    "evaluate_bandit",
]


def _array(name: str, value: Any, ndim: int | None = None) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except Exception as err:  # ragged
        raise ValueError(f"{name} could not be converted to an array ({err})") from err
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-dimensional, got shape {arr.shape}")
    if arr.dtype == object:
        raise ValueError(f"{name} must be numeric, got dtype object")
    return arr


def check_bandit_inputs(
    action_dist: Any,
    reward: Any = None,
    action: Any = None,
    pscore: Any = None,
    position: Any = None,
    estimated_rewards_by_reg_model: Any = None,
) -> dict[str, Any]:
    """Validate OBP-style inputs; return them as arrays (position filled with zeros when omitted).

    A 2-d `action_dist` (n_rounds, n_actions) is accepted as len_list = 1.
    """
    dist = _array("action_dist", action_dist).astype(np.float64)
    if dist.ndim == 2:
        dist = dist[:, :, None]
    if dist.ndim != 3:
        raise ValueError(f"action_dist must have shape (n_rounds, n_actions, len_list), got {dist.shape}")
    n, n_actions, len_list = dist.shape
    if not np.all(np.isfinite(dist)) or np.any(dist < 0):
        raise ValueError("action_dist must contain finite non-negative probabilities")
    sums = dist.sum(axis=1)
    if not np.allclose(sums, 1.0):
        i, p = np.argwhere(~np.isclose(sums, 1.0))[0]
        raise ValueError(f"action_dist must be a probability distribution over actions: row {i} (position {p}) sums to "
                         f"{sums[i, p]:.6g}")
    out: dict[str, Any] = {"action_dist": dist}
    lengths = {"action_dist": n}
    if reward is not None:
        out["reward"] = _array("reward", reward, 1).astype(np.float64)
        lengths["reward"] = len(out["reward"])
        if not np.all(np.isfinite(out["reward"])):
            raise ValueError("reward contains NaN or inf")
    if action is not None:
        a = _array("action", action, 1)
        if not (np.issubdtype(a.dtype, np.integer) or (np.issubdtype(a.dtype, np.floating) and np.all(a == np.round(a)))):
            raise ValueError("action must hold integer action indices")
        out["action"] = a.astype(np.int64)
        lengths["action"] = len(a)
    if pscore is not None:
        ps = _array("pscore", pscore, 1).astype(np.float64)
        lengths["pscore"] = len(ps)
        out["pscore"] = ps
    if estimated_rewards_by_reg_model is not None:
        q = _array("estimated_rewards_by_reg_model", estimated_rewards_by_reg_model).astype(np.float64)
        if q.ndim == 2:
            q = q[:, :, None]
        if q.shape != dist.shape:
            raise ValueError(f"estimated_rewards_by_reg_model has shape {q.shape} but action_dist has {dist.shape}; "
                             "they must match (n_rounds, n_actions, len_list)")
        if not np.all(np.isfinite(q)):
            raise ValueError("estimated_rewards_by_reg_model contains NaN or inf")
        out["estimated_rewards_by_reg_model"] = q
    if position is not None:
        pos = _array("position", position, 1)
        lengths["position"] = len(pos)
        if not (np.issubdtype(pos.dtype, np.integer) and (len(pos) == 0 or pos.min() >= 0)):
            raise ValueError("position elements must be non-negative integers")
        if len(pos) and pos.max() >= len_list:
            raise ValueError(f"position elements must be smaller than action_dist.shape[2] ({len_list}), found {pos.max()}")
        out["position"] = pos.astype(np.int64)
    else:
        if len_list > 1:
            raise ValueError(f"position must be given when action_dist.shape[2] > 1 (len_list = {len_list})")
        out["position"] = np.zeros(n, np.int64)
    mismatched = {k: v for k, v in lengths.items() if v != n}
    if mismatched:
        name, rows = next(iter(mismatched.items()))
        raise ValueError(f"{name} has {rows} rows but action_dist has {n}; every input needs one row per round")
    if "action" in out and len(out["action"]) and (out["action"].min() < 0 or out["action"].max() >= n_actions):
        bad = int(np.flatnonzero((out["action"] < 0) | (out["action"] >= n_actions))[0])
        raise ValueError(f"action has value {out['action'][bad]} at row {bad}, outside [0, {n_actions}) "
                         "(the actions of action_dist.shape[1])")
    if "pscore" in out:
        ps = out["pscore"]
        bad = np.flatnonzero(~(ps > 0) | ~np.isfinite(ps))
        if len(bad):
            raise ValueError(f"pscore must be positive and finite: found {ps[bad[0]]} at row {int(bad[0])} "
                             f"({len(bad)} rows in all); a logged action must have positive probability under the "
                             "behaviour policy")
        if np.any(ps > 1 + 1e-8):
            warnings.warn("some pscore values exceed 1; propensities of discrete actions are probabilities", OPEWarning,
                          stacklevel=3)
    return out


class _BanditEstimator(sklearn.base.BaseEstimator):
    estimator_name = "bandit"
    needs = ("reward", "action", "pscore")
    needs_q = False

    def __init__(self, *, interval: str = "bootstrap", alpha: float = 0.05, n_bootstrap: int = 2000,
                 reward_bound: tuple[float, float] | None = None, weight_bound: float | None = None,
                 random_state: Any = 0, warn: bool = True) -> None:
        self.interval = interval
        self.alpha = alpha
        self.n_bootstrap = n_bootstrap
        self.reward_bound = reward_bound
        self.weight_bound = weight_bound
        self.random_state = random_state
        self.warn = warn

    # -- hooks
    def _components(self, d: dict[str, Any]) -> RatioComponents:
        raise NotImplementedError

    def _interval_ranges(self, d: dict[str, Any], diag: dict[str, Any]) -> tuple[Any, ColumnRanges | None]:
        """(bound, ranges) for make_result's concentration intervals, their sources written to `diag`."""
        return sample_bound_from_rewards(self.reward_bound, 1.0), None

    def _guaranteed_weight_bound(self) -> float | None:
        """A bound on the weights the estimator uses that holds by construction (e.g. from clipping)."""
        return None

    def _used_weights(self, d: dict[str, Any]) -> np.ndarray:
        return d["iw"]

    # -- ranges for concentration intervals
    def _rewards(self, d: dict[str, Any], diag: dict[str, Any]) -> tuple[float, float]:
        low, high, source = reward_range(self.reward_bound, d["reward"])
        diag.update({"reward_low": low, "reward_high": high, "reward_bound_source": source})
        return low, high

    def _weight_range(self, d: dict[str, Any], diag: dict[str, Any]) -> float:
        """W with 0 <= used weight <= W: the smallest guaranteed bound (weight_bound, clipping), else the observed maximum."""
        given = check_weight_bound(self.weight_bound)
        raw = d["iw"]
        if given is not None and len(raw):
            if float(raw.max()) > given * (1 + 1e-6):  # up to rounding
                raise ValueError(f"weight_bound={given:.6g} but the largest importance weight pi_e / pi_b in the data "
                                 f"is {float(raw.max()):.6g}; weight_bound must hold for every weight (or leave it "
                                 "None to use the observed maximum)")
            given = max(given, float(raw.max()))
        candidates = [(given, "given"), (self._guaranteed_weight_bound(), "lambda_ (a range guaranteed by construction)")]
        candidates = [(value, source) for value, source in candidates if value is not None]
        if candidates:
            bound, source = min(candidates, key=lambda c: c[0])
        else:
            used = self._used_weights(d)
            bound, source = (float(used.max()) if len(used) else 0.0), OBSERVED_WEIGHTS
        bound = max(bound, 1e-300)  # all weights 0: any positive bound holds
        diag.update({"weight_bound": bound, "weight_bound_source": source})
        return bound

    def _q_range(self, d: dict[str, Any], diag: dict[str, Any]) -> tuple[float, float]:
        q = d["q_at_pos"]
        low, high = float(q.min()), float(q.max())
        diag.update({"q_range_low": low, "q_range_high": high, "q_range_source": OBSERVED_Q})
        return low, high

    # -- plumbing
    def _inputs(self, reward: Any, action: Any, pscore: Any, action_dist: Any, position: Any,
                estimated_rewards_by_reg_model: Any) -> dict[str, Any]:
        given = {"reward": reward, "action": action, "pscore": pscore}
        for name in self.needs:
            if given[name] is None:
                raise ValueError(f"{type(self).__name__} needs {name}=...")
        if self.needs_q and estimated_rewards_by_reg_model is None:
            raise ValueError(f"{type(self).__name__} needs estimated_rewards_by_reg_model=... "
                             "(e.g. from RegressionModel(...).fit_predict(...))")
        d = check_bandit_inputs(action_dist, reward, action, pscore, position, estimated_rewards_by_reg_model)
        n = d["action_dist"].shape[0]
        rows = np.arange(n)
        pos = d["position"]
        d["rows"] = rows
        if "action" in d:
            d["pi_e_logged"] = d["action_dist"][rows, d["action"], pos]
        if "pscore" in d:
            d["iw"] = d["pi_e_logged"] / d["pscore"]
        if "estimated_rewards_by_reg_model" in d:
            q = d["estimated_rewards_by_reg_model"]
            d["q_at_pos"] = q[rows, :, pos]
            dist_at_pos = d["action_dist"][rows, :, pos]
            d["dm"] = (q[rows, :, pos] * dist_at_pos).sum(1) / dist_at_pos.sum(1)
            if "action" in d:
                d["q_factual"] = q[rows, d["action"], pos]
        return d

    def _round_terms(self, d: dict[str, Any]) -> np.ndarray:
        """OBP's per-round estimated rewards (whose mean is OBP's estimate)."""
        comp = self._components(d)
        if comp.den is None:
            return comp.num.sum(1)
        den_mean = comp.den.mean(0)
        return (comp.num / np.where(den_mean > 0, den_mean, 1.0)).sum(1)

    def _support_diagnostics(self, d: dict[str, Any]) -> dict[str, Any]:
        diag: dict[str, Any] = {}
        if "iw" not in d:
            return diag
        w = d["iw"]
        n = len(w)
        ess = effective_sample_size(w)
        diag.update({"ess": ess, "ess_fraction": ess / n, "max_weight": float(w.max()), "mean_weight": float(w.mean())})
        dist = d["action_dist"][d["rows"], :, d["position"]]
        never = np.setdiff1d(np.arange(dist.shape[1]), np.unique(d["action"]))
        mass = float(dist[:, never].sum(1).mean()) if len(never) else 0.0
        diag["unsupported_mass"] = mass
        message = None
        if mass > 1e-3:
            message = (f"the target policy puts {mass:.1%} of its probability on actions the logs never take "
                       f"({never.tolist()}); importance weights cannot see that mass, so IPW-type estimates are biased")
        elif ess < max(0.01 * n, 2.0):
            message = "the importance weights are dominated by a few rounds"
        if message is not None:
            text = f"{message} (effective sample size {ess:.1f} of {n}, max weight {w.max():.3g})"
            diag["warning"] = text
            if self.warn:
                warnings.warn(f"{self.estimator_name}: {text}", OPEWarning, stacklevel=4)
        return diag

    # -- public API
    def estimate(self, *, reward: Any = None, action: Any = None, pscore: Any = None, action_dist: Any = None,
                 position: Any = None, estimated_rewards_by_reg_model: Any = None, **kwargs: Any) -> OPEResult:
        """Estimate the target policy's value; returns an OPEResult (value, std_error, interval, diagnostics)."""
        if action_dist is None:
            raise ValueError(f"{type(self).__name__} needs action_dist=... of shape (n_rounds, n_actions, len_list)")
        d = self._inputs(reward, action, pscore, action_dist, position, estimated_rewards_by_reg_model)
        diag = self._support_diagnostics(d)
        check_weight_bound(self.weight_bound)
        bound, ranges = self._interval_ranges(d, diag) if self.interval in CONCENTRATION else (None, None)
        return make_result(self._components(d), self.estimator_name, interval=self.interval, alpha=self.alpha,
                           n_bootstrap=self.n_bootstrap, random_state=self.random_state, bound=bound, ranges=ranges,
                           diagnostics=diag)

    def estimate_policy_value(self, reward: Any = None, action: Any = None, action_dist: Any = None,
                              pscore: Any = None, position: Any = None, estimated_rewards_by_reg_model: Any = None,
                              **kwargs: Any) -> float:
        """OBP's `estimate_policy_value`: the point estimate as a float."""
        if action_dist is None:
            raise ValueError(f"{type(self).__name__} needs action_dist=...")
        d = self._inputs(reward, action, pscore, action_dist, position, estimated_rewards_by_reg_model)
        return float(self._round_terms(d).mean())

    def estimate_interval(self, reward: Any = None, action: Any = None, action_dist: Any = None, pscore: Any = None,
                          position: Any = None, estimated_rewards_by_reg_model: Any = None, alpha: float = 0.05,
                          n_bootstrap_samples: int = 10000, random_state: Any = None, **kwargs: Any) -> dict[str, float]:
        """OBP's `estimate_interval`: bootstrap of OBP's per-round terms, with OBP's random stream and dict keys."""
        from sklearn.utils import check_random_state

        alpha = check_alpha(alpha)
        if action_dist is None:
            raise ValueError(f"{type(self).__name__} needs action_dist=...")
        d = self._inputs(reward, action, pscore, action_dist, position, estimated_rewards_by_reg_model)
        samples = self._round_terms(d)
        rng = check_random_state(random_state)
        n = len(samples)
        boot = np.empty(int(n_bootstrap_samples))
        chunk = max(1, int(2e7 // max(n, 1)))
        for start in range(0, len(boot), chunk):
            b = min(chunk, len(boot) - start)
            # RandomState.choice(samples, size=n) draws randint(0, n, size=n); b draws in a row are one (b, n) draw.
            boot[start:start + b] = samples[rng.randint(0, n, size=(b, n))].mean(1)
        return {
            "mean": float(np.mean(boot)),
            f"{100 * (1. - alpha)}% CI (lower)": float(np.percentile(boot, 100 * (alpha / 2))),
            f"{100 * (1. - alpha)}% CI (upper)": float(np.percentile(boot, 100 * (1.0 - alpha / 2))),
        }


class IPW(_BanditEstimator):
    """Inverse probability weighting: mean(w r), weights clipped at `lambda_`."""

    estimator_name = "ipw"

    def __init__(self, *, lambda_: float = np.inf, interval: str = "bootstrap", alpha: float = 0.05,
                 n_bootstrap: int = 2000, reward_bound: tuple[float, float] | None = None,
                 weight_bound: float | None = None, random_state: Any = 0, warn: bool = True) -> None:
        super().__init__(interval=interval, alpha=alpha, n_bootstrap=n_bootstrap, reward_bound=reward_bound,
                         weight_bound=weight_bound, random_state=random_state, warn=warn)
        self.lambda_ = lambda_

    def _check_lambda(self) -> float:
        lam = float(self.lambda_)
        if math.isnan(lam) or lam < 0:
            raise ValueError(f"lambda_ must be a non-negative number (np.inf for none), got {self.lambda_}")
        return lam

    def _components(self, d: dict[str, Any]) -> RatioComponents:
        return RatioComponents(d["reward"] * np.minimum(d["iw"], self._check_lambda()))

    def _used_weights(self, d: dict[str, Any]) -> np.ndarray:
        return np.minimum(d["iw"], self._check_lambda())

    def _guaranteed_weight_bound(self) -> float | None:
        lam = self._check_lambda()  # every weight used is at most lambda_
        return max(lam, 1e-300) if math.isfinite(lam) else None

    def _interval_ranges(self, d: dict[str, Any], diag: dict[str, Any]) -> tuple[Any, ColumnRanges | None]:
        low, high = self._rewards(d, diag)
        top = self._weight_range(d, diag)
        return (min(0.0, top * low), max(0.0, top * high)), None


class SNIPW(_BanditEstimator):
    """Self-normalised IPW: mean(w r) / mean(w)."""

    estimator_name = "snipw"

    def _components(self, d: dict[str, Any]) -> RatioComponents:
        return RatioComponents(d["reward"] * d["iw"], d["iw"])

    def _interval_ranges(self, d: dict[str, Any], diag: dict[str, Any]) -> tuple[Any, ColumnRanges | None]:
        low, high = self._rewards(d, diag)
        return None, ColumnRanges([low], [high], [self._weight_range(d, diag)])


class DirectMethod(_BanditEstimator):
    """Direct method: mean over rounds of sum_a action_dist q_hat."""

    estimator_name = "dm"
    needs = ()
    needs_q = True

    def _components(self, d: dict[str, Any]) -> RatioComponents:
        return RatioComponents(d["dm"])

    def _support_diagnostics(self, d: dict[str, Any]) -> dict[str, Any]:
        return {"model_based_terms": True}  # the terms are the reward model's predictions


class DR(IPW):
    """Doubly robust: mean(DM_i + w (r - q_hat(a_i))), weights clipped at `lambda_`."""

    estimator_name = "dr"
    needs_q = True

    def _correction_weights(self, d: dict[str, Any]) -> np.ndarray:
        return np.minimum(d["iw"], self._check_lambda())

    def _components(self, d: dict[str, Any]) -> RatioComponents:
        return RatioComponents(d["dm"] + self._correction_weights(d) * (d["reward"] - d["q_factual"]))

    def _used_weights(self, d: dict[str, Any]) -> np.ndarray:
        return self._correction_weights(d)

    def _interval_ranges(self, d: dict[str, Any], diag: dict[str, Any]) -> tuple[Any, ColumnRanges | None]:
        # DM_i in [q_low, q_high] (a mixture of predictions), r - q_hat(a_i) in [r_min - q_high, r_max - q_low]
        low, high = self._rewards(d, diag)
        q_low, q_high = self._q_range(d, diag)
        top = self._weight_range(d, diag)
        return (q_low + top * min(0.0, low - q_high), q_high + top * max(0.0, high - q_low)), None


class SNDR(_BanditEstimator):
    """Self-normalised DR: mean(DM_i) + mean(w (r - q_hat(a_i))) / mean(w)."""

    estimator_name = "sndr"
    needs_q = True

    def _components(self, d: dict[str, Any]) -> RatioComponents:
        w = d["iw"]
        num = np.stack([d["dm"], w * (d["reward"] - d["q_factual"])], axis=1)
        den = np.stack([np.ones_like(w), w], axis=1)
        return RatioComponents(num, den)

    def _interval_ranges(self, d: dict[str, Any], diag: dict[str, Any]) -> tuple[Any, ColumnRanges | None]:
        # column 0: mean(DM_i), a plain mean in [q_low, q_high]; column 1: a ratio with X = r - q_hat(a_i)
        low, high = self._rewards(d, diag)
        q_low, q_high = self._q_range(d, diag)
        top = self._weight_range(d, diag)
        return None, ColumnRanges([q_low, low - q_high], [q_high, high - q_low], [np.nan, top])


class SwitchDR(DR):
    """Switch-DR (Wang et al. 2017): the IPW correction only where w <= lambda_."""

    estimator_name = "switch-dr"

    def _correction_weights(self, d: dict[str, Any]) -> np.ndarray:
        w = d["iw"]
        return w * (w <= self._check_lambda())


class DRShrinkage(DR):
    """DR with optimistic shrinkage (DRos, Su et al. 2020): w' = lambda_ w / (w^2 + lambda_)."""

    estimator_name = "dr-os"

    def __init__(self, *, lambda_: float = 0.0, interval: str = "bootstrap", alpha: float = 0.05,
                 n_bootstrap: int = 2000, reward_bound: tuple[float, float] | None = None,
                 weight_bound: float | None = None, random_state: Any = 0, warn: bool = True) -> None:
        super().__init__(lambda_=lambda_, interval=interval, alpha=alpha, n_bootstrap=n_bootstrap,
                         reward_bound=reward_bound, weight_bound=weight_bound, random_state=random_state, warn=warn)

    def _guaranteed_weight_bound(self) -> float | None:
        # lambda w / (w^2 + lambda) <= sqrt(lambda) / 2 (at w = sqrt(lambda)); 0 for lambda = 0
        lam = self._check_lambda()
        if math.isinf(lam):
            return None
        return math.sqrt(lam) / 2 if lam > 0 else 1e-300

    def _correction_weights(self, d: dict[str, Any]) -> np.ndarray:
        lam = self._check_lambda()
        w = d["iw"]
        if math.isinf(lam):
            return w
        den = w ** 2 + lam
        return np.where(den > 0, lam * w / np.where(den > 0, den, 1.0), 0.0)


# OBP's class names, for drop-in use
InverseProbabilityWeighting = IPW
SelfNormalizedInverseProbabilityWeighting = SNIPW
DoublyRobust = DR
SelfNormalizedDoublyRobust = SNDR
SwitchDoublyRobust = SwitchDR
DoublyRobustWithShrinkage = DRShrinkage


# ---------------------------------------------------------------------- regression model
class RegressionModel(sklearn.base.BaseEstimator):
    """q_hat(x, a, position) from a scikit-learn model, OBP's `RegressionModel` interface.

    Features are [context, action_context[action]] (one-hot actions by
    default); one clone of `base_model` per position; `fitting_method`
    "normal" (plain regression), "iw" (importance-weighted) or "mrdr"
    (weights pi_e (1 - pi_b) / pi_b^2).  Classifiers predict P(reward = 1).
    """

    def __init__(self, base_model: Any, n_actions: int, len_list: int = 1, action_context: Any = None,
                 fitting_method: str = "normal") -> None:
        self.base_model = base_model
        self.n_actions = n_actions
        self.len_list = len_list
        self.action_context = action_context
        self.fitting_method = fitting_method

    def _check(self) -> np.ndarray:
        if not isinstance(self.base_model, sklearn.base.BaseEstimator):
            raise ValueError("base_model must be a scikit-learn estimator")
        if self.fitting_method not in ("normal", "iw", "mrdr"):
            raise ValueError(f"fitting_method must be 'normal', 'iw' or 'mrdr', got {self.fitting_method!r}")
        ctx = np.eye(int(self.n_actions), dtype=int) if self.action_context is None else np.asarray(self.action_context)
        if ctx.shape[0] != int(self.n_actions):
            raise ValueError(f"action_context has {ctx.shape[0]} rows but n_actions is {self.n_actions}")
        return ctx

    @staticmethod
    def _features(context: np.ndarray, action: np.ndarray, action_context: np.ndarray) -> np.ndarray:
        return np.c_[context, action_context[action]]

    def fit(self, context: Any, action: Any, reward: Any, pscore: Any = None, position: Any = None,
            action_dist: Any = None) -> "RegressionModel":
        action_context = self._check()
        context = _array("context", context, 2)
        action = _array("action", action, 1).astype(np.int64)
        reward = _array("reward", reward, 1)
        n = len(context)
        for name, arr in (("action", action), ("reward", reward)):
            if len(arr) != n:
                raise ValueError(f"{name} has {len(arr)} rows but context has {n}")
        position = np.zeros(n, np.int64) if position is None or int(self.len_list) == 1 else _array("position", position, 1)
        if len(position) != n:
            raise ValueError(f"position has {len(position)} rows but context has {n}")
        if position.max() >= int(self.len_list):
            raise ValueError(f"position elements must be smaller than len_list ({self.len_list})")
        if pscore is None:
            pscore = np.ones_like(action) / int(self.n_actions)
        pscore = np.asarray(pscore, np.float64)
        if self.fitting_method in ("iw", "mrdr"):
            dist = np.asarray(action_dist) if action_dist is not None else None
            if dist is None or dist.shape != (n, int(self.n_actions), int(self.len_list)):
                raise ValueError("fitting_method 'iw'/'mrdr' needs action_dist of shape (n_rounds, n_actions, len_list)")
        self.base_model_list_ = [sklearn.base.clone(self.base_model) for _ in range(int(self.len_list))]
        self.action_context_ = action_context
        for pos in range(int(self.len_list)):
            idx = position == pos
            X = self._features(context[idx], action[idx], action_context)
            if X.shape[0] == 0:
                raise ValueError(f"no training data at position {pos}")
            model = self.base_model_list_[pos]
            if self.fitting_method == "normal":
                model.fit(X, reward[idx])
            else:
                pi_e = dist[np.arange(n), action, pos][idx]
                if self.fitting_method == "iw":
                    weight = pi_e / pscore[idx]
                else:
                    weight = pi_e * (1.0 - pscore[idx]) / pscore[idx] ** 2
                model.fit(X, reward[idx], sample_weight=weight)
        return self

    def predict(self, context: Any) -> np.ndarray:
        """(n_rounds, n_actions, len_list) estimated expected rewards."""
        context = _array("context", context, 2)
        n = len(context)
        q = np.zeros((n, int(self.n_actions), int(self.len_list)))
        for a in range(int(self.n_actions)):
            X = self._features(context, np.full(n, a, np.int64), self.action_context_)
            for pos, model in enumerate(self.base_model_list_):
                q[:, a, pos] = model.predict_proba(X)[:, 1] if sklearn.base.is_classifier(model) else model.predict(X)
        return q

    def fit_predict(self, context: Any, action: Any, reward: Any, pscore: Any = None, position: Any = None,
                    action_dist: Any = None, n_folds: int = 1, random_state: Any = None) -> np.ndarray:
        """Fit and predict on the same rounds; with `n_folds` > 1 each fold is predicted by a model fitted on the others."""
        from sklearn.model_selection import KFold

        context = _array("context", context, 2)
        action = np.asarray(action)
        reward = np.asarray(reward)
        n = len(context)
        if int(n_folds) < 1:
            raise ValueError(f"n_folds must be at least 1, got {n_folds}")
        if int(n_folds) == 1:
            return self.fit(context, action, reward, pscore, position, action_dist).predict(context)
        pscore = np.ones(n) / int(self.n_actions) if pscore is None else np.asarray(pscore)
        position = np.zeros(n, np.int64) if position is None else np.asarray(position)
        q = np.zeros((n, int(self.n_actions), int(self.len_list)))
        for train, test in KFold(n_splits=int(n_folds), shuffle=True, random_state=random_state).split(context):
            dist = None if action_dist is None else np.asarray(action_dist)[train]
            self.fit(context[train], action[train], reward[train], pscore[train], position[train], dist)
            q[test] = self.predict(context[test])
        return q


def evaluate_bandit(
    action_dists: dict[str, Any],
    *,
    reward: Any,
    action: Any,
    pscore: Any,
    context: Any = None,
    position: Any = None,
    estimators: Any = None,
    base_model: Any = None,
    n_folds: int = 3,
    true_values: dict[str, float] | None = None,
    random_state: Any = 0,
) -> Any:
    """Evaluate several target policies (name -> action_dist) on one bandit log; returns an OPEReport.

    Estimators default to all seven; the reward model for DM/DR-type
    estimators is `base_model` (default: logistic regression for 0/1
    rewards, ridge otherwise) fitted with `n_folds`-fold cross-fitting on
    `context`.
    """
    from offrl.ope.report import OPEReport

    if estimators is None:
        estimators = [IPW(), SNIPW(), DirectMethod(), DR(), SNDR(), SwitchDR(lambda_=100.0), DRShrinkage(lambda_=1.0)]
    reward_arr = np.asarray(reward, np.float64)
    action_arr = np.asarray(action)
    q_hat = None
    if any(getattr(e, "needs_q", False) for e in estimators):
        if context is None:
            raise ValueError("DM/DR-type estimators need context=... to fit the reward model")
        if base_model is None:
            from sklearn.linear_model import LogisticRegression, Ridge

            base_model = LogisticRegression(max_iter=1000) if set(np.unique(reward_arr)) <= {0.0, 1.0} else Ridge()
        first = np.asarray(next(iter(action_dists.values())))
        len_list = 1 if first.ndim == 2 else first.shape[2]
        model = RegressionModel(base_model, n_actions=first.shape[1], len_list=len_list)
        q_hat = model.fit_predict(np.asarray(context), action_arr, reward_arr, pscore=pscore, position=position,
                                  n_folds=n_folds, random_state=random_state)
    results: dict[str, dict[str, OPEResult]] = {}
    for name, dist in action_dists.items():
        results[name] = {}
        for est in estimators:
            results[name][est.estimator_name] = est.estimate(
                reward=reward_arr, action=action_arr, pscore=pscore, action_dist=dist, position=position,
                estimated_rewards_by_reg_model=q_hat if getattr(est, "needs_q", False) else None)
    return OPEReport(results, true_values=true_values)
