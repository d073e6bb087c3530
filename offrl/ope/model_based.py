"""Model-based OPE: learn an ensemble dynamics/reward model, roll the target policy out in it.

Each member of a batched `EnsembleMLP` predicts a Gaussian over the
standardised (state change, reward) and, when the data has terminals, a
termination logit; members are trained by maximum likelihood on their own
random batches.  A terminal row's next state is not a state the
environment reaches (a Dataset built without `next_observations` holds the
next episode's first observation there), so the state part of the loss
skips terminal rows; their reward and termination still train.  The value is estimated by rolling the target policy out
from every logged initial state for `horizon` steps in every member
(member k drives roll-out k from start to end), accumulating the
discounted reward, with termination handled as a survival probability.
The per-member values give `ensemble_std` (model uncertainty), which widens
the initial-state interval as in `FQE`.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import sklearn.base
import torch
from torch.nn import functional as F

from offrl.algos.params import (boolean, check_params, choice, device_name, integer, interval_pair, layer_sizes, real,
                                seed)
from offrl.datasets.core import Dataset
from offrl.nn import EnsembleMLP
from offrl.ope.behavior import as_target_policy
from offrl.ope.results import (
    INTERVALS,
    OPEResult,
    RatioComponents,
    check_gamma,
    check_horizon,
    make_result,
    value_range,
)

__all__ = ["ModelBased", "gaussian_nll"]


def gaussian_nll(mean: torch.Tensor, log_var: torch.Tensor, target: torch.Tensor,
                 weight: torch.Tensor | None = None) -> torch.Tensor:
    """Gaussian negative log-likelihood (up to a constant), averaged over the elements `weight` keeps (all by default)."""
    nll = ((mean - target) ** 2) * torch.exp(-log_var) + log_var
    if weight is None:
        return nll.mean()
    weight = weight.expand_as(nll)
    return (nll * weight).sum() / weight.sum().clamp(min=1.0)


class ModelBased(sklearn.base.BaseEstimator):
    """Model-based OPE with an ensemble of probabilistic dynamics and reward models."""

    name = "MB"
    _param_rules = {
        "gamma": real(0, 1, closed="right"), "horizon": integer(1, none=True), "n_models": integer(1), "hidden_dims": layer_sizes(),
        "n_steps": integer(0), "batch_size": integer(1), "lr": real(0, None, closed="neither"),
        "sample_noise": boolean(), "interval": choice(*INTERVALS), "alpha": real(0, 1, closed="neither"),
        "n_bootstrap": integer(1), "reward_bound": interval_pair(), "device": device_name(), "random_state": seed(),
    }

    def __init__(
        self,
        *,
        gamma: float = 0.99,
        horizon: int | None = None,
        n_models: int = 5,
        hidden_dims: Sequence[int] = (200, 200),
        n_steps: int = 5000,
        batch_size: int = 256,
        lr: float = 1e-3,
        sample_noise: bool = True,
        interval: str = "bootstrap",
        alpha: float = 0.05,
        n_bootstrap: int = 2000,
        reward_bound: tuple[float, float] | None = None,
        device: str = "auto",
        random_state: Any = 0,
    ) -> None:
        self.gamma = gamma
        self.horizon = horizon
        self.n_models = n_models
        self.hidden_dims = hidden_dims
        self.n_steps = n_steps
        self.batch_size = batch_size
        self.lr = lr
        self.sample_noise = sample_noise
        self.interval = interval
        self.alpha = alpha
        self.n_bootstrap = n_bootstrap
        self.reward_bound = reward_bound
        self.device = device
        self.random_state = random_state

    # ------------------------------------------------------------------ fit
    def _device(self) -> torch.device:
        from offrl.algos.base import resolve_device

        return resolve_device(self.device)

    def _action_input(self, actions: torch.Tensor) -> torch.Tensor:
        if self.discrete_ is not None:
            return F.one_hot(actions.reshape(actions.shape[:-1]).long(), self.discrete_).float()
        return (actions - self.act_mid_) / self.act_half_

    def fit(self, dataset: Dataset) -> "ModelBased":
        """Train the model ensemble on every logged transition (independent of the target policy)."""
        from offrl.algos.base import make_adam

        if not isinstance(dataset, Dataset):
            raise TypeError(f"dataset must be an offrl Dataset, got {type(dataset).__name__}")
        check_params(self)
        device = self._device()
        seed = int(np.random.default_rng(self.random_state).integers(2**31 - 1))
        torch.manual_seed(seed)
        gen = torch.Generator(device=device).manual_seed(seed)
        self.discrete_ = dataset.discrete_actions
        obs, nxt = dataset.observations, dataset.next_observations
        dataset.require_labels("rewards", "actions", context="ModelBased")
        delta = nxt - obs
        self.obs_mean_, self.obs_std_ = obs.mean(0), np.maximum(obs.std(0), 1e-3)
        targets = np.concatenate([delta, dataset.rewards[:, None]], axis=1)
        self.has_terminals_ = bool(dataset.terminals.any())
        continuing = dataset.terminals == 0
        if self.has_terminals_ and continuing.any():
            # state-change statistics from the rows whose next state is real
            state_mean, state_std = delta[continuing].mean(0), delta[continuing].std(0)
            self.y_mean_ = np.append(state_mean, targets[:, -1].mean()).astype(np.float32)
            self.y_std_ = np.maximum(np.append(state_std, targets[:, -1].std()), 1e-4).astype(np.float32)
        else:
            self.y_mean_, self.y_std_ = targets.mean(0), np.maximum(targets.std(0), 1e-4)
        act_dim = int(self.discrete_) if self.discrete_ is not None else dataset.action_dim
        if self.discrete_ is None:
            low = dataset.action_low if dataset.action_low is not None else dataset.actions.min(0)
            high = dataset.action_high if dataset.action_high is not None else dataset.actions.max(0)
            self.act_mid_ = torch.as_tensor((high + low) / 2, dtype=torch.float32, device=device)
            self.act_half_ = torch.as_tensor(np.maximum((high - low) / 2, 1e-6), dtype=torch.float32, device=device)
        self.obs_dim_ = dataset.observation_dim
        out_dim = 2 * (self.obs_dim_ + 1) + 1
        self.model_ = EnsembleMLP(int(self.n_models), self.obs_dim_ + act_dim, out_dim, self.hidden_dims,
                                  activation="silu").to(device)
        # foreach: the kernel torch picks by default on CUDA, and bit-identical to its CPU default here.
        opt = make_adam(self.model_.parameters(), self.lr, device, kernel="foreach", weight_decay=1e-5)
        x_obs = torch.as_tensor((obs - self.obs_mean_) / self.obs_std_, device=device)
        x_act = self._action_input(torch.as_tensor(dataset.actions, device=device))
        y = torch.as_tensor((targets - self.y_mean_) / self.y_std_, dtype=torch.float32, device=device)
        term = torch.as_tensor(dataset.terminals, device=device)
        # per-row weights of the (state change..., reward) targets: terminal rows keep only the reward
        target_weight = torch.ones(dataset.n_transitions, self.obs_dim_ + 1, device=device)
        target_weight[:, :-1] *= (1.0 - term)[:, None]
        n = dataset.n_transitions
        k = int(self.n_models)
        for _ in range(int(self.n_steps)):
            idx = torch.randint(n, (k, int(self.batch_size)), generator=gen, device=device)
            out = self.model_(torch.cat([x_obs[idx], x_act[idx]], dim=-1))
            mean, log_var, logit = self._split(out)
            if self.has_terminals_:
                loss = gaussian_nll(mean, log_var, y[idx], target_weight[idx])
                loss = loss + F.binary_cross_entropy_with_logits(logit, term[idx])
            else:
                loss = gaussian_nll(mean, log_var, y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        self.final_loss_ = float(loss.detach())
        self.model_.eval()
        return self

    def _split(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.obs_dim_ + 1
        mean, raw, logit = out[..., :d], out[..., d:2 * d], out[..., -1]
        log_var = 0.5 - F.softplus(0.5 - raw)
        log_var = -10.0 + F.softplus(log_var + 10.0)
        return mean, log_var, logit

    # ------------------------------------------------------------------ roll-outs
    @torch.no_grad()
    def rollout_returns(self, initial_observations: np.ndarray, policy: Any, horizon: int, gamma: float,
                        dataset: Dataset | None = None) -> np.ndarray:
        """(n_models, n_initial) discounted returns; roll-out k runs entirely in member k."""
        if not hasattr(self, "model_"):
            raise ValueError("ModelBased is not fitted; call fit(dataset) first")
        target = as_target_policy(policy, dataset)
        device = next(self.model_.parameters()).device
        k, n0 = int(self.n_models), len(initial_observations)
        rng = np.random.default_rng(self.random_state)
        gen = torch.Generator(device=device).manual_seed(int(rng.integers(2**31 - 1)))
        state = np.broadcast_to(np.asarray(initial_observations, np.float32), (k, n0, self.obs_dim_)).copy()
        alive = torch.ones(k, n0, device=device)
        total = torch.zeros(k, n0, dtype=torch.float64, device=device)
        y_mean = torch.as_tensor(self.y_mean_, device=device)
        y_std = torch.as_tensor(self.y_std_, device=device)
        o_mean = torch.as_tensor(self.obs_mean_, device=device)
        o_std = torch.as_tensor(self.obs_std_, device=device)
        for t in range(horizon):
            flat = state.reshape(k * n0, -1)
            act = target.act(flat, rng)
            act = np.asarray(act, np.float32).reshape(k, n0, -1)
            s = torch.as_tensor(state, device=device)
            x = torch.cat([(s - o_mean) / o_std, self._action_input(torch.as_tensor(act, device=device))], dim=-1)
            mean, log_var, logit = self._split(self.model_(x))
            if self.sample_noise:
                noise = torch.randn(mean.shape, generator=gen, device=device)
                mean = mean + torch.exp(0.5 * log_var) * noise
            pred = mean * y_std + y_mean
            reward = pred[..., -1]
            total += (gamma ** t) * (alive * reward).double()
            if self.has_terminals_:
                alive = alive * (1.0 - torch.sigmoid(logit))
            state = (s + pred[..., :-1]).cpu().numpy().astype(np.float32)
        return total.cpu().numpy()

    def estimate(self, dataset: Dataset, policy: Any, **_: Any) -> OPEResult:
        """Mean discounted return of `policy` over model roll-outs from the dataset's initial states (fits first if needed)."""
        gamma = check_gamma(self.gamma)
        horizon = check_horizon(self.horizon) or int(dataset.episode_lengths().max())
        if not hasattr(self, "model_"):
            self.fit(dataset)
        obs0 = dataset.observations[dataset.episode_starts[:-1]]
        returns = self.rollout_returns(obs0, policy, horizon, gamma, dataset)
        per_episode = returns.mean(0)
        member_values = returns.mean(1)
        k = len(member_values)
        ensemble_std = float(member_values.std(ddof=1)) if k > 1 else 0.0
        diag = {"member_values": member_values.tolist(), "ensemble_std": ensemble_std, "horizon": horizon,
                "model_based_terms": True,
                "gamma": gamma, "model_loss": getattr(self, "final_loss_", math.nan)}
        scale = float(sum(gamma ** t for t in range(horizon)))
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
            result.diagnostics["interval_note"] = "initial-state interval widened in quadrature by t_{1-alpha/2,K-1} * ensemble_std"
        return result
