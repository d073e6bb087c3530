"""Marginal (state-action) importance sampling: MWL density ratios, MQL, MIS, SNMIS and marginal DR.

Per-decision IS multiplies one ratio per step, so on 200-step episodes a
handful of trajectories carry all the weight.  Marginal estimators weight a
transition by the ratio of *occupancies* instead,

    w(s, a) = d_pi(s, a) / d_D(s, a),

which needs no product over time and no behaviour policy at all.

Ratios are learned with MWL (Uehara, Huang & Jiang 2020): for every test
function f in a class F, the occupancy of pi satisfies the flow equation

    E_D[ w(x) (f(x) - gamma f(x', pi)) ] = E_{s0}[ f(s0, pi) ],             (1)

x = (s, a, t), x' = (s', ., t + 1), f(x', pi) = E_{a'~pi(.|s')} f(s', a', t + 1),
taken as 0 after a terminal and at t + 1 = H.  Here w is scaled per episode
(E_D is the sum over an episode's transitions averaged over episodes), so the
value is simply V = E_D[w r].  With w = phi' theta linear in features phi and
F the unit ball of the same span (an RKHS with kernel phi(x)' phi(y); random
Fourier features approximate a Gaussian kernel), MWL's minimax loss
max_f (E_D[w (f - gamma f')] - E[f0])^2 is ||A theta - b||^2 with

    A = E_D[(phi(x) - gamma phi(x', pi)) phi(x)'],   b = E_{s0}[phi(s0, pi, 0)],

so theta = (A'A + lambda I)^{-1} A' b in closed form.  The same A gives MQL
(the Q function whose Bellman residual is orthogonal to every weight
function): Q = phi' beta with A' beta = E_D[phi r], V_MQL = b' beta; with the
same features and no ridge V_MQL equals V_MIS (both are LSTDQ).

- finite horizon (`horizon` set): the features include the step t (one-hot
  per step for tabular data, a coordinate of the random features otherwise),
  so the ratios are time-indexed: w(s, a, t) = gamma^t d_pi,t(s, a) / d_D,t(s, a)
  (Xie, Ma & Wang 2019's marginalised IS for the tabular case) and the
  estimand is sum_{t<H} gamma^t r_t, as the per-decision estimators'.
- discounted (`horizon=None`, gamma < 1): stationary ratios over (s, a),
  time-limit cuts bootstrapped through f(s', pi); the estimand is the
  infinite-horizon discounted value from the logged initial states (FQE's
  with horizon None).

Estimators (all `estimate(dataset, policy) -> OPEResult`):

- MIS:   V = E_D[w r]
- SNMIS: V = K E_D[w r] / E_D[w],  K = sum_{t<H} gamma^t (1 / (1 - gamma) discounted),
         the mass E_D[w] has when no episode terminates early (so it is
         biased when the target policy's episodes end at terminals; the
         diagnostics say so when the data have terminals).
- MDR (Kallus & Uehara 2020's double RL):
         V = E_{s0}[V_q(s0)] + E_D[ w (r + gamma V_q(s', t + 1) - Q(s, a, t)) ]
         with Q from FQE (default) or MQL; consistent when either the ratios
         or Q are right.
- MQL:   V = E_{s0}[Q(s0, pi)] with the linear MQL Q above.

Intervals: the per-episode terms are linearised through the ratio (or Q) fit
(the delta method on theta = argmin ||A theta - b||^2 + lambda ||theta||^2),
so the interval includes the error of the learned ratios, not only the
sampling of the final average; Q from FQE is held fixed, as in DR.
Hoeffding and Bernstein use the observed range of those terms (flagged: the
ratios are unbounded estimates, so no range is guaranteed).
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, Mapping

import numpy as np
import sklearn.base

from offrl.datasets.core import Dataset
from offrl.ope.behavior import TargetPolicy, as_target_policy
from offrl.ope.results import OPEResult, OPEWarning, RatioComponents, check_gamma, check_horizon, make_result

__all__ = ["StateActionFeatures", "MarginalRatios", "MarginalIS", "SelfNormalizedMarginalIS", "MarginalDR", "MQL",
           "MARGINAL_PARAMS", "check_marginal_params"]

FEATURES = ("auto", "tabular", "rff")
# The ratio settings the marginal estimators share (`evaluate(marginal_params=...)`, a sweep's
# ope.marginal_params, a tune objective's): gamma, horizon and the seed come from the caller.
MARGINAL_PARAMS = ("features", "n_features", "lengthscale", "ridge", "n_action_samples")


def check_marginal_params(params: Mapping[str, Any], where: str = "marginal_params") -> dict[str, Any]:
    """`params` checked as MarginalRatios settings (names in MARGINAL_PARAMS): a ValueError that names the
    setting and what is valid, before any fit."""
    if not isinstance(params, Mapping):
        raise ValueError(f"{where} must be a mapping of marginal-ratio settings ({', '.join(MARGINAL_PARAMS)}), "
                         f"got {params!r}")
    params = dict(params)
    for name in params:
        if name not in MARGINAL_PARAMS:
            raise ValueError(f"{where}: the marginal ratios have no setting {name!r}; valid: {list(MARGINAL_PARAMS)}")
    if params.get("features", "auto") not in FEATURES:
        raise ValueError(f"{where}: features must be one of {FEATURES}, got {params['features']!r}")
    for name in ("n_features", "n_action_samples"):
        value = params.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{where}: {name} must be a positive integer, got {value!r}")
    for name, low in (("lengthscale", "a positive number"), ("ridge", "a non-negative number")):
        value = params.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
                value > 0 if name == "lengthscale" else value >= 0) or not math.isfinite(value):
            raise ValueError(f"{where}: {name} must be {low} (or None for the default), got {value!r}")
    return params


def _is_one_hot(obs: np.ndarray) -> bool:
    return obs.ndim == 2 and bool(np.all((obs == 0) | (obs == 1))) and bool(np.all(obs.sum(1) == 1))


class StateActionFeatures:
    """phi(s, a[, t]): one-hot cells for tabular data, random Fourier features of standardised inputs otherwise.

    Random Fourier features (Rahimi & Recht 2007) approximate a Gaussian
    kernel of bandwidth `lengthscale` (median pairwise distance of the
    standardised inputs by default); a constant feature is appended.
    Discrete actions enter as a one-hot factor: phi(s, a) = psi(s) (x) e_a.
    """

    def __init__(self, kind: str = "auto", n_features: int = 100, lengthscale: float | None = None,
                 random_state: Any = 0) -> None:
        if kind not in FEATURES:
            raise ValueError(f"features must be one of {FEATURES}, got {kind!r}")
        self.kind = kind
        self.n_features = int(n_features)
        self.lengthscale = lengthscale
        self.random_state = random_state

    def fit(self, dataset: Dataset, horizon: int | None) -> "StateActionFeatures":
        obs = np.asarray(dataset.observations, np.float64)
        self.n_actions_ = dataset.discrete_actions
        self.horizon_ = horizon
        kind = self.kind
        if kind == "auto":
            kind = "tabular" if dataset.discrete_actions is not None and _is_one_hot(obs) else "rff"
        if kind == "tabular":
            if dataset.discrete_actions is None or not _is_one_hot(obs):
                raise ValueError("features='tabular' needs one-hot observations and discrete actions; "
                                 "use features='rff' for other data")
            self.kind_ = "tabular"
            self.state_dim_ = obs.shape[1]
            return self
        if self.n_features < 1:
            raise ValueError(f"n_features must be at least 1, got {self.n_features}")
        self.kind_ = "rff"
        inputs = [obs] if dataset.discrete_actions is not None else [obs, np.asarray(dataset.actions, np.float64)]
        if horizon is not None:
            inputs.append(self._steps(dataset)[:, None].astype(np.float64))
        z = np.concatenate(inputs, axis=1)
        self.mean_ = z.mean(0)
        self.scale_ = np.where(z.std(0) > 1e-8, z.std(0), 1.0)
        rng = np.random.default_rng(self.random_state)
        if self.lengthscale is None:
            from scipy.spatial.distance import pdist

            zs = (z[rng.choice(len(z), size=min(len(z), 1000), replace=False)] - self.mean_) / self.scale_
            self.lengthscale_ = float(np.median(pdist(zs))) if len(zs) > 1 else 1.0
            self.lengthscale_ = self.lengthscale_ or 1.0
        else:
            self.lengthscale_ = float(self.lengthscale)
        self.weights_ = rng.standard_normal((z.shape[1], self.n_features)) / self.lengthscale_
        self.offsets_ = rng.uniform(0.0, 2 * math.pi, self.n_features)
        return self

    @staticmethod
    def _steps(dataset: Dataset) -> np.ndarray:
        starts = dataset.episode_starts
        return np.arange(dataset.n_transitions) - np.repeat(starts[:-1], np.diff(starts))

    @property
    def dim(self) -> int:
        if self.kind_ == "tabular":
            return self.state_dim_ * self.n_actions_ * (self.horizon_ or 1)
        base = self.n_features + 1
        return base * self.n_actions_ if self.n_actions_ is not None else base

    def _state_part(self, obs: np.ndarray, actions: np.ndarray | None, steps: np.ndarray | None) -> np.ndarray:
        """psi(s[, a][, t]) for random features (actions only for continuous action spaces)."""
        parts = [np.asarray(obs, np.float64)]
        if actions is not None:
            parts.append(np.asarray(actions, np.float64).reshape(len(obs), -1))
        if self.horizon_ is not None:
            parts.append(np.asarray(steps, np.float64).reshape(-1, 1))
        z = (np.concatenate(parts, axis=1) - self.mean_) / self.scale_
        rff = math.sqrt(2.0 / self.n_features) * np.cos(z @ self.weights_ + self.offsets_)
        return np.concatenate([rff, np.ones((len(z), 1))], axis=1)

    def _tabular(self, obs: np.ndarray, action_probs: np.ndarray, steps: np.ndarray | None) -> np.ndarray:
        """phi as the outer product one-hot(s) x action distribution [x one-hot(t)]."""
        out = np.asarray(obs, np.float64)[:, :, None] * action_probs[:, None, :]
        out = out.reshape(len(obs), -1)
        if self.horizon_ is not None:
            t = np.zeros((len(obs), self.horizon_))
            t[np.arange(len(obs)), np.asarray(steps, np.int64)] = 1.0
            out = (out[:, :, None] * t[:, None, :]).reshape(len(obs), -1)
        return out

    def _check_steps(self, steps: Any) -> None:
        if self.horizon_ is None:
            return
        t = np.asarray(steps)
        if t.size and (t.min() < 0 or t.max() >= self.horizon_):
            raise ValueError(f"steps must lie in [0, {self.horizon_}) (the horizon these features were fitted for), "
                             f"got {int(t.min())} to {int(t.max())}")

    def transform(self, obs: np.ndarray, actions: np.ndarray, steps: np.ndarray | None = None) -> np.ndarray:
        """phi(s, a, t) for logged (obs, action, step) rows."""
        self._check_steps(steps)
        if self.n_actions_ is not None:
            onehot = np.eye(self.n_actions_)[np.asarray(actions).reshape(len(obs), -1)[:, 0].astype(np.int64)]
            if self.kind_ == "tabular":
                return self._tabular(obs, onehot, steps)
            psi = self._state_part(obs, None, steps)
            return (psi[:, :, None] * onehot[:, None, :]).reshape(len(obs), -1)
        return self._state_part(obs, actions, steps)

    def policy_transform(self, obs: np.ndarray, target: TargetPolicy, steps: np.ndarray | None,
                         n_action_samples: int, rng: np.random.Generator) -> np.ndarray:
        """phi(s, pi, t) = E_{a ~ pi(.|s)} phi(s, a, t)."""
        if len(obs) == 0:
            return np.zeros((0, self.dim))
        self._check_steps(steps)
        if self.n_actions_ is not None:
            probs = target.probs(obs)
            if self.kind_ == "tabular":
                return self._tabular(obs, probs, steps)
            psi = self._state_part(obs, None, steps)
            return (psi[:, :, None] * probs[:, None, :]).reshape(len(obs), -1)
        n = 1 if target.kind == "deterministic" else int(n_action_samples)
        samples = target.sample_actions(obs, n, rng)
        return np.mean([self._state_part(obs, a, steps) for a in samples], axis=0)


def _ridge_solve(P: np.ndarray, q: np.ndarray, ridge: float) -> tuple[np.ndarray, np.ndarray]:
    """argmin ||P x - q||^2 + lam ||x||^2 with lam = ridge * trace(P'P) / d; returns x and M = P'P + lam I."""
    gram = P.T @ P
    lam = float(ridge) * float(np.trace(gram)) / max(len(gram), 1)
    M = gram + lam * np.eye(len(gram))
    return np.linalg.solve(M, P.T @ q), M


class MarginalRatios(sklearn.base.BaseEstimator):
    """MWL state-action density ratios w(s, a[, t]) of a target policy, and the linear MQL Q (module docstring).

    Fit once per (dataset, policy); the estimators MIS, SNMIS, MDR and MQL
    share one fit.  `ridge` is relative to the mean eigenvalue of A'A; None:
    1e-6 with tabular features (exact up to conditioning), 1e-3 with random
    features (100 by default).
    After `fit`: `weights_` (per transition, episode-scaled so that
    V_MIS = E_D[w r]), `density_ratio(...)` (normalised d_pi / d_D),
    `q_values` / `state_values` (MQL), `diagnostics_`.
    """

    def __init__(self, *, gamma: float = 0.99, horizon: int | None = None, features: str = "auto",
                 n_features: int = 100, lengthscale: float | None = None, ridge: float | None = None,
                 n_action_samples: int = 10, random_state: Any = 0) -> None:
        self.gamma = gamma
        self.horizon = horizon
        self.features = features
        self.n_features = n_features
        self.lengthscale = lengthscale
        self.ridge = ridge
        self.n_action_samples = n_action_samples
        self.random_state = random_state

    def fit(self, dataset: Dataset, policy: Any) -> "MarginalRatios":
        if not isinstance(dataset, Dataset):
            raise TypeError(f"dataset must be an offrl Dataset, got {type(dataset).__name__}")
        gamma = check_gamma(self.gamma)
        horizon = check_horizon(self.horizon)
        if horizon is None and gamma >= 1.0:
            raise ValueError("discounted marginal ratios need gamma < 1; for undiscounted returns pass a horizon "
                             "(e.g. horizon=1000) to use time-indexed ratios")
        if not dataset.is_labelled("rewards"):
            raise ValueError("marginal OPE needs rewards; label them first (offrl.reward_labeling)")
        if self.ridge is not None and not float(self.ridge) >= 0:
            raise ValueError(f"ridge must be a non-negative number (or None for the default), got {self.ridge}")
        target = as_target_policy(policy, dataset)
        rng = np.random.default_rng(self.random_state)
        self.gamma_, self.horizon_ = gamma, horizon
        self.features_ = StateActionFeatures(self.features, self.n_features, self.lengthscale,
                                             self.random_state).fit(dataset, horizon)
        # tabular features solve the flow equation exactly (a tiny ridge only for conditioning); random
        # features approximate the kernel and need real regularisation
        ridge = float(self.ridge) if self.ridge is not None else 1e-6 if self.features_.kind_ == "tabular" else 1e-3
        self.ridge_ = ridge
        steps = StateActionFeatures._steps(dataset)
        keep = np.ones(dataset.n_transitions, bool) if horizon is None else steps < horizon
        rows = np.flatnonzero(keep)
        self.rows_ = rows
        starts = dataset.episode_starts
        self.episode_ = np.repeat(np.arange(dataset.n_episodes), np.diff(starts))[rows]
        self.n_episodes_ = dataset.n_episodes
        # every episode keeps its first transition, and rows are ordered by episode: sums per episode by reduceat
        self.episode_starts_ = np.flatnonzero(np.r_[True, np.diff(self.episode_) != 0])
        obs, nxt = dataset.observations[rows], dataset.next_observations[rows]
        t = steps[rows] if horizon is not None else None
        phi = self.features_.transform(obs, dataset.actions[rows], t)
        # f(x', pi): 0 after a terminal and at the horizon
        live = (dataset.terminals[rows] == 0) & (True if horizon is None else (steps[rows] + 1 < horizon))
        phi_next = np.zeros_like(phi)
        idx = np.flatnonzero(live)
        phi_next[idx] = self.features_.policy_transform(nxt[idx], target, None if t is None else t[idx] + 1,
                                                        self.n_action_samples, rng)
        delta = phi - gamma * phi_next  # (N, d)
        init = dataset.observations[starts[:-1]]
        phi0 = self.features_.policy_transform(init, target, None if horizon is None else np.zeros(len(init), np.int64),
                                               self.n_action_samples, rng)
        n = self.n_episodes_
        A = delta.T @ phi / n
        b = phi0.mean(0)
        c = phi.T @ np.asarray(dataset.rewards[rows], np.float64) / n
        self.theta_, self.M_theta_ = _ridge_solve(A, b, ridge)
        self.beta_, self.M_beta_ = _ridge_solve(A.T, c, ridge)
        self.A_, self.b_, self.c_ = A, b, c
        self.phi_, self.delta_, self.phi0_ = phi, delta, phi0
        self.rewards_ = np.asarray(dataset.rewards[rows], np.float64)
        self.weights_ = phi @ self.theta_
        self.target_kind_ = target.kind
        self.policy_ = policy  # estimators given these ratios check they evaluate the same policy
        self.mass_target_ = self._mass_target(gamma, horizon)
        self._fingerprint = (dataset.n_transitions, dataset.n_episodes, float(np.sum(dataset.rewards)))
        w = self.weights_
        mass = float(w.sum() / n)
        ess = float(w.sum() ** 2 / np.sum(w * w)) if np.sum(w * w) > 0 else 0.0
        residual = float(np.linalg.norm(A @ self.theta_ - b) / max(np.linalg.norm(b), 1e-12))
        self.diagnostics_ = {
            "features": f"{self.features_.kind_} ({self.features_.dim})",
            "ridge": ridge,
            "ratio_mass": mass / self.mass_target_,
            "negative_weight_share": float(np.mean(w < 0)),
            "ess_transitions": ess,
            "ess_fraction": ess / max(len(w), 1),
            "max_weight": float(np.max(np.abs(w))) if len(w) else 0.0,
            "flow_residual": residual,
            "target_policy": target.kind,
            "horizon": horizon if horizon is not None else "discounted (stationary)",
            "gamma": gamma,
        }
        notes = []
        if abs(mass / self.mass_target_ - 1.0) > 0.2 and not np.any(dataset.terminals[rows] > 0):
            notes.append(f"the learned ratios' mass is {mass / self.mass_target_:.2f} of what it must be (1.0): the "
                         "feature class cannot express d_pi / d_D or the data do not cover the target policy; "
                         "trust SNMIS, MDR or FQE over MIS")
        if residual > 0.1:
            notes.append(f"the flow equation is solved only up to a relative residual of {residual:.2f} "
                         "(poor overlap or too strong a ridge)")
        if notes:
            self.diagnostics_["warning"] = "; ".join(notes)
        return self

    @staticmethod
    def _mass_target(gamma: float, horizon: int | None) -> float:
        """E_D[w] when no episode ends early: sum_{t<H} gamma^t, or 1 / (1 - gamma)."""
        if horizon is None:
            return 1.0 / (1.0 - gamma)
        return float(np.sum(gamma ** np.arange(horizon)))

    def same_policy(self, dataset: Dataset, policy: Any) -> bool:
        """Whether `policy` acts as the fitted one at the logged initial states (its features phi(s0, pi) agree).

        A stochastic policy's sampled actions differ from call to call, so only
        the same object counts as the same stochastic policy."""
        target = as_target_policy(policy, dataset)
        if target.kind == "stochastic" or target.kind != self.target_kind_:
            return False
        k = min(64, len(self.phi0_))
        init = dataset.observations[dataset.episode_starts[:k]]
        t = None if self.horizon_ is None else np.zeros(k, np.int64)
        probe = self.features_.policy_transform(init, target, t, self.n_action_samples, np.random.default_rng(0))
        return bool(np.allclose(probe, self.phi0_[:k], rtol=1e-6, atol=1e-9))

    def _check_fitted(self, dataset: Dataset | None = None) -> None:
        if not hasattr(self, "theta_"):
            from sklearn.exceptions import NotFittedError

            raise NotFittedError("MarginalRatios is not fitted; call fit(dataset, policy) first")
        if dataset is not None and self._fingerprint != (dataset.n_transitions, dataset.n_episodes,
                                                         float(np.sum(dataset.rewards))):
            raise ValueError("these ratios were fitted on another dataset; fit MarginalRatios on this one")

    def density_ratio(self, observations: Any, actions: Any, steps: Any = None) -> np.ndarray:
        """d_pi(s, a[, t]) / d_D(s, a[, t]) with both occupancies normalised to sum to 1 (no early terminations).

        d_D is the logged transitions' distribution (uniform over the
        transitions used); d_pi the target policy's normalised discounted
        occupancy (per step t, gamma^t-weighted, with a horizon).
        """
        self._check_fitted()
        obs = np.asarray(observations, np.float64)
        if self.horizon_ is not None and steps is None:
            raise ValueError("these ratios are time-indexed (horizon set): pass steps= (each row's step t)")
        t = None if self.horizon_ is None else np.asarray(steps, np.int64).reshape(-1)
        w = self.features_.transform(obs, np.asarray(actions), t) @ self.theta_
        return w * len(self.rows_) / (self.n_episodes_ * self.mass_target_)

    # --------------------------------------------------------------- MQL Q as a q_function for MDR
    def q_values(self, obs: np.ndarray, actions: np.ndarray, steps_to_go: np.ndarray | None = None) -> np.ndarray:
        self._check_fitted()
        t = None if self.horizon_ is None else self.horizon_ - np.asarray(steps_to_go, np.int64)
        return self.features_.transform(np.asarray(obs, np.float64), actions, t) @ self.beta_

    def episode_sums(self, per_row: np.ndarray) -> np.ndarray:
        """Sum of per-transition values (or rows) over each episode's transitions."""
        return np.add.reduceat(per_row, self.episode_starts_, axis=0)

    # --------------------------------------------------------------- linearisation
    def influence(self, s_i: np.ndarray, transpose: bool) -> np.ndarray:
        """Per-episode terms of d(s' x)/d(data) for x = theta (transpose False) or beta (True): the delta method.

        x = argmin ||P x - q||^2 + lam ||x||^2 with P = A, q = b (theta) or P = A', q = c (beta);
        returns, per episode i, s_i' x - rho' (P_i - P) u - (P u)' ((P_i - P) x - (q_i - q))
        - (u' x) d lam_i with u = M^{-1} mean(s), rho = P x - q and d lam_i the ridge's own change
        (lam is relative to trace(P'P)): its mean is s' x and its spread carries the fit's error.
        """
        s_bar = s_i.mean(0)
        if not transpose:
            x, M, P, q = self.theta_, self.M_theta_, self.A_, self.b_
        else:
            x, M, P, q = self.beta_, self.M_beta_, self.A_.T, self.c_
        u = np.linalg.solve(M, s_bar)
        rho = P @ x - q
        Pu = P @ u

        def bilinear(left: np.ndarray, right: np.ndarray) -> np.ndarray:
            """per episode: left' P_i right, P_i the episode's share of P (A_i = sum_j delta_j phi_j')."""
            if transpose:  # A_i' : left' A_i' right = right' A_i left
                left, right = right, left
            per_row = (self.delta_ @ left) * (self.phi_ @ right)
            return self.episode_sums(per_row)

        if not transpose:
            q_i = self.phi0_
        else:
            q_i = self.episode_sums(self.phi_ * self.rewards_[:, None])
        term = s_i @ x
        term = term - (bilinear(rho, u) - rho @ P @ u)
        term = term - (bilinear(Pu, x) - Pu @ P @ x)
        term = term + (q_i @ Pu - q @ Pu)
        # lam = ridge * trace(P'P) / d moves with the data too: d lam = 2 ridge <P, dP>_F / d
        # (<A', A_i'>_F = <A, A_i>_F, so one term serves theta and beta)
        frob_i = self.episode_sums(np.einsum("nd,nd->n", self.delta_, self.phi_ @ self.A_.T))
        term = term - (u @ x) * 2.0 * self.ridge_ / len(M) * (frob_i - np.sum(self.A_ ** 2))
        return term


