"""Episodic importance-sampling estimators and doubly robust estimators.

With w_t = pi_e(a_t|s_t) / pi_b(a_t|s_t) and w_{0:t} = prod_{u<=t} w_u, for
episodes truncated at `horizon` steps (or as logged):

- IS (trajectory-wise):   mean_i  w_{0:T-1} sum_t gamma^t r_t
- PDIS (per-decision):    mean_i  sum_t gamma^t w_{0:t} r_t
- WIS:                    sum_i w_{0:T-1} G_i / sum_i w_{0:T-1}
- WPDIS:                  sum_t gamma^t sum_i w_{i,0:t} r_{i,t} / sum_i w_{i,0:t}
- DR (Jiang & Li 2016; Thomas & Brunskill 2016):
      mean_i sum_t gamma^t [w_{0:t} (r_t - Q(s_t, a_t)) + w_{0:t-1} V(s_t)],
      V(s) = E_{a~pi_e} Q(s, a), w_{0:-1} = 1
- WDR: DR with each step's w_{0:t} and w_{0:t-1} divided by their mean over episodes.

Episodes shorter than the horizon are padded with zero rewards and their
cumulative weight carried forward (so the weighted estimators stay
consistent for variable-length episodes).  The estimand is the expected
discounted return over the first `horizon` steps (episodes end earlier at
terminals), from the dataset's initial states.

Hoeffding and Bernstein intervals (`interval=`) need ranges: `reward_bound`
(r_min, r_max) and `weight_bound`, an upper bound on the weights the
estimator uses (the trajectory weight w_{0:H-1} for IS and WIS, every
cumulative weight w_{0:t} for PDIS, WPDIS, DR and WDR; e.g. rho^H when every
per-step ratio pi_e / pi_b <= rho, rho >= 1).  Without them the observed
rewards and the largest observed weight are used, and the diagnostics say
that these are not guaranteed ranges; DR and WDR also use the observed range
of the Q model's outputs.  The weighted estimators' intervals bound each
step's ratio through its numerator and denominator (see `offrl.ope.results`).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable

import numpy as np
import sklearn.base

from offrl.datasets.core import Dataset
from offrl.ope.behavior import StepLogRatios, as_target_policy, log_importance_ratios, weight_diagnostics
from offrl.ope.results import (
    CONCENTRATION,
    OBSERVED_Q,
    ColumnRanges,
    OPEResult,
    OPEWarning,
    RatioComponents,
    check_gamma,
    check_horizon,
    check_weight_bound,
    effective_sample_size,
    make_result,
    resolve_log_weight_bound,
    return_range,
    reward_range,
)

__all__ = [
    "ImportanceSampling",
    "PerDecisionIS",
    "WeightedIS",
    "WeightedPerDecisionIS",
    "DoublyRobust",
    "WeightedDoublyRobust",
    "QFunction",
    "EpisodeGrid",
]

_MAX_LOG_WEIGHT = 700.0


class EpisodeGrid:
    """Episodes as an (n_episodes, H) grid of transition rows, truncated at `horizon` and padded."""

    def __init__(self, dataset: Dataset, horizon: int | None = None) -> None:
        lengths = dataset.episode_lengths()
        self.horizon = int(lengths.max()) if horizon is None else int(horizon)
        h = self.horizon
        self.lengths = np.minimum(lengths, h)
        steps = np.arange(h)
        self.mask = steps[None, :] < self.lengths[:, None]
        self.rows = np.where(self.mask, dataset.episode_starts[:-1, None] + steps[None, :], 0)
        self.n_episodes = len(lengths)
        self.initial_rows = dataset.episode_starts[:-1]

    def take(self, column: np.ndarray, fill: float = 0.0) -> np.ndarray:
        """`column[rows]` with `fill` at padded positions (column indexed by transition)."""
        out = np.asarray(column, np.float64)[self.rows]
        return np.where(self.mask.reshape(self.mask.shape + (1,) * (out.ndim - 2)), out, fill)

    def discounts(self, gamma: float) -> np.ndarray:
        return gamma ** np.arange(self.horizon, dtype=np.float64)

    def steps_to_go(self) -> np.ndarray:
        """H - t for every grid cell."""
        return np.broadcast_to(self.horizon - np.arange(self.horizon), self.mask.shape)


def _cumulative_log_weights(grid: EpisodeGrid, log_ratio: np.ndarray) -> np.ndarray:
    lr = grid.take(log_ratio, fill=0.0)
    with np.errstate(invalid="ignore"):
        return np.cumsum(lr, axis=1)  # -inf stays -inf (weight 0) once reached


def _column_tops(log_w: np.ndarray) -> np.ndarray:
    """The per-column log scale `_scaled` divides by: the largest log weight (0 where none is finite)."""
    top = np.max(log_w, axis=0)
    return np.where(np.isfinite(top), top, 0.0)


def _scaled(log_w: np.ndarray) -> np.ndarray:
    """exp(log_w - max over episodes) per column: the weights up to a per-step constant (for ratio estimators)."""
    return np.exp(log_w - _column_tops(log_w))


def _max_log(log_w: np.ndarray) -> float:
    """Largest finite log weight (0 when every weight is 0: any positive bound then holds)."""
    finite = log_w[np.isfinite(log_w)]
    return float(finite.max()) if len(finite) else 0.0


def _scaled_bounds(log_bound: float, tops: np.ndarray) -> np.ndarray:
    """The weight bound in `_scaled` units, per column (capped where it overflows: the bound is then vacuous)."""
    return np.exp(np.minimum(log_bound - tops, 690.0))


def _exp_weights(log_w: np.ndarray, notes: list[str]) -> np.ndarray:
    if np.any(log_w > _MAX_LOG_WEIGHT):
        notes.append(f"importance weights overflowed (log weight up to {float(np.max(log_w)):.0f}) and were clipped "
                     f"at exp({_MAX_LOG_WEIGHT:.0f}); the unweighted estimate is meaningless, use a weighted estimator, DR or FQE")
    return np.exp(np.minimum(log_w, _MAX_LOG_WEIGHT))


class _EpisodicEstimator(sklearn.base.BaseEstimator):
    """Shared parameters and plumbing of the episodic estimators."""

    name = "episodic"
    self_normalized = False
    per_decision_weights = False

    def __init__(
        self,
        *,
        gamma: float = 0.99,
        horizon: int | None = None,
        bandwidth: Any = "scott",
        interval: str = "bootstrap",
        alpha: float = 0.05,
        n_bootstrap: int = 2000,
        reward_bound: tuple[float, float] | None = None,
        weight_bound: float | None = None,
        random_state: Any = 0,
        warn: bool = True,
    ) -> None:
        self.gamma = gamma
        self.horizon = horizon
        self.bandwidth = bandwidth
        self.interval = interval
        self.alpha = alpha
        self.n_bootstrap = n_bootstrap
        self.reward_bound = reward_bound
        self.weight_bound = weight_bound
        self.random_state = random_state
        self.warn = warn

    def _prepare(self, dataset: Dataset, policy: Any, behavior: Any, log_ratios: StepLogRatios | None
                 ) -> tuple[float, EpisodeGrid, StepLogRatios]:
        if not isinstance(dataset, Dataset):
            raise TypeError(f"dataset must be an offrl Dataset, got {type(dataset).__name__}")
        gamma = check_gamma(self.gamma)
        grid = EpisodeGrid(dataset, check_horizon(self.horizon))
        if log_ratios is None:
            log_ratios = log_importance_ratios(dataset, policy, behavior, self.bandwidth)
        elif len(log_ratios.log_ratio) != dataset.n_transitions:
            raise ValueError(f"log_ratios has {len(log_ratios.log_ratio)} rows but the dataset has "
                             f"{dataset.n_transitions} transitions")
        return gamma, grid, log_ratios

    def _diagnostics(self, grid: EpisodeGrid, ratios: StepLogRatios, log_w: np.ndarray, notes: list[str]
                     ) -> dict[str, Any]:
        from scipy.special import logsumexp

        final = log_w[:, -1]
        finite = final[np.isfinite(final)]
        max_weight = float(np.exp(min(finite.max(), _MAX_LOG_WEIGHT))) if len(finite) else 0.0
        # per-decision ESS: ESS of w_{0:t} averaged over steps, weighted by gamma^t and the share of live episodes
        scaled = _scaled(log_w)
        ess_t = scaled.sum(0) ** 2 / np.maximum((scaled ** 2).sum(0), 1e-300)
        step_weight = grid.discounts(check_gamma(self.gamma)) * grid.mask.mean(0)
        ess_pd = float((ess_t * step_weight).sum() / step_weight.sum())
        weights = _scaled(final[:, None])[:, 0]
        if self.per_decision_weights:
            diag = weight_diagnostics(weights, list(ratios.warnings) + notes, warn=False, max_weight=max_weight,
                                      ess=ess_pd, log_max_weight=float(finite.max()) if len(finite) else None)
        else:
            diag = weight_diagnostics(weights, list(ratios.warnings) + notes, warn=False, max_weight=max_weight,
                                      log_max_weight=float(finite.max()) if len(finite) else None)
        diag["ess_trajectory"] = effective_sample_size(weights)
        diag["ess_per_decision"] = ess_pd
        diag["log_max_weight"] = float(finite.max()) if len(finite) else -math.inf
        log_mean = float(logsumexp(final) - math.log(len(final)))
        diag["mean_weight"] = float(np.exp(min(log_mean, _MAX_LOG_WEIGHT)))
        diag["behavior_policy"] = ratios.behavior
        diag.update(ratios.behavior_diagnostics)  # an estimated model's held-out log-likelihood
        diag["target_policy"] = ratios.target_kind
        if ratios.bandwidth is not None:
            diag["kernel_bandwidth"] = float(np.mean(ratios.bandwidth))
        diag["unsupported_mass"] = ratios.unsupported_mass
        diag["horizon"] = grid.horizon
        diag["gamma"] = float(self.gamma)
        if "warning" in diag and self.warn:
            warnings.warn(f"{self.name}: {diag['warning']}", OPEWarning, stacklevel=4)
        return diag

    def _result(self, components: RatioComponents, diag: dict[str, Any], bound: Any = None,
                ranges: ColumnRanges | None = None) -> OPEResult:
        return make_result(components, self.name, interval=self.interval, alpha=self.alpha,
                           n_bootstrap=self.n_bootstrap, random_state=self.random_state,
                           bound=bound, ranges=ranges, diagnostics=diag)

    def _concentration(self) -> bool:
        check_weight_bound(self.weight_bound)
        return self.interval in CONCENTRATION

    def _bounds(self, dataset: Dataset, grid: EpisodeGrid, log_w: np.ndarray, diag: dict[str, Any]
                ) -> tuple[float, float, float]:
        """(r_min, r_max, log W) for a concentration interval, their sources written to `diag`.

        W bounds the weights in `log_w` (those the estimator uses): `weight_bound`
        when given (checked against the data), else their observed maximum.
        """
        r_min, r_max, r_source = reward_range(self.reward_bound, grid.take(dataset.rewards)[grid.mask])
        log_bound, w_source = resolve_log_weight_bound(self.weight_bound, _max_log(log_w), "cumulative importance weight")
        diag.update({"weight_bound": float(np.exp(min(log_bound, _MAX_LOG_WEIGHT))), "weight_bound_source": w_source,
                     "reward_low": r_min, "reward_high": r_max, "reward_bound_source": r_source})
        return r_min, r_max, log_bound


class _ISFamily(_EpisodicEstimator):
    per_decision = False

    @property
    def per_decision_weights(self) -> bool:
        return self.per_decision

    def estimate(self, dataset: Dataset, policy: Any, *, behavior: Any = None,
                 log_ratios: StepLogRatios | None = None) -> OPEResult:
        """Estimate the value of `policy` from `dataset` (see the module docstring for the formula)."""
        gamma, grid, ratios = self._prepare(dataset, policy, behavior, log_ratios)
        notes: list[str] = []
        log_w = _cumulative_log_weights(grid, ratios.log_ratio)
        disc = grid.discounts(gamma)
        rewards = grid.take(dataset.rewards) * disc
        final = log_w[:, -1]
        used = log_w if self.per_decision else final[:, None]  # the weights this estimator multiplies rewards by
        if self.self_normalized:
            w = _scaled(used)
            components = RatioComponents(w * rewards, w) if self.per_decision else RatioComponents(w * rewards.sum(1, keepdims=True), w)
        else:
            w = _exp_weights(log_w, notes)
            if self.per_decision:
                samples = (w * rewards).sum(1)
            else:
                samples = w[:, -1] * rewards.sum(1)
            components = RatioComponents(samples)
        diag = self._diagnostics(grid, ratios, log_w, notes)
        bound = ranges = None
        if self._concentration():
            r_min, r_max, log_bound = self._bounds(dataset, grid, used, diag)
            g_min, g_max = return_range(r_min, r_max, disc)
            if self.self_normalized and self.per_decision:
                # step t: X_t = gamma^t r_t (0 once the episode has ended; every episode is alive at t = 0)
                alive_low = np.where(np.arange(grid.horizon) == 0, r_min, min(r_min, 0.0))
                alive_high = np.where(np.arange(grid.horizon) == 0, r_max, max(r_max, 0.0))
                ranges = ColumnRanges(disc * alive_low, disc * alive_high, _scaled_bounds(log_bound, _column_tops(used)))
            elif self.self_normalized:
                ranges = ColumnRanges([g_min], [g_max], _scaled_bounds(log_bound, _column_tops(used)))
            else:
                top = float(np.exp(min(log_bound, _MAX_LOG_WEIGHT)))
                scale = float(disc.sum())
                bound = ((scale * min(0.0, top * r_min), scale * max(0.0, top * r_max)) if self.per_decision
                         else (min(0.0, top * g_min), max(0.0, top * g_max)))
        return self._result(components, diag, bound, ranges)


class ImportanceSampling(_ISFamily):
    """Trajectory-wise importance sampling (unbiased with exact propensities)."""

    name = "IS"


class PerDecisionIS(_ISFamily):
    """Per-decision importance sampling (Precup et al. 2000): unbiased, lower variance than IS."""

    name = "PDIS"
    per_decision = True


class WeightedIS(_ISFamily):
    """Weighted (self-normalised) trajectory-wise IS: biased, consistent, bounded by the returns."""

    name = "WIS"
    self_normalized = True


class WeightedPerDecisionIS(_ISFamily):
    """Weighted per-decision IS: each step's cumulative weights divided by their mean over episodes."""

    name = "WPDIS"
    per_decision = True
    self_normalized = True


