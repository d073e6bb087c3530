"""Fitted Q Evaluation (Le et al. 2019), the direct method for episodic OPE.

FQE regresses Q^pi on the Bellman target r + gamma (1 - done) E_{a'~pi} Q'(s', a')
with the same machinery as the learning algorithms: the dataset lives as
tensors on the device, a batched critic ensemble (`QEnsemble`, or one
`EnsembleMLP` head per action for discrete actions), fused Adam and Polyak
target updates.  The target policy's actions at every s' are computed once per
fit (probabilities for discrete policies, pi(s') for deterministic ones, a few
samples per state for stochastic ones).

Regression targets are clipped to the range any policy's value can take
given the logged rewards, [min(0, r_min G), max(0, r_max G)] with G the sum
of discounts (`clip_targets`), which stops extrapolation to states the data
barely covers from producing impossible values.

Values are learned in a normalised unit, Q~ = Q / (scale * H_eff) with
H_eff = min(1 / (1 - gamma), horizon), so regression targets stay O(1)
whatever the reward scale.  With `horizon=None` FQE fits the stationary
(infinite-horizon) Q and bootstraps through time-limit cuts; with an integer
`horizon` it fits the finite-horizon Q_h(s, a) (h = steps to go, an input
feature) whose value at h = horizon is exactly the truncated return the IS
estimators target.

Each ensemble member is an independent FQE (own target network) and, with
`bootstrap=True`, is trained on its own Poisson(1) bootstrap resample of the
episodes, so the spread of the members' estimates (`ensemble_std`) measures
how much the fitted Q depends on the data.  The estimate is the members'
mean.  Its interval is the chosen interval over initial states, widened in
quadrature by t_{1-alpha/2, K-1} * ensemble_std (K members), and its
standard error is sqrt(se_initial_states^2 + ensemble_std^2).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Sequence

import numpy as np
import torch

from offrl.algos.base import OfflineAlgorithm, make_adam
from offrl.algos.params import boolean, choice, integer, interval_pair, real
from offrl.datasets.core import Batch, Dataset
from offrl.nn import EnsembleMLP, QEnsemble, soft_update_
from offrl.ope.behavior import TargetPolicy, as_target_policy
from offrl.ope.results import (
    INTERVALS,
    OPEResult,
    RatioComponents,
    check_gamma,
    check_horizon,
    make_result,
    value_range,
)

__all__ = ["FQE", "fqe_loss"]

_CHUNK = 65536


def fqe_loss(q: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared Bellman error: (n_critics, batch) -> scalar, transitions weighted per member by `weight`."""
    err = (q - target) ** 2
    if weight is None:
        return err.mean()
    weight = weight.expand_as(err)
    return ((err * weight).sum(-1) / weight.sum(-1).clamp_min(1.0)).mean()


_N_PROBE = 32


def _probe_values(target: TargetPolicy, probe: dict[str, Any]) -> np.ndarray:
    """The policy's response on the probe states: actions, action probabilities, or log pi(a|s) of logged actions."""
    obs = np.asarray(probe["observations"], np.float32)
    if target.kind == "deterministic":
        return target.act(obs).astype(np.float64)
    if target.kind == "discrete":
        return target.probs(obs)
    return target.log_prob(obs, np.asarray(probe["actions"], np.float32))


def _policy_probe(target: TargetPolicy, dataset: Dataset) -> dict[str, Any]:
    """A JSON record of what `target` does on the dataset's first few logged states."""
    rows = np.arange(min(_N_PROBE, dataset.n_transitions))
    probe: dict[str, Any] = {"kind": target.kind, "observations": dataset.observations[rows].tolist()}
    if target.kind == "stochastic":
        probe["actions"] = dataset.actions[rows].tolist()
    probe["values"] = np.asarray(_probe_values(target, probe), np.float64).tolist()  # JSON keeps -inf log-densities
    return probe