class _MarginalEstimator(sklearn.base.BaseEstimator):
    """Shared parameters and plumbing of MIS, SNMIS, MDR and MQL."""

    name = "marginal"

    def __init__(self, *, gamma: float = 0.99, horizon: int | None = None, features: str = "auto",
                 n_features: int = 100, lengthscale: float | None = None, ridge: float | None = None,
                 n_action_samples: int = 10, interval: str = "bootstrap", alpha: float = 0.05,
                 n_bootstrap: int = 2000, random_state: Any = 0, warn: bool = True) -> None:
        self.gamma = gamma
        self.horizon = horizon
        self.features = features
        self.n_features = n_features
        self.lengthscale = lengthscale
        self.ridge = ridge
        self.n_action_samples = n_action_samples
        self.interval = interval
        self.alpha = alpha
        self.n_bootstrap = n_bootstrap
        self.random_state = random_state
        self.warn = warn

    def ratio_params(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("gamma", "horizon", "features", "n_features", "lengthscale", "ridge",
                                              "n_action_samples", "random_state")}

    def _ratios(self, dataset: Dataset, policy: Any, ratios: MarginalRatios | None) -> MarginalRatios:
        if ratios is None:
            return MarginalRatios(**self.ratio_params()).fit(dataset, policy)
        ratios._check_fitted(dataset)
        if policy is not ratios.policy_ and not ratios.same_policy(dataset, policy):
            raise ValueError("these ratios were fitted for another policy; fit MarginalRatios(...).fit(dataset, policy) "
                             "for the one evaluated (or pass ratios=None)")
        if check_horizon(self.horizon) != ratios.horizon_ or float(self.gamma) != ratios.gamma_:
            raise ValueError(f"the ratios were fitted with gamma={ratios.gamma_}, horizon={ratios.horizon_} but this "
                             f"estimator has gamma={self.gamma}, horizon={self.horizon}")
        return ratios

    def _result(self, samples: np.ndarray, ratios: MarginalRatios, dataset: Dataset, extra: dict[str, Any]
                ) -> OPEResult:
        diag = {**ratios.diagnostics_, **extra}
        if self.interval in ("hoeffding", "bernstein"):
            diag["weight_bound_source"] = "learned ratios (no guaranteed range)"
        if "warning" in diag and self.warn:
            warnings.warn(f"{self.name}: {diag['warning']}", OPEWarning, stacklevel=3)
        return make_result(RatioComponents(samples), self.name, interval=self.interval, alpha=self.alpha,
                           n_bootstrap=self.n_bootstrap, random_state=self.random_state, diagnostics=diag)


