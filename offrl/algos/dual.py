"""Dual RL (Sikchi, Zheng, Zhang & Niekum, 2023): offline RL and imitation as one dual over visitation
distributions, with the value loss a function of the f-divergence.

IQL, XQL and f-DVL are the same algorithm, IQL's update order

    value:   L_V = E f*(Q'(s, a) - V(s))                 (the divergence's value loss, `offrl.algos.losses`)
    actor:   L_pi = -E min(exp(beta_pi (Q'(s, a) - V(s))), 100) log pi(a | s)      (AWR, as IQL)
    critic:  L_Q = sum_i E huber_20(r + gamma (1 - d) V(s') - Q_i(s, a))

with Q' the minimum of the target critics, and only the value loss changes:

- `XQL` (Garg et al., 2023), reverse KL: Gumbel regression exp(z) - z - 1,
  z = (Q' - V) / beta, with the authors' clipped exponent and max-normalisation
  (beta 2, clip 7, layer-normed value network, Huber(20) critic);
- `FDVL(divergence="chi2" | "tv" | "kl")`: chi-square lam max(x + x^2/4, 0)
  - (1 - lam) x and total variation lam max(x, 0) - (1 - lam) x on
  x = Q' - V; they grow at most quadratically, which removes XQL's
  exponential blow-ups on large Q-value gaps.  "kl" is XQL's loss.

`ReCOIL` (same paper) imitates without rewards from a mixed dataset plus a few
expert demonstrations: each batch is half expert, half mixed (the mixture
sampler); the critic pushes expert Q-values to the bound R/(1-gamma) and
regresses mixed ones to a Bellman target with reward -R (least-squares
inverse-Q's fixed targets, as the authors' code), the value takes XQL's loss
on the mixed half and the actor AWR on the whole batch (the authors' actor,
the mixed half only, is `actor_data="mixed"`).

Networks, the critic target and the AWR actor are IQL's (`offrl.algos.iql`);
this module only states what differs.  Hyper-parameters follow the authors'
code (XQL: Div99/XQL offline; f-DVL: hari-sikchi/DVL offline; ReCOIL: the
authors' imitation code); see docs/algorithms/dual.md for the tables.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from offrl.algos.guide import DEMONSTRATIONS_RULE, load_demonstrations
from offrl.algos.iql import IQL
from offrl.algos.losses import awr_actor_loss, gumbel_log_loss, gumbel_loss, huber_td_loss, value_loss
from offrl.algos.params import boolean, choice, integer, real
from offrl.datasets.core import Batch, Dataset
from offrl.datasets.samplers import MixtureSampler, TransitionSampler
from offrl.nn import ValueNetwork, soft_update_

__all__ = ["FDVL", "XQL", "ReCOIL"]

_DIVERGENCES = ("chi2", "tv", "kl")


class FDVL(IQL):
    """f-DVL: IQL's update with the value loss of an f-divergence (chi-square, total variation or reverse KL).

    `lam` weighs the conjugate term of chi2 / tv, which take the raw gap Q' - V
    as the authors' code does (their optimum rises with lam: tv's V is the
    (2 lam - 1) / lam quantile of Q').  `beta` and `max_clip` are the Gumbel
    temperature and exponent clip of "kl" only.  `critic_loss="huber"`
    (delta `huber_delta`) and `value_layer_norm` are the authors' settings;
    `random_actions` is their `--sample_random_times` (uniform actions added to
    the value loss's batch): 1 by default, the f-DVL locomotion example's
    setting, with which f-DVL matches IQL on pendulum as well as hopper.
    `action_noise` is their `--noise` with `--noise_std`: the value loss sees
    the data actions plus Gaussian noise of that std (in units of half the
    action range, clipped at 0.5 of it); 0 (off) by default, as in their code.
    `guide=` plugs in GORL as for IQL.
    """

    _param_rules = {"divergence": choice(*_DIVERGENCES), "lam": real(0, 1, closed="right"),
                    "beta": real(0, None, closed="neither"), "max_clip": real(0, None, closed="neither"),
                    "critic_loss": choice("huber", "mse"), "huber_delta": real(0, None, closed="neither"),
                    "value_layer_norm": boolean(), "random_actions": integer(0),
                    "action_noise": real(0, None)}

    def __init__(
        self,
        *,
        divergence: str = "chi2",
        lam: float = 0.7,
        beta: float = 2.0,
        max_clip: float = 7.0,
        temperature: float = 3.0,
        critic_loss: str = "huber",
        huber_delta: float = 20.0,
        value_layer_norm: bool = True,
        random_actions: int = 1,
        action_noise: float = 0.0,
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
        self.divergence = divergence
        self.lam = lam
        self.beta = beta
        self.max_clip = max_clip
        self.temperature = temperature
        self.critic_loss = critic_loss
        self.huber_delta = huber_delta
        self.value_layer_norm = value_layer_norm
        self.random_actions = random_actions
        self.action_noise = action_noise
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

    def _value_objective(self, diff: torch.Tensor) -> torch.Tensor:
        return value_loss(self.divergence, diff, lam=self.lam, beta=self.beta, max_clip=self.max_clip)

    def _critic_objective(self, q: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.critic_loss == "huber":
            return huber_td_loss(q, target, self.huber_delta)
        return super()._critic_objective(q, target)

    def _make_value_network(self, obs_dim: int, hidden: tuple[int, ...]) -> ValueNetwork:
        return ValueNetwork(obs_dim, hidden, layer_norm=bool(self.value_layer_norm))

    def _value_loss_eager(self, obs, actions):
        """The value loss on the batch, with the data actions perturbed by `action_noise` and followed by
        `random_actions` uniform actions per state when set (the authors' `--noise` and `--sample_random_times`:
        for 1, V is fitted to Q' under (data + uniform) / 2).  Returns Q' of the data rows as logged, for the actor."""
        if not self.random_actions and not self.action_noise:
            return super()._value_loss_eager(obs, actions)
        value_actions = self._with_action_noise(actions) if self.action_noise else actions
        value_obs, value_actions = (self._with_random_actions(obs, value_actions) if self.random_actions
                                    else (obs, value_actions))
        with self._autocast():
            with torch.no_grad():
                target_q = self._target_min(self.critic_target_, value_obs, value_actions)
                data_q = (self._target_min(self.critic_target_, obs, actions) if self.action_noise
                          else target_q[: obs.shape[0]])
            v = self.value_(value_obs)
            return self._value_objective(target_q - v), data_q

    def _with_action_noise(self, actions: torch.Tensor) -> torch.Tensor:
        """The data actions plus N(0, action_noise^2) noise, clipped at +-0.5, in units of half the action range,
        then clipped to the action box (the authors' --noise, written for actions in [-1, 1])."""
        policy = self.policy_
        noise = (torch.randn_like(actions) * float(self.action_noise)).clamp(-0.5, 0.5) * policy.action_scale
        return policy.clamp_to_bounds(actions + noise)

    def _with_random_actions(self, obs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's states and actions followed by each state `random_actions` more times, each with an action
        drawn uniformly from the action box."""
        policy, times = self.policy_, int(self.random_actions)
        low = policy.action_bias - policy.action_scale
        uniform = low + 2.0 * policy.action_scale * torch.rand((times * obs.shape[0], actions.shape[-1]),
                                                                device=obs.device, dtype=actions.dtype)
        return torch.cat([obs, obs.repeat(times, 1)]), torch.cat([actions, uniform])


class XQL(FDVL):
    """Extreme Q-learning (offline): Gumbel regression for V, IQL's AWR actor, a Huber(20) critic.

    `beta` is the Gumbel temperature (the authors' `--temp`: 2 for hopper-medium-replay;
    per-dataset values in the presets), `max_clip` the exponent clip (7),
    `random_actions` and `action_noise` as for `FDVL`, but random actions are 0 by
    default (the authors' hopper-medium-replay script; one uniform action per
    state costs XQL on hopper and pendulum).
    `log_loss=True` fits V with the log of the Gumbel loss (the authors' `--log_loss`):
    the same minimiser, the textbook Gumbel gradient divided by the loss + 1.
    `guide=` plugs in GORL as for IQL.
    """

    _param_rules = {"log_loss": boolean()}

    def __init__(
        self,
        *,
        beta: float = 2.0,
        max_clip: float = 7.0,
        log_loss: bool = False,
        temperature: float = 3.0,
        critic_loss: str = "huber",
        huber_delta: float = 20.0,
        value_layer_norm: bool = True,
        random_actions: int = 0,
        action_noise: float = 0.0,
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
        self.beta = beta
        self.max_clip = max_clip
        self.log_loss = log_loss
        self.temperature = temperature
        self.critic_loss = critic_loss
        self.huber_delta = huber_delta
        self.value_layer_norm = value_layer_norm
        self.random_actions = random_actions
        self.action_noise = action_noise
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

    def _value_objective(self, diff: torch.Tensor) -> torch.Tensor:
        if self.log_loss:
            return gumbel_log_loss(diff, self.beta, self.max_clip)
        return gumbel_loss(diff, self.beta, self.max_clip)


class ReCOIL(IQL):
    """Relaxed coverage imitation (ReCOIL): imitation from a reward-free mixed dataset plus expert demonstrations.

    `expert`: the demonstrations (a Dataset with actions, or a load spec).
    `fit(dataset)` takes the mixed data; rewards are never read, so it may have
    none.  Each batch of `batch_size` is `expert_fraction` expert transitions
    and the rest mixed (`MixtureSampler`).  With `expert_in_mixed` the mixed
    source also holds the expert transitions, as the authors' data does, so
    the mixed distribution covers the expert's.

    critic:  sum_i E_expert 1/2 (Q_i - R/(1-gamma))^2
                 + E_mixed 1/2 (Q_i - (-R + gamma (1-d) clip(V(s')) + gamma d (-R/(1-gamma))))^2
             (V(s') clipped to [-R/(1-gamma), R/(1-gamma)], the range the rewards allow)
    value:   Gumbel loss (beta, max_clip) on Q' - V, mixed half
    actor:   AWR (temperature, max_weight) on the whole batch (`actor_data="all"`, the default), or on the
             mixed half only (`actor_data="mixed"`, the authors' actor)

    `reward_bound` is R (the authors' 2, so expert Q-values sit at 200 for gamma 0.99).
    The authors' actor reads the mixed half only; their mixed data holds 200
    expert trajectories (D4RL random + expert, about 1 row in 6), and on the
    states of the expert's gait, which random episodes never reach, those are
    the only expert actions it sees.  Where the mixed data holds almost none
    (the demonstrations only), that actor barely sees the expert: on hopper
    with 5 demonstrations it stays near the mixed data's level (20.8 against
    BC on the demonstrations' 93.2 at 200,000 steps).  The default `"all"`
    trains the actor on the mixture `expert_fraction` d_E + (1 -
    expert_fraction) d_mixed of the batch, with the same AWR weights; measured
    on hopper and pendulum it was never significantly worse than the authors'
    actor, in the authors' own kind of data included (docs/algorithms/dual.md).
    """

    _param_rules = {"expert": DEMONSTRATIONS_RULE, "expert_fraction": real(0, 1, closed="neither"), "beta": real(0, None, closed="neither"),
                    "max_clip": real(0, None, closed="neither"), "reward_bound": real(0, None, closed="neither"),
                    "expert_in_mixed": boolean(), "value_layer_norm": boolean(),
                    "actor_data": choice("mixed", "all")}
    required_labels = ("actions",)

    def __init__(
        self,
        *,
        expert: Any = None,
        expert_fraction: float = 0.5,
        expert_in_mixed: bool = True,
        actor_data: str = "all",
        beta: float = 1.0,
        max_clip: float = 7.0,
        reward_bound: float = 2.0,
        temperature: float = 3.0,
        value_layer_norm: bool = False,
        hidden_dims: Sequence[int] = (256, 256),
        n_critics: int = 2,
        actor_lr: float = 3e-4,
        critic_lr: float = 3e-4,
        value_lr: float = 3e-4,
        actor_lr_schedule: str | None = "cosine",
        batch_size: int = 512,
        gamma: float = 0.99,
        tau: float = 0.005,
        dropout: float = 0.0,
        max_weight: float = 100.0,
        n_steps: int = 1_000_000,
        normalize_observations: bool = True,
        precision: str = "fp32",
        compile: bool | str = False,
        log_every: int = 100,
        device: str = "auto",
        random_state: Any = None,
    ) -> None:
        self.expert = expert
        self.expert_fraction = expert_fraction
        self.expert_in_mixed = expert_in_mixed
        self.actor_data = actor_data
        self.beta = beta
        self.max_clip = max_clip
        self.reward_bound = reward_bound
        self.temperature = temperature
        self.value_layer_norm = value_layer_norm
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
        self.precision = precision
        self.compile = compile
        self.log_every = log_every
        self.device = device
        self.random_state = random_state

    guide = None  # ReCOIL's demonstrations are its reward; it takes no GORL guide

    # ------------------------------------------------------------------ data
    def _expert_dataset(self, dataset: Dataset) -> Dataset:
        return load_demonstrations(self.expert, dataset, "ReCOIL")

    def _reward_affine(self, dataset: Dataset) -> tuple[float, float]:
        return 1.0, 0.0  # rewards are not used

    def _make_spec(self, dataset: Dataset) -> dict[str, Any]:
        # Observation statistics (and action bounds) over everything the networks will see.
        return super()._make_spec(self._union(dataset))

    def _union(self, dataset: Dataset, expert: Dataset | None = None) -> Dataset:
        expert = _reward_free(self._expert_dataset(dataset)) if expert is None else expert
        return Dataset.concatenate([_reward_free(dataset), expert])

    def _make_sampler(self, dataset: Dataset) -> MixtureSampler:
        expert = _reward_free(self._expert_dataset(dataset))  # loaded once, shared by both sources
        mixed = self._union(dataset, expert) if self.expert_in_mixed else _reward_free(dataset)
        batch_size = int(self.batch_size)
        sources = [TransitionSampler(self._training_columns(d), batch_size) for d in (expert, mixed)]
        sampler = MixtureSampler(sources, [self.expert_fraction, 1.0 - self.expert_fraction], batch_size)
        self._n_expert_rows = sampler.counts[0]  # expert rows come first in every batch
        return sampler

    def _training_columns(self, dataset: Dataset) -> dict[str, torch.Tensor]:
        columns = super()._training_columns(dataset)
        columns.pop("rewards", None)
        return columns

    # ------------------------------------------------------------------ losses
    def _value_objective(self, diff: torch.Tensor) -> torch.Tensor:
        return gumbel_loss(diff, self.beta, self.max_clip)

    def _make_value_network(self, obs_dim: int, hidden: tuple[int, ...]) -> ValueNetwork:
        return ValueNetwork(obs_dim, hidden, layer_norm=bool(self.value_layer_norm))

    def _update(self, batch: Batch, step: int) -> dict[str, torch.Tensor]:
        n_expert = self._n_expert_rows
        obs, actions, next_obs, terminals = batch.observations, batch.actions, batch.next_observations, batch.terminals
        mixed = slice(n_expert, None)
        bound = self.reward_bound / (1.0 - self.gamma)

        with self._autocast():
            with torch.no_grad():
                target_q = self.critic_target_(obs[mixed], actions[mixed]).min(0).values
            value_loss = self._value_objective(target_q - self.value_(obs[mixed]))
        self.value_optimizer_.zero_grad(set_to_none=True)
        value_loss.backward()
        self.value_optimizer_.step()

        with self._autocast():
            with torch.no_grad():
                v, next_v = self.value_(torch.cat([obs[mixed], next_obs[mixed]])).chunk(2)
                done = terminals[mixed]
                # Rewards lie in [-R, R], so values lie in [-R/(1-gamma), R/(1-gamma)]: the bootstrap is clipped
                # there (LSIQ's bounded targets), which stops the soft-max V from inflating Q without limit.
                next_v = next_v.clamp(-bound, bound)
                bellman = -self.reward_bound + self.gamma * ((1.0 - done) * next_v - done * bound)
                advantage, actor_rows = target_q - v, mixed
                if self.actor_data == "all":  # the expert rows' advantages, in front of the mixed ones
                    expert = slice(None, n_expert)
                    expert_advantage = (self.critic_target_(obs[expert], actions[expert]).min(0).values
                                        - self.value_(obs[expert]))
                    advantage, actor_rows = torch.cat([expert_advantage, advantage]), slice(None)
            actor_loss = awr_actor_loss(advantage, self.policy_.log_prob(obs[actor_rows], actions[actor_rows]),
                                        self.temperature, self.max_weight)
            q = self.critic_(obs, actions)
            critic_loss = (0.5 * (q[:, :n_expert] - bound) ** 2).mean(dim=1).sum() \
                + (0.5 * (q[:, n_expert:] - bellman) ** 2).mean(dim=1).sum()
        self.actor_optimizer_.zero_grad(set_to_none=True)
        self.critic_optimizer_.zero_grad(set_to_none=True)
        (actor_loss + critic_loss).backward()
        self._schedule_actor_lr(step)
        self.actor_optimizer_.step()
        self.critic_optimizer_.step()
        soft_update_(self.critic_target_, self.critic_, self.tau)
        return {"value_loss": value_loss.detach(), "actor_loss": actor_loss.detach(),
                "critic_loss": critic_loss.detach(), "v_mean": v.mean(), "q_expert": q[:, :n_expert].mean().detach(),
                "q_mixed": q[:, n_expert:].mean().detach()}

    def fit_online(self, *args: Any, **kwargs: Any) -> "ReCOIL":
        raise ValueError("ReCOIL learns without rewards and has no online fine-tuning; fit another algorithm online, "
                         "e.g. IQL on the environment's rewards")


def _reward_free(dataset: Dataset) -> Dataset:
    """The dataset as ReCOIL reads it: no rewards, no behaviour log-probs (so any two sources concatenate)."""
    if dataset.rewards is not None:
        dataset = dataset.without_rewards()
    return dataset.without_behavior_log_probs() if dataset.has_behavior_log_probs else dataset