class FQE(OfflineAlgorithm):
    """Fitted Q Evaluation of a target policy.

    `fit(dataset, policy)` learns Q^pi; `estimate(dataset)` returns the
    mean over the dataset's initial states of V(s0) = E_pi Q(s0, .).
    `FQE(...).estimate(dataset, policy)` does both.
    """

    supports_discrete_actions = True
    name = "FQE"
    _param_rules = {
        "gamma": real(0, 1, closed="right"), "horizon": integer(1, none=True), "n_critics": integer(1), "bootstrap": boolean(), "layer_norm": boolean(),
        "lr_decay": boolean(), "clip_targets": boolean(), "n_action_samples": integer(1),
        "interval": choice(*INTERVALS), "alpha": real(0, 1, closed="neither"), "n_bootstrap": integer(1),
        "reward_bound": interval_pair(),
    }

    def __init__(
        self,
        *,
        gamma: float = 0.99,
        horizon: int | None = None,
        hidden_dims: Sequence[int] = (256, 256),
        n_critics: int = 3,
        bootstrap: bool = True,
        layer_norm: bool = False,
        lr: float = 3e-4,
        lr_decay: bool = True,
        batch_size: int = 256,
        n_steps: int = 20_000,
        tau: float = 0.05,
        clip_targets: bool = True,
        n_action_samples: int = 8,
        normalize_observations: bool = True,
        interval: str = "bootstrap",
        alpha: float = 0.05,
        n_bootstrap: int = 2000,
        reward_bound: tuple[float, float] | None = None,
        log_every: int = 100,
        device: str = "auto",
        random_state: Any = None,
    ) -> None:
        self.gamma = gamma
        self.horizon = horizon
        self.hidden_dims = hidden_dims
        self.n_critics = n_critics
        self.bootstrap = bootstrap
        self.layer_norm = layer_norm
        self.lr = lr
        self.lr_decay = lr_decay
        self.batch_size = batch_size
        self.n_steps = n_steps
        self.tau = tau
        self.clip_targets = clip_targets
        self.n_action_samples = n_action_samples
        self.normalize_observations = normalize_observations
        self.interval = interval
        self.alpha = alpha
        self.n_bootstrap = n_bootstrap
        self.reward_bound = reward_bound
        self.log_every = log_every
        self.device = device
        self.random_state = random_state

    # ------------------------------------------------------------------ fit
    def fit(self, dataset: Dataset | str, y: None = None, *, policy: Any = None, n_steps: int | None = None,
            **kwargs: Any) -> "FQE":
        """Learn Q of `policy` (any target policy, see `as_target_policy`) on `dataset`.

        `y` is unused (scikit-learn's `Pipeline` passes it); the policy is a keyword.
        """
        from offrl.datasets import load as load_dataset

        if isinstance(dataset, str):
            dataset = load_dataset(dataset)
        if policy is None:
            policy = getattr(self, "_policy_obj", None)
        if policy is None:
            raise ValueError("FQE.fit needs the policy to evaluate: fqe.fit(dataset, policy=policy)")
        if check_gamma(self.gamma) == 1.0 and check_horizon(self.horizon) is None and dataset.timeouts.any():
            raise ValueError("gamma=1 with horizon=None has no finite value for episodes cut by a time limit; "
                             "pass horizon=<steps> (finite-horizon FQE) or gamma < 1")
        target = as_target_policy(policy, dataset)
        if target.kind == "stochastic" and target._sample is None:
            raise ValueError("FQE needs to sample the target policy's actions; this stochastic policy has no sampler "
                             "(wrap it as TargetPolicy('stochastic', log_prob=..., sample=...))")
        if (target.kind == "discrete") != (dataset.discrete_actions is not None):
            raise ValueError(f"a {target.kind} target policy does not match this dataset's "
                             f"{'discrete' if dataset.discrete_actions is not None else 'continuous'} actions")
        self._target, self._policy_obj = target, policy
        self._probe = _policy_probe(target, dataset)
        self._total_steps = int(self.n_steps if n_steps is None else n_steps)
        kwargs.setdefault("progress", False)
        return super().fit(dataset, n_steps=n_steps, **kwargs)

    def _make_spec(self, dataset: Dataset) -> dict[str, Any]:
        spec = super()._make_spec(dataset)
        gamma = check_gamma(self.gamma)
        horizon = check_horizon(self.horizon)
        if horizon is None and gamma == 1.0:
            h_eff = float(dataset.episode_lengths().max())
        else:
            h_eff = min(1.0 / (1.0 - gamma) if gamma < 1 else float("inf"), float(horizon or float("inf")))
        r = dataset.rewards.astype(np.float64)
        scale = float(max(r.std(), abs(r.mean()), 1e-6))
        # Q^pi lies in [min(0, r_min G), max(0, r_max G)], G = sum of discounts over the horizon
        if horizon is not None:
            total = float(sum(gamma ** t for t in range(horizon)))
        elif gamma < 1:
            total = 1.0 / (1.0 - gamma)
        else:
            total = h_eff
        unit = scale * h_eff
        # What the fitted policy does on a few logged states, so a later call with another policy is caught
        # (also after save/load, when the policy object itself is gone).
        spec["policy_probe"] = self._probe
        spec.update({"fqe_horizon": horizon, "reward_scale": scale, "effective_horizon": float(h_eff),
                     "q_low": min(0.0, float(r.min()) * total) / unit, "q_high": max(0.0, float(r.max()) * total) / unit})
        return spec

    def _transform_rewards(self, dataset: Dataset) -> np.ndarray:
        return (dataset.rewards / (self.spec_["reward_scale"] * self.spec_["effective_horizon"])).astype(np.float32)

    def _extra_columns(self, dataset: Dataset) -> dict[str, np.ndarray]:
        target: TargetPolicy = self._target
        cols: dict[str, np.ndarray] = {}
        horizon = self.spec_["fqe_horizon"]
        if horizon is not None:
            cols["steps_to_go"] = (horizon - dataset.timesteps()).astype(np.float32)
        if self.bootstrap and int(self.n_critics) > 1:
            rng = np.random.default_rng(np.random.SeedSequence(int(torch.initial_seed()) % 2**32))
            per_episode = rng.poisson(1.0, size=(dataset.n_episodes, int(self.n_critics)))
            cols["member_weights"] = np.repeat(per_episode, dataset.episode_lengths(), axis=0).astype(np.float32)
        if target.kind == "discrete":
            cols["next_probs"] = target.probs(dataset.next_observations).astype(np.float32)
        else:
            k = 1 if target.kind == "deterministic" else int(self.n_action_samples)
            rng = np.random.default_rng(0)
            samples = target.sample_actions(dataset.next_observations, k, rng)  # (k, N, d)
            cols["next_actions"] = np.ascontiguousarray(samples.transpose(1, 0, 2).reshape(dataset.n_transitions, -1))
        return cols

    def _build(self, spec: dict[str, Any]) -> None:
        obs_dim = spec["observation_dim"] + (1 if spec.get("fqe_horizon") is not None else 0)
        device = self.device_
        if spec.get("discrete_actions") is not None:
            self.critic_ = EnsembleMLP(self.n_critics, obs_dim, int(spec["discrete_actions"]), self.hidden_dims,
                                       layer_norm=self.layer_norm)
        else:
            self.critic_ = QEnsemble(obs_dim, spec["action_dim"], self.n_critics, self.hidden_dims,
                                     layer_norm=self.layer_norm)
        self.critic_.to(device)
        self.critic_target_ = copy.deepcopy(self.critic_).requires_grad_(False)
        self.optimizer_ = make_adam(self.critic_.parameters(), self.lr, device, kernel="fused")
        low = torch.as_tensor(spec["action_low"] or [-1.0] * spec["action_dim"], dtype=torch.float32, device=device)
        high = torch.as_tensor(spec["action_high"] or [1.0] * spec["action_dim"], dtype=torch.float32, device=device)
        self._act_mid, self._act_half = (high + low) / 2, ((high - low) / 2).clamp_min(1e-6)

    # ------------------------------------------------------------------ networks
    def _input(self, obs: torch.Tensor, steps_to_go: torch.Tensor | None) -> torch.Tensor:
        horizon = self.spec_.get("fqe_horizon")
        if horizon is None:
            return obs
        return torch.cat([obs, (steps_to_go / horizon).unsqueeze(-1)], dim=-1)

    def _q(self, net: torch.nn.Module, x: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """(n_critics, batch) normalised Q of the given actions."""
        if self.spec_.get("discrete_actions") is not None:
            q = net(x)  # (n_critics, batch, n_actions)
            idx = actions.reshape(1, -1, 1).long().expand(q.shape[0], -1, 1)
            return q.gather(-1, idx).squeeze(-1)
        return net(x, (actions - self._act_mid) / self._act_half)

    def _update(self, batch: Batch, step: int) -> dict[str, torch.Tensor]:
        gamma = float(self.gamma)
        extras = batch.extras
        finite = "steps_to_go" in extras
        stg = extras.get("steps_to_go")
        x = self._input(batch.observations, stg)
        x_next = self._input(batch.next_observations, None if stg is None else stg - 1)
        done = batch.terminals
        weight = extras["member_weights"].T if "member_weights" in extras else None
        if finite:
            done = torch.maximum(done, (stg <= 1).float())
            valid = (stg > 0).float().unsqueeze(0)
            weight = valid if weight is None else weight * valid
        with torch.no_grad():
            if "next_probs" in extras:
                q_next = self.critic_target_(x_next)  # (n_critics, batch, n_actions)
                v_next = (q_next * extras["next_probs"]).sum(-1)
            else:
                samples = extras["next_actions"].reshape(len(done), -1, self.spec_["action_dim"])
                if samples.shape[1] > 1:
                    pick = torch.randint(samples.shape[1], (len(done),), device=samples.device)
                    samples = samples[torch.arange(len(done), device=samples.device), pick]
                else:
                    samples = samples[:, 0]
                v_next = self._q(self.critic_target_, x_next, samples)
            target = batch.rewards + gamma * (1.0 - done) * v_next
            if self.clip_targets:
                target = target.clamp(self.spec_["q_low"], self.spec_["q_high"])
        if self.lr_decay:  # cosine decay to 5% of lr over the run: removes most SGD noise from the final Q
            frac = min(step / max(getattr(self, "_total_steps", self.n_steps), 1), 1.0)
            for group in self.optimizer_.param_groups:
                group["lr"] = self.lr * (0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * frac)))
        q = self._q(self.critic_, x, batch.actions)
        loss = fqe_loss(q, target, weight)
        self.optimizer_.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer_.step()
        soft_update_(self.critic_target_, self.critic_, self.tau)
        return {"fqe_loss": loss.detach(), "q_mean": q.detach().mean() * self._q_unit()}

    def _q_unit(self) -> float:
        return float(self.spec_["reward_scale"] * self.spec_["effective_horizon"])

    def _act(self, obs: torch.Tensor, deterministic: bool) -> torch.Tensor:
        raise AttributeError("FQE evaluates a policy and has none of its own to act with")

    def _value(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        stg = None
        if self.spec_.get("fqe_horizon") is not None:
            stg = torch.full((len(obs),), float(self.spec_["fqe_horizon"]), device=obs.device)
        return self._q(self.critic_, self._input(obs, stg), actions).mean(0) * self._q_unit()

    # ------------------------------------------------------------------ queries
    @torch.no_grad()
    def _member_q(self, obs: np.ndarray, actions: np.ndarray, steps_to_go: np.ndarray | None) -> np.ndarray:
        """(n_critics, n) Q in reward units."""
        self._check_fitted()
        self._set_training_mode(False)
        try:
            out = []
            for i in range(0, len(obs), _CHUNK):
                o = self.obs_normalizer_(torch.as_tensor(np.asarray(obs[i:i + _CHUNK], np.float32), device=self.device_))
                a = torch.as_tensor(np.asarray(actions[i:i + _CHUNK], np.float32).reshape(len(o), -1), device=self.device_)
                stg = None
                if self.spec_.get("fqe_horizon") is not None:
                    s = np.full(len(o), self.spec_["fqe_horizon"]) if steps_to_go is None else steps_to_go[i:i + _CHUNK]
                    stg = torch.as_tensor(np.asarray(s, np.float32), device=self.device_)
                out.append(self._q(self.critic_, self._input(o, stg), a).double().cpu().numpy())
        finally:
            self._set_training_mode(True)
        return np.concatenate(out, axis=1) * self._q_unit()

    @property
    def horizon_(self) -> int | None:
        return self.spec_.get("fqe_horizon")

    def q_values(self, obs: np.ndarray, actions: np.ndarray, steps_to_go: np.ndarray | None = None) -> np.ndarray:
        """Q(s, a) (mean over the ensemble); `steps_to_go` defaults to the full horizon."""
        return self._member_q(obs, actions, steps_to_go).mean(0)

    def _member_v(self, obs: np.ndarray, steps_to_go: np.ndarray | None, policy: Any = None) -> np.ndarray:
        target = getattr(self, "_target", None)
        if policy is not None and policy is not getattr(self, "_policy_obj", None):
            target = as_target_policy(policy, discrete_actions=self.spec_.get("discrete_actions"))
            self._check_fitted_policy(target)
        if target is None:
            raise ValueError("this FQE has no target policy (it was loaded from a file); pass policy=...")
        obs = np.asarray(obs, np.float32)
        if target.kind == "discrete":
            p = target.probs(obs)
            total = np.zeros((int(self.n_critics), len(obs)))
            for a in range(p.shape[1]):
                total += p[:, a] * self._member_q(obs, np.full((len(obs), 1), a, np.float32), steps_to_go)
            return total
        n = 1 if target.kind == "deterministic" else int(self.n_action_samples)
        samples = target.sample_actions(obs, n, np.random.default_rng(0))
        return np.mean([self._member_q(obs, s, steps_to_go) for s in samples], axis=0)

    def _check_fitted_policy(self, target: TargetPolicy) -> None:
        """Refuse a policy other than the one Q was fitted for: its Q would be the old policy's."""
        probe = self.spec_.get("policy_probe")
        if probe is None:  # a model file from before policy probes: nothing to compare with
            return
        if target.kind != probe["kind"] or not np.allclose(
                _probe_values(target, probe), np.asarray(probe["values"], np.float64), rtol=1e-4, atol=1e-5, equal_nan=True):
            raise ValueError(
                "this FQE was fitted to evaluate another policy (it acts differently on the training data's first "
                "states), and its Q-function is that policy's; fit one FQE per policy: "
                "FQE(...).fit(dataset, policy=new_policy), or sklearn.base.clone(fqe).estimate(dataset, new_policy)")

    def state_values(self, obs: np.ndarray, steps_to_go: np.ndarray | None = None, policy: Any = None) -> np.ndarray:
        """V(s) = E_{a~pi} Q(s, a) for the fitted target policy (mean over the ensemble).

        `policy` must be the fitted one (checked on a few logged states); a
        different policy raises, since Q was learnt for the fitted one.
        """
        return self._member_v(obs, steps_to_go, policy).mean(0)

    def estimate(self, dataset: Dataset, policy: Any = None, **_: Any) -> OPEResult:
        """Mean over the dataset's initial states of V(s0).  Fits first when not fitted yet.

        On a fitted FQE, `policy` may be omitted or must be the policy it was
        fitted for; another policy raises a ValueError (fit a new FQE for it).
        """
        if not hasattr(self, "spec_"):
            self.fit(dataset, policy=policy)
        obs0 = dataset.observations[dataset.episode_starts[:-1]]
        members = self._member_v(obs0, None, policy)  # (n_critics, n_episodes)
        per_episode = members.mean(0)
        member_values = members.mean(1)
        h = self.spec_.get("fqe_horizon")
        gamma = check_gamma(self.gamma)
        scale = float(sum(gamma ** t for t in range(int(h)))) if h is not None else float(self.spec_["effective_horizon"])
        k = len(member_values)
        ensemble_std = float(member_values.std(ddof=1)) if k > 1 else 0.0
        diag = {
            "member_values": member_values.tolist(),
            "ensemble_std": ensemble_std,
            "n_steps": int(getattr(self, "n_steps_done_", 0)),
            "final_loss": float(getattr(self, "last_metrics_", {}).get("fqe_loss", float("nan"))),
            "horizon": h,
            "gamma": gamma,
            "target_policy": self._target.kind if getattr(self, "_target", None) is not None else "given",
            "model_based_terms": True,
            "estimand": (f"discounted return over the first {h} steps" if h is not None
                         else "infinite-horizon discounted value (bootstraps through time-limit cuts)"),
        }
        result = make_result(RatioComponents(per_episode), self.name, interval=self.interval, alpha=self.alpha,
                             n_bootstrap=self.n_bootstrap, random_state=0,
                             bound=value_range(self.reward_bound, dataset.rewards, scale), diagnostics=diag)
        if k > 1 and ensemble_std > 0:
            from scipy import stats

            extra = float(stats.t.ppf(1 - result.alpha / 2, k - 1)) * ensemble_std
            lo, hi = result.value - result.ci_low, result.ci_high - result.value
            result.ci_low = result.value - float(np.hypot(lo, extra))
            result.ci_high = result.value + float(np.hypot(hi, extra))
            result.std_error = float(np.hypot(result.std_error, ensemble_std))
            result.diagnostics["interval_note"] = (
                "initial-state interval widened in quadrature by t_{1-alpha/2,K-1} * ensemble_std"
                + (" (members fitted on bootstrap resamples)" if self.bootstrap else " (members differ only by initialisation)"))
        else:
            result.diagnostics["interval_note"] = "covers the sampling of initial states only, not the error of the fitted Q"
        return result