class MarginalIS(_MarginalEstimator):
    """State-action marginal importance sampling with MWL ratios: V = E_D[w(s, a) r]."""

    name = "MIS"

    def estimate(self, dataset: Dataset, policy: Any, *, ratios: MarginalRatios | None = None, **_: Any) -> OPEResult:
        r = self._ratios(dataset, policy, ratios)
        c_i = r.episode_sums(r.phi_ * r.rewards_[:, None])
        samples = r.influence(c_i, transpose=False)
        return self._result(samples, r, dataset, {"interval_note": "delta method through the ratio fit"})


class SelfNormalizedMarginalIS(_MarginalEstimator):
    """Self-normalised MIS: V = K E_D[w r] / E_D[w], K the weights' mass without early terminations."""

    name = "SNMIS"

    def estimate(self, dataset: Dataset, policy: Any, *, ratios: MarginalRatios | None = None, **_: Any) -> OPEResult:
        r = self._ratios(dataset, policy, ratios)
        c_i = r.episode_sums(r.phi_ * r.rewards_[:, None])
        e_i = r.episode_sums(r.phi_)
        num, den = r.influence(c_i, transpose=False), r.influence(e_i, transpose=False)
        N, D = num.mean(), den.mean()
        if D <= 0:
            raise ValueError("SNMIS: the learned ratios have non-positive total mass; the data do not cover the "
                             "target policy (use FQE or MDR)")
        K = r.mass_target_
        value = K * N / D
        samples = value + K * (num - N) / D - K * N * (den - D) / D ** 2
        extra = {"interval_note": "delta method through the ratio fit and the normalisation"}
        if np.any(dataset.terminals > 0):
            extra["normalisation_note"] = ("the data have terminals: SNMIS normalises to the mass of episodes that do "
                                           "not end early and is biased when the target policy's episodes terminate")
        return self._result(samples, r, dataset, extra)


