"""Implicit Q-learning (Kostrikov, Nair & Levine, 2022).

    value:   L_V = E |tau - 1(u < 0)| u^2,               u = min_i Q'_i(s, a) - V(s)
    actor:   L_pi = -E min(exp(beta (min_i Q'_i(s, a) - V(s))), 100) log pi(a | s)
    critic:  L_Q = sum_i E (r + gamma (1 - d) V(s') - Q_i(s, a))^2

in the official order V, pi, Q (the actor and the critic see the value
network just updated), then a Polyak update of the target critics.
Defaults are the paper's locomotion settings: expectile 0.7, beta 3.0,
256x256 networks, Adam 3e-4 with cosine decay of the actor's learning rate
over the run, batch 256, gamma 0.99, tau 0.005, and rewards scaled by
1000 / (max episode return - min episode return).  AntMaze, Kitchen and
Adroit settings are in `offrl.algos.presets` (`IQL.from_preset(name)`).

One default is not the authors': observations are normalised by the
dataset's mean and std (`normalize_observations=True`), as in CORL's IQL;
the authors' code feeds raw observations.  On the built pendulum datasets
it learns better (benchmarks/RESULTS.md, "IQL's observation normalisation":
medium 44.9 +/- 11.4 vs 8.4 +/- 0.6 raw, medium-replay 80.8 +/- 2.9 vs
73.6 +/- 5.9); pass `normalize_observations=False` for the authors' setting.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Sequence

import torch

from offrl.algos.base import OfflineAlgorithm, make_adam
from offrl.algos.guide import GuidedMixin, call_policy, guided_scales
from offrl.algos.params import choice, real
from offrl.algos.losses import awr_actor_loss, critic_td_loss, expectile_loss
from offrl.datasets.core import Batch, Dataset
from offrl.nn import GaussianPolicy, QEnsemble, ValueNetwork, soft_update_

__all__ = ["IQL", "expectile_loss", "awr_actor_loss"]


class IQL(GuidedMixin, OfflineAlgorithm):
    """Implicit Q-learning with a state-independent-std Gaussian actor (tanh mean).

    The value loss, the critic loss and the value network are hooks
    (`_value_objective`, `_critic_objective`, `_make_value_network`), so the
    rest of the implicit family (XQL, f-DVL in `offrl.algos.dual`) changes
    only those.  `guide=` plugs in GORL (`offrl.algos.guide`): a per-sample
    advantage temperature beta * w(s, a) learned from expert demonstrations.
    """

    _param_rules = {
        "expectile": real(0, 1, closed="neither"), "temperature": real(0, None), "actor_lr_schedule": choice(None, "cosine"),
        "dropout": real(0, 1, closed="left"), "max_weight": real(0, None, closed="neither"),
    }

    def __init__(
        self,
        *,
        expectile: float = 0.7,
        temperature: float = 3.0,
        hidden_dims: Sequence[int] = (256, 256),
        n_critics: int = 2,
        actor_lr: float = 3e-4,
        critic_lr: float = 3e-4,
        value_lr: float = 3e-4,
        actor_lr_schedule: str | None = "cosine",
        batch_size: int = 256,
        gamma: float = 0.99,
        tau: float = 0.005,
        dropout: float = 0.0,
        max_weight: float = 100.0,
        n_steps: int = 1_000_000,
        normalize_observations: bool = True,
        reward_normalization: str | None = "return_range",
        reward_scale: float = 1.0,
        reward_bias: float = 0.0,
        precision: str = "fp32",
        compile: bool | str = False,
        log_every: int = 100,
        device: str = "auto",
        random_state: Any = None,
        guide: Any = None,
    ) -> None:
        self.expectile = expectile
        self.temperature = temperature
        self.hidden_dims = hidden_dims
        self.n_critics = n_critics
        self.actor_lr = actor_lr
        self.critic_lr = critic_lr
        self.value_lr = value_lr
        self.actor_lr_schedule = actor_lr_schedule
        self.batch_size = batch_size
        self.gamma = gamma
        self.tau = tau
        self.dropout = dropout
        self.max_weight = max_weight
        self.n_steps = n_steps
        self.normalize_observations = normalize_observations
        self.reward_normalization = reward_normalization
        self.reward_scale = reward_scale
        self.reward_bias = reward_bias
        self.precision = precision
        self.compile = compile
        self.log_every = log_every
        self.device = device
        self.random_state = random_state
        self.guide = guide

    # ------------------------------------------------------------------ what the implicit family varies
    def _value_objective(self, diff: torch.Tensor) -> torch.Tensor:
        """The value loss on diff = min_i Q'_i(s, a) - V(s): IQL's expectile."""
        return expectile_loss(diff, self.expectile)

    def _critic_objective(self, q: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The critic loss of q (n_critics, batch) against target (batch,): squared TD error."""
        return critic_td_loss(q, target)

    def _make_value_network(self, obs_dim: int, hidden: tuple[int, ...]) -> ValueNetwork:
        return ValueNetwork(obs_dim, hidden)

    def _build(self, spec: dict[str, Any]) -> None:
        if self.actor_lr_schedule not in (None, "cosine"):
            raise ValueError(f"actor_lr_schedule must be 'cosine' or None, got {self.actor_lr_schedule!r}")
        device = self.device_
        obs_dim, act_dim, hidden = spec["observation_dim"], spec["action_dim"], tuple(self.hidden_dims)
        self.policy_ = GaussianPolicy(obs_dim, act_dim, hidden, spec["action_low"], spec["action_high"],
                                      dropout=self.dropout).to(device)
        self.critic_ = QEnsemble(obs_dim, act_dim, n_critics=self.n_critics, hidden_dims=hidden).to(device)
        self.critic_target_ = copy.deepcopy(self.critic_).requires_grad_(False)
        self.value_ = self._make_value_network(obs_dim, hidden).to(device)
        self.actor_optimizer_ = make_adam(self.policy_.parameters(), self.actor_lr, device)
        self.critic_optimizer_ = make_adam(self.critic_.parameters(), self.critic_lr, device)
        self.value_optimizer_ = make_adam(self.value_.parameters(), self.value_lr, device)
        # The cosine schedule spans the run being fitted (restored from the model file on load).
        self.lr_schedule_steps_ = max(int(getattr(self, "_fit_n_steps", self.n_steps)), 1)
        self._value_loss = self._maybe_compile(self._value_loss_eager)
        self._actor_critic_loss = self._maybe_compile(self._actor_critic_loss_eager)
        self._build_guide(spec)

    def _make_sampler(self, dataset: Dataset) -> Any:
        self._prepare_guide(dataset)
        return super()._make_sampler(dataset)

    # ------------------------------------------------------------------ losses on a batch
    def _value_loss_eager(self, obs, actions):
        with self._autocast():
            with torch.no_grad():
                target_q = self._target_min(self.critic_target_, obs, actions)
            v = self.value_(obs)
            return self._value_objective(target_q - v), target_q

    def _actor_critic_loss_eager(self, obs, actions, rewards, terminals, next_obs, target_q, temperature=None):
        with self._autocast():
            with torch.no_grad():  # the value network just updated, on s and s' in one pass
                v, next_v = self.value_(torch.cat([obs, next_obs])).chunk(2)
            actor_loss = awr_actor_loss(target_q - v, self.policy_.log_prob(obs, actions),
                                        self.temperature if temperature is None else temperature, self.max_weight)
            q = self.critic_(obs, actions)
            critic_loss = self._critic_objective(q, rewards + self.gamma * (1.0 - terminals) * next_v)
        return actor_loss, critic_loss, v.mean()

    def _guided_temperature(self, obs, actions, target_q, step):
        """GORL: one guide update, then per-sample temperatures beta * w(s, a) for this batch's actor loss."""
        with torch.no_grad(), self._autocast():
            advantage = target_q - self.value_(obs)
        policy = self.policy_

        def actor_loss_of(params, scales):
            with self._autocast():
                log_prob = call_policy(policy, params, obs, actions, method="log_prob")
                return awr_actor_loss(advantage, log_prob, self.temperature * scales, self.max_weight)

        def expert_loss_of(params, expert_obs, expert_actions):
            with self._autocast():
                return -call_policy(policy, params, expert_obs, expert_actions, method="log_prob").mean()

        scales, metrics = guided_scales(self, obs, actions, step, actor_loss_of, expert_loss_of)
        return self.temperature * scales, metrics

    # ------------------------------------------------------------------ one step
    def _update(self, batch: Batch, step: int) -> dict[str, torch.Tensor]:
        obs, actions = batch.observations, batch.actions
        value_loss, target_q = self._value_loss(obs, actions)
        self.value_optimizer_.zero_grad(set_to_none=True)
        value_loss.backward()
        self.value_optimizer_.step()

        guide_metrics: dict[str, torch.Tensor] = {}
        temperature = None
        if self.guide is not None:
            temperature, guide_metrics = self._guided_temperature(obs, actions, target_q, step)
        actor_loss, critic_loss, v_mean = self._actor_critic_loss(obs, actions, batch.rewards, batch.terminals,
                                                                  batch.next_observations, target_q, temperature)
        # Actor and critic losses share no parameters: one backward pass serves both.
        self.actor_optimizer_.zero_grad(set_to_none=True)
        self.critic_optimizer_.zero_grad(set_to_none=True)
        (actor_loss + critic_loss).backward()
        self._schedule_actor_lr(step)
        self.actor_optimizer_.step()
        self.critic_optimizer_.step()
        soft_update_(self.critic_target_, self.critic_, self.tau)
        return {"value_loss": value_loss.detach(), "actor_loss": actor_loss.detach(),
                "critic_loss": critic_loss.detach(), "v_mean": v_mean.detach(), **guide_metrics}

    def _schedule_actor_lr(self, step: int) -> None:
        if self.actor_lr_schedule == "cosine":
            # The cosine decay spans the offline run; steps past it (online fine-tuning with `fit_online`) use the
            # constant actor learning rate, as IQL's fine-tuning configs do (a decayed-to-zero actor cannot improve).
            lr = self.actor_lr * 0.5 * (1.0 + math.cos(math.pi * step / self.lr_schedule_steps_))
            self.actor_optimizer_.param_groups[0]["lr"] = lr if step < self.lr_schedule_steps_ else self.actor_lr

    def _act(self, obs: torch.Tensor, deterministic: bool) -> torch.Tensor:
        return self.policy_(obs, deterministic=deterministic, with_log_prob=False)[0]

    def _value(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return self.critic_(obs, actions).min(0).values
