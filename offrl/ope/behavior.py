"""Target-policy adapters, behaviour-policy estimation, kernels and importance-weight diagnostics.

A *target policy* may be a fitted offrl estimator, a callable, or a
`TargetPolicy`; `as_target_policy` turns any of them into a `TargetPolicy`
with one of three kinds:

- ``"discrete"``: action probabilities pi(a|s), shape (n, n_actions);
- ``"stochastic"``: a density, log pi(a|s), plus a sampler;
- ``"deterministic"``: continuous actions a = pi(s).  Importance weights
  then use a Gaussian kernel K_h(a - pi(s)) in place of pi(a|s), with a
  data-driven bandwidth h (Scott's or Silverman's rule, or a number).

The behaviour policy's log-probabilities come from the dataset's
`behavior_log_probs` when it has them; otherwise `BehaviorPolicy` estimates
them (a scikit-learn classifier for discrete actions, a mixture-density BC
network for continuous ones, squashed into the action box by default),
cross-fitted over episodes, and results say so with the model's held-out
log-likelihood.
"""

from __future__ import annotations

import inspect
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import sklearn.base
import torch

from offrl.datasets.core import Dataset
from offrl.ope.results import OPEWarning, effective_sample_size

__all__ = [
    "TargetPolicy",
    "as_target_policy",
    "BehaviorPolicy",
    "BehaviorEstimate",
    "estimate_behavior",
    "behavior_log_probs",
    "kernel_bandwidth",
    "StepLogRatios",
    "log_importance_ratios",
]

_CHUNK = 65536


def _batched(fn: Callable[[np.ndarray], Any], obs: np.ndarray) -> np.ndarray:
    if len(obs) <= _CHUNK:
        return np.asarray(fn(obs))
    return np.concatenate([np.asarray(fn(obs[i:i + _CHUNK])) for i in range(0, len(obs), _CHUNK)])


def _n_required_args(fn: Callable) -> int:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return 1
    return sum(
        1 for p in sig.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    )


