"""TD3+BC (Fujimoto & Gu, 2021): TD3 with a behaviour-cloning term in the actor loss.

    critic:  sum_i (Q_i(s, a) - y)^2,  y = r + gamma (1 - d) min_i Q'_i(s', clip(pi'(s') + eps)),
             eps = clip(N(0, sigma), -c, c)                    (target policy smoothing)
    actor:   -lambda Q_1(s, pi(s)) + (pi(s) - a)^2,  lambda = alpha / mean |Q_1(s, pi(s))|

every `policy_freq`-th step, followed by Polyak updates of both targets.
`guide=` plugs in GORL (`offrl.algos.guide`): the Q term of each sample is
scaled by w(s, a), a guiding network trained from expert demonstrations.
Defaults are the paper's: alpha 2.5, noise 0.2 clipped at 0.5, policy delay
2, Adam 3e-4, tau 0.005, gamma 0.99, 256x256 networks, normalised states.
Noise and the BC term are measured in [-1, 1] action units, which is the
paper's setting for its max_action = 1 tasks and stays scale-free elsewhere.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch

from offrl.algos.base import OfflineAlgorithm, make_adam
from offrl.algos.guide import GuidedMixin, call_policy, guided_scales
from offrl.algos.params import integer, real
from offrl.algos.losses import critic_td_loss, mse_bc_loss
from offrl.datasets.core import Batch, Dataset
from offrl.nn import DeterministicPolicy, QEnsemble, soft_update_

__all__ = ["TD3PlusBC", "td3_bc_actor_loss"]


def td3_bc_actor_loss(q: torch.Tensor, policy_actions: torch.Tensor, data_actions: torch.Tensor,
                      alpha: float, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(-lambda * mean Q + mean (pi(s) - a)^2, lambda) with lambda = alpha / mean |Q| (not differentiated).

    `weights` (GORL) scale each sample's Q term: -lambda * mean(w Q)."""
    lmbda = alpha / q.abs().mean().detach()
    improvement = q.mean() if weights is None else (weights * q).mean()
    return -lmbda * improvement + mse_bc_loss(policy_actions, data_actions), lmbda


