"""Conservative Q-learning (Kumar et al., 2020) and Cal-QL (Nakamoto et al., 2023).

CQL is SAC with a conservative penalty on the critics:

    L_Q = sum_i E (Q_i(s, a) - y)^2 + alpha_cql * sum_i E [logsumexp_j Q_i(s, a_j) - Q_i(s, a)]
    y   = r + gamma (1 - d) min_i Q'_i(s', a'),   a' ~ pi(s')   (no entropy in the backup)

where the a_j are 10 uniform actions, 10 from pi(. | s) and 10 from
pi(. | s'), each with its log-density subtracted (importance sampling).  The
Lagrange variant learns alpha' >= 0 so the gap meets `target_action_gap`.
The actor is SAC's (maximise min_i Q_i(s, pi(s)) - alpha log pi) with
automatic entropy tuning towards -|A|.  All losses are computed from the
same parameters and stepped together, as in the official code.

Cal-QL clips the Q-values of the policy's actions inside the logsumexp from
below by the Monte-Carlo return-to-go of the dataset trajectory, so the
penalty never pushes Q(s, pi(s)) below a reference policy's value.

Defaults follow the CQL paper (alpha 5, actor lr 1e-4, critic lr 3e-4,
3x256 networks; `critic_hidden_dims` makes the critics deeper, as the
AntMaze presets do) and CORL's implementation details (no entropy in the backup,
no max-target backup, normalised states).  All 31 critic evaluations per
state (data action + 30 sampled) are one batched ensemble call, and the
policy network runs once per state for all of its samples.
"""

from __future__ import annotations

import copy
import inspect
import math
from typing import Any, Sequence

import numpy as np
import torch
from torch.func import functional_call

from offrl.algos.base import OfflineAlgorithm, make_adam
from offrl.algos.params import InvalidParameterError, any_of, boolean, choice, integer, layer_sizes, real
from offrl.algos.losses import LearnedScale, critic_td_loss, sac_actor_loss, temperature_loss
from offrl.datasets.core import Batch, Dataset
from offrl.nn import QEnsemble, TanhGaussianPolicy, soft_update_

__all__ = ["CQL", "CalQL", "cql_penalty", "calql_mc_returns"]


# ---------------------------------------------------------------------- losses
def cql_penalty(q_data: torch.Tensor, q_sampled: torch.Tensor, log_density: torch.Tensor, temperature: float = 1.0,
                clip_min: float | None = None, clip_max: float | None = None) -> torch.Tensor:
    """Per-critic E[temp * logsumexp_j ((Q(s, a_j) - log mu(a_j)) / temp) - Q(s, a)].

    q_data (n_critics, batch); q_sampled (n_critics, n_samples, batch);
    log_density (n_samples, batch) or broadcastable.  Returns (n_critics,).
    """
    ood = torch.logsumexp((q_sampled - log_density) / temperature, dim=1) * temperature
    diff = ood - q_data
    if clip_min is not None or clip_max is not None:
        diff = diff.clamp(clip_min, clip_max)
    return diff.mean(dim=1)


def calql_mc_returns(dataset: Dataset, rewards: np.ndarray, gamma: float, sparse_rewards: bool = False) -> np.ndarray:
    """Monte-Carlo discounted returns-to-go of the training rewards, per transition.

    With `sparse_rewards`, an episode whose rewards *all* equal the dataset's
    lowest reward (a goal-reaching episode that never reached the goal) gets
    the value of failing forever, r_min / (1 - gamma), at every step, as in
    the reference implementation's `calc_return_to_go`.  An episode that
    reached the goal at some step, even if it ended elsewhere, keeps its
    Monte-Carlo returns.
    """
    returns = dataset.with_rewards(rewards).returns_to_go(gamma).astype(np.float32)
    if sparse_rewards and gamma >= 1.0:
        raise ValueError(f"the failure value r_min / (1 - gamma) of sparse rewards needs gamma < 1, got {gamma}")
    if sparse_rewards:
        r_min = rewards.min()
        n_better = np.add.reduceat((rewards != r_min).astype(np.int64), dataset.episode_starts[:-1])
        failed = n_better == 0
        returns[np.repeat(failed, dataset.episode_lengths())] = float(r_min) / (1.0 - gamma)
    return returns


