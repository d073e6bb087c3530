"""Model-based OPE: learn an ensemble dynamics/reward model, roll the target policy out in it.

The model is `offrl.nn.dynamics.EnsembleDynamics`, the one MBRCSL also
uses: each member of a batched `EnsembleMLP` predicts a Gaussian over the
standardised (state change, reward) and, when the data has terminals, a
termination logit; members are trained by maximum likelihood on their own
random batches, and the state part of a terminal row's loss is skipped (its
next state is not one the environment reaches).  The value is estimated by
rolling the target policy out from every logged initial state for `horizon`
steps in every member (member k drives roll-out k from start to end),
accumulating the discounted reward, with termination handled as a survival
probability.  With `n_elites` (and a `holdout_ratio`) only the members with
the lowest holdout error roll out, as in MOPO.  The per-member values give
`ensemble_std` (model uncertainty), which widens the initial-state interval
as in `FQE`.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import sklearn.base
import torch

from offrl.algos.params import (boolean, check_params, choice, device_name, integer, interval_pair, layer_sizes, real,
                                seed)
from offrl.datasets.core import Dataset
from offrl.nn.dynamics import EnsembleDynamics, gaussian_nll
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


class ModelBased(sklearn.base.BaseEstimator):
    """Model-based OPE with an ensemble of probabilistic dynamics and reward models.

    `n_elites` (default: every member) keeps only the members with the lowest error on a held-out
    `holdout_ratio` of the rows (MOPO's elites); without a holdout they are ranked on the training rows.
    """

    name = "MB"
    _param_rules = {
        "gamma": real(0, 1, closed="right"), "horizon": integer(1, none=True), "n_models": integer(1), "hidden_dims": layer_sizes(),
        "n_steps": integer(0), "batch_size": integer(1), "lr": real(0, None, closed="neither"),
        "sample_noise": boolean(), "interval": choice(*INTERVALS), "alpha": real(0, 1, closed="neither"),
        "n_bootstrap": integer(1), "reward_bound": interval_pair(), "device": device_name(), "random_state": seed(),
        "n_elites": integer(1, none=True), "holdout_ratio": real(0, 1, closed="left"),
    }

    def __init__(
        self,
        *,
        gamma: float = 0.99,
        horizon: int | None = None,
        n_models: int = 5,
        n_elites: int | None = None,
        holdout_ratio: float = 0.0,
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
        self.n_elites = n_elites
        self.holdout_ratio = holdout_ratio
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
        return self.dynamics_.action_input(actions)

    def _split(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.dynamics_.split(out)

    def fit(self, dataset: Dataset) -> "ModelBased":
        """Train the model ensemble on every logged transition (independent of the target policy)."""
        if not isinstance(dataset, Dataset):
            raise TypeError(f"dataset must be an offrl Dataset, got {type(dataset).__name__}")
        check_params(self)
        device = self._device()
        seed = int(np.random.default_rng(self.random_state).integers(2**31 - 1))
        torch.manual_seed(seed)
        gen = torch.Generator(device=device).manual_seed(seed)
        dataset.require_labels("rewards", "actions", context="ModelBased")
        self.discrete_ = dataset.discrete_actions
        self.obs_dim_ = dataset.observation_dim
        self.dynamics_ = EnsembleDynamics(self.obs_dim_, dataset.action_dim, int(self.n_models), self.hidden_dims,
                                          n_elites=self.n_elites, discrete_actions=self.discrete_,
                                          activation="silu").to(device)
        self.final_loss_ = self.dynamics_.fit(dataset, n_steps=int(self.n_steps), batch_size=int(self.batch_size),
                                              lr=self.lr, generator=gen, weight_decay=1e-5,
                                              holdout_ratio=float(self.holdout_ratio))
        # the fitted model's parts under the names this estimator has always had
        dyn = self.dynamics_
        self.model_ = dyn.model
        self.has_terminals_ = bool(dyn.has_terminals)
        self.obs_mean_, self.obs_std_ = dyn.obs_mean.cpu().numpy(), dyn.obs_std.cpu().numpy()
        self.y_mean_, self.y_std_ = dyn.target_mean.cpu().numpy(), dyn.target_std.cpu().numpy()
        self.elites_ = dyn.elites.cpu().numpy()
        return self

    # ------------------------------------------------------------------ roll-outs
    @torch.no_grad()
    def rollout_returns(self, initial_observations: np.ndarray, policy: Any, horizon: int, gamma: float,
                        dataset: Dataset | None = None) -> np.ndarray:
        """(n_elites, n_initial) discounted returns; roll-out k runs entirely in elite k (every member by default)."""
        if not hasattr(self, "dynamics_"):
            raise ValueError("ModelBased is not fitted; call fit(dataset) first")
        target = as_target_policy(policy, dataset)
        dynamics = self.dynamics_
        device = dynamics.obs_mean.device
        k, n0 = dynamics.n_elites, len(initial_observations)
        rng = np.random.default_rng(self.random_state)
        gen = torch.Generator(device=device).manual_seed(int(rng.integers(2**31 - 1)))
        state = np.broadcast_to(np.asarray(initial_observations, np.float32), (k, n0, self.obs_dim_)).copy()
        alive = torch.ones(k, n0, device=device)
        total = torch.zeros(k, n0, dtype=torch.float64, device=device)
        for t in range(horizon):
            flat = state.reshape(k * n0, -1)
            act = target.act(flat, rng)
            act = np.asarray(act, np.float32).reshape(k, n0, -1)
            s = torch.as_tensor(state, device=device)
            nxt, reward, p_terminal = dynamics.step(s, torch.as_tensor(act, device=device), gen,
                                                    sample=self.sample_noise)
            total += (gamma ** t) * (alive * reward).double()
            if self.has_terminals_:
                alive = alive * (1.0 - p_terminal)
            state = nxt.cpu().numpy().astype(np.float32)
        return total.cpu().numpy()

    def estimate(self, dataset: Dataset, policy: Any, **_: Any) -> OPEResult:
        """Mean discounted return of `policy` over model roll-outs from the dataset's initial states (fits first if needed)."""
        gamma = check_gamma(self.gamma)
        horizon = check_horizon(self.horizon) or int(dataset.episode_lengths().max())
        if not hasattr(self, "dynamics_"):
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