class MQL(_MarginalEstimator):
    """MQL with a linear Q in the ratio features: V = E_{s0}[Q(s0, pi)], Q's Bellman residual orthogonal to every w."""

    name = "MQL"

    def estimate(self, dataset: Dataset, policy: Any, *, ratios: MarginalRatios | None = None, **_: Any) -> OPEResult:
        r = self._ratios(dataset, policy, ratios)
        samples = r.influence(r.phi0_, transpose=True)
        return self._result(samples, r, dataset, {"interval_note": "delta method through the Q fit"})


class MarginalDR(_MarginalEstimator):
    """Marginal doubly robust (double RL): V = E[V_q(s0)] + E_D[w (r + gamma V_q(s') - Q(s, a))].

    `q_function`: None (an FQE fitted with `fqe_params`), "MQL" (the linear
    MQL Q of the same fit), or any object with `q_values` and `state_values`
    (a fitted FQE, `offrl.ope.QFunction`).
    """

    name = "MDR"

    def __init__(self, *, gamma: float = 0.99, horizon: int | None = None, q_function: Any = None,
                 fqe_params: dict[str, Any] | None = None, features: str = "auto", n_features: int = 100,
                 lengthscale: float | None = None, ridge: float | None = None, n_action_samples: int = 10,
                 interval: str = "bootstrap", alpha: float = 0.05, n_bootstrap: int = 2000,
                 random_state: Any = 0, warn: bool = True) -> None:
        super().__init__(gamma=gamma, horizon=horizon, features=features, n_features=n_features,
                         lengthscale=lengthscale, ridge=ridge, n_action_samples=n_action_samples, interval=interval,
                         alpha=alpha, n_bootstrap=n_bootstrap, random_state=random_state, warn=warn)
        self.q_function = q_function
        self.fqe_params = fqe_params

    def _q(self, dataset: Dataset, policy: Any, q_function: Any, ratios: MarginalRatios) -> Any:
        q = q_function if q_function is not None else self.q_function
        if isinstance(q, str):
            if q.upper() != "MQL":
                raise ValueError(f"q_function must be None (FQE), 'MQL' or a fitted Q model, got {q!r}")
            return _MQLFunction(ratios, policy, dataset)
        if q is None:
            from offrl.ope.fqe import FQE

            params = {"gamma": self.gamma, "horizon": self.horizon, "random_state": self.random_state,
                      **(self.fqe_params or {})}
            return FQE(**params).fit(dataset, policy=policy, progress=False)
        if callable(q) and not hasattr(q, "q_values"):
            from offrl.ope.episodic import QFunction

            return QFunction(q, policy=policy)
        return q

    def estimate(self, dataset: Dataset, policy: Any, *, ratios: MarginalRatios | None = None,
                 q_function: Any = None, **_: Any) -> OPEResult:
        r = self._ratios(dataset, policy, ratios)
        q = self._q(dataset, policy, q_function, r)
        H = r.horizon_
        from offrl.ope.episodic import QFunction

        q_h = getattr(q, "horizon", None)
        # plain callables (QFunction) take the steps to go when they accept them; a fitted model states its horizon
        if not isinstance(q, QFunction) and ((H is None) != (q_h is None) or (H is not None and int(q_h) != H)):
            raise ValueError(f"the Q function's horizon ({q_h}) differs from this estimator's ({H}); fit FQE with the "
                             "same horizon")
        rows = r.rows_
        steps = StateActionFeatures._steps(dataset)[rows]
        obs, nxt = dataset.observations[rows], dataset.next_observations[rows]
        to_go = None if H is None else H - steps
        q_sa = np.asarray(q.q_values(obs, dataset.actions[rows], to_go), np.float64)
        live = (dataset.terminals[rows] == 0) & (True if H is None else steps + 1 < H)
        v_next = np.zeros(len(rows))
        idx = np.flatnonzero(live)
        if len(idx):
            v_next[idx] = _state_values(q, nxt[idx], None if H is None else to_go[idx] - 1, dataset)
        init = dataset.observations[dataset.episode_starts[:-1]]
        v0 = _state_values(q, init, None if H is None else np.full(len(init), H), dataset)
        td = r.rewards_ + r.gamma_ * v_next - q_sa
        d_i = r.episode_sums(r.phi_ * td[:, None])
        samples = v0 + r.influence(d_i, transpose=False)
        return self._result(samples, r, dataset, {"dm_value": float(v0.mean()),
                                                  "interval_note": "delta method through the ratio fit (Q held fixed)"})