class TargetPolicy:
    """A target policy as OPE sees it.

    Parameters
    ----------
    kind : "discrete", "stochastic" or "deterministic".
    probs : obs (n, obs_dim) -> (n, n_actions) action probabilities (discrete).
    log_prob : (obs, actions) -> (n,) log-density (stochastic).
    sample : obs -> (n, action_dim) one sampled action per row (stochastic).
    act : obs -> (n, action_dim) actions (deterministic).
    name : shown in reports.
    """

    def __init__(
        self,
        kind: str,
        *,
        probs: Callable[[np.ndarray], Any] | None = None,
        log_prob: Callable[[np.ndarray, np.ndarray], Any] | None = None,
        sample: Callable[[np.ndarray], Any] | None = None,
        act: Callable[[np.ndarray], Any] | None = None,
        name: str | None = None,
    ) -> None:
        if kind not in ("discrete", "stochastic", "deterministic"):
            raise ValueError(f"kind must be 'discrete', 'stochastic' or 'deterministic', got {kind!r}")
        needed = {"discrete": ("probs", probs), "stochastic": ("log_prob", log_prob), "deterministic": ("act", act)}[kind]
        if needed[1] is None:
            raise ValueError(f"a {kind} TargetPolicy needs {needed[0]}=...")
        self.kind = kind
        self._probs, self._log_prob, self._sample, self._act = probs, log_prob, sample, act
        self.name = name

    def __repr__(self) -> str:
        return f"TargetPolicy(kind={self.kind!r}{', name=' + repr(self.name) if self.name else ''})"

    # ------------------------------------------------------------------ queries
    def probs(self, obs: np.ndarray) -> np.ndarray:
        if self.kind != "discrete":
            raise TypeError(f"a {self.kind} target policy has no action probabilities")
        obs = np.asarray(obs, np.float32)
        p = np.asarray(_batched(self._probs, obs), dtype=np.float64)
        if p.ndim != 2 or len(p) != len(obs):
            raise ValueError(f"the target policy returned probabilities of shape {p.shape}; expected ({len(obs)}, n_actions)")
        if np.any(p < -1e-8) or not np.allclose(p.sum(1), 1.0, atol=1e-4):
            raise ValueError("the target policy's action probabilities must be non-negative and sum to 1 in every row")
        return np.clip(p, 0.0, None)

    def log_prob(self, obs: np.ndarray, actions: np.ndarray) -> np.ndarray:
        obs = np.asarray(obs, np.float32)
        if self.kind == "discrete":
            p = self.probs(obs)
            a = np.asarray(actions).reshape(len(obs), -1)[:, 0].astype(np.int64)
            with np.errstate(divide="ignore"):
                return np.log(p[np.arange(len(obs)), a])
        if self.kind == "stochastic":
            actions = np.asarray(actions, np.float32).reshape(len(obs), -1)
            out = [np.asarray(self._log_prob(obs[i:i + _CHUNK], actions[i:i + _CHUNK]), np.float64).reshape(-1)
                   for i in range(0, len(obs), _CHUNK)]
            return np.concatenate(out)
        raise TypeError("a deterministic target policy has no density; importance weights use a kernel instead")

    def act(self, obs: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
        """The action the policy takes (sampled for stochastic and discrete policies): used for roll-outs."""
        obs = np.asarray(obs, np.float32)
        if self.kind == "deterministic":
            return np.asarray(_batched(self._act, obs), np.float32).reshape(len(obs), -1)
        if self.kind == "stochastic":
            if self._sample is None:
                raise ValueError("this stochastic target policy has no sampler; build it with TargetPolicy(..., sample=fn)")
            return np.asarray(_batched(self._sample, obs), np.float32).reshape(len(obs), -1)
        rng = rng if rng is not None else np.random.default_rng()
        p = self.probs(obs)
        cdf = np.cumsum(p, axis=1)
        u = rng.random((len(obs), 1)) * cdf[:, -1:]
        return np.minimum((u > cdf).sum(1), p.shape[1] - 1).astype(np.int64)

    def sample_actions(self, obs: np.ndarray, n_samples: int, rng: np.random.Generator | None = None) -> np.ndarray:
        """(n_samples, n, action_dim) actions for continuous policies (repeated for deterministic ones)."""
        obs = np.asarray(obs, np.float32)
        if self.kind == "deterministic":
            a = self.act(obs)
            return np.broadcast_to(a, (n_samples, *a.shape)).copy()
        if self.kind == "stochastic":
            return np.stack([self.act(obs, rng) for _ in range(n_samples)])
        raise TypeError("sample_actions is for continuous policies; use probs for discrete ones")


def _wrap_estimator(policy: Any, deterministic: bool | None, name: str | None) -> TargetPolicy:
    spec = getattr(policy, "spec_", None)
    if spec is None:
        from sklearn.exceptions import NotFittedError

        raise NotFittedError(f"the target policy {type(policy).__name__} is not fitted; fit it (or load a saved one) first")
    name = name or type(policy).__name__
    if spec.get("discrete_actions") is not None:
        n_actions = int(spec["discrete_actions"])
        if hasattr(policy, "predict_proba") and deterministic is not True:
            return TargetPolicy("discrete", probs=policy.predict_proba, name=name)
        if deterministic is False:
            raise ValueError(f"{type(policy).__name__} has no predict_proba, so only its deterministic (argmax) policy can be evaluated")

        def one_hot(obs: np.ndarray) -> np.ndarray:
            a = np.asarray(policy.predict(obs, deterministic=True)).reshape(-1).astype(np.int64)
            return np.eye(n_actions)[a]

        return TargetPolicy("discrete", probs=one_hot, name=name)
    if deterministic is None:
        deterministic = not callable(getattr(policy, "log_prob", None))
    if deterministic:
        return TargetPolicy("deterministic", act=lambda obs: policy.predict(obs, deterministic=True), name=name)
    if not callable(getattr(policy, "log_prob", None)):
        raise ValueError(
            f"{type(policy).__name__} exposes no log_prob(observations, actions), so it cannot be evaluated as a "
            "stochastic policy; use deterministic=True (kernel weights) or wrap it in TargetPolicy"
        )
    return TargetPolicy("stochastic", log_prob=policy.log_prob, sample=policy.sample_action, name=name)


def as_target_policy(
    policy: Any,
    dataset: Dataset | None = None,
    *,
    deterministic: bool | None = None,
    name: str | None = None,
    discrete_actions: int | None = None,
) -> TargetPolicy:
    """Any supported target policy as a `TargetPolicy`.

    - a `TargetPolicy`: returned as is;
    - a fitted offrl estimator: discrete action spaces use `predict_proba` when
      it exists (else the argmax policy); continuous ones use the density
      (`log_prob`, `sample_action`) when the estimator exposes `log_prob`,
      and otherwise `predict` as a deterministic policy (kernel weights).
      `deterministic=True/False` forces either;
    - a callable `f(obs)`: on a discrete dataset, (n, n_actions) probabilities
      or (n,) integer actions; on a continuous one, (n, action_dim) actions
      (deterministic).  A callable `f(obs, actions)` is a log-density
      (stochastic, without a sampler: fine for IS, not for FQE or roll-outs).

    Whether the action space is discrete comes from `dataset` (or
    `discrete_actions`, the number of actions).
    """
    if isinstance(policy, TargetPolicy):
        return policy
    if hasattr(policy, "predict") and hasattr(policy, "get_params"):
        return _wrap_estimator(policy, deterministic, name)
    if not callable(policy):
        raise TypeError(
            f"a target policy must be a fitted offrl estimator, a callable or a TargetPolicy, got {type(policy).__name__}"
        )
    name = name or getattr(policy, "__name__", None)
    if _n_required_args(policy) >= 2:
        return TargetPolicy("stochastic", log_prob=policy, name=name)
    discrete = dataset.discrete_actions if dataset is not None else discrete_actions
    if discrete is not None:
        n_actions = int(discrete)

        def probs(obs: np.ndarray) -> np.ndarray:
            out = np.asarray(policy(obs))
            if out.ndim == 1 or (out.ndim == 2 and out.shape[1] == 1 and n_actions > 1):
                a = out.reshape(-1)
                if not np.all(a == np.round(a)):
                    raise ValueError("a discrete target policy must return (n, n_actions) probabilities or (n,) integer actions")
                return np.eye(n_actions)[a.astype(np.int64)]
            if out.ndim != 2 or out.shape[1] != n_actions:
                raise ValueError(f"the target policy returned shape {out.shape}; expected ({len(obs)}, {n_actions}) probabilities")
            return out

        return TargetPolicy("discrete", probs=probs, name=name)
    return TargetPolicy("deterministic", act=policy, name=name)


# ---------------------------------------------------------------------- kernels
def kernel_bandwidth(actions: np.ndarray, rule: Any = "scott", n: int | None = None) -> np.ndarray:
    """Per-dimension Gaussian-kernel bandwidth for deterministic target policies.

    `rule`: "scott" (h_j = sigma_j n^(-1/(d+4))), "silverman"
    (h_j = (4/(d+2))^(1/(d+4)) sigma_j n^(-1/(d+4))), a number or an array
    (used as is).  sigma_j = min(std, IQR/1.349) of the logged actions in
    dimension j (robust to heavy tails); n defaults to the number of rows.
    """
    actions = np.asarray(actions, np.float64)
    if actions.ndim == 1:
        actions = actions[:, None]
    n_rows, d = actions.shape
    if not isinstance(rule, str):
        h = np.broadcast_to(np.asarray(rule, np.float64), (d,)).copy()
        if np.any(~np.isfinite(h)) or np.any(h <= 0):
            raise ValueError(f"bandwidth must be positive, got {rule!r}")
        return h
    n = int(n or n_rows)
    std = actions.std(0, ddof=1) if n_rows > 1 else np.ones(d)
    q75, q25 = np.percentile(actions, [75, 25], axis=0)
    iqr = (q75 - q25) / 1.349
    sigma = np.where(iqr > 0, np.minimum(std, iqr), std)
    sigma = np.where(sigma > 0, sigma, 1.0)
    if rule == "scott":
        factor = n ** (-1.0 / (d + 4))
    elif rule == "silverman":
        factor = (4.0 / (d + 2)) ** (1.0 / (d + 4)) * n ** (-1.0 / (d + 4))
    else:
        raise ValueError(f"bandwidth must be 'scott', 'silverman' or a positive number, got {rule!r}")
    return sigma * factor


def gaussian_kernel_log_density(actions: np.ndarray, centers: np.ndarray, bandwidth: np.ndarray) -> np.ndarray:
    """log prod_j N(a_j; c_j, h_j^2): the kernel that stands in for a deterministic pi(a|s)."""
    z = (np.asarray(actions, np.float64) - np.asarray(centers, np.float64)) / bandwidth
    return (-0.5 * z ** 2 - np.log(bandwidth) - 0.5 * math.log(2 * math.pi)).sum(-1)


# ---------------------------------------------------------------------- behaviour policy
class _MixtureDensity(torch.nn.Module):
    def __init__(self, obs_dim: int, act_dim: int, n_components: int, hidden_dims: Sequence[int]) -> None:
        super().__init__()
        from offrl.nn import MLP

        self.k, self.d = n_components, act_dim
        self.net = MLP(obs_dim, n_components * (2 * act_dim + 1), hidden_dims)

    def log_prob(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        out = self.net(obs)
        k, d = self.k, self.d
        logits = out[:, :k]
        mean = out[:, k:k + k * d].reshape(-1, k, d)
        log_std = out[:, k + k * d:].reshape(-1, k, d).clamp(-7.0, 2.0)
        z = (actions[:, None, :] - mean) / log_std.exp()
        comp = (-0.5 * z ** 2 - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        return torch.logsumexp(torch.log_softmax(logits, -1) + comp, -1)


_DENSITIES = ("auto", "tanh", "gaussian")


class _OneClass:
    """The classifier of a training set with one action: that action with probability 1."""

    def __init__(self, label: int) -> None:
        self.classes_ = np.array([label])

    def predict_proba(self, obs: np.ndarray) -> np.ndarray:
        return np.ones((len(obs), 1))


@dataclass
class _ContinuousModel:
    """One fitted density network and the standardisation (and action box) around it."""

    net: _MixtureDensity
    o_mean: np.ndarray
    o_std: np.ndarray
    x_mean: np.ndarray
    x_std: np.ndarray
    low: np.ndarray | None = None  # set for the tanh density: the action box
    high: np.ndarray | None = None


class BehaviorPolicy(sklearn.base.BaseEstimator):
    """An estimate of the behaviour policy pi_b(a|s) from the logged data.

    Discrete actions: `classifier` (a scikit-learn classifier with
    `predict_proba`; default multinomial logistic regression).  Continuous
    actions: a mixture-density BC network (`n_components` Gaussians whose
    weights, means and scales depend on the state) trained by maximum
    likelihood on standardised observations.

    `density` says where the mixture lives:

    - ``"tanh"``: on x = atanh(u), u the action rescaled from the box
      [action_low, action_high] to (-1, 1), with the change-of-variables
      term, so the density of a is positive only inside the box and
      integrates to 1 there.  Logged actions on (or, within the dataset's
      1e-6 tolerance, past) the bound are clipped to u = +-(1 - `bound_eps`)
      first: a density cannot hold a point mass at the bound, and such rows
      get a large but finite density;
    - ``"gaussian"``: on the standardised action itself (mass outside the
      box is lost);
    - ``"auto"`` (default): "tanh" when the dataset gives finite action
      bounds, else "gaussian".

    Cross-fitting (`n_folds` >= 2, default 2): the episodes are split into
    `n_folds` folds at random, each run of `n_folds` consecutive episodes
    sending one to each fold so that every fold gets the same mix of a log
    whose behaviour changes over time (contiguous blocks of rows when there
    are fewer episodes than folds); each fold's model is trained on the
    other folds, and the logged rows are scored only by the model that did
    not see them.
    Scoring rows with the model trained on them overstates pi_b(a|s) and so
    biases importance weights downwards.  `heldout_log_likelihood_` is then
    the mean out-of-fold log pi_b(a|s) per transition (nats; per action
    dimension in `heldout_log_likelihood_per_dim_`), the number to compare
    behaviour models by; `insample_log_likelihood_` is the same on the
    training rows.  New points (`log_prob`, `predict_proba`) are scored by
    the average of the fold models' densities.  `n_folds=1` fits one model
    on all rows and scores in-sample, with no held-out figure.

    Fitted attributes: `models_` (one per fold), `folds_` (each logged
    row's fold; `models_[k]` never saw fold k), `logged_log_probs_`,
    `heldout_log_likelihood_` (None when n_folds=1),
    `heldout_log_likelihood_per_dim_`, `insample_log_likelihood_`,
    `density_` ("tanh" or "gaussian" as resolved; None for discrete actions).

    For a log of several policies (a replay buffer, medium-expert) the model
    is their state-conditional mixture: it does not know which policy logged
    an episode, so its trajectory weights differ from those of the logged
    per-episode propensities.

    The model before this default was `density="gaussian", n_components=1,
    n_folds=1`; it stays selectable by those parameters (and gives the same
    numbers as before).
    """

    def __init__(
        self,
        *,
        classifier: Any = None,
        density: str = "auto",
        n_components: int = 3,
        hidden_dims: Sequence[int] = (64, 64),
        n_steps: int = 2000,
        batch_size: int = 256,
        lr: float = 1e-3,
        n_folds: int = 2,
        bound_eps: float = 1e-6,
        random_state: Any = 0,
    ) -> None:
        self.classifier = classifier
        self.density = density
        self.n_components = n_components
        self.hidden_dims = hidden_dims
        self.n_steps = n_steps
        self.batch_size = batch_size
        self.lr = lr
        self.n_folds = n_folds
        self.bound_eps = bound_eps
        self.random_state = random_state

    # ------------------------------------------------------------------ description
    @property
    def description(self) -> str:
        """How pi_b was obtained, for results and reports ('estimated (...)')."""
        folds = int(self.n_folds)
        cross = f", {folds}-fold cross-fitted" if folds > 1 else ""
        if getattr(self, "discrete_", None) is not None:
            name = type(self.classifier).__name__ if self.classifier is not None else "LogisticRegression"
            return f"estimated ({name} classifier{cross}{self._heldout_text()})"
        density = getattr(self, "density_", None) or self.density
        k = int(self.n_components)
        if density == "tanh":
            kind = "tanh-Gaussian" if k == 1 else f"{k}-component tanh-Gaussian-mixture"
        else:
            kind = "Gaussian" if k == 1 else f"{k}-component Gaussian-mixture"
        return f"estimated ({kind} BC{cross}{self._heldout_text()})"

    def _heldout_text(self) -> str:
        heldout = getattr(self, "heldout_log_likelihood_", None)
        return "" if heldout is None else f"; held-out log-likelihood {heldout:.4g} nats per transition"

    def fit_diagnostics(self) -> dict[str, Any]:
        """The fit's figures for OPE results: held-out and in-sample log-likelihood (nats per transition)."""
        self._check_fitted()
        out: dict[str, Any] = {"behavior_n_folds": int(self.n_folds),
                               "behavior_insample_loglik": self.insample_log_likelihood_}
        if self.heldout_log_likelihood_ is not None:
            out["behavior_heldout_loglik"] = self.heldout_log_likelihood_
        return out

    # ------------------------------------------------------------------ fitting
    def _check_params(self, dataset: Dataset) -> str | None:
        if not isinstance(dataset, Dataset):
            raise TypeError(f"BehaviorPolicy.fit takes an offrl Dataset, got {type(dataset).__name__}")
        if dataset.actions is None:
            raise ValueError("the dataset has no actions; a behaviour policy cannot be estimated without them")
        if int(self.n_folds) < 1:
            raise ValueError(f"n_folds must be at least 1, got {self.n_folds}")
        if int(self.n_components) < 1:
            raise ValueError(f"n_components must be at least 1, got {self.n_components}")
        if not 0.0 < float(self.bound_eps) < 0.5:
            raise ValueError(f"bound_eps must lie in (0, 0.5), got {self.bound_eps}")
        if self.density not in _DENSITIES:
            raise ValueError(f"density must be one of {_DENSITIES}, got {self.density!r}")
        if dataset.discrete_actions is not None:
            return None
        low, high = dataset.action_low, dataset.action_high
        boxed = (low is not None and high is not None and bool(np.all(np.isfinite(low)) and np.all(np.isfinite(high)))
                 and bool(np.all(high > low)))
        if self.density == "tanh" and not boxed:
            raise ValueError("density='tanh' needs finite action bounds with action_high > action_low; the dataset's "
                             f"action_low / action_high are {low} / {high}. Pass the bounds when building the "
                             "Dataset, or use density='gaussian'")
        return "tanh" if self.density == "tanh" or (self.density == "auto" and boxed) else "gaussian"

    def _folds(self, dataset: Dataset) -> np.ndarray:
        """The fold of every transition: random episode folds, or row blocks when episodes are too few."""
        n_folds = int(self.n_folds)
        if dataset.n_episodes >= n_folds:
            # Blocked randomisation: each run of n_folds consecutive episodes goes one to each fold, in random
            # order, so logs whose behaviour drifts over time (a replay buffer, concatenated datasets) give
            # every fold the same mix of behaviours.
            rng = np.random.default_rng(self.random_state)
            n_blocks = -(-dataset.n_episodes // n_folds)
            fold_of_episode = np.concatenate([rng.permutation(n_folds) for _ in range(n_blocks)])[:dataset.n_episodes]
            return np.repeat(fold_of_episode, dataset.episode_lengths())
        if dataset.n_transitions < 2 * n_folds:
            raise ValueError(f"the dataset has {dataset.n_transitions} transitions, too few for n_folds={n_folds}; "
                             "pass n_folds=1")
        return (np.arange(dataset.n_transitions) * n_folds) // dataset.n_transitions

    def fit(self, dataset: Dataset) -> "BehaviorPolicy":
        """Fit the model(s); with n_folds >= 2 also score every logged row out of fold."""
        self.density_ = self._check_params(dataset)
        self.discrete_ = dataset.discrete_actions
        obs, actions = dataset.observations, dataset.actions
        seed = int(np.random.default_rng(self.random_state).integers(2**31 - 1))
        low, high = dataset.action_low, dataset.action_high
        n_folds = int(self.n_folds)
        logged = np.empty(dataset.n_transitions)
        if n_folds == 1:
            self.folds_ = np.zeros(dataset.n_transitions, np.int64)
            self.models_ = [self._fit_one(obs, actions, seed, low, high)]
            logged[:] = self._log_prob_with(self.models_[0], obs, actions)
            self.insample_log_likelihood_ = float(logged.mean())
            self.heldout_log_likelihood_ = None
            self.heldout_log_likelihood_per_dim_ = None
        else:
            self.folds_ = fold = self._folds(dataset)
            self.models_, insample = [], []
            for k in range(n_folds):
                train, test = fold != k, fold == k
                model = self._fit_one(obs[train], actions[train], seed + k, low, high)
                self.models_.append(model)
                logged[test] = self._log_prob_with(model, obs[test], actions[test])
                insample.append(self._log_prob_with(model, obs[train], actions[train]))
            self.insample_log_likelihood_ = float(np.mean(np.concatenate(insample)))
            self.heldout_log_likelihood_ = float(logged.mean())
            self.heldout_log_likelihood_per_dim_ = self.heldout_log_likelihood_ / actions.shape[1]
        self.logged_log_probs_ = logged
        self.fingerprint_ = _fingerprint(dataset)
        return self

    def _fit_one(self, obs: np.ndarray, actions: np.ndarray, seed: int, low: np.ndarray | None,
                 high: np.ndarray | None) -> Any:
        if self.discrete_ is not None:
            from sklearn.linear_model import LogisticRegression
            from sklearn.pipeline import make_pipeline
            from sklearn.preprocessing import StandardScaler

            labels = actions[:, 0].astype(np.int64)
            if len(np.unique(labels)) == 1:  # one action only (a small fold): classifiers refuse a single class
                return (_OneClass(int(labels[0])), len(obs))
            base = self.classifier if self.classifier is not None else make_pipeline(
                StandardScaler(), LogisticRegression(max_iter=1000))
            model = sklearn.base.clone(base)
            model.fit(obs, labels)
            return (model, len(obs))
        from offrl.algos.base import make_adam

        boxed = self.density_ == "tanh"
        x = self._to_latent(actions, low, high) if boxed else np.asarray(actions)  # dtype kept: the old fit exactly
        o_mean, o_std = obs.mean(0), np.maximum(obs.std(0), 1e-3)
        x_mean, x_std = x.mean(0), np.maximum(x.std(0), 1e-3)
        with torch.random.fork_rng(devices=[]):  # the caller's global torch stream stays as it was
            torch.manual_seed(seed)
            gen = torch.Generator().manual_seed(seed)
            net = _MixtureDensity(obs.shape[1], actions.shape[1], int(self.n_components), self.hidden_dims)
        # foreach: bit-identical on the CPU to torch's default (single-tensor) Adam, which this fit used.
        opt = make_adam(net.parameters(), self.lr, torch.device("cpu"), kernel="foreach")
        o = torch.as_tensor((obs - o_mean) / o_std, dtype=torch.float32)
        a = torch.as_tensor((x - x_mean) / x_std, dtype=torch.float32)
        for _ in range(int(self.n_steps)):
            idx = torch.randint(len(o), (int(self.batch_size),), generator=gen)
            loss = -net.log_prob(o[idx], a[idx]).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        net.eval()
        return _ContinuousModel(net, o_mean, o_std, x_mean, x_std, low if boxed else None, high if boxed else None)

    def _to_latent(self, actions: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
        """x = atanh(u), u = the action rescaled to (-1, 1) and clipped to +-(1 - bound_eps)."""
        u = self._to_unit(actions, low, high)
        return np.arctanh(u)

    def _to_unit(self, actions: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
        low64, high64 = np.asarray(low, np.float64), np.asarray(high, np.float64)
        u = 2.0 * (np.asarray(actions, np.float64) - low64) / (high64 - low64) - 1.0
        edge = 1.0 - float(self.bound_eps)
        return np.clip(u, -edge, edge)

    def _log_prob_with(self, model: Any, obs: np.ndarray, actions: np.ndarray) -> np.ndarray:
        actions = np.asarray(actions).reshape(len(obs), -1)
        if self.discrete_ is not None:
            return np.log(self._proba_with(model, obs)[np.arange(len(obs)), actions[:, 0].astype(np.int64)])
        m: _ContinuousModel = model
        if m.low is not None:
            u = self._to_unit(actions, m.low, m.high)
            x = np.arctanh(u)
            # log |dx/da| = -log(1 - u^2) + log(2 / (high - low)), per dimension
            log_jac = (-np.log1p(-u) - np.log1p(u) + np.log(2.0 / (np.asarray(m.high, np.float64)
                                                                 - np.asarray(m.low, np.float64)))).sum(1)
        else:
            x, log_jac = actions, 0.0
        with torch.no_grad():
            o = torch.as_tensor((obs - m.o_mean) / m.o_std, dtype=torch.float32)
            a = torch.as_tensor((x - m.x_mean) / m.x_std, dtype=torch.float32)
            lp = torch.cat([m.net.log_prob(o[i:i + _CHUNK], a[i:i + _CHUNK]) for i in range(0, len(o), _CHUNK)])
        return lp.double().numpy() - np.log(m.x_std).sum() + log_jac

    def _proba_with(self, model: Any, obs: np.ndarray) -> np.ndarray:
        """(n, n_actions) probabilities; actions the fold's training rows never took get 1 / (n_train + 1)."""
        clf, n_train = model
        full = np.zeros((len(obs), int(self.discrete_)))
        full[:, np.asarray(clf.classes_, dtype=np.int64)] = clf.predict_proba(obs)
        absent = np.ones(int(self.discrete_), bool)
        absent[np.asarray(clf.classes_, dtype=np.int64)] = False
        if absent.any():  # a fold that never saw an action must not call it impossible
            full[:, absent] = 1.0 / (n_train + 1)
            full /= full.sum(1, keepdims=True)
        return full

    # ------------------------------------------------------------------ queries
    def _check_fitted(self) -> None:
        if not hasattr(self, "models_"):
            from sklearn.exceptions import NotFittedError

            raise NotFittedError("This BehaviorPolicy is not fitted yet; call fit(dataset) first")

    def log_prob(self, observations: Any, actions: Any) -> np.ndarray:
        """log pi_b(a|s) of the given actions (env units); the fold models' densities are averaged."""
        self._check_fitted()
        obs = np.asarray(observations, np.float32)
        if self.discrete_ is not None:
            a = np.asarray(actions).reshape(len(obs), -1)[:, 0].astype(np.int64)
            with np.errstate(divide="ignore"):
                return np.log(self.predict_proba(obs)[np.arange(len(obs)), a])
        per_model = np.stack([self._log_prob_with(m, obs, actions) for m in self.models_])
        if len(per_model) == 1:
            return per_model[0]
        from scipy.special import logsumexp

        return logsumexp(per_model, axis=0) - math.log(len(per_model))

    def predict_proba(self, observations: Any) -> np.ndarray:
        """(n, n_actions) pi_b(.|s) for discrete action spaces (the fold models' average)."""
        self._check_fitted()
        if self.discrete_ is None:
            raise TypeError("predict_proba is for discrete action spaces")
        obs = np.asarray(observations, np.float32)
        return np.mean([self._proba_with(m, obs) for m in self.models_], axis=0)

    def logged_log_probs(self, dataset: Dataset) -> np.ndarray:
        """log pi_b(a_i|s_i) for every logged transition of `dataset`.

        Not fitted yet: fits on `dataset` first.  Fitted on this dataset: the
        cross-fitted (out-of-fold) values, or in-sample ones when n_folds=1.
        Fitted on other data: `log_prob` (every row is then held out).
        """
        if not hasattr(self, "models_"):
            self.fit(dataset)
        if getattr(self, "fingerprint_", None) == _fingerprint(dataset):
            return self.logged_log_probs_.copy()
        return self.log_prob(dataset.observations, dataset.actions)


def _fingerprint(dataset: Dataset) -> tuple[int, int, str]:
    """Identifies the data a model was fitted on (sizes and a digest of observations and actions)."""
    import hashlib

    digest = hashlib.blake2b(digest_size=16)
    digest.update(np.ascontiguousarray(dataset.observations).view(np.uint8))
    digest.update(np.ascontiguousarray(dataset.actions).view(np.uint8))
    digest.update(np.asarray(dataset.episode_starts, np.int64).view(np.uint8))
    return (dataset.n_transitions, dataset.n_episodes, digest.hexdigest())


@dataclass
class BehaviorEstimate:
    """log pi_b(a_i|s_i) of the logged transitions, how they were obtained, and the model's fit figures."""

    log_probs: np.ndarray
    description: str
    diagnostics: dict[str, Any] = field(default_factory=dict)


def estimate_behavior(dataset: Dataset, behavior: Any = None) -> BehaviorEstimate:
    """log pi_b(a_i|s_i) for the logged transitions, with how they were obtained and (for a model) its fit.

    `behavior`: None (the dataset's `behavior_log_probs`, else a default
    `BehaviorPolicy` is fitted), an array of per-transition log-probabilities,
    a `BehaviorPolicy` (fitted or not), or any target-policy-like object
    (e.g. the known data-collection policy).  For a `BehaviorPolicy`,
    `diagnostics` holds `fit_diagnostics()` (held-out log-likelihood).
    """
    if behavior is None:
        if dataset.behavior_log_probs is not None:
            return BehaviorEstimate(dataset.behavior_log_probs.astype(np.float64), "logged")
        behavior = BehaviorPolicy()
    if isinstance(behavior, BehaviorPolicy):
        log_probs = behavior.logged_log_probs(dataset)
        return BehaviorEstimate(log_probs, behavior.description, behavior.fit_diagnostics())
    if isinstance(behavior, np.ndarray) or isinstance(behavior, (list, tuple)):
        lp = np.asarray(behavior, np.float64).reshape(-1)
        if len(lp) != dataset.n_transitions:
            raise ValueError(
                f"behavior log-probabilities have {len(lp)} rows but the dataset has {dataset.n_transitions} transitions"
            )
        return BehaviorEstimate(lp, "given")
    policy = as_target_policy(behavior, dataset)
    if policy.kind == "deterministic":
        raise ValueError("the behaviour policy must be stochastic (a deterministic logger gives no overlap for IS)")
    return BehaviorEstimate(policy.log_prob(dataset.observations, dataset.actions), "given policy")


def behavior_log_probs(dataset: Dataset, behavior: Any = None) -> tuple[np.ndarray, str]:
    """log pi_b(a_i|s_i) for the logged transitions and how they were obtained (see `estimate_behavior`)."""
    out = estimate_behavior(dataset, behavior)
    return out.log_probs, out.description


def _check_behavior(log_b: np.ndarray) -> None:
    if np.any(np.isnan(log_b)):
        raise ValueError("behaviour log-probabilities contain NaN")
    bad = np.flatnonzero(~np.isfinite(log_b) & (log_b < 0))
    if len(bad):
        raise ValueError(
            f"the behaviour policy gives probability 0 to the logged action at row {int(bad[0])} "
            f"({len(bad)} rows in all); propensities must be positive. Check the logged log-probabilities "
            "or the behaviour model"
        )


@dataclass
class StepLogRatios:
    """Per-transition log importance ratios log pi_e(a|s) - log pi_b(a|s) and what went into them."""

    log_ratio: np.ndarray
    behavior: str
    target_kind: str
    bandwidth: np.ndarray | None = None
    unsupported_mass: float = 0.0
    warnings: list[str] = field(default_factory=list)
    behavior_diagnostics: dict[str, Any] = field(default_factory=dict)


def log_importance_ratios(
    dataset: Dataset,
    policy: Any,
    behavior: Any = None,
    bandwidth: Any = "scott",
    behavior_log_probs_: BehaviorEstimate | tuple[np.ndarray, str] | None = None,
) -> StepLogRatios:
    """log(pi_e / pi_b) for every logged transition, with the support check.

    Deterministic continuous targets use the Gaussian kernel
    K_h(a - pi(s)) / h^d in place of pi_e(a|s) (bandwidth by `kernel_bandwidth`).
    `behavior_log_probs_`: pi_b already worked out (`estimate_behavior`, or a
    (log_probs, description) pair), so that several policies share one fit.
    """
    target = as_target_policy(policy, dataset)
    known = behavior_log_probs_ if behavior_log_probs_ is not None else estimate_behavior(dataset, behavior)
    if not isinstance(known, BehaviorEstimate):
        known = BehaviorEstimate(*known)
    log_b, description = known.log_probs, known.description
    _check_behavior(log_b)
    obs, actions = dataset.observations, dataset.actions
    notes: list[str] = []
    h = None
    unsupported = 0.0
    if target.kind == "discrete":
        if dataset.discrete_actions is None:
            raise ValueError("a discrete target policy needs a dataset with discrete actions")
        probs = target.probs(obs)
        if probs.shape[1] != dataset.discrete_actions:
            raise ValueError(f"the target policy gives {probs.shape[1]} action probabilities but the dataset has "
                             f"{dataset.discrete_actions} actions")
        a = actions[:, 0].astype(np.int64)
        with np.errstate(divide="ignore"):
            log_e = np.log(probs[np.arange(len(a)), a])
        never = np.setdiff1d(np.arange(dataset.discrete_actions), np.unique(a))
        unsupported = float(probs[:, never].sum(1).mean()) if len(never) else 0.0
        if unsupported > 1e-3:
            notes.append(
                f"the target policy puts {unsupported:.1%} of its probability on actions the logs never take "
                f"({never.tolist()}); importance weights cannot see that mass, so IS-type estimates are biased"
            )
    elif target.kind == "stochastic":
        if dataset.discrete_actions is not None:
            raise ValueError("a continuous (density) target policy cannot be evaluated on a discrete-action dataset")
        log_e = target.log_prob(obs, actions)
    else:
        if dataset.discrete_actions is not None:
            raise ValueError("a continuous deterministic target policy cannot be evaluated on a discrete-action dataset")
        centers = target.act(obs)
        h = kernel_bandwidth(actions, bandwidth)
        log_e = gaussian_kernel_log_density(actions, centers, h)
        low, high = actions.min(0), actions.max(0)
        outside = np.any((centers < low - h) | (centers > high + h), axis=1)
        unsupported = float(outside.mean())
        if unsupported > 1e-3:
            notes.append(
                f"the target policy's action lies outside the logged action range at {unsupported:.1%} of the "
                "logged states; importance weights there are ~0 and IS-type estimates are biased"
            )
    log_ratio = np.where(np.isneginf(log_e), -np.inf, log_e - log_b)
    return StepLogRatios(log_ratio=log_ratio, behavior=description, target_kind=target.kind, bandwidth=h,
                         unsupported_mass=unsupported, warnings=notes, behavior_diagnostics=dict(known.diagnostics))


def weight_diagnostics(weights: np.ndarray, notes: Sequence[str] = (), name: str = "importance weights",
                       warn: bool = True, min_ess_fraction: float = 0.01, max_weight: float | None = None,
                       ess: float | None = None, log_max_weight: float | None = None) -> dict[str, Any]:
    """ESS, max weight and the warnings they call for (issued as OPEWarning when `warn`).

    `max_weight` / `ess` override the values computed from `weights` (e.g.
    when `weights` are rescaled, or a per-decision ESS is the relevant one);
    `log_max_weight` is the largest weight's log when it is too small or
    large for a float (long episodes), so the message prints 1e-194, not 0.
    """
    w = np.asarray(weights, np.float64).reshape(-1)
    n = len(w)
    ess = effective_sample_size(w) if ess is None else float(ess)
    max_w = (float(w.max()) if n else 0.0) if max_weight is None else float(max_weight)
    diag: dict[str, Any] = {
        "ess": ess,
        "ess_fraction": ess / n if n else 0.0,
        "max_weight": max_w,
        "mean_weight": float(w.mean()) if n else 0.0,
    }
    messages = list(notes)
    if n and ess < max(min_ess_fraction * n, 2.0) and not messages:
        messages.append(f"the {name} are dominated by a few samples")
    if messages:
        total = float(w.sum()) if n else 0.0
        share = f", the largest carries {w.max() / total:.0%} of their total" if total > 0 else ""
        if log_max_weight is not None and np.isfinite(log_max_weight) and not -7.0 < log_max_weight < 14.0:
            largest = f"largest weight about 1e{log_max_weight / np.log(10):.0f}"
        else:
            largest = f"max weight {max_w:.3g}"
        text = "; ".join(messages) + f" (effective sample size {ess:.1f} of {n}{share}, {largest})"
        diag["warning"] = text
        if warn:
            warnings.warn(text, OPEWarning, stacklevel=3)
    return diag
