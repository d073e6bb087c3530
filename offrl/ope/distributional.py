"""Distributional OPE: the estimated CDF of each policy's discounted return, and risk measures read from it.

A policy's mean value hides how often it does badly.  These estimators give
the whole distribution function F(x) = P_pi(G <= x) of the discounted return
G = sum_{t<H} gamma^t r_t over the first `horizon` steps (Chandak et al. 2021,
"Universal Off-Policy Evaluation"; Huang et al. 2021; SCOPE-RL's cumulative
distribution OPE).  With G_i the i-th logged episode's return, s0_i / a0_i
its first state / action and w_i = prod_{t<H} pi_e(a_t|s_t) / pi_b(a_t|s_t)
its trajectory weight:

- CD-IS:    F(x) = (1/n) sum_i w_i 1{G_i <= x}
- CD-SNIS:  F(x) = sum_i w_i 1{G_i <= x} / sum_i w_i
- CD-DM:    F(x) = (1/n) sum_i Fhat(x | s0_i, pi)
- CD-DR:    F(x) = (1/n) sum_i Fhat(x | s0_i, pi) + (1/n) sum_i w_i [1{G_i <= x} - Fhat(x | s0_i, a0_i)]
- CD-SNDR:  CD-DR with the correction divided by sum_i w_i instead of n

CD-DR and CD-SNDR are SCOPE-RL's trajectory-wise DR (its CumulativeDistributionTDR
/ SNTDR): the control variate carries the whole trajectory weight w_i, which
keeps CD-DR unbiased for any model because E_b[w_i Fhat(x|s0_i, a0_i)] =
E[Fhat(x|s0, pi)].  Fhat(x | s, a) is the empirical CDF of returns simulated
in a learned model (`offrl.ope.model_based.ModelBased`, one roll-out per
ensemble elite and `n_rollouts` per start): from s, take a (or a ~ pi for
Fhat(x | s, pi)), then follow pi.  `ModelBased.rollout_returns` cannot start
from a given first action and weights rewards by a survival probability
where the data has terminals (a mean over terminations, not a sample of
them), so the roll-outs here step the same fitted dynamics themselves and
draw terminations.  (SCOPE-RL's own DM/TDR put all of Fhat's mass on a fitted
Q-value instead of simulating returns.)

Every estimate is made non-decreasing (a running maximum) and clipped to
[0, 1], as SCOPE-RL does; the self-normalised ones end at 1.  CD-IS and CD-DR
may end below 1: the statistics then put the missing mass at the largest
return on the grid (the CDF reaches 1 at the top of the observed support, as
in Chandak et al.).  Statistics (mean, variance, CVaR, interquartile range)
come with percentile-bootstrap intervals over episodes: each resample
recomputes the estimator's CDF with the same per-episode weights and model
roll-outs (the behaviour and dynamics models are not refitted).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import sklearn.base

from offrl.datasets.core import Dataset
from offrl.ope.behavior import (
    BehaviorEstimate,
    StepLogRatios,
    as_target_policy,
    estimate_behavior,
    log_importance_ratios,
    weight_diagnostics,
)
from offrl.ope.episodic import EpisodeGrid, _cumulative_log_weights, _exp_weights, _scaled
from offrl.ope.results import OPEWarning, check_alpha, check_gamma, check_horizon, effective_sample_size

__all__ = [
    "ReturnDistribution",
    "CumulativeDistributionIS",
    "CumulativeDistributionSNIS",
    "CumulativeDistributionDM",
    "CumulativeDistributionDR",
    "CumulativeDistributionSNDR",
    "DISTRIBUTIONAL_ESTIMATORS",
    "evaluate_distributions",
    "exact_return_distribution",
    "ks_distance",
]

_TIE = 1e-10  # tolerance of F(x) >= q, so that a quantile at an atom's exact CDF value is not lost to rounding
_CHUNK_ENTRIES = 2_000_000  # bootstrap rows x atoms handled at once


# ---------------------------------------------------------------------- statistics of CDFs on a grid
def _masses(cdf: np.ndarray) -> np.ndarray:
    """(B, K) probabilities of the grid points; the mass a CDF misses (1 - F(max)) goes to the largest point."""
    p = np.diff(cdf, axis=1, prepend=0.0)
    p[:, -1] += 1.0 - cdf[:, -1]
    return np.clip(p, 0.0, None)


def _quantiles(grid: np.ndarray, completed: np.ndarray, q: float) -> np.ndarray:
    """inf{x on the grid: F(x) >= q} per row of the completed CDFs."""
    hit = completed >= q - _TIE
    return grid[np.argmax(hit, axis=1)]


def _cvars(grid: np.ndarray, completed: np.ndarray, alpha: float) -> np.ndarray:
    """(1/alpha) int_0^alpha F^{-1}(u) du per row: the mean of the lowest alpha share of returns (the boundary
    atom split exactly)."""
    capped = np.minimum(completed, alpha)
    share = np.diff(capped, axis=1, prepend=0.0)
    return (share * grid).sum(1) / alpha


def _statistics(grid: np.ndarray, cdf: np.ndarray, cvar_alpha: float) -> dict[str, np.ndarray]:
    """Mean, variance, CVaR at `cvar_alpha` and interquartile range of each row of `cdf` (B, K)."""
    p = _masses(cdf)
    total = p.sum(1)
    p = p / np.where(total > 0, total, 1.0)[:, None]
    completed = np.cumsum(p, axis=1)
    mean = p @ grid
    variance = (p * (grid[None, :] - mean[:, None]) ** 2).sum(1)
    return {
        "mean": mean,
        "variance": variance,
        f"cvar_{cvar_alpha:g}": _cvars(grid, completed, cvar_alpha),
        "iqr": _quantiles(grid, completed, 0.75) - _quantiles(grid, completed, 0.25),
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


@dataclass
class ReturnDistribution:
    """An estimated CDF of the discounted return: F(grid[j]) = cdf[j], a right-continuous step function.

    `statistics`: name -> (value, ci_low, ci_high) for "mean", "variance",
    "cvar_<cvar_alpha>" and "iqr", with (1 - alpha) percentile-bootstrap
    intervals (empty for an exact distribution).  CVaR is the risk of a low
    return: the mean of the lowest `alpha` share of returns,
    (1/alpha) int_0^alpha F^{-1}(u) du, higher is safer.  Where `cdf` ends
    below 1 the missing mass sits at the largest grid value.
    """

    grid: np.ndarray
    cdf: np.ndarray
    method: str
    diagnostics: dict[str, Any] = field(default_factory=dict)
    statistics: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    alpha: float = 0.05
    cvar_alpha: float = 0.1

    def __post_init__(self) -> None:
        self.grid = np.asarray(self.grid, np.float64).reshape(-1)
        self.cdf = np.asarray(self.cdf, np.float64).reshape(-1)
        if len(self.grid) == 0 or len(self.grid) != len(self.cdf):
            raise ValueError(f"grid has {len(self.grid)} points but cdf has {len(self.cdf)}; they must have the "
                             f"same, positive length")
        if not (np.all(np.isfinite(self.grid)) and np.all(np.isfinite(self.cdf))):
            raise ValueError("grid and cdf must be finite")
        if np.any(np.diff(self.grid) < 0):
            raise ValueError("grid must be sorted in increasing order")
        if np.any(self.cdf < -1e-12) or np.any(self.cdf > 1 + 1e-12) or np.any(np.diff(self.cdf) < -1e-12):
            raise ValueError("cdf must be non-decreasing within [0, 1]")

    @classmethod
    def from_probabilities(cls, support: Any, probabilities: Any, method: str = "exact", **kwargs: Any
                           ) -> "ReturnDistribution":
        """A distribution with the given atoms (support values, any order) and their probabilities."""
        support = np.asarray(support, np.float64).reshape(-1)
        probabilities = np.asarray(probabilities, np.float64).reshape(-1)
        if len(support) != len(probabilities):
            raise ValueError(f"support has {len(support)} values but probabilities has {len(probabilities)}")
        if np.any(probabilities < 0) or not math.isclose(float(probabilities.sum()), 1.0, abs_tol=1e-9):
            raise ValueError("probabilities must be non-negative and sum to 1")
        order = np.argsort(support, kind="stable")
        values, first = np.unique(support[order], return_index=True)
        mass = np.add.reduceat(probabilities[order], first)
        return cls(values, np.clip(np.cumsum(mass), 0.0, 1.0), method, **kwargs)

    # ------------------------------------------------------------------ reading the CDF
    def cdf_at(self, x: Any) -> np.ndarray:
        """F(x) at any points (0 below the grid)."""
        idx = np.searchsorted(self.grid, np.asarray(x, np.float64), side="right")
        return np.where(idx > 0, self.cdf[np.maximum(idx - 1, 0)], 0.0)

    def probabilities(self) -> np.ndarray:
        """The probability of each grid value (the missing mass, if any, at the last)."""
        return _masses(self.cdf[None, :])[0]

    def mean(self) -> float:
        return float(_statistics(self.grid, self.cdf[None, :], self.cvar_alpha)["mean"][0])

    def variance(self) -> float:
        return float(_statistics(self.grid, self.cdf[None, :], self.cvar_alpha)["variance"][0])

    def quantile(self, q: float) -> float:
        """inf{x: F(x) >= q}, the lower q-quantile (q in (0, 1])."""
        if not 0.0 < float(q) <= 1.0:
            raise ValueError(f"q must lie in (0, 1], got {q}")
        return float(_quantiles(self.grid, np.cumsum(self.probabilities())[None, :], float(q))[0])

    def cvar(self, alpha: float | None = None) -> float:
        """Mean of the lowest `alpha` share of returns (default: `cvar_alpha`); the boundary atom is split exactly.

        SCOPE-RL's estimate_conditional_value_at_risk takes the whole grid cell where F first exceeds alpha, an
        approximation of the same quantity on its grid.
        """
        alpha = self.cvar_alpha if alpha is None else float(alpha)
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"the CVaR level alpha must lie in (0, 1], got {alpha}")
        return float(_cvars(self.grid, np.cumsum(self.probabilities())[None, :], alpha)[0])

    def interquartile_range(self, alpha: float = 0.25) -> float:
        """quantile(1 - alpha) - quantile(alpha): the interquartile range by default.

        SCOPE-RL's estimate_interquartile_range returns the median and the alpha and 1 - alpha quantiles
        (alpha = 0.05 by default); `quantile` gives those.
        """
        if not 0.0 < float(alpha) < 0.5:
            raise ValueError(f"alpha must lie in (0, 0.5), got {alpha}")
        return self.quantile(1.0 - float(alpha)) - self.quantile(float(alpha))

    def to_dict(self) -> dict[str, Any]:
        """Plain lists and numbers (JSON-ready)."""
        return {
            "method": self.method, "grid": self.grid.tolist(), "cdf": self.cdf.tolist(), "alpha": float(self.alpha),
            "cvar_alpha": float(self.cvar_alpha),
            "statistics": {name: {"value": float(v), "ci_low": float(lo), "ci_high": float(hi)}
                           for name, (v, lo, hi) in self.statistics.items()},
            "diagnostics": _jsonable(self.diagnostics),
        }

    def __repr__(self) -> str:
        return (f"ReturnDistribution(method={self.method!r}, {len(self.grid)} grid points, mean={self.mean():.4g}, "
                f"cvar_{self.cvar_alpha:g}={self.cvar():.4g})")


# ---------------------------------------------------------------------- estimators as signed atoms
@dataclass
class _Atoms:
    """A CDF estimate as point masses: F(x) = sum_{a: value_a <= x} c_a count(episode_a) / denominator.

    `plain` coefficients are divided by the number of episodes; `weighted` ones by the same, or by the sum of
    `normalizer` (per-episode weights) over the sample for self-normalised estimators.  With counts = 1 this is
    the estimate; with bootstrap counts, the estimate on a resample of episodes.
    """

    values: np.ndarray
    episode: np.ndarray
    plain: np.ndarray
    weighted: np.ndarray
    normalizer: np.ndarray | None = None


def _concat(*parts: _Atoms) -> _Atoms:
    return _Atoms(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("values", "episode", "plain", "weighted")),
                  normalizer=next((p.normalizer for p in parts if p.normalizer is not None), None))


def _sample_atoms(samples: np.ndarray, coefficient: np.ndarray | float, kind: str) -> _Atoms:
    """Atoms of per-episode samples (n, m): each of episode i's m samples carries coefficient_i / m."""
    n, m = samples.shape
    coef = np.broadcast_to(np.asarray(coefficient, np.float64), (n,)) / m
    each = np.repeat(coef, m)
    zeros = np.zeros(n * m)
    return _Atoms(samples.reshape(-1).astype(np.float64), np.repeat(np.arange(n), m),
                  each if kind == "plain" else zeros, each if kind == "weighted" else zeros)