# ---------------------------------------------------------------------- Q functions for DR
class QFunction:
    """Q(s, a) (and V(s) = E_pi Q(s, .)) for DR, from plain callables.

    `q(obs, actions)` -> (n,); `v(obs)` -> (n,) optional: without it V is
    computed from `policy` (sum over actions for discrete policies, Q at
    pi(s) for deterministic ones, a mean over `n_action_samples` samples for
    stochastic ones).  Finite-horizon callables may take a third argument,
    the steps to go.
    """

    def __init__(self, q: Callable, v: Callable | None = None, policy: Any = None, n_action_samples: int = 16,
                 random_state: Any = 0) -> None:
        self.q, self.v, self.policy = q, v, policy
        self.n_action_samples = n_action_samples
        self.random_state = random_state

    @staticmethod
    def _call(fn: Callable, *args: Any, steps_to_go: np.ndarray | None) -> np.ndarray:
        from offrl.ope.behavior import _n_required_args

        if steps_to_go is not None and _n_required_args(fn) > len(args):
            return np.asarray(fn(*args, steps_to_go), np.float64).reshape(-1)
        return np.asarray(fn(*args), np.float64).reshape(-1)

    def q_values(self, obs: np.ndarray, actions: np.ndarray, steps_to_go: np.ndarray | None = None) -> np.ndarray:
        return self._call(self.q, obs, actions, steps_to_go=steps_to_go)

    def state_values(self, obs: np.ndarray, steps_to_go: np.ndarray | None = None, dataset: Dataset | None = None
                     ) -> np.ndarray:
        if self.v is not None:
            return self._call(self.v, obs, steps_to_go=steps_to_go)
        if self.policy is None:
            raise ValueError("QFunction needs v=... or policy=... to compute V(s) = E_pi Q(s, .)")
        target = as_target_policy(self.policy, dataset)
        if target.kind == "discrete":
            p = target.probs(obs)
            total = np.zeros(len(obs))
            for a in range(p.shape[1]):
                total += p[:, a] * self.q_values(obs, np.full((len(obs), 1), a, np.float32), steps_to_go)
            return total
        rng = np.random.default_rng(self.random_state)
        n = 1 if target.kind == "deterministic" else int(self.n_action_samples)
        samples = target.sample_actions(obs, n, rng)
        return np.mean([self.q_values(obs, s, steps_to_go) for s in samples], axis=0)


