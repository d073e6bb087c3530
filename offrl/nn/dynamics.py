"""One learned model of the environment, shared by model-based OPE (`offrl.ope.ModelBased`) and MBRCSL.

`EnsembleDynamics` is a batched ensemble (`EnsembleMLP`, SiLU) whose members
each predict a diagonal Gaussian over the standardised (state change,
reward) and a termination logit.  Members train by Gaussian negative
log-likelihood on their own random batches (plus binary cross-entropy on
the termination logit when the data has terminals).  A terminal row's next
state is not a state the environment reaches (a Dataset built without
`next_observations` holds the next episode's first observation there), so
the state part of the loss skips terminal rows; their reward and
termination still train.

Elites (MOPO / MBRCSL): with `holdout_ratio > 0` a random part of the rows
(at most `max_holdout`) is held out of training, and the `n_elites` members
with the lowest mean squared error of their mean on it are kept as
`elites`; roll-outs use only those.  Without a holdout the ranking uses the
training rows.  With `n_elites == n_models` (the default) every member is
an elite and no ranking is computed.

Departures from the MBRCSL / MOPO code (offlinerlkit's `EnsembleDynamics`):
a fixed budget of steps instead of training until the holdout loss stops
improving (and no per-member best snapshot), one weight decay for every
layer (theirs 2.5e-5 ... 1e-4 by layer), log-variances soft-clamped to the
fixed [-10, 0.5] (their learned bounds' initial values), observations
standardised and actions scaled to [-1, 1] by their bounds (theirs: one
standard scaler over both), and targets standardised.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from offrl.datasets.core import Dataset
from offrl.nn import EnsembleMLP

__all__ = ["EnsembleDynamics", "gaussian_nll"]


def gaussian_nll(mean: torch.Tensor, log_var: torch.Tensor, target: torch.Tensor,
                 weight: torch.Tensor | None = None) -> torch.Tensor:
    """Gaussian negative log-likelihood (up to a constant), averaged over the elements `weight` keeps (all by default)."""
    nll = ((mean - target) ** 2) * torch.exp(-log_var) + log_var
    if weight is None:
        return nll.mean()
    weight = weight.expand_as(nll)
    return (nll * weight).sum() / weight.sum().clamp(min=1.0)


class EnsembleDynamics(nn.Module):
    """Ensemble Gaussian model of (next state, reward, termination) given (state, action).

    Everything a fitted model needs to predict is a parameter or a buffer,
    so `state_dict()` saves it whole: the input and target statistics, the
    elites and each member's holdout loss.
    """

    def __init__(
        self,
        observation_dim: int,
        action_dim: int,
        n_models: int = 7,
        hidden_dims: Sequence[int] = (200, 200, 200, 200),
        *,
        n_elites: int | None = None,
        discrete_actions: int | None = None,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        self.observation_dim, self.action_dim = int(observation_dim), int(action_dim)
        self.n_models = int(n_models)
        self.n_elites = self.n_models if n_elites is None else int(n_elites)
        if not 1 <= self.n_elites <= self.n_models:
            raise ValueError(f"n_elites must be between 1 and n_models ({self.n_models}), got {n_elites}")
        self.discrete_actions = None if discrete_actions is None else int(discrete_actions)
        in_dim = self.observation_dim + (self.discrete_actions or self.action_dim)
        target_dim = self.observation_dim + 1
        # (mean, raw log-variance) of (state change, reward), then one termination logit
        self.model = EnsembleMLP(self.n_models, in_dim, 2 * target_dim + 1, hidden_dims, activation=activation)
        self.register_buffer("obs_mean", torch.zeros(self.observation_dim))
        self.register_buffer("obs_std", torch.ones(self.observation_dim))
        self.register_buffer("target_mean", torch.zeros(target_dim))
        self.register_buffer("target_std", torch.ones(target_dim))
        self.register_buffer("action_mid", torch.zeros(self.action_dim))
        self.register_buffer("action_half", torch.ones(self.action_dim))
        self.register_buffer("elites", torch.arange(self.n_elites))
        self.register_buffer("holdout_loss", torch.full((self.n_models,), float("nan")))
        self.register_buffer("has_terminals", torch.tensor(False))

    # ------------------------------------------------------------------ inputs and outputs
    def action_input(self, actions: torch.Tensor) -> torch.Tensor:
        """Actions as the network reads them: one-hot for discrete actions, [-1, 1] by the bounds otherwise."""
        if self.discrete_actions is not None:
            return F.one_hot(actions.reshape(actions.shape[:-1]).long(), self.discrete_actions).float()
        return (actions - self.action_mid) / self.action_half

    def inputs(self, observations: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return torch.cat([(observations - self.obs_mean) / self.obs_std, self.action_input(actions)], dim=-1)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mean, log-variance, termination logit) of a network output; log-variances soft-clamped to [-10, 0.5]."""
        d = self.observation_dim + 1
        mean, raw, logit = out[..., :d], out[..., d:2 * d], out[..., -1]
        log_var = 0.5 - F.softplus(0.5 - raw)
        log_var = -10.0 + F.softplus(log_var + 10.0)
        return mean, log_var, logit

    @property
    def all_members_are_elites(self) -> bool:
        return self.n_elites == self.n_models

    # ------------------------------------------------------------------ training
    def fit(
        self,
        dataset: Dataset,
        *,
        n_steps: int,
        batch_size: int,
        lr: float,
        generator: torch.Generator,
        weight_decay: float = 0.0,
        holdout_ratio: float = 0.0,
        max_holdout: int = 1000,
    ) -> float:
        """Set the statistics from `dataset`, train every member for `n_steps` and pick the elites.

        Random draws come from `generator` only: the holdout split (one
        `randperm`, only when there is a holdout), then one (n_models,
        batch_size) `randint` per step.  Returns the last step's loss (NaN
        without steps).
        """
        dataset.require_labels("rewards", "actions", context=type(self).__name__)
        if (dataset.observation_dim, dataset.action_dim) != (self.observation_dim, self.action_dim):
            raise ValueError(f"the dataset has observation/action dims {(dataset.observation_dim, dataset.action_dim)} "
                             f"but this model was built for {(self.observation_dim, self.action_dim)}")
        if not 0.0 <= holdout_ratio < 1.0:
            raise ValueError(f"holdout_ratio must be in [0, 1), got {holdout_ratio}")
        device = self.obs_mean.device
        obs, nxt = dataset.observations, dataset.next_observations
        delta = nxt - obs
        obs_mean, obs_std = obs.mean(0), np.maximum(obs.std(0), 1e-3)
        targets = np.concatenate([delta, dataset.rewards[:, None]], axis=1)
        has_terminals = bool(dataset.terminals.any())
        continuing = dataset.terminals == 0
        if has_terminals and continuing.any():
            # state-change statistics from the rows whose next state is real
            state_mean, state_std = delta[continuing].mean(0), delta[continuing].std(0)
            y_mean = np.append(state_mean, targets[:, -1].mean()).astype(np.float32)
            y_std = np.maximum(np.append(state_std, targets[:, -1].std()), 1e-4).astype(np.float32)
        else:
            y_mean, y_std = targets.mean(0), np.maximum(targets.std(0), 1e-4)
        with torch.no_grad():
            self.obs_mean.copy_(torch.as_tensor(obs_mean))
            self.obs_std.copy_(torch.as_tensor(obs_std))
            self.target_mean.copy_(torch.as_tensor(y_mean))
            self.target_std.copy_(torch.as_tensor(y_std))
            self.has_terminals.fill_(has_terminals)
            if self.discrete_actions is None:
                low = dataset.action_low if dataset.action_low is not None else dataset.actions.min(0)
                high = dataset.action_high if dataset.action_high is not None else dataset.actions.max(0)
                self.action_mid.copy_(torch.as_tensor((high + low) / 2, dtype=torch.float32))
                self.action_half.copy_(torch.as_tensor(np.maximum((high - low) / 2, 1e-6), dtype=torch.float32))
        x_obs = torch.as_tensor((obs - obs_mean) / obs_std, device=device)
        x_act = self.action_input(torch.as_tensor(dataset.actions, device=device))
        x = torch.cat([x_obs, x_act], dim=-1)
        y = torch.as_tensor((targets - y_mean) / y_std, dtype=torch.float32, device=device)
        term = torch.as_tensor(dataset.terminals, device=device)
        # per-row weights of the (state change..., reward) targets: terminal rows keep only the reward
        target_weight = torch.ones(dataset.n_transitions, self.observation_dim + 1, device=device)
        target_weight[:, :-1] *= (1.0 - term)[:, None]

        n = dataset.n_transitions
        n_holdout = min(int(n * holdout_ratio), int(max_holdout), n - 1)
        train_rows = holdout_rows = None
        if n_holdout > 0:
            order = torch.randperm(n, generator=generator, device=device)
            holdout_rows, train_rows = order[:n_holdout], order[n_holdout:]
        n_train = n - max(n_holdout, 0)
        k = self.n_models
        # foreach: the kernel torch picks by default on CUDA, and bit-identical to its CPU default (offrl's
        # `make_adam(kernel="foreach")`, which the nn layer cannot import).
        opt = torch.optim.Adam(self.model.parameters(), lr=lr, foreach=device.type != "mps", weight_decay=weight_decay)
        self.model.train()
        loss = torch.tensor(float("nan"))
        for _ in range(int(n_steps)):
            idx = torch.randint(n_train, (k, int(batch_size)), generator=generator, device=device)
            if train_rows is not None:
                idx = train_rows[idx]
            mean, log_var, logit = self.split(self.model(x[idx]))
            if has_terminals:
                loss = gaussian_nll(mean, log_var, y[idx], target_weight[idx])
                loss = loss + F.binary_cross_entropy_with_logits(logit, term[idx])
            else:
                loss = gaussian_nll(mean, log_var, y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        self.model.eval()
        if holdout_rows is not None or not self.all_members_are_elites:
            rows = holdout_rows if holdout_rows is not None else torch.arange(n, device=device)
            self._select_elites(x[rows], y[rows], target_weight[rows])
        return float(loss.detach())

    @torch.no_grad()
    def _select_elites(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor) -> None:
        """Each member's weighted mean squared error of its mean on (x, y); the `n_elites` lowest are the elites."""
        mean = self.split(self.model(x))[0]
        losses = ((mean - y) ** 2 * weight).sum((1, 2)) / weight.sum().clamp(min=1.0)
        self.holdout_loss.copy_(losses)
        if not self.all_members_are_elites:
            best = torch.argsort(losses, stable=True)[: self.n_elites]
            self.elites.copy_(torch.sort(best).values)  # in member order

    # ------------------------------------------------------------------ prediction
    def predict(self, observations: torch.Tensor, actions: torch.Tensor, members: Any = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mean, log-variance, logit) in standardised target units, (n_selected, ..., .) for `members` (None: all)."""
        return self.split(self.model(self.inputs(observations, actions), members=members))

    @torch.no_grad()
    def step(
        self,
        observations: torch.Tensor,
        actions: torch.Tensor,
        generator: torch.Generator | None = None,
        *,
        sample: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One model step: (next observations, rewards, termination probabilities).

        (n, obs_dim) observations: each row goes through one elite drawn at
        random (MOPO / MBRCSL roll-outs).  (n_elites, n, obs_dim): elite i
        drives row block i (model-based OPE: one roll-out per member).
        `sample` adds the predicted Gaussian noise; draws come from
        `generator` (the elite choice first, then the noise).  Termination
        probabilities are 0 when the data had no terminals.
        """
        members = None if self.all_members_are_elites else self.elites
        if observations.dim() == 3:
            if observations.shape[0] != self.n_elites:
                raise ValueError(f"observations has {observations.shape[0]} member blocks but the model has "
                                 f"{self.n_elites} elites; pass (n_elites, n, obs_dim) or (n, obs_dim)")
            mean, log_var, logit = self.predict(observations, actions, members)
        elif observations.dim() == 2:
            n = observations.shape[0]
            pick = torch.randint(self.n_elites, (n,), generator=generator, device=observations.device)
            mean, log_var, logit = self.predict(observations, actions, members)
            rows = torch.arange(n, device=observations.device)
            mean, log_var, logit = mean[pick, rows], log_var[pick, rows], logit[pick, rows]
        else:
            raise ValueError(f"observations must be (n, obs_dim) or (n_elites, n, obs_dim), got shape "
                             f"{tuple(observations.shape)}")
        if sample:
            noise = torch.randn(mean.shape, generator=generator, device=mean.device)
            mean = mean + torch.exp(0.5 * log_var) * noise
        pred = mean * self.target_std + self.target_mean
        p_terminal = torch.sigmoid(logit) if bool(self.has_terminals) else torch.zeros_like(logit)
        return observations + pred[..., :-1], pred[..., -1], p_terminal
