"""Soft actor-critic (Haarnoja et al., 2018), online.

Tanh-Gaussian policy, twin critics as one batched `QEnsemble`, automatic
entropy tuning towards -|A|.  Defaults are the paper's: 256x256 ReLU MLPs,
Adam 3e-4, batch 256, gamma 0.99, tau 0.005, one update per environment step
after 5000 uniformly random warm-up steps.

`update(batch)` is one gradient step on a `Batch` (from a `ReplayBuffer` or a
`Dataset`) and `replay_buffer_` is a plain `offrl.online.ReplayBuffer`, so
fine-tuning code can drive both itself.  `log_prob(obs, actions)` gives the
behaviour log-densities a dataset records.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from offrl.algos.base import BaseEstimator, _seed_from, check_precision, make_adam
from offrl.algos.params import boolean, integer, real
from offrl.algos.losses import LearnedScale, critic_td_loss, sac_actor_loss, temperature_loss
from offrl.datasets.core import Batch
from offrl.nn import QEnsemble, TanhGaussianPolicy, soft_update_
from offrl.online.loop import episode_seed

__all__ = ["SAC", "episode_seed"]


def _adam_kernel(device: torch.device) -> str:
    """Fused Adam on CUDA, foreach elsewhere.

    On this project's CPU, fused and foreach measured the same within noise for a whole SAC update
    (12.5-13.9 ms); foreach stays the CPU choice because the recorded dataset builds used it (changing the
    kernel changes the last bits, and so the run).
    """
    return "fused" if device.type == "cuda" else "foreach"


class SAC(BaseEstimator):
    """Online soft actor-critic with a tanh-Gaussian policy and twin critics.

    Parameters
    ----------
    hidden_dims : widths of the policy and critic MLPs.
    lr : Adam learning rate of the policy, critics and temperature
        (`actor_lr`, `critic_lr`, `alpha_lr` override it one by one).
    batch_size, gamma, tau : the usual; tau is the Polyak rate of the target critics.
    n_critics, critic_layer_norm : the critic ensemble's size and LayerNorm
        (a fine-tuning strategy that builds its own critics, RLPD's 10 with
        LayerNorm, overrides both for its run).
    init_alpha : initial entropy temperature.
    target_entropy : entropy target of automatic tuning; None means -action_dim.
    learning_starts : environment steps taken with uniformly random actions
        before the first update.
    utd_ratio : gradient updates per environment step.
    buffer_size : replay capacity (a ring; the oldest transitions are dropped).
    n_steps : default number of environment steps for `fit_online`.
    log_every : steps between loss logs (and NaN checks).
    precision : "fp32", or "bf16" for bf16 autocast of the networks' hidden
        layers in `update` (fp32 weights, optimiser state, output layers and
        losses; acting and log-probabilities stay fp32).
    """

    # model files written before the shared LearnedScale (issue 10) call the temperature parameter log_alpha
    _legacy_tensors = {("temperature_", "log_alpha"): "log_value"}
    _param_rules = {
        "actor_lr": real(0, None, closed="neither", none=True), "critic_lr": real(0, None, closed="neither", none=True),
        "alpha_lr": real(0, None, closed="neither", none=True), "init_alpha": real(0, None, closed="neither"),
        "target_entropy": real(none=True), "learning_starts": integer(0), "utd_ratio": integer(1),
        "buffer_size": integer(1), "critic_layer_norm": boolean(),
    }

    def __init__(
        self,
        *,
        hidden_dims: Sequence[int] = (256, 256),
        n_critics: int = 2,
        critic_layer_norm: bool = False,
        lr: float = 3e-4,
        actor_lr: float | None = None,
        critic_lr: float | None = None,
        alpha_lr: float | None = None,
        batch_size: int = 256,
        gamma: float = 0.99,
        tau: float = 0.005,
        init_alpha: float = 1.0,
        target_entropy: float | None = None,
        learning_starts: int = 5000,
        utd_ratio: int = 1,
        buffer_size: int = 1_000_000,
        n_steps: int = 1_000_000,
        log_every: int = 1000,
        precision: str = "fp32",
        device: str = "auto",
        random_state: Any = None,
    ) -> None:
        self.hidden_dims = hidden_dims
        self.n_critics = n_critics
        self.critic_layer_norm = critic_layer_norm
        self.lr = lr
        self.actor_lr = actor_lr
        self.critic_lr = critic_lr
        self.alpha_lr = alpha_lr
        self.batch_size = batch_size
        self.gamma = gamma
        self.tau = tau
        self.init_alpha = init_alpha
        self.target_entropy = target_entropy
        self.learning_starts = learning_starts
        self.utd_ratio = utd_ratio
        self.buffer_size = buffer_size
        self.n_steps = n_steps
        self.log_every = log_every
        self.precision = precision
        self.device = device
        self.random_state = random_state

    # ------------------------------------------------------------------ networks
    def _build(self, spec: dict[str, Any]) -> None:
        if spec.get("discrete_actions") is not None:
            raise ValueError("SAC needs a continuous (Box) action space; this task has discrete actions")
        device = self.device_
        obs_dim, act_dim = spec["observation_dim"], spec["action_dim"]
        hidden = tuple(self.hidden_dims)
        self.policy_ = TanhGaussianPolicy(obs_dim, act_dim, hidden, spec["action_low"], spec["action_high"]).to(device)
        # A strategy that builds its own critics (RLPD) records them in the spec, so a checkpoint rebuilds the same.
        self.critic_ = QEnsemble(obs_dim, act_dim, n_critics=int(spec.get("n_critics", self.n_critics)), hidden_dims=hidden,
                                 layer_norm=bool(spec.get("critic_layer_norm", self.critic_layer_norm))).to(device)
        self.critic_target_ = copy.deepcopy(self.critic_).requires_grad_(False)
        self.temperature_ = LearnedScale(self.init_alpha).to(device)  # log alpha, called: alpha
        self.actor_optimizer_ = make_adam(self.policy_.parameters(), self.actor_lr or self.lr, device, kernel=_adam_kernel(device))
        self.critic_optimizer_ = make_adam(self.critic_.parameters(), self.critic_lr or self.lr, device, kernel=_adam_kernel(device))
        self.alpha_optimizer_ = make_adam(self.temperature_.parameters(), self.alpha_lr or self.lr, device, kernel=_adam_kernel(device))
        self.target_entropy_ = float(-act_dim if self.target_entropy is None else self.target_entropy)
        self._critic_params = list(self.critic_.parameters())

    @property
    def log_alpha_(self) -> torch.Tensor:
        return self.temperature_.log_value

    @staticmethod
    def spec_from_env(env: Any) -> dict[str, Any]:
        """The estimator spec (dimensions, action bounds) of a gymnasium env with Box spaces."""
        import gymnasium as gym

        action_space = env.action_space
        if not isinstance(action_space, gym.spaces.Box):
            raise ValueError(
                f"SAC needs a continuous (Box) action space, but {_env_name(env)} has {action_space}; "
                "use a continuous-control environment"
            )
        if not (np.isfinite(action_space.low).all() and np.isfinite(action_space.high).all()):
            raise ValueError(f"SAC needs a bounded action space; {_env_name(env)} has {action_space}")
        obs_shape = env.observation_space.shape
        if obs_shape is None or len(obs_shape) != 1:
            raise ValueError(
                f"SAC needs flat (1-d Box) observations, but {_env_name(env)} has {env.observation_space}; "
                "flatten them with gymnasium.wrappers.FlattenObservation"
            )
        obs_dim = int(obs_shape[0])
        spec: dict[str, Any] = {
            "observation_dim": obs_dim,
            "action_dim": int(np.prod(action_space.shape)),
            "discrete_actions": None,
            "action_low": np.asarray(action_space.low, np.float32).reshape(-1).tolist(),
            "action_high": np.asarray(action_space.high, np.float32).reshape(-1).tolist(),
            "obs_mean": [0.0] * obs_dim,
            "obs_std": [1.0] * obs_dim,
        }
        if getattr(env, "spec", None) is not None and env.spec is not None:
            spec["env_id"] = env.spec.id
        return spec

    # ------------------------------------------------------------------ acting
    def _act(self, obs: torch.Tensor, deterministic: bool) -> torch.Tensor:
        return self.policy_(obs, deterministic=deterministic, with_log_prob=False)[0]

    def _value(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return self.critic_(obs, actions).min(0).values

    @torch.no_grad()
    def sample_with_log_prob(self, obs: torch.Tensor, generator: torch.Generator | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled env-unit actions and their log-probabilities, drawn with `generator`.

        The log-probability is `policy_.log_prob` of the returned (float32,
        clipped to the bounds) action, so it is exactly what `log_prob` of
        the stored action gives later.
        """
        policy = self.policy_
        mean, log_std = policy.distribution_params(obs)
        noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        action = policy.to_env(torch.tanh(mean + log_std.exp() * noise))
        action = torch.minimum(torch.maximum(action, self._low), self._high)
        unit = policy.to_unit(action).clamp(-1 + 1e-6, 1 - 1e-6)
        return action, policy._squashed_log_prob(torch.atanh(unit), mean, log_std)

    @property
    def _low(self) -> torch.Tensor:
        return self.policy_.action_bias - self.policy_.action_scale

    @property
    def _high(self) -> torch.Tensor:
        return self.policy_.action_bias + self.policy_.action_scale

    @torch.no_grad()
    def log_prob(self, observations: Any, actions: Any) -> np.ndarray:
        """log pi(a | s) of env-unit `actions` under the current policy (numpy in, numpy out)."""
        obs, single = self._as_obs_tensor(observations)
        act = np.asarray(actions, dtype=np.float32).reshape(len(obs), -1)
        if act.shape[1] != self.spec_["action_dim"]:
            raise ValueError(f"actions has shape {np.asarray(actions).shape}; expected (n, {self.spec_['action_dim']})")
        self._set_training_mode(False)
        try:
            value = self.policy_.log_prob(self.obs_normalizer_(obs), torch.as_tensor(act, device=self.device_))
        finally:
            self._set_training_mode(True)
        value = value.float().cpu().numpy()
        return value[0] if single else value

    def uniform_log_prob(self) -> float:
        """log-density of a uniformly random action (the warm-up policy)."""
        return float(-np.log(np.asarray(self.spec_["action_high"]) - np.asarray(self.spec_["action_low"])).sum())

    # ------------------------------------------------------------------ learning
    def update(self, batch: Batch) -> dict[str, torch.Tensor]:
        """One SAC gradient step on `batch` (critics, then policy, then temperature, then targets).

        Returns detached scalar tensors (no host synchronisation).
        """
        obs, actions, next_obs = batch.observations, batch.actions, batch.next_observations
        alpha = self.temperature_.log_value.detach().exp()
        with torch.no_grad(), self._autocast():
            next_actions, next_log_prob = self.policy_(next_obs)
            q_next = self._target_min(self.critic_target_, next_obs, next_actions) - alpha * next_log_prob
            target = batch.rewards + self.gamma * (1.0 - batch.terminals) * q_next
        with self._autocast():
            q = self.critic_(obs, actions)
        critic_loss = critic_td_loss(q.float(), target.float())
        self.critic_optimizer_.zero_grad(set_to_none=True)
        critic_loss.backward()
        self.critic_optimizer_.step()

        for p in self._critic_params:  # the actor step needs no critic gradients
            p.requires_grad_(False)
        with self._autocast():
            new_actions, log_prob = self.policy_(obs)
            q_new = self._actor_q(self.critic_(obs, new_actions))
        actor_loss = sac_actor_loss(log_prob.float(), q_new.float(), alpha)
        self.actor_optimizer_.zero_grad(set_to_none=True)
        actor_loss.backward()
        self.actor_optimizer_.step()
        for p in self._critic_params:
            p.requires_grad_(True)

        alpha_loss = temperature_loss(self.temperature_.log_value, log_prob, self.target_entropy_)
        self.alpha_optimizer_.zero_grad(set_to_none=True)
        alpha_loss.backward()
        self.alpha_optimizer_.step()

        soft_update_(self.critic_target_, self.critic_, self.tau)
        return {
            "critic_loss": critic_loss.detach(),
            "actor_loss": actor_loss.detach(),
            "alpha": alpha,
            "entropy": -log_prob.detach().mean(),
            "q_mean": q.detach().mean(),
        }

    # ------------------------------------------------------------------ online training
    def _online_act(self, obs: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sample_with_log_prob(self.obs_normalizer_(obs), generator)

    def _online_update(self, batch: Batch) -> dict[str, torch.Tensor]:
        return self.update(batch)

    def _online_extra_names(self) -> tuple[str, ...]:
        return ()

    def fit_online(
        self,
        env: Any,
        n_steps: int | None = None,
        *,
        strategy: Any = None,
        offline_dataset: Any = None,
        n_envs: int = 1,
        eval_env: Any = None,
        eval_every: int | None = None,
        eval_episodes: int = 10,
        callbacks: Iterable[Callable[["SAC", int, dict[str, float]], Any]] = (),
        log_dir: str | os.PathLike | None = None,
        checkpoint_path: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
        resume: bool = False,
        progress: bool = True,
    ) -> "SAC":
        """Train online for `n_steps` environment steps (default: the `n_steps` hyper-parameter); return self.

        Runs the shared online loop (`offrl.online.loop.run_online`) with
        `learning_starts` uniformly random warm-up steps and `utd_ratio`
        updates per step.  `env` is an env, a gymnasium id (with `n_envs`
        copies stepped in lock step) or a list of envs.  Episode j is reset
        with seed `episode_seed(seed_, 1, j)`; actions and replay batches come
        from a seeded generator and the update's noise from the (seeded) global
        torch RNG, so a fixed `random_state` gives the same run on the same
        machine and thread count.  Every `eval_every` steps (default
        n_steps / 10) `eval_env` is evaluated with the deterministic policy
        and the callbacks are called as `callback(sac, step, row)`; a callback
        returning False stops training.  `log_dir` receives train.csv /
        eval.csv (and its checkpoint.pt when `checkpoint_path` is not given).
        With a checkpoint path the whole run (networks, optimisers, replay
        buffer, generators) is written atomically at the first episode end
        after every `checkpoint_every` steps and at the end; `resume=True`
        continues from it to the same result as an uninterrupted run.

        `strategy` (default: SAC's own, `learning_starts` uniform warm-up
        steps, `utd_ratio`, no offline data) takes a recipe of
        `offrl.online.strategies` instead, e.g. "rlpd" with
        `offline_dataset=` (RLPD from scratch: half of each batch offline, 10
        LayerNorm critics built for the run).
        """
        from offrl.datasets import load as load_dataset
        from offrl.online.loop import OnlineNames, make_envs, run_online
        from offrl.online.strategies import OnlineStrategy, resolve_strategy

        self.check_params()
        envs = make_envs(env, n_envs)
        n_steps = int(self.n_steps if n_steps is None else n_steps)
        check_precision("SAC", self.precision, self.device_)
        spec = self.spec_from_env(envs[0])
        if checkpoint_path is None and log_dir is not None:
            checkpoint_path = Path(log_dir) / "checkpoint.pt"

        if strategy is None:
            strategy = OnlineStrategy(warmup_steps=int(self.learning_starts), warmup_actions="uniform",
                                      utd_ratio=int(self.utd_ratio), keep_offline_data=False)
            strategy.name = "sac"  # SAC's own recipe: uniform warm-up, its own update ratio, no offline data
        else:
            strategy = resolve_strategy(strategy)
        if isinstance(offline_dataset, (str, os.PathLike)):
            offline_dataset = load_dataset(offline_dataset)
        if offline_dataset is not None:  # its reference scores normalise the evaluations, as for the offline learners
            for key in ("ref_min_score", "ref_max_score"):
                if offline_dataset.metadata.get(key) is not None:
                    spec[key] = offline_dataset.metadata[key]

        def start_fresh() -> None:
            run_spec = dict(spec)
            if strategy.n_critics is not None:  # the strategy's critics (RLPD: 10 with LayerNorm)
                run_spec["n_critics"] = int(strategy.n_critics)
                run_spec["critic_layer_norm"] = bool(strategy.critic_layer_norm)
            self._build_all(run_spec)
        try:
            return run_online(
                self, envs, n_steps, strategy=strategy, names=OnlineNames(), start_fresh=start_fresh,
                batch_size=int(self.batch_size), buffer_size=int(self.buffer_size), offline_dataset=offline_dataset,
                eval_env=eval_env,
                eval_every=eval_every, eval_episodes=eval_episodes, callbacks=callbacks, log_every=int(self.log_every),
                log_dir=log_dir, checkpoint_path=checkpoint_path, checkpoint_every=checkpoint_every, resume=resume,
                progress=progress, seed=_seed_from(self.random_state), desc="SAC")
        finally:
            if not isinstance(env, (list, tuple)) and isinstance(env, str):
                for e in envs:
                    e.close()


def _env_name(env: Any) -> str:
    spec = getattr(env, "spec", None)
    return repr(spec.id) if spec is not None else type(env).__name__