def _state_values(q: Any, obs: np.ndarray, steps_to_go: np.ndarray | None, dataset: Dataset) -> np.ndarray:
    from offrl.ope.episodic import _accepts_dataset

    if _accepts_dataset(q):
        return np.asarray(q.state_values(obs, steps_to_go, dataset=dataset), np.float64)
    return np.asarray(q.state_values(obs, steps_to_go), np.float64)


class _MQLFunction:
    """The linear MQL Q of a MarginalRatios fit, with V(s) = Q(s, pi) from the same features."""

    def __init__(self, ratios: MarginalRatios, policy: Any, dataset: Dataset) -> None:
        self.ratios, self.target = ratios, as_target_policy(policy, dataset)
        self.horizon = ratios.horizon_

    def q_values(self, obs: np.ndarray, actions: np.ndarray, steps_to_go: np.ndarray | None = None) -> np.ndarray:
        return self.ratios.q_values(obs, actions, steps_to_go)

    def state_values(self, obs: np.ndarray, steps_to_go: np.ndarray | None = None) -> np.ndarray:
        r = self.ratios
        t = None if r.horizon_ is None else r.horizon_ - np.asarray(steps_to_go, np.int64)
        rng = np.random.default_rng(r.random_state)
        return r.features_.policy_transform(np.asarray(obs, np.float64), self.target, t, r.n_action_samples, rng) @ r.beta_