class CQL(OfflineAlgorithm):
    """Conservative Q-learning (SAC-based, continuous actions); `lagrange=True` for the Lagrange variant."""

    # before issue 10 the temperature and the Lagrange multiplier were saved as log_alpha_ / log_alpha_prime_
    _legacy_modules = {"log_alpha_": "temperature_", "log_alpha_prime_": "alpha_prime_"}
    _param_rules = {
        "critic_hidden_dims": any_of(layer_sizes(), choice(None)),
        "cql_alpha": real(0, None), "n_action_samples": integer(1), "cql_temperature": real(0, None, closed="neither"),
        "importance_sampling": boolean(), "lagrange": boolean(), "target_action_gap": real(),
        "cql_clip_diff_min": real(none=True, infinite=True), "cql_clip_diff_max": real(none=True, infinite=True),
        "alpha_lr": real(0, None, closed="neither", none=True),
        "alpha_prime_lr": real(0, None, closed="neither", none=True), "auto_entropy": boolean(),
        "init_alpha": real(0, None, closed="neither"), "target_entropy": real(none=True), "backup_entropy": boolean(),
        "max_target_backup": boolean(), "bc_steps": integer(0),
    }

    def __init__(
        self,
        *,
        cql_alpha: float = 5.0,
        n_action_samples: int = 10,
        cql_temperature: float = 1.0,
        importance_sampling: bool = True,
        lagrange: bool = False,
        target_action_gap: float = 0.8,
        cql_clip_diff_min: float | None = None,
        cql_clip_diff_max: float | None = None,
        hidden_dims: Sequence[int] = (256, 256, 256),
        critic_hidden_dims: Sequence[int] | None = None,
        n_critics: int = 2,
        actor_lr: float = 1e-4,
        critic_lr: float = 3e-4,
        alpha_lr: float | None = None,
        alpha_prime_lr: float | None = None,
        batch_size: int = 256,
        gamma: float = 0.99,
        tau: float = 0.005,
        auto_entropy: bool = True,
        init_alpha: float = 1.0,
        target_entropy: float | None = None,
        backup_entropy: bool = False,
        max_target_backup: bool = False,
        bc_steps: int = 0,
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
    ) -> None:
        self.cql_alpha = cql_alpha
        self.n_action_samples = n_action_samples
        self.cql_temperature = cql_temperature
        self.importance_sampling = importance_sampling
        self.lagrange = lagrange
        self.target_action_gap = target_action_gap
        self.cql_clip_diff_min = cql_clip_diff_min
        self.cql_clip_diff_max = cql_clip_diff_max
        self.hidden_dims = hidden_dims
        self.critic_hidden_dims = critic_hidden_dims
        self.n_critics = n_critics
        self.actor_lr = actor_lr
        self.critic_lr = critic_lr
        self.alpha_lr = alpha_lr
        self.alpha_prime_lr = alpha_prime_lr
        self.batch_size = batch_size
        self.gamma = gamma
        self.tau = tau
        self.auto_entropy = auto_entropy
        self.init_alpha = init_alpha
        self.target_entropy = target_entropy
        self.backup_entropy = backup_entropy
        self.max_target_backup = max_target_backup
        self.bc_steps = bc_steps
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

    # ------------------------------------------------------------------ networks
    def _build(self, spec: dict[str, Any]) -> None:
        if not self.init_alpha > 0:
            raise ValueError(f"init_alpha must be positive (alpha is learned as log alpha), got {self.init_alpha}")
        device = self.device_
        obs_dim, act_dim, hidden = spec["observation_dim"], spec["action_dim"], tuple(self.hidden_dims)
        self.policy_ = TanhGaussianPolicy(obs_dim, act_dim, hidden, spec["action_low"], spec["action_high"]).to(device)
        critic_hidden = hidden if self.critic_hidden_dims is None else tuple(self.critic_hidden_dims)
        self.critic_ = QEnsemble(obs_dim, act_dim, n_critics=self.n_critics, hidden_dims=critic_hidden).to(device)
        self.critic_target_ = copy.deepcopy(self.critic_).requires_grad_(False)
        # temperature_() is SAC's entropy temperature alpha, alpha_prime_() the Lagrange multiplier alpha';
        # each keeps the log of its value as the parameter (`.log_value`).
        self.temperature_ = LearnedScale(self.init_alpha).to(device)
        # CORL starts alpha' at e (log alpha' = 1).
        self.alpha_prime_ = LearnedScale(math.e).to(device)
        self.actor_optimizer_ = make_adam(self.policy_.parameters(), self.actor_lr, device)
        self.critic_optimizer_ = make_adam(self.critic_.parameters(), self.critic_lr, device)
        self.alpha_optimizer_ = make_adam(self.temperature_.parameters(), self.alpha_lr or self.actor_lr, device)
        self.alpha_prime_optimizer_ = make_adam(self.alpha_prime_.parameters(),
                                                self.alpha_prime_lr or self.critic_lr, device)
        self.target_entropy_ = float(-act_dim if self.target_entropy is None else self.target_entropy)
        # log density of the uniform proposal over the action box
        self.uniform_log_density_ = float(-np.log(np.asarray(spec["action_high"]) - np.asarray(spec["action_low"])).sum())
        self._critic_param_names = [name for name, _ in self.critic_.named_parameters()]
        self._losses = self._maybe_compile(self._losses_eager)

    # ------------------------------------------------------------------ hook for Cal-QL
    def _penalized_policy_q(self, q_policy: torch.Tensor, batch_extras: dict[str, torch.Tensor]) -> torch.Tensor:
        """Q-values of the policy's actions as they enter the penalty's logsumexp (CQL: unchanged)."""
        return q_policy

    # ------------------------------------------------------------------ losses
    def _losses_eager(self, obs, actions, rewards, terminals, next_obs, extras, bc_phase: bool):
        policy, n = self.policy_, self.n_action_samples
        batch = obs.shape[0]
        with self._autocast():
            # One policy pass on s and s' serves the actor loss and every sampled action.
            mean, log_std = policy.distribution_params(torch.cat([obs, next_obs]))
            new_actions, log_pi = policy.sample_from_params(mean[:batch], log_std[:batch], 1)
            new_actions, log_pi = new_actions[0], log_pi[0]
            alpha = self.temperature_() if self.auto_entropy else torch.full((), self.init_alpha, device=obs.device)
            alpha_loss = (temperature_loss(self.temperature_.log_value, log_pi, self.target_entropy_)
                          if self.auto_entropy else torch.zeros((), device=obs.device))

            # Actor: SAC loss against the critics (their parameters detached: only the actor learns from it),
            # or behaviour cloning during the first `bc_steps` (the same loss with log pi(a_data|s) in place of Q).
            if bc_phase:
                policy_loss = sac_actor_loss(log_pi, policy.log_prob(obs, actions), alpha.detach())
            else:
                detached = {k: v.detach() for k, v in zip(self._critic_param_names, self.critic_.parameters())}
                q_new = self._actor_q(functional_call(self.critic_, detached, (obs, new_actions)))
                policy_loss = sac_actor_loss(log_pi, q_new, alpha.detach())

            with torch.no_grad():
                mean_d, log_std_d = mean.detach(), log_std.detach()
                # TD target
                if self.max_target_backup:
                    next_a, next_logp = policy.sample_from_params(mean_d[batch:], log_std_d[batch:], n)
                    q_next = self._target_min(self.critic_target_, next_obs.expand(n, -1, -1), next_a)  # (n, batch)
                    target_q, best = q_next.max(0)
                    next_logp = next_logp.gather(0, best[None])[0]
                else:
                    next_a, next_logp = policy.sample_from_params(mean_d[batch:], log_std_d[batch:], 1)
                    target_q = self._target_min(self.critic_target_, next_obs, next_a[0])
                    next_logp = next_logp[0]
                if self.backup_entropy:
                    target_q = target_q - alpha * next_logp
                td_target = rewards + self.gamma * (1.0 - terminals) * target_q
            if not self._conservative:  # online without the penalty (WSRL, E2O): SAC's critic update, nothing sampled
                q_data = self.critic_(obs, actions)
                td_loss = critic_td_loss(q_data, td_target)
                gap = torch.zeros(q_data.shape[0], device=obs.device)
                alpha_prime = cql_loss = alpha_prime_loss = torch.zeros((), device=obs.device)
            else:
                td_loss, gap, cql_loss, alpha_prime, alpha_prime_loss, q_data = self._penalized_critic_loss(
                    obs, actions, td_target, mean.detach(), log_std.detach(), extras)
            critic_loss = td_loss + cql_loss
        total = critic_loss + policy_loss + alpha_loss + alpha_prime_loss
        metrics = {"critic_loss": critic_loss.detach(), "td_loss": td_loss.detach(), "cql_gap": gap.mean().detach(),
                   "actor_loss": policy_loss.detach(), "alpha": alpha.detach(), "q_data": q_data.mean().detach()}
        if self.lagrange:
            metrics["alpha_prime"] = alpha_prime.detach()
        return total, metrics

    def _penalized_critic_loss(self, obs, actions, td_target, mean_d, log_std_d, extras):
        """TD loss plus the conservative penalty on 10 uniform, 10 pi(s) and 10 pi(s') actions (all at s)."""
        policy, n, batch = self.policy_, self.n_action_samples, obs.shape[0]
        with torch.no_grad():
            both, both_logp = policy.sample_from_params(mean_d, log_std_d, n)  # (n, 2 batch, A)
            low = policy.action_bias - policy.action_scale
            uniform = low + 2.0 * policy.action_scale * torch.rand((n, batch, actions.shape[-1]), device=obs.device)
            sampled = torch.cat([actions[None], uniform, both[:, :batch], both[:, batch:]])  # (1 + 3n, batch, A)
        # Critics on the data action and the 3n sampled actions: one ensemble call.
        q_all = self.critic_(obs.expand(1 + 3 * n, -1, -1), sampled)  # (n_critics, 1 + 3n, batch)
        q_data = q_all[:, 0]
        td_loss = critic_td_loss(q_data, td_target)
        q_rand = q_all[:, 1:1 + n]
        q_pi = self._penalized_policy_q(q_all[:, 1 + n:], extras)  # pi(s) then pi(s') actions
        if self.importance_sampling:
            q_sampled = torch.cat([q_rand - self.uniform_log_density_,
                                   q_pi[:, :n] - both_logp[:, :batch], q_pi[:, n:] - both_logp[:, batch:]], dim=1)
        else:  # the paper's CQL(H) without the correction also includes the data action
            q_sampled = torch.cat([q_rand, q_data[:, None], q_pi], dim=1)
        gap = cql_penalty(q_data, q_sampled, 0.0, self.cql_temperature,
                          self.cql_clip_diff_min, self.cql_clip_diff_max)  # (n_critics,)
        if self.lagrange:
            alpha_prime = self.alpha_prime_().clamp(0.0, 1e6)
            cql_loss = (alpha_prime.detach() * self.cql_alpha * (gap - self.target_action_gap)).sum()
            alpha_prime_loss = -0.5 * (alpha_prime * self.cql_alpha * (gap.detach() - self.target_action_gap)).sum()
        else:
            alpha_prime = torch.zeros((), device=obs.device)
            cql_loss = self.cql_alpha * gap.sum()
            alpha_prime_loss = torch.zeros((), device=obs.device)
        return td_loss, gap, cql_loss, alpha_prime, alpha_prime_loss, q_data

    # ------------------------------------------------------------------ one step
    def _update(self, batch: Batch, step: int) -> dict[str, torch.Tensor]:
        total, metrics = self._losses(batch.observations, batch.actions, batch.rewards, batch.terminals,
                                      batch.next_observations, batch.extras, step < self.bc_steps)
        optimizers = [self.actor_optimizer_, self.critic_optimizer_]
        if self.auto_entropy:
            optimizers.append(self.alpha_optimizer_)
        if self.lagrange:
            optimizers.append(self.alpha_prime_optimizer_)
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        # Each loss reaches only its own parameters (see _losses), so one backward pass serves all of them.
        total.backward()
        for optimizer in optimizers:
            optimizer.step()
        soft_update_(self.critic_target_, self.critic_, self.tau)
        return metrics

    def _act(self, obs: torch.Tensor, deterministic: bool) -> torch.Tensor:
        return self.policy_(obs, deterministic=deterministic, with_log_prob=False)[0]

    def _value(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return self.critic_(obs, actions).min(0).values


class CalQL(CQL):
    """Cal-QL: CQL whose penalty is calibrated by Monte-Carlo returns-to-go of the dataset (needs episodes).

    `sparse_rewards=True` treats episodes whose rewards all equal the
    dataset's lowest reward (the goal never reached) as failures worth
    r_min / (1 - gamma) at every step (AntMaze; the reference rule).
    Every other parameter is CQL's, with CQL's defaults.
    """

    _param_rules = {"sparse_rewards": boolean()}

    def check_params(self) -> None:
        super().check_params()
        if self.sparse_rewards and self.gamma >= 1.0:
            raise InvalidParameterError("CalQL: sparse_rewards values a failed episode at r_min / (1 - gamma), which "
                                        f"needs gamma < 1, got gamma={self.gamma}; lower gamma or set sparse_rewards=False")

    def __init__(self, *, sparse_rewards: bool = False, **cql_params: Any) -> None:
        super().__init__(**cql_params)
        self.sparse_rewards = sparse_rewards

    def _extra_columns(self, dataset: Dataset) -> dict[str, np.ndarray]:
        rewards = self._transform_rewards(dataset)
        return {"mc_returns": calql_mc_returns(dataset, rewards, self.gamma, self.sparse_rewards)}

    def _penalized_policy_q(self, q_policy: torch.Tensor, batch_extras: dict[str, torch.Tensor]) -> torch.Tensor:
        """The policy's Q-values clipped from below by the Monte-Carlo return-to-go."""
        return torch.maximum(q_policy, batch_extras["mc_returns"].to(q_policy.dtype))


def _merged_signature(own: Any, base: Any) -> inspect.Signature:
    """`own`'s keyword parameters followed by `base`'s, without `own`'s **kwargs.

    CalQL's `__init__` forwards CQL's parameters as **kwargs; giving it the
    merged signature lets scikit-learn's get_params / set_params / clone /
    repr (which read the constructor's signature), `offrl.load` and help()
    see every parameter, so the two constructors never repeat each other.
    """
    own_params = [p for p in inspect.signature(own).parameters.values() if p.kind != p.VAR_KEYWORD]
    names = {p.name for p in own_params}
    extra = [p for p in inspect.signature(base).parameters.values() if p.name != "self" and p.name not in names]
    return inspect.Signature(own_params + extra)


CalQL.__init__.__signature__ = _merged_signature(CalQL.__init__, CQL.__init__)  # type: ignore[attr-defined]