class TD3PlusBC(GuidedMixin, OfflineAlgorithm):
    """TD3+BC: deterministic actor, twin critics (one batched ensemble), delayed actor updates."""

    _param_rules = {"alpha": real(0, None), "policy_noise": real(0, None), "noise_clip": real(0, None),
                    "policy_freq": integer(1)}

    def __init__(
        self,
        *,
        alpha: float = 2.5,
        hidden_dims: Sequence[int] = (256, 256),
        n_critics: int = 2,
        actor_lr: float = 3e-4,
        critic_lr: float = 3e-4,
        batch_size: int = 256,
        gamma: float = 0.99,
        tau: float = 0.005,
        policy_noise: float = 0.2,
        noise_clip: float = 0.5,
        policy_freq: int = 2,
        n_steps: int = 1_000_000,
        normalize_observations: bool = True,
        reward_scale: float = 1.0,
        reward_bias: float = 0.0,
        reward_normalization: str | None = None,
        precision: str = "fp32",
        compile: bool | str = False,
        log_every: int = 100,
        device: str = "auto",
        random_state: Any = None,
        guide: Any = None,
    ) -> None:
        self.alpha = alpha
        self.hidden_dims = hidden_dims
        self.n_critics = n_critics
        self.actor_lr = actor_lr
        self.critic_lr = critic_lr
        self.batch_size = batch_size
        self.gamma = gamma
        self.tau = tau
        self.policy_noise = policy_noise
        self.noise_clip = noise_clip
        self.policy_freq = policy_freq
        self.n_steps = n_steps
        self.normalize_observations = normalize_observations
        self.reward_scale = reward_scale
        self.reward_bias = reward_bias
        self.reward_normalization = reward_normalization
        self.precision = precision
        self.compile = compile
        self.log_every = log_every
        self.device = device
        self.random_state = random_state
        self.guide = guide

    def _build(self, spec: dict[str, Any]) -> None:
        device = self.device_
        obs_dim, act_dim, hidden = spec["observation_dim"], spec["action_dim"], tuple(self.hidden_dims)
        self.policy_ = DeterministicPolicy(obs_dim, act_dim, hidden, spec["action_low"], spec["action_high"]).to(device)
        self.policy_target_ = copy.deepcopy(self.policy_).requires_grad_(False)
        self.critic_ = QEnsemble(obs_dim, act_dim, n_critics=self.n_critics, hidden_dims=hidden).to(device)
        self.critic_target_ = copy.deepcopy(self.critic_).requires_grad_(False)
        self.actor_optimizer_ = make_adam(self.policy_.parameters(), self.actor_lr, device)
        self.critic_optimizer_ = make_adam(self.critic_.parameters(), self.critic_lr, device)
        self._actor_params = list(self.policy_.parameters())
        zero = torch.zeros((), device=device)
        self._last_actor_metrics = {"actor_loss": zero, "lambda": zero}
        self._critic_loss = self._maybe_compile(self._critic_loss_eager)
        self._actor_loss = self._maybe_compile(self._actor_loss_eager)
        self._build_guide(spec)
        if self.guide is not None:
            self._last_actor_metrics.update(guide_loss=zero, guide_scale_mean=zero, guide_scale_std=zero)

    def _make_sampler(self, dataset: Dataset) -> Any:
        self._prepare_guide(dataset)
        return super()._make_sampler(dataset)

    # ------------------------------------------------------------------ losses on a batch
    def _critic_loss_eager(self, obs, actions, rewards, terminals, next_obs):
        policy = self.policy_target_
        with self._autocast():
            with torch.no_grad():
                noise = (torch.randn_like(actions) * self.policy_noise).clamp(-self.noise_clip, self.noise_clip)
                next_actions = policy.clamp_to_bounds(policy(next_obs)[0] + noise * policy.action_scale)
                target_q = self._target_min(self.critic_target_, next_obs, next_actions)
                target = rewards + self.gamma * (1.0 - terminals) * target_q
            q = self.critic_(obs, actions)
            loss = critic_td_loss(q, target)
        return loss, q[0].mean().detach()

    def _actor_loss_eager(self, obs, actions, weights=None):
        policy = self.policy_
        with self._autocast():
            pi = policy(obs)[0]
            q = self.critic_(obs, pi, members=slice(0, 1))[0]
            if not self._conservative:  # online without the behaviour-cloning term: TD3's actor
                return -q.mean(), torch.zeros((), device=q.device)
            return td3_bc_actor_loss(q, policy.to_unit(pi), policy.to_unit(actions), self.alpha, weights)

    def _guided_weights(self, obs, actions, step):
        """GORL: one guide update, then the per-sample weights w(s, a) of this batch's Q term."""
        policy = self.policy_

        def actor_loss_of(params, scales):
            with self._autocast():
                pi = call_policy(policy, params, obs)[0]
                q = self.critic_(obs, pi, members=slice(0, 1))[0]
                return td3_bc_actor_loss(q, policy.to_unit(pi), policy.to_unit(actions), self.alpha, scales)[0]

        def expert_loss_of(params, expert_obs, expert_actions):
            with self._autocast():
                pi = call_policy(policy, params, expert_obs)[0]
                return mse_bc_loss(policy.to_unit(pi), policy.to_unit(expert_actions))

        return guided_scales(self, obs, actions, step, actor_loss_of, expert_loss_of)

    # ------------------------------------------------------------------ one step
    def _update(self, batch: Batch, step: int) -> dict[str, torch.Tensor]:
        critic_loss, q_mean = self._critic_loss(batch.observations, batch.actions, batch.rewards, batch.terminals,
                                                batch.next_observations)
        self.critic_optimizer_.zero_grad(set_to_none=True)
        critic_loss.backward()
        self.critic_optimizer_.step()
        metrics = {"critic_loss": critic_loss.detach(), "q_mean": q_mean}
        if (step + 1) % self.policy_freq == 0:
            # The actor sees the critic just updated (the paper's order); only actor gradients are computed.
            weights, guide_metrics = None, {}
            if self.guide is not None:
                weights, guide_metrics = self._guided_weights(batch.observations, batch.actions, step)
            actor_loss, lmbda = self._actor_loss(batch.observations, batch.actions, weights)
            self.actor_optimizer_.zero_grad(set_to_none=True)
            actor_loss.backward(inputs=self._actor_params)
            self.actor_optimizer_.step()
            soft_update_(self.critic_target_, self.critic_, self.tau)
            soft_update_(self.policy_target_, self.policy_, self.tau)
            self._last_actor_metrics = {"actor_loss": actor_loss.detach(), "lambda": lmbda, **guide_metrics}
        metrics.update(self._last_actor_metrics)
        return metrics

    def _act(self, obs: torch.Tensor, deterministic: bool) -> torch.Tensor:
        return self.policy_(obs)[0]

    def _value(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return self.critic_(obs, actions).min(0).values
