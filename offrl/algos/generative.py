"""What the diffusion and flow Q-learning algorithms share (Diffusion-QL, EDP, FQL, OFQL).

The networks and samplers are in `offrl.nn.generative`; this module holds
the estimator side, written once:

- acting by candidates: `n_action_samples` actions are sampled per
  observation and one is chosen by the critic.  Stochastic acting
  (`sample_action`) draws fresh noise and picks by softmax(Q), the
  papers' evaluation protocol.  Deterministic acting (`predict`,
  `evaluate`, `export_policy`) is the same protocol with its randomness
  fixed: a noise table saved with the model (candidate 0 is the zero-noise
  path, the mean of the prior at every step; the others are fixed draws)
  and the softmax(Q) draw fixed at its median.  So a deterministic action
  is a function of the observation alone: the same in any batch, after
  `offrl.load`, and in the exported TorchScript module, which runs the
  whole sampler;
- twin critics with a TD loss to min_i Q'_i(s', a'), optionally with
  Diffusion-QL's max-Q backup over several sampled a';
- an EMA copy of the actor (Diffusion-QL: decay 0.995, every 5 steps from
  step 1000) that samples the target actions;
- optimiser steps with optional gradient-norm clipping;
- the Q term of the actor loss normalised by the other critic's mean |Q|.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from offrl.algos.base import OfflineAlgorithm, _seed_from
from offrl.algos.losses import critic_td_loss
from offrl.algos.params import any_of, boolean, choice, integer, layer_sizes, real
from offrl.nn import QEnsemble, soft_update_

__all__ = ["GenerativeQLearning", "CandidateActor", "NoiseTable", "candidate_actions", "normalised_q_loss",
           "SELECTION_QUANTILE"]


def normalised_q_loss(q: torch.Tensor, coin: torch.Tensor) -> torch.Tensor:
    """Diffusion-QL's Q term: -mean Q_i(s, a) / mean |Q_j(s, a)| (not differentiated), i != j, i by a coin flip.

    `q` is (2, batch) from the twin critics; `coin` a boolean scalar tensor
    (drawn on the device, so the choice costs no host synchronisation).
    """
    first = -q[0].mean() / q[1].abs().mean().detach()
    second = -q[1].mean() / q[0].abs().mean().detach()
    return torch.where(coin, first, second)


class NoiseTable(nn.Module):
    """The fixed noise of deterministic acting: (n_candidates, noise_count, action_dim), row 0 all zeros."""

    def __init__(self, n_candidates: int, noise_count: int, action_dim: int, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(int(seed) % 2**63)
        table = torch.randn((n_candidates, noise_count, action_dim), generator=generator)
        table[0] = 0.0
        self.register_buffer("noise", table)


class CandidateActor(nn.Module):
    """Deterministic acting: every candidate of the noise table through the sampler, one chosen by softmax(Q).

    Written with shape-free tensor operations only, so `torch.jit.trace`
    on a batch of one gives a module that takes any batch size.
    """

    def __init__(self, policy: nn.Module, critic: nn.Module | None, noise: torch.Tensor) -> None:
        super().__init__()
        self.policy = policy
        self.critic = critic
        self.register_buffer("noise", noise.clone())

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return candidate_actions(self.policy, self.critic, self.noise, obs)


def candidate_actions(policy: nn.Module, critic: nn.Module | None, noise_table: torch.Tensor,
                      obs: torch.Tensor) -> torch.Tensor:
    """Every candidate of `noise_table` (n, k, act_dim) through `policy`, one kept by softmax(min-Q) at its median."""
    n, k, act_dim = noise_table.shape
    zeros = torch.zeros_like(obs[:, :1])  # (batch, 1): broadcasts the table over the batch
    if n == 1 or critic is None:
        return policy(obs, zeros.unsqueeze(0) + noise_table[0].unsqueeze(1))
    obs_dim = obs.shape[-1]
    repeated = obs.unsqueeze(0).expand(n, -1, -1).reshape(-1, obs_dim)  # candidate-major (n * batch, obs_dim)
    noise = zeros.unsqueeze(0).unsqueeze(0) + noise_table.unsqueeze(2)  # (n, k, batch, act_dim)
    noise = noise.transpose(0, 1).reshape(k, -1, act_dim)
    actions = policy(repeated, noise)
    q = critic(repeated, actions).min(0).values.reshape(n, -1)
    # The papers' softmax(Q) choice with its random draw fixed at the median: the first candidate whose
    # cumulative probability passes 1/2.  (An argmax instead exploits the critic's errors on out-of-data
    # candidates: on hopper medium-replay after 5,000 steps it scored 0.9 where the softmax draw scored 13.5.)
    cumulative = torch.softmax(q.float(), dim=0).cumsum(0)
    picked = (cumulative < SELECTION_QUANTILE).sum(0).clamp(max=n - 1)
    return actions.reshape(n, -1, act_dim).gather(0, picked.reshape(1, -1, 1).expand(1, -1, act_dim))[0]


#: The fixed draw of deterministic acting's softmax(Q) choice among candidates.
SELECTION_QUANTILE = 0.5


class GenerativeQLearning(OfflineAlgorithm):
    """Shell of the generative-policy algorithms: candidates, twin critics, EMA actor, clipped steps.

    A subclass builds `policy_` (an `offrl.nn.generative` policy) and calls
    `_build_shared(spec, critic_hidden=...)`; its `_update` uses
    `_critic_loss` (or its own), `_optimizer_step` and `_update_ema`.
    `_selection_critic()` names the critic that scores candidates.
    """

    _param_rules = {
        "n_action_samples": integer(1), "ema_decay": real(0, 1, closed="left"), "ema_start": integer(0),
        "ema_every": integer(1), "max_grad_norm": real(0, None, closed="neither", none=True),
        "max_q_backup": boolean(), "n_backup_samples": integer(1), "critic_hidden_dims": any_of(layer_sizes(), choice(None)),
    }

    # ------------------------------------------------------------------ building
    def _build_shared(self, spec: dict[str, Any], *, critic_hidden: tuple[int, ...], activation: str = "mish",
                      layer_norm: bool = False, ema: bool = True) -> None:
        from offrl.algos.base import make_adam

        device = self.device_
        obs_dim, act_dim = spec["observation_dim"], spec["action_dim"]
        self.critic_ = QEnsemble(obs_dim, act_dim, n_critics=2, hidden_dims=critic_hidden, activation=activation,
                                 layer_norm=layer_norm).to(device)
        self.critic_target_ = copy.deepcopy(self.critic_).requires_grad_(False)
        if ema:
            self.ema_policy_ = copy.deepcopy(self.policy_).requires_grad_(False)
        self.actor_optimizer_ = make_adam(self.policy_.parameters(), self.actor_lr, device)
        self.critic_optimizer_ = make_adam(self.critic_.parameters(), self.critic_lr, device)
        # The fixed noise of deterministic acting: its own stream, from random_state (saved with the model).
        seed = 0 if self.random_state is None else _seed_from(self.random_state)
        self.action_noise_ = NoiseTable(int(self.n_action_samples), self.policy_.noise_count, act_dim, seed).to(device)
        self._actor_params = list(self.policy_.parameters())

    # ------------------------------------------------------------------ training pieces
    def _optimizer_step(self, optimizer: torch.optim.Optimizer, loss: torch.Tensor, params: list[torch.Tensor]
                        ) -> None:
        """Backward into `params` only, clip their gradient norm to `max_grad_norm` when set, step."""
        optimizer.zero_grad(set_to_none=True)
        loss.backward(inputs=params)
        max_norm = getattr(self, "max_grad_norm", None)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, float(max_norm), foreach=True)
        optimizer.step()

    def _target_actions(self, next_obs: torch.Tensor) -> torch.Tensor:
        """a' for the TD target: a sample of the EMA actor (Diffusion-QL, EDP, OFQL)."""
        policy = self.ema_policy_
        return policy.to_env(policy.sample_unit(next_obs).clamp(-1.0, 1.0))

    def _target_q(self, next_obs: torch.Tensor) -> torch.Tensor:
        """min_i Q'_i(s', a'); with `max_q_backup`, the max over `n_backup_samples` a' of that min."""
        if not getattr(self, "max_q_backup", False):
            return self.critic_target_(next_obs, self._target_actions(next_obs)).min(0).values
        n = int(self.n_backup_samples)
        repeated = next_obs.unsqueeze(0).expand(n, -1, -1).reshape(-1, next_obs.shape[-1])
        q = self.critic_target_(repeated, self._target_actions(repeated)).reshape(2, n, -1)
        return q.max(1).values.min(0).values

    def _critic_loss(self, obs, actions, rewards, terminals, next_obs):
        with self._autocast():
            with torch.no_grad():
                target = rewards + self.gamma * (1.0 - terminals) * self._target_q(next_obs)
            q = self.critic_(obs, actions)
            return critic_td_loss(q, target), q.mean().detach()

    @property
    def _critic_params(self) -> list[torch.Tensor]:
        return list(self.critic_.parameters())

    def _update(self, batch: Any, step: int) -> dict[str, torch.Tensor]:
        """Diffusion-QL's step, OFQL's too: the critics, then the actor (BC + eta * Q term, from the subclass's
        `_actor_loss_fn(obs, actions, coin)`) on the critics just updated, the EMA actor, the target critics."""
        critic_loss, q_mean = self._critic_loss_fn(batch.observations, batch.actions, batch.rewards, batch.terminals,
                                                   batch.next_observations)
        self._optimizer_step(self.critic_optimizer_, critic_loss, self._critic_params)
        actor_loss, bc_loss, q_loss = self._actor_loss_fn(batch.observations, batch.actions, self._coin())
        self._optimizer_step(self.actor_optimizer_, actor_loss, self._actor_params)
        self._update_ema(step)
        soft_update_(self.critic_target_, self.critic_, self.tau)
        return {"critic_loss": critic_loss.detach(), "q_mean": q_mean, "actor_loss": actor_loss.detach(),
                "bc_loss": bc_loss.detach(), "q_loss": q_loss.detach()}

    def _update_ema(self, step: int) -> None:
        """Diffusion-QL's EMA: untouched before `ema_start`, then every `ema_every` steps ema <- decay ema + (1-decay) pi."""
        if step < int(self.ema_start) or step % int(self.ema_every):
            return
        with torch.no_grad():
            torch._foreach_lerp_(list(self.ema_policy_.parameters()), self._actor_params, 1.0 - float(self.ema_decay))

    def _coin(self) -> torch.Tensor:
        return torch.rand((), device=self.device_) < 0.5

    # ------------------------------------------------------------------ acting
    def _selection_critic(self) -> nn.Module:
        return self.critic_

    def _candidate_actor(self) -> CandidateActor:
        return CandidateActor(self.policy_, self._selection_critic(), self.action_noise_.noise)

    def _act(self, obs: torch.Tensor, deterministic: bool) -> torch.Tensor:
        if deterministic:  # what the exported module computes (CandidateActor), without building a module per call
            return candidate_actions(self.policy_, self._selection_critic(), self.action_noise_.noise, obs)
        return self._sample(obs)

    def _sample(self, obs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """The papers' acting: `n_action_samples` fresh samples per observation, one drawn by softmax(Q)."""
        n = int(self.n_action_samples)
        policy = self.policy_
        repeated = obs.unsqueeze(0).expand(n, -1, -1).reshape(-1, obs.shape[-1])
        actions = policy(repeated, policy.draw_noise(repeated, generator))
        if n == 1:
            return actions
        q = self._selection_critic()(repeated, actions).min(0).values.reshape(n, -1)
        picked = torch.multinomial(torch.softmax(q.t().float(), dim=1), 1, generator=generator).reshape(1, -1, 1)
        return actions.reshape(n, -1, actions.shape[-1]).gather(0, picked.expand(1, -1, actions.shape[-1]))[0]

    def _online_act(self, obs: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Online exploration (`fit_online`): the papers' stochastic acting, seeded by the online loop's generator.
        The generative policies have no tractable log-density, so the recorded log-probabilities are zeros."""
        with torch.no_grad():
            self._set_training_mode(False)
            try:
                actions = self._sample(self.obs_normalizer_(obs), generator)
            finally:
                self._set_training_mode(True)
        return actions, torch.zeros(len(actions), device=actions.device)

    def _value(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return self.critic_(obs, actions).min(0).values

    def _export_actor(self) -> nn.Module:
        return self._candidate_actor()
