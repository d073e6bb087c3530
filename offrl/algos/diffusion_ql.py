"""Diffusion policies with Q-learning: Diffusion-QL (Wang, Hunt & Zhou, 2023) and EDP (Kang et al., 2023).

Diffusion-QL, per step:

    critic:  sum_i (Q_i(s, a) - y)^2,  y = r + gamma (1 - d) min_i Q'_i(s', a'),  a' ~ pi_ema(s')
    actor:   L = E |eps - eps_theta(s, sqrt(abar_t) a + sqrt(1 - abar_t) eps, t)|^2
                 + eta * (-mean Q_i(s, a0) / mean |Q_j(s, a0)|),   a0 ~ pi_theta(s)

with a0 sampled by the whole T-step reverse chain and gradients through
it, i by a coin flip, then the EMA actor and the Polyak target critics.
Defaults are the paper's locomotion settings: T = 5 (VP schedule), 3x256
Mish networks with a 16-d sinusoidal time embedding, eta 1.0, Adam 3e-4,
batch 256, EMA 0.995 every 5 steps from step 1000, tau 0.005, raw
observations.  Per-dataset eta, actor learning rate, gradient-norm clip and
max-Q backup are in `offrl.algos.presets`.  At evaluation the paper draws
50 actions and picks one by softmax(Q'(s, a)) (`sample_action` here); see
`offrl.algos.generative` for the deterministic `predict`.

EDP keeps the networks and replaces the chain in the actor loss by the
one-step estimate of the clean action from a noised dataset action,

    a0_hat = (a_t - sqrt(1 - abar_t) eps_theta(s, a_t, t)) / sqrt(abar_t),   a_t = q(a_t | a),

so the actor's backward pass crosses one network evaluation instead of T.
Two variants, as in the paper:

- `variant="td3"`: L = L_eps - (alpha / mean |Q_i(s, a0_hat)|) Q_i(s, a0_hat), alpha 2.0, TD critics as
  Diffusion-QL's (targets from the EMA actor's chain, without gradients);
- `variant="iql"`: IQL's expectile value and critics (expectile 0.7), and
  L = L_eps + E w ||a - a0_hat||^2 / 2 with w = min(exp(beta (Q'(s, a) - V(s))), 100), beta 3:
  advantage-weighted regression with the Gaussian N(a; a0_hat, I) as the likelihood.

The official EDP trains T = 100..1000 with a DPM-solver sampler; here T is
`n_diffusion_steps` (5 by default, Diffusion-QL's, so the two compare at
equal T) with the same DDPM sampler.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from offrl.algos.base import make_adam
from offrl.algos.generative import GenerativeQLearning, normalised_q_loss
from offrl.algos.losses import awr_weights, expectile_loss
from offrl.algos.losses import critic_td_loss
from offrl.algos.params import choice, integer, real
from offrl.datasets.core import Batch
from offrl.nn import ValueNetwork, soft_update_
from offrl.nn.generative import DiffusionPolicy

__all__ = ["DiffusionQL", "EDP"]


class DiffusionQL(GenerativeQLearning):
    """Diffusion-QL: a DDPM policy trained by its denoising loss plus a normalised Q term through the chain."""

    _param_rules = {"eta": real(0, None), "n_diffusion_steps": integer(1), "time_dim": integer(2),
                    "sampler": choice("ddpm", "ddim")}

    def __init__(
        self,
        *,
        eta: float = 1.0,
        n_diffusion_steps: int = 5,
        sampler: str = "ddpm",
        hidden_dims: Sequence[int] = (256, 256, 256),
        critic_hidden_dims: Sequence[int] | None = None,
        time_dim: int = 16,
        actor_lr: float = 3e-4,
        critic_lr: float = 3e-4,
        batch_size: int = 256,
        gamma: float = 0.99,
        tau: float = 0.005,
        ema_decay: float = 0.995,
        ema_start: int = 1000,
        ema_every: int = 5,
        max_grad_norm: float | None = None,
        max_q_backup: bool = False,
        n_backup_samples: int = 10,
        n_action_samples: int = 50,
        n_steps: int = 1_000_000,
        normalize_observations: bool = False,
        reward_scale: float = 1.0,
        reward_bias: float = 0.0,
        reward_normalization: str | None = None,
        precision: str = "fp32",
        compile: bool | str = False,
        log_every: int = 100,
        device: str = "auto",
        random_state: Any = None,
    ) -> None:
        self.eta = eta
        self.n_diffusion_steps = n_diffusion_steps
        self.sampler = sampler
        self.hidden_dims = hidden_dims
        self.critic_hidden_dims = critic_hidden_dims
        self.time_dim = time_dim
        self.actor_lr = actor_lr
        self.critic_lr = critic_lr
        self.batch_size = batch_size
        self.gamma = gamma
        self.tau = tau
        self.ema_decay = ema_decay
        self.ema_start = ema_start
        self.ema_every = ema_every
        self.max_grad_norm = max_grad_norm
        self.max_q_backup = max_q_backup
        self.n_backup_samples = n_backup_samples
        self.n_action_samples = n_action_samples
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

    def _build(self, spec: dict[str, Any]) -> None:
        hidden = tuple(self.hidden_dims)
        self.policy_ = DiffusionPolicy(spec["observation_dim"], spec["action_dim"], hidden, self.n_diffusion_steps,
                                       self.time_dim, spec["action_low"], spec["action_high"],
                                       sampler=self.sampler).to(self.device_)
        critic_hidden = hidden if self.critic_hidden_dims is None else tuple(self.critic_hidden_dims)
        self._build_shared(spec, critic_hidden=critic_hidden, activation="mish")
        self._critic_loss_fn = self._maybe_compile(self._critic_loss)
        self._actor_loss_fn = self._maybe_compile(self._actor_loss)

    def _actor_loss(self, obs: torch.Tensor, actions: torch.Tensor, coin: torch.Tensor):
        policy = self.policy_
        with self._autocast():
            bc_loss = policy.bc_loss(obs, actions)
            new_actions = policy.to_env(policy.sample_unit(obs).clamp(-1.0, 1.0))  # gradients through the chain
            q_loss = normalised_q_loss(self.critic_(obs, new_actions), coin)
            return bc_loss + self.eta * q_loss, bc_loss, q_loss

    # _update: GenerativeQLearning's (critics, then the actor on them, the EMA actor, the target critics).

    def _selection_critic(self) -> torch.nn.Module:
        return self.critic_target_  # the official sample_action scores candidates with the target critics


class EDP(GenerativeQLearning):
    """Efficient diffusion policy: Diffusion-QL's networks, the actor's Q term on a one-step estimate of a0."""

    _param_rules = {"variant": choice("td3", "iql"), "alpha": real(0, None), "expectile": real(0, 1, closed="neither"),
                    "temperature": real(0, None), "max_weight": real(0, None, closed="neither"),
                    "n_diffusion_steps": integer(1), "time_dim": integer(2), "sampler": choice("ddpm", "ddim"),
                    "value_lr": real(0, None, closed="neither")}

    def __init__(
        self,
        *,
        variant: str = "td3",
        alpha: float = 2.0,
        expectile: float = 0.7,
        temperature: float = 3.0,
        max_weight: float = 100.0,
        n_diffusion_steps: int = 5,
        sampler: str = "ddpm",
        hidden_dims: Sequence[int] = (256, 256, 256),
        critic_hidden_dims: Sequence[int] | None = None,
        time_dim: int = 16,
        actor_lr: float = 3e-4,
        critic_lr: float = 3e-4,
        value_lr: float = 3e-4,
        batch_size: int = 256,
        gamma: float = 0.99,
        tau: float = 0.005,
        ema_decay: float = 0.995,
        ema_start: int = 1000,
        ema_every: int = 5,
        max_grad_norm: float | None = None,
        max_q_backup: bool = False,
        n_backup_samples: int = 10,
        n_action_samples: int = 50,
        n_steps: int = 1_000_000,
        normalize_observations: bool = False,
        reward_scale: float = 1.0,
        reward_bias: float = 0.0,
        reward_normalization: str | None = None,
        precision: str = "fp32",
        compile: bool | str = False,
        log_every: int = 100,
        device: str = "auto",
        random_state: Any = None,
    ) -> None:
        self.variant = variant
        self.alpha = alpha
        self.expectile = expectile
        self.temperature = temperature
        self.max_weight = max_weight
        self.n_diffusion_steps = n_diffusion_steps
        self.sampler = sampler
        self.hidden_dims = hidden_dims
        self.critic_hidden_dims = critic_hidden_dims
        self.time_dim = time_dim
        self.actor_lr = actor_lr
        self.critic_lr = critic_lr
        self.value_lr = value_lr
        self.batch_size = batch_size
        self.gamma = gamma
        self.tau = tau
        self.ema_decay = ema_decay
        self.ema_start = ema_start
        self.ema_every = ema_every
        self.max_grad_norm = max_grad_norm
        self.max_q_backup = max_q_backup
        self.n_backup_samples = n_backup_samples
        self.n_action_samples = n_action_samples
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

    def _build(self, spec: dict[str, Any]) -> None:
        hidden = tuple(self.hidden_dims)
        self.policy_ = DiffusionPolicy(spec["observation_dim"], spec["action_dim"], hidden, self.n_diffusion_steps,
                                       self.time_dim, spec["action_low"], spec["action_high"],
                                       sampler=self.sampler).to(self.device_)
        critic_hidden = hidden if self.critic_hidden_dims is None else tuple(self.critic_hidden_dims)
        self._build_shared(spec, critic_hidden=critic_hidden, activation="mish", ema=self.variant == "td3")
        if self.variant == "iql":
            self.value_ = ValueNetwork(spec["observation_dim"], critic_hidden, activation="mish").to(self.device_)
            self.value_optimizer_ = make_adam(self.value_.parameters(), self.value_lr, self.device_)
        self._critic_loss_fn = self._maybe_compile(self._critic_loss)
        self._actor_loss_fn = self._maybe_compile(self._actor_loss)

    def _approximate_a0(self, obs: torch.Tensor, actions: torch.Tensor):
        """(L_eps, a0_hat, unit actions): the denoising loss and the clean action it implies, from one forward pass."""
        policy = self.policy_
        unit = policy.to_unit(actions)
        t, noise, noised = policy.schedule.noised(unit)
        eps = policy.denoiser(obs, noised, t.float())
        bc_loss = ((eps - noise) ** 2).mean()
        return bc_loss, policy.schedule.predict_x0(noised, t, eps).clamp(-1.0, 1.0), unit

    def _actor_loss(self, obs: torch.Tensor, actions: torch.Tensor, coin: torch.Tensor,
                    advantage: torch.Tensor | None = None):
        policy = self.policy_
        with self._autocast():
            bc_loss, a0, unit = self._approximate_a0(obs, actions)
            if self.variant == "td3":
                q = self.critic_(obs, policy.to_env(a0))
                q_i = torch.where(coin, q[0], q[1])
                guide = -(self.alpha / q_i.abs().mean().detach()) * q_i.mean()
            else:
                weight = awr_weights(advantage, self.temperature, self.max_weight)
                guide = (weight * 0.5 * ((unit - a0) ** 2).sum(-1)).mean()
            return bc_loss + guide, bc_loss, guide

    # ------------------------------------------------------------------ IQL-style critics
    def _value_loss(self, obs: torch.Tensor, actions: torch.Tensor):
        with self._autocast():
            with torch.no_grad():
                target_q = self.critic_target_(obs, actions).min(0).values
            v = self.value_(obs)
            return expectile_loss(target_q - v, self.expectile), target_q

    def _iql_critic_loss(self, obs, actions, rewards, terminals, next_obs):
        with self._autocast():
            with torch.no_grad():
                target = rewards + self.gamma * (1.0 - terminals) * self.value_(next_obs)
            q = self.critic_(obs, actions)
            return critic_td_loss(q, target), q.mean().detach()

    def _update(self, batch: Batch, step: int) -> dict[str, torch.Tensor]:
        obs, actions = batch.observations, batch.actions
        metrics: dict[str, torch.Tensor] = {}
        if self.variant == "iql":  # IQL's order: V, then the actor (advantages from the new V), then Q
            value_loss, target_q = self._value_loss(obs, actions)
            self._optimizer_step(self.value_optimizer_, value_loss, list(self.value_.parameters()))
            with torch.no_grad(), self._autocast():
                advantage = target_q - self.value_(obs)
            actor_loss, bc_loss, guide = self._actor_loss_fn(obs, actions, self._coin(), advantage.float())
            self._optimizer_step(self.actor_optimizer_, actor_loss, self._actor_params)
            critic_loss, q_mean = self._iql_critic_loss(obs, actions, batch.rewards, batch.terminals,
                                                        batch.next_observations)
            self._optimizer_step(self.critic_optimizer_, critic_loss, self._critic_params)
            metrics["value_loss"] = value_loss.detach()
        else:
            critic_loss, q_mean = self._critic_loss_fn(obs, actions, batch.rewards, batch.terminals,
                                                       batch.next_observations)
            self._optimizer_step(self.critic_optimizer_, critic_loss, self._critic_params)
            actor_loss, bc_loss, guide = self._actor_loss_fn(obs, actions, self._coin())
            self._optimizer_step(self.actor_optimizer_, actor_loss, self._actor_params)
            self._update_ema(step)
        soft_update_(self.critic_target_, self.critic_, self.tau)
        metrics.update({"critic_loss": critic_loss.detach(), "q_mean": q_mean, "actor_loss": actor_loss.detach(),
                        "bc_loss": bc_loss.detach(), "guide_loss": guide.detach()})
        return metrics