def _cdfs(atoms: _Atoms, counts: np.ndarray, self_normalized: bool) -> tuple[np.ndarray, np.ndarray]:
    """(grid (K,), CDFs (B, K)): the estimate for each row of episode `counts` (B, n), monotone and in [0, 1]."""
    order = np.argsort(atoms.values, kind="stable")
    values = atoms.values[order]
    last = np.append(np.flatnonzero(np.diff(values) > 0), len(values) - 1)  # the last atom of each distinct value
    grid = values[last]
    episode, plain, weighted = atoms.episode[order], atoms.plain[order], atoms.weighted[order]
    has_plain, has_weighted = bool(np.any(plain)), bool(np.any(weighted))
    out = np.empty((len(counts), len(grid)))
    rows = max(1, _CHUNK_ENTRIES // max(len(values), 1))
    for start in range(0, len(counts), rows):
        c = counts[start:start + rows].astype(np.float64)
        per_atom = c[:, episode]
        f = np.zeros((len(c), len(grid)))
        n = c.sum(1)
        if has_plain:
            f += np.cumsum(per_atom * plain, axis=1)[:, last] / n[:, None]
        if has_weighted:
            den = c @ atoms.normalizer if atoms.normalizer is not None else n
            safe = np.where(den > 0, den, np.inf)  # a resample with no weight at all adds no correction
            f += np.cumsum(per_atom * weighted, axis=1)[:, last] / safe[:, None]
        f = np.clip(np.maximum.accumulate(f, axis=1), 0.0, 1.0)
        if self_normalized:
            f[:, -1] = 1.0
        out[start:start + rows] = f
    return grid, out


def _bootstrap_counts(n: int, n_bootstrap: int, rng: np.random.Generator) -> np.ndarray:
    """(n_bootstrap, n) multiplicities of the episodes in each resample (with replacement)."""
    draws = rng.integers(n, size=(n_bootstrap, n))
    flat = draws + n * np.arange(n_bootstrap)[:, None]
    return np.bincount(flat.reshape(-1), minlength=n_bootstrap * n).reshape(n_bootstrap, n)


def _simulate_returns(model: Any, initial_observations: np.ndarray, policy: Any, horizon: int, gamma: float, *,
                      first_actions: np.ndarray | None = None, n_rollouts: int = 1, dataset: Dataset | None = None,
                      random_state: Any = 0) -> np.ndarray:
    """(n, n_elites * n_rollouts) discounted returns simulated in a fitted `ModelBased` from each start.

    Elite k drives its roll-outs from start to end; `first_actions` (n, action_dim) replace the policy's first
    action; terminations are drawn from the model's termination probability (the return stops there).
    """
    import torch

    if not hasattr(model, "dynamics_"):
        raise ValueError("the model is not fitted; pass a fitted offrl.ope.ModelBased (or model=None to fit one)")
    target = as_target_policy(policy, dataset)
    dynamics = model.dynamics_
    device = dynamics.obs_mean.device
    n = len(initial_observations)
    reps = int(n_rollouts)
    starts = np.repeat(np.asarray(initial_observations, np.float32).reshape(n, -1), reps, axis=0)
    k, n0 = int(dynamics.n_elites), len(starts)
    rng = np.random.default_rng(random_state)
    gen = torch.Generator(device=device).manual_seed(int(rng.integers(2**31 - 1)))
    state = np.broadcast_to(starts, (k, n0, starts.shape[1])).copy()
    first = None if first_actions is None else np.repeat(np.asarray(first_actions, np.float32).reshape(n, -1), reps, 0)
    alive = np.ones((k, n0))
    total = np.zeros((k, n0))
    has_terminals = bool(dynamics.has_terminals)
    with torch.no_grad():
        for t in range(int(horizon)):
            if t == 0 and first is not None:
                act = np.broadcast_to(first, (k, n0, first.shape[1]))
            else:
                act = np.asarray(target.act(state.reshape(k * n0, -1), rng), np.float32).reshape(k, n0, -1)
            nxt, reward, p_terminal = dynamics.step(torch.as_tensor(state, device=device),
                                                    torch.as_tensor(np.ascontiguousarray(act), device=device), gen,
                                                    sample=bool(getattr(model, "sample_noise", True)))
            total += (gamma ** t) * alive * reward.double().cpu().numpy()
            if has_terminals:
                alive = alive * (rng.random((k, n0)) >= p_terminal.double().cpu().numpy())
            state = nxt.cpu().numpy().astype(np.float32)
    return total.reshape(k, n, reps).transpose(1, 0, 2).reshape(n, k * reps)


class _DistributionalEstimator(sklearn.base.BaseEstimator):
    """Shared parameters and plumbing: episodes, weights, model roll-outs, bootstrap statistics."""

    name = "CD"
    self_normalized = False
    uses_weights = True
    uses_model = False

    def __init__(self, *, gamma: float = 0.99, horizon: int | None = None, bandwidth: Any = "scott",
                 alpha: float = 0.05, cvar_alpha: float = 0.1, n_bootstrap: int = 500, random_state: Any = 0,
                 warn: bool = True) -> None:
        self.gamma = gamma
        self.horizon = horizon
        self.bandwidth = bandwidth
        self.alpha = alpha
        self.cvar_alpha = cvar_alpha
        self.n_bootstrap = n_bootstrap
        self.random_state = random_state
        self.warn = warn

    # ------------------------------------------------------------------ pieces
    def _check(self, dataset: Dataset) -> tuple[float, EpisodeGrid]:
        if not isinstance(dataset, Dataset):
            raise TypeError(f"dataset must be an offrl Dataset, got {type(dataset).__name__}")
        dataset.require_labels("rewards", context=self.name)
        gamma = check_gamma(self.gamma)
        check_alpha(self.alpha)
        if not 0.0 < float(self.cvar_alpha) <= 1.0:
            raise ValueError(f"cvar_alpha must lie in (0, 1] (e.g. 0.1: the mean of the worst 10% of returns), "
                             f"got {self.cvar_alpha}")
        if int(self.n_bootstrap) < 0:
            raise ValueError(f"n_bootstrap must be >= 0 (0: no intervals), got {self.n_bootstrap}")
        return gamma, EpisodeGrid(dataset, check_horizon(self.horizon))

    def _weights(self, dataset: Dataset, grid: EpisodeGrid, policy: Any, behavior: Any,
                 log_ratios: StepLogRatios | None) -> tuple[np.ndarray, dict[str, Any]]:
        """Per-episode trajectory weights (scaled by their maximum when self-normalised) and their diagnostics."""
        if log_ratios is None:
            log_ratios = log_importance_ratios(dataset, policy, behavior, self.bandwidth)
        elif len(log_ratios.log_ratio) != dataset.n_transitions:
            raise ValueError(f"log_ratios has {len(log_ratios.log_ratio)} rows but the dataset has "
                             f"{dataset.n_transitions} transitions")
        log_w = _cumulative_log_weights(grid, log_ratios.log_ratio)[:, -1]
        notes: list[str] = []
        scaled = _scaled(log_w[:, None])[:, 0]
        weights = scaled if self.self_normalized else _exp_weights(log_w, notes)
        finite = log_w[np.isfinite(log_w)]
        log_max = float(finite.max()) if len(finite) else -math.inf
        diag = weight_diagnostics(scaled, list(log_ratios.warnings) + notes, warn=False,
                                  max_weight=float(np.exp(min(log_max, 700.0))) if len(finite) else 0.0,
                                  log_max_weight=log_max if len(finite) else None)
        diag["n"] = grid.n_episodes
        diag["ess_trajectory"] = effective_sample_size(scaled)
        diag["log_max_weight"] = log_max
        diag["mean_weight"] = float(np.mean(np.exp(np.minimum(log_w, 700.0))))
        diag["behavior_policy"] = log_ratios.behavior
        diag.update(log_ratios.behavior_diagnostics)
        diag["target_policy"] = log_ratios.target_kind
        diag["unsupported_mass"] = log_ratios.unsupported_mass
        if self.self_normalized and not np.any(scaled > 0):
            raise ValueError(f"{self.name}: every trajectory weight is 0 (the target policy never takes the logged "
                             f"actions), so a self-normalised CDF is undefined; use CD-DM or a policy the data covers")
        return weights, diag

    def _model(self, dataset: Dataset, model: Any) -> Any:
        if model is None:
            model = distribution_model(gamma=self.gamma, horizon=self.horizon, random_state=self.random_state,
                                       mb_params=getattr(self, "mb_params", None))
        if not hasattr(model, "dynamics_"):
            model = model.fit(dataset)
        return model

    def _model_samples(self, dataset: Dataset, grid: EpisodeGrid, policy: Any, model: Any, gamma: float,
                       first_actions: bool, seed_offset: int) -> np.ndarray:
        rows = grid.initial_rows
        seed = int(np.random.default_rng(self.random_state).integers(2**31 - 1)) + seed_offset
        return _simulate_returns(model, dataset.observations[rows], policy, grid.horizon, gamma,
                                 first_actions=dataset.actions[rows] if first_actions else None,
                                 n_rollouts=int(getattr(self, "n_rollouts", 1)), dataset=dataset, random_state=seed)

    def _atoms(self, dataset: Dataset, grid: EpisodeGrid, gamma: float, policy: Any, behavior: Any,
               log_ratios: StepLogRatios | None, model: Any) -> tuple[_Atoms, dict[str, Any]]:
        """Abstract: each estimator's returns and per-episode weights (its CDF's atoms) and its diagnostics."""
        raise NotImplementedError(f"{type(self).__name__} must define _atoms")

    # ------------------------------------------------------------------ the estimate
    def estimate_distribution(self, dataset: Dataset, policy: Any, *, behavior: Any = None,
                              log_ratios: StepLogRatios | None = None, model: Any = None) -> ReturnDistribution:
        """The estimated return distribution of `policy` (see the module docstring for the formula).

        `log_ratios`: per-step log importance ratios already computed (`log_importance_ratios`), else they are
        computed with `behavior`; `model`: a fitted `ModelBased` for CD-DM / CD-DR (else one is fitted).
        """
        gamma, grid = self._check(dataset)
        atoms, diag = self._atoms(dataset, grid, gamma, policy, behavior, log_ratios, model)
        n = grid.n_episodes
        values, cdf = _cdfs(atoms, np.ones((1, n), np.int64), self.self_normalized)
        cdf = cdf[0]
        cvar_alpha = float(self.cvar_alpha)
        point = _statistics(values, cdf[None, :], cvar_alpha)
        statistics = {k: (float(v[0]), math.nan, math.nan) for k, v in point.items()}
        n_boot = int(self.n_bootstrap)
        if n_boot > 0:
            rng = np.random.default_rng(self.random_state)
            counts = _bootstrap_counts(n, n_boot, rng)
            # each resample's CDF lives on its own atoms: the same sorted grid, with absent episodes weighing 0
            _, boot = _cdfs(atoms, counts, self.self_normalized)
            stats = _statistics(values, boot, cvar_alpha)
            a = float(self.alpha)
            for key, samples in stats.items():
                lo, hi = np.nanquantile(samples, [a / 2, 1 - a / 2])
                statistics[key] = (statistics[key][0], float(lo), float(hi))
        diag.update({"n": n, "horizon": grid.horizon, "gamma": gamma, "n_bootstrap": n_boot,
                     "total_mass": float(cdf[-1]), "interval": "bootstrap (percentile, over episodes)"})
        if "warning" in diag and self.warn:
            warnings.warn(f"{self.name}: {diag['warning']}", OPEWarning, stacklevel=2)
        return ReturnDistribution(values, cdf, self.name, diag, statistics, float(self.alpha), cvar_alpha)


class CumulativeDistributionIS(_DistributionalEstimator):
    """Trajectory-wise IS CDF: F(x) = (1/n) sum_i w_i 1{G_i <= x} (SCOPE-RL's CumulativeDistributionTIS).

    Unbiased with exact propensities at every x, but it need not end at 1 (clipped where it exceeds 1).
    """

    name = "CD-IS"

    def _atoms(self, dataset, grid, gamma, policy, behavior, log_ratios, model):
        weights, diag = self._weights(dataset, grid, policy, behavior, log_ratios)
        returns = (grid.take(dataset.rewards) * grid.discounts(gamma)).sum(1)
        zeros = np.zeros(grid.n_episodes)
        normalizer = weights if self.self_normalized else None
        return _Atoms(returns, np.arange(grid.n_episodes), zeros, weights, normalizer), diag


class CumulativeDistributionSNIS(CumulativeDistributionIS):
    """Self-normalised IS CDF: F(x) = sum_i w_i 1{G_i <= x} / sum_i w_i (SCOPE-RL's CumulativeDistributionSNTIS).

    A proper distribution (ends at 1), biased but consistent: the usual choice.
    """

    name = "CD-SNIS"
    self_normalized = True


class _ModelEstimator(_DistributionalEstimator):
    """Adds the model's parameters: `n_rollouts` per start and elite, `mb_params` for a `ModelBased` fitted here."""

    uses_model = True

    def __init__(self, *, gamma: float = 0.99, horizon: int | None = None, bandwidth: Any = "scott",
                 alpha: float = 0.05, cvar_alpha: float = 0.1, n_bootstrap: int = 500, random_state: Any = 0,
                 warn: bool = True, n_rollouts: int = 1, mb_params: Mapping[str, Any] | None = None) -> None:
        super().__init__(gamma=gamma, horizon=horizon, bandwidth=bandwidth, alpha=alpha, cvar_alpha=cvar_alpha,
                         n_bootstrap=n_bootstrap, random_state=random_state, warn=warn)
        self.n_rollouts = n_rollouts
        self.mb_params = mb_params

    def _model_diagnostics(self, model: Any, samples: np.ndarray) -> dict[str, Any]:
        return {"model_samples_per_episode": int(samples.shape[1]), "n_rollouts": int(self.n_rollouts),
                "model_based_terms": True, "model_loss": float(getattr(model, "final_loss_", math.nan)),
                "dm_mean": float(samples.mean())}


class CumulativeDistributionDM(_ModelEstimator):
    """Direct method: the CDF of returns simulated in a learned model from the logged initial states,
    F(x) = (1/n) sum_i Fhat(x | s0_i, pi).  No weights; biased where the model is wrong."""

    name = "CD-DM"
    uses_weights = False

    def _atoms(self, dataset, grid, gamma, policy, behavior, log_ratios, model):
        model = self._model(dataset, model)
        samples = self._model_samples(dataset, grid, policy, model, gamma, first_actions=False, seed_offset=0)
        return _sample_atoms(samples, 1.0, "plain"), self._model_diagnostics(model, samples)


class CumulativeDistributionDR(_ModelEstimator):
    """Trajectory-wise doubly robust CDF (SCOPE-RL's CumulativeDistributionTDR):

        F(x) = (1/n) sum_i Fhat(x | s0_i, pi) + (1/n) sum_i w_i [1{G_i <= x} - Fhat(x | s0_i, a0_i)]

    with Fhat the model's simulated return CDF (from s0_i taking a0_i, or a0 ~ pi, then following pi).
    Unbiased for any model (with exact propensities); a good model lowers the variance.  The control variate
    carries the whole trajectory weight w_i, as in SCOPE-RL; w_{0,i} Fhat(x | s0_i, a0_i), with the first
    step's ratio only, would be unbiased too.
    """

    name = "CD-DR"

    def _atoms(self, dataset, grid, gamma, policy, behavior, log_ratios, model):
        weights, diag = self._weights(dataset, grid, policy, behavior, log_ratios)
        model = self._model(dataset, model)
        baseline = self._model_samples(dataset, grid, policy, model, gamma, first_actions=False, seed_offset=0)
        control = self._model_samples(dataset, grid, policy, model, gamma, first_actions=True, seed_offset=1)
        returns = (grid.take(dataset.rewards) * grid.discounts(gamma)).sum(1)
        n = grid.n_episodes
        observed = _Atoms(returns, np.arange(n), np.zeros(n), weights)
        atoms = _concat(_sample_atoms(baseline, 1.0, "plain"), observed, _sample_atoms(control, -weights, "weighted"))
        if self.self_normalized:
            atoms.normalizer = weights
        diag.update(self._model_diagnostics(model, baseline))
        return atoms, diag


class CumulativeDistributionSNDR(CumulativeDistributionDR):
    """Self-normalised trajectory-wise DR CDF (SCOPE-RL's CumulativeDistributionSNTDR): CD-DR's correction
    sum_i w_i [1{G_i <= x} - Fhat(x | s0_i, a0_i)] divided by sum_i w_i instead of n."""

    name = "CD-SNDR"
    self_normalized = True


DISTRIBUTIONAL_ESTIMATORS = {
    "CD-IS": CumulativeDistributionIS,
    "CD-SNIS": CumulativeDistributionSNIS,
    "CD-DM": CumulativeDistributionDM,
    "CD-DR": CumulativeDistributionDR,
    "CD-SNDR": CumulativeDistributionSNDR,
}


def _make_estimator(spec: Any, common: dict[str, Any], mb_params: Mapping[str, Any] | None) -> Any:
    if isinstance(spec, str):
        names = {k.lower(): k for k in DISTRIBUTIONAL_ESTIMATORS}
        names.update({cls.__name__.lower(): k for k, cls in DISTRIBUTIONAL_ESTIMATORS.items()})
        key = names.get(spec.lower())
        if key is None:
            raise ValueError(f"unknown distributional estimator {spec!r}; choose from {list(DISTRIBUTIONAL_ESTIMATORS)} "
                             f"(or their class names)")
        cls = DISTRIBUTIONAL_ESTIMATORS[key]
        valid = cls().get_params()
        params = {k: v for k, v in common.items() if k in valid}
        if "mb_params" in valid:
            params["mb_params"] = mb_params
        return cls(**params)
    if not isinstance(spec, _DistributionalEstimator):
        raise TypeError(f"a distributional estimator must be a name or an estimator from "
                        f"offrl.ope.distributional, got {type(spec).__name__}")
    est = sklearn.base.clone(spec)
    est.set_params(gamma=common["gamma"], horizon=common["horizon"])
    return est


def distribution_model(*, gamma: float, horizon: int | None, random_state: Any,
                       mb_params: Mapping[str, Any] | None) -> Any:
    """The (unfitted) `ModelBased` that `evaluate_distributions` fits for its model-based estimators."""
    from offrl.ope.model_based import ModelBased

    return ModelBased(**{"gamma": gamma, "horizon": horizon, "random_state": random_state, **dict(mb_params or {})})


def evaluate_distributions(
    policies: Mapping[str, Any],
    dataset: Dataset,
    estimators: Sequence[Any] = ("CD-SNIS",),
    *,
    gamma: float = 0.99,
    horizon: int | None = None,
    behavior: Any = None,
    bandwidth: Any = "scott",
    alpha: float = 0.05,
    cvar_alpha: float = 0.1,
    n_bootstrap: int = 500,
    random_state: Any = 0,
    mb_params: Mapping[str, Any] | None = None,
    behavior_log_probs: Any = None,
    model: Any = None,
) -> dict[str, dict[str, ReturnDistribution]]:
    """Every distributional estimator on every policy: result[policy][estimator] -> ReturnDistribution.

    `estimators`: names ("CD-IS", "CD-SNIS", "CD-DM", "CD-DR", "CD-SNDR", or class names) or instances (their
    gamma and horizon are set to this call's).  The behaviour log-probabilities are worked out once
    (`behavior_log_probs`: a `BehaviorEstimate`, a (log_probs, description) pair or an array; else
    `estimate_behavior(dataset, behavior)`), and one `ModelBased(**mb_params)` is fitted for all model-based
    estimators (`model`: an already fitted `ModelBased` to use instead, e.g. the MB estimator's of the same
    call).  Pass the result to `OPEReport(..., distributions=...)`.
    """
    if not isinstance(dataset, Dataset):
        raise TypeError(f"dataset must be an offrl Dataset, got {type(dataset).__name__}")
    if not isinstance(policies, Mapping) or not policies:
        raise ValueError("policies must be a non-empty dict name -> policy")
    gamma = check_gamma(gamma)
    horizon = check_horizon(horizon)
    common = dict(gamma=gamma, horizon=horizon, bandwidth=bandwidth, alpha=alpha, cvar_alpha=cvar_alpha,
                  n_bootstrap=n_bootstrap, random_state=random_state, warn=False)
    if isinstance(estimators, (str, _DistributionalEstimator)):
        estimators = [estimators]
    ests = [_make_estimator(spec, common, mb_params) for spec in estimators]
    ests = [e.set_params(warn=False) for e in ests]
    names = [e.name for e in ests]
    if not ests or len(set(names)) != len(names):
        raise ValueError(f"estimators must be a non-empty list of distinct estimators, got {names}")
    known = None
    if any(e.uses_weights for e in ests):
        if behavior_log_probs is None:
            known = estimate_behavior(dataset, behavior)
        elif isinstance(behavior_log_probs, BehaviorEstimate):
            known = behavior_log_probs
        elif isinstance(behavior_log_probs, tuple):
            known = BehaviorEstimate(*behavior_log_probs)
        else:
            known = BehaviorEstimate(np.asarray(behavior_log_probs, np.float64).reshape(-1), "given")
    if not any(e.uses_model for e in ests):
        model = None
    elif model is None:
        model = distribution_model(gamma=gamma, horizon=horizon, random_state=random_state,
                                   mb_params=mb_params).fit(dataset)
    elif not hasattr(model, "dynamics_"):
        raise ValueError("model must be a fitted offrl.ope.ModelBased (or None to fit one here)")
    out: dict[str, dict[str, ReturnDistribution]] = {}
    for policy_name, policy in policies.items():
        ratios = log_importance_ratios(dataset, policy, behavior_log_probs_=known, bandwidth=bandwidth) \
            if known is not None else None
        per_policy = {}
        for est in ests:
            per_policy[est.name] = est.estimate_distribution(dataset, policy, log_ratios=ratios, model=model)
        texts = [f"{name}: {d.diagnostics['warning']}" for name, d in per_policy.items() if "warning" in d.diagnostics]
        if texts:
            more = f" (and warnings from {len(texts) - 1} more estimators)" if len(texts) > 1 else ""
            warnings.warn(f"policy {policy_name!r}: {texts[0]}{more}", OPEWarning, stacklevel=2)
        out[str(policy_name)] = per_policy
    return out


# ---------------------------------------------------------------------- ground truth for tests
def exact_return_distribution(mdp: Any, pi: Any, gamma: float, horizon: int) -> tuple[np.ndarray, np.ndarray]:
    """(support, probabilities) of the discounted return over `horizon` steps of tabular policy `pi` in a
    `TabularMDP` without reward noise, by enumerating (state, return so far) paths; equal returns are merged.

    Grows like (n_states * n_actions) ** horizon at worst: for small problems.
    """
    if float(getattr(mdp, "reward_noise", 0.0)) != 0.0:
        raise ValueError("exact_return_distribution needs reward_noise=0 (noisy rewards have a continuous return "
                         "distribution)")
    gamma = check_gamma(gamma)
    horizon = check_horizon(horizon)
    if horizon is None:
        raise ValueError("horizon must be a positive integer (the number of steps to enumerate)")
    pi = np.asarray(pi, np.float64)
    S, A = mdp.R.shape
    if pi.shape != (S, A):
        raise ValueError(f"pi has shape {pi.shape}; expected (n_states, n_actions) = ({S}, {A})")
    states = np.arange(S)
    returns = np.zeros(S)
    probs = np.asarray(mdp.mu0, np.float64).copy()
    done_values: list[np.ndarray] = []
    done_probs: list[np.ndarray] = []
    for t in range(horizon):
        # every live path takes every action
        p_a = probs[:, None] * pi[states]  # (m, A)
        g = returns[:, None] + gamma ** t * mdp.R[states]  # (m, A)
        end = mdp.D[states]  # (m, A)
        done_values.append(g.reshape(-1))
        done_probs.append((p_a * end).reshape(-1))
        # the rest moves on
        p_next = (p_a * (1.0 - end))[:, :, None] * mdp.P[states]  # (m, A, S)
        nxt = np.broadcast_to(np.arange(S), p_next.shape).reshape(-1)
        g_next = np.broadcast_to(g[:, :, None], p_next.shape).reshape(-1)
        p_next = p_next.reshape(-1)
        if t == horizon - 1:
            done_values.append(g_next)
            done_probs.append(p_next)
            break
        keep = p_next > 0
        key = np.stack([nxt[keep].astype(np.float64), np.round(g_next[keep], 12)], axis=1)
        unique, inverse = np.unique(key, axis=0, return_inverse=True)
        states = unique[:, 0].astype(np.int64)
        returns = unique[:, 1]
        probs = np.bincount(inverse.reshape(-1), weights=p_next[keep], minlength=len(unique))
    values = np.round(np.concatenate(done_values), 12)
    mass = np.concatenate(done_probs)
    keep = mass > 0
    support, inverse = np.unique(values[keep], return_inverse=True)
    return support, np.bincount(inverse.reshape(-1), weights=mass[keep], minlength=len(support))


def ks_distance(distribution: ReturnDistribution, support: Any, probabilities: Any, tol: float = 1e-6) -> float:
    """sup_x |F_hat(x) - F(x)| against a discrete distribution (support, probabilities).

    Both CDFs are read `tol` to the right of every jump of either, so that returns summed from float32 rewards
    meet the exact atoms they stand for.
    """
    support = np.asarray(support, np.float64)
    exact = ReturnDistribution.from_probabilities(support, probabilities)
    points = np.union1d(exact.grid, distribution.grid) + float(tol)
    return float(np.max(np.abs(distribution.cdf_at(points) - exact.cdf_at(points))))