class _DRFamily(_EpisodicEstimator):
    """DR / WDR.  `q_function`: a fitted FQE, a QFunction, or None (an FQE with `fqe_params` is fitted)."""

    per_decision_weights = True

    def __init__(
        self,
        *,
        gamma: float = 0.99,
        horizon: int | None = None,
        q_function: Any = None,
        fqe_params: dict[str, Any] | None = None,
        bandwidth: Any = "scott",
        interval: str = "bootstrap",
        alpha: float = 0.05,
        n_bootstrap: int = 2000,
        reward_bound: tuple[float, float] | None = None,
        weight_bound: float | None = None,
        random_state: Any = 0,
        warn: bool = True,
    ) -> None:
        super().__init__(gamma=gamma, horizon=horizon, bandwidth=bandwidth, interval=interval, alpha=alpha,
                         n_bootstrap=n_bootstrap, reward_bound=reward_bound, weight_bound=weight_bound,
                         random_state=random_state, warn=warn)
        self.q_function = q_function
        self.fqe_params = fqe_params

    def _q_function(self, dataset: Dataset, policy: Any, q_function: Any) -> Any:
        q = q_function if q_function is not None else self.q_function
        if q is None:
            from offrl.ope.fqe import FQE

            params = {"gamma": self.gamma, "horizon": self.horizon, "random_state": self.random_state,
                      **(self.fqe_params or {})}
            q = FQE(**params).fit(dataset, policy=policy, progress=False)
        elif isinstance(q, tuple):
            q = QFunction(*q, policy=policy)
        elif callable(q) and not hasattr(q, "q_values"):
            q = QFunction(q, policy=policy)
        return q

    def estimate(self, dataset: Dataset, policy: Any, *, behavior: Any = None, q_function: Any = None,
                 log_ratios: StepLogRatios | None = None) -> OPEResult:
        """Estimate the value of `policy`; `q_function` overrides the one given at construction."""
        gamma, grid, ratios = self._prepare(dataset, policy, behavior, log_ratios)
        q = self._q_function(dataset, policy, q_function)
        notes: list[str] = []
        finite_h = getattr(q, "horizon", None) is not None
        mask = grid.mask
        rows = grid.rows[mask]
        steps = grid.steps_to_go()[mask] if finite_h else None
        if finite_h and int(q.horizon) != grid.horizon:
            raise ValueError(f"the Q function was fitted for horizon {q.horizon} but this estimator uses horizon "
                             f"{grid.horizon}; fit FQE with the same horizon")
        obs = dataset.observations[rows]
        q_sa = np.zeros(mask.shape)
        v_s = np.zeros(mask.shape)
        q_sa[mask] = q.q_values(obs, dataset.actions[rows], steps)
        v_s[mask] = q.state_values(obs, steps, dataset=dataset) if _accepts_dataset(q) else q.state_values(obs, steps)
        rewards = grid.take(dataset.rewards)
        disc = grid.discounts(gamma)
        log_w = _cumulative_log_weights(grid, ratios.log_ratio)
        log_w_prev = np.concatenate([np.zeros((grid.n_episodes, 1)), log_w[:, :-1]], axis=1)
        if self.self_normalized:
            w, w_prev = _scaled(log_w), _scaled(log_w_prev)
            num = np.concatenate([disc * w * (rewards - q_sa), disc * w_prev * v_s], axis=1)
            den = np.concatenate([w, w_prev], axis=1)
            components = RatioComponents(num, den)
        else:
            w, w_prev = _exp_weights(log_w, notes), np.exp(np.minimum(log_w_prev, _MAX_LOG_WEIGHT))
            samples = (disc * (w * (rewards - q_sa) + w_prev * v_s)).sum(1)
            components = RatioComponents(samples)
        diag = self._diagnostics(grid, ratios, log_w, notes)
        diag["dm_value"] = float(v_s[:, 0].mean())
        bound = ranges = None
        if self._concentration():
            r_min, r_max, log_bound = self._bounds(dataset, grid, log_w, diag)
            log_bound_prev = max(log_bound, 0.0)  # w_{0:-1} = 1
            # the Q model's outputs are only known on the logged states: their observed range
            q_low, q_high = float(q_sa[mask].min()), float(q_sa[mask].max())
            v_low, v_high = float(v_s[mask].min()), float(v_s[mask].max())
            diag.update({"q_range_low": min(q_low, v_low), "q_range_high": max(q_high, v_high),
                         "q_range_source": OBSERVED_Q})
            d_low, d_high = r_min - q_high, r_max - q_low  # r_t - Q(s_t, a_t)
            first = np.arange(grid.horizon) == 0  # every episode is alive at t = 0; later terms may be 0
            if self.self_normalized:
                x_low = np.concatenate([disc * np.where(first, d_low, min(d_low, 0.0)),
                                        disc * np.where(first, v_low, min(v_low, 0.0))])
                x_high = np.concatenate([disc * np.where(first, d_high, max(d_high, 0.0)),
                                         disc * np.where(first, v_high, max(v_high, 0.0))])
                prev_bounds = _scaled_bounds(log_bound_prev, _column_tops(log_w_prev))
                prev_bounds[0] = np.nan  # w_{0:-1} = 1 for every episode: a plain mean of V(s_0)
                ranges = ColumnRanges(x_low, x_high,
                                      np.concatenate([_scaled_bounds(log_bound, _column_tops(log_w)), prev_bounds]))
            else:
                top = float(np.exp(min(log_bound, _MAX_LOG_WEIGHT)))
                top_prev = float(np.exp(min(log_bound_prev, _MAX_LOG_WEIGHT)))
                scale = float(disc.sum())
                bound = (scale * (top * min(0.0, d_low) + top_prev * min(0.0, v_low)),
                         scale * (top * max(0.0, d_high) + top_prev * max(0.0, v_high)))
        return self._result(components, diag, bound, ranges)


def _accepts_dataset(q: Any) -> bool:
    import inspect

    try:
        return "dataset" in inspect.signature(q.state_values).parameters
    except (TypeError, ValueError):
        return False


class DoublyRobust(_DRFamily):
    """Doubly robust (per-decision) estimator with Q from a fitted FQE (or any QFunction)."""

    name = "DR"


class WeightedDoublyRobust(_DRFamily):
    """Weighted doubly robust (Thomas & Brunskill 2016): DR with self-normalised per-step weights."""

    name = "WDR"
    self_normalized = True
