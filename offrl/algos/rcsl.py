"""Return-conditioned supervised learning: RvS (Emmons et al., 2022) and Decision Transformer (Chen et al., 2021).

Both regress the logged action on the state and a command omega computed from
the logged episode's future, and act by asking for a target return:

    RvS:  pi(a | s, omega),  omega = G_t (`"rtg"`), the average reward to go
          G_t / (H - t) * H (`"avg_rtg"`, RvS's choice, in whole-episode units) or
          (G_t, (L - t) / H) (`"udrl"`, upside-down RL's desired return and horizon);
    DT:   a causal transformer over (G_t, s_t, a_t) tokens of the last K steps,
          a_t read from the s_t token.

G_t is the undiscounted return from step t to its episode's end, L the
episode's length and H the dataset's longest episode.  Returns enter the
networks times `return_scale` (DT's 1/1000).  When acting, the return still to
get starts at the target and loses each observed reward (DT, and RvS's "rtg");
RvS's average target stays fixed for the episode, as in the RvS code.  A target
left unset is the dataset's best complete episode return (`spec_["target_return"]`,
see `best_complete_episode`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from offrl.algos.base import OfflineAlgorithm, make_adam
from offrl.algos.bc import nll_bc_loss
from offrl.algos.losses import mse_bc_loss
from offrl.algos.params import choice, integer, real
from offrl.datasets.core import Batch, Dataset
from offrl.datasets.samplers import SegmentBatch, SegmentSampler
from offrl.evaluation import Actor
from offrl.nn import MLP, DeterministicPolicy, GaussianPolicy, _fp32_head, _ScaledPolicy

__all__ = ["RvS", "DecisionTransformer", "rvs_commands", "masked_action_loss", "best_complete_episode", "target_spec",
           "CONDITIONINGS"]

CONDITIONINGS = ("rtg", "avg_rtg", "udrl")
_SCALE = real(0, None, closed="neither")
_DROPOUT = real(0, 1, closed="left")


def rvs_commands(dataset: Dataset, conditioning: str, return_scale: float, horizon: int) -> np.ndarray:
    """The command of every logged transition, (N, 1) or (N, 2) float32.

    "rtg": G_t * scale; "avg_rtg": G_t / (H - t) * H * scale (RvS's average
    reward to go, in the units of a whole episode's return); "udrl":
    (G_t * scale, (L - t) / H).  H is `horizon` (RvS: the longest episode).
    The average divides by H - t even for an episode that ended early (a
    fall), as RvS's `reward_to_go` does, so such an episode's rows carry a
    lower command than its own per-step rewards would give.
    """
    if conditioning not in CONDITIONINGS:
        raise ValueError(f"conditioning must be one of {CONDITIONINGS}, got {conditioning!r}")
    rtg = dataset.returns_to_go().astype(np.float64)
    t = dataset.timesteps().astype(np.float64)
    if conditioning == "rtg":
        columns = [rtg * return_scale]
    elif conditioning == "avg_rtg":
        columns = [rtg / (horizon - t) * horizon * return_scale]
    else:
        length = np.repeat(dataset.episode_lengths(), dataset.episode_lengths()).astype(np.float64)
        columns = [rtg * return_scale, (length - t) / horizon]
    return np.stack(columns, axis=1).astype(np.float32)


def masked_action_loss(predicted: torch.Tensor, actions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean squared action error over the real (mask True) steps of (B, K, act_dim) windows; padding counts zero."""
    squared = torch.where(mask.unsqueeze(-1), (predicted.float() - actions) ** 2, 0.0)
    return squared.sum() / (mask.sum() * actions.shape[-1]).clamp(min=1)


@contextlib.contextmanager
def _inference(algo: OfflineAlgorithm) -> Iterator[None]:
    """No gradients and evaluation behaviour (no dropout) for the duration."""
    algo._set_training_mode(False)
    try:
        with torch.no_grad():
            yield
    finally:
        algo._set_training_mode(True)


def best_complete_episode(dataset: Dataset) -> int:
    """Index of the best-return episode among the complete ones: those that terminated or ran the longest length.

    A log cut short (the last, partial episode of each collecting environment, or a user's window) has a return
    that does not compare with whole episodes: with negative rewards (Pendulum's costs) a 50-step cut of a
    200-step task "beats" every whole episode.  Targets and thresholds read from the best episode therefore
    skip such cuts; when no episode is complete, every episode counts.
    """
    returns, lengths = dataset.episode_returns(), dataset.episode_lengths()
    ends = np.asarray(dataset.episode_starts[1:]) - 1
    complete = (dataset.terminals[ends] > 0) | (lengths == lengths.max())
    candidates = np.flatnonzero(complete) if complete.any() else np.arange(len(returns))
    return int(candidates[np.argmax(returns[candidates])])


def target_spec(dataset: Dataset) -> dict[str, Any]:
    """The default command read from `dataset`: its best complete episode's return and length, and its horizon."""
    best = best_complete_episode(dataset)
    return {"target_return": float(dataset.episode_returns()[best]),
            "target_horizon": int(dataset.episode_lengths()[best]),
            "horizon": int(dataset.episode_lengths().max())}


class _ReturnConditioned(OfflineAlgorithm):
    """What RvS and DT share: the dataset's target return in `spec_` and the `target_return` acting option."""

    _predict_options = ("target_return",)

    def _make_spec(self, dataset: Dataset) -> dict[str, Any]:
        return super()._make_spec(dataset) | target_spec(dataset)

    def _targets(self, target_return: Any, n: int) -> np.ndarray:
        """(n,) float64 targets from None (the dataset's best return), a number or one per row."""
        value = self.spec_["target_return"] if target_return is None else target_return
        try:
            targets = np.broadcast_to(np.asarray(value, np.float64), (n,)).copy()
        except (ValueError, TypeError):
            raise ValueError(f"target_return must be a number or one per observation ({n}), got {value!r}") from None
        if not np.all(np.isfinite(targets)):
            raise ValueError(f"target_return must be finite, got {value!r}")
        return targets

    def _obs(self, observations: Any) -> torch.Tensor:
        return self.obs_normalizer_(self._as_obs_tensor(observations)[0])


class _ReturnActor(Actor):
    """Per env: the return still to get, from the target down by each observed reward."""

    def __init__(self, algo: _ReturnConditioned, deterministic: bool, target_return: Any) -> None:
        algo._check_fitted()
        self.algo, self.deterministic, self.target_return = algo, bool(deterministic), target_return
        self.reset(max(int(np.size(target_return)), 1) if target_return is not None else 1)  # checks the target

    def reset(self, n_envs: int) -> None:
        self.targets = self.algo._targets(self.target_return, n_envs)
        self.remaining = self.targets.copy()

    def _check_envs(self, observations: np.ndarray) -> None:
        if len(observations) != len(self.remaining):
            raise ValueError(f"the actor was reset for {len(self.remaining)} envs but got {len(observations)} "
                             "observations; call reset(n_envs) first")

    def observe(self, rewards: np.ndarray, episode_over: np.ndarray) -> None:
        self.remaining -= np.asarray(rewards, np.float64).reshape(-1)
        over = np.asarray(episode_over, bool).reshape(-1)
        self.remaining[over] = self.targets[over]


# ---------------------------------------------------------------------------------------------- RvS


class RvS(_ReturnConditioned):
    """RvS-R: an MLP policy on (normalised state, command), fitted to the logged actions.

    Defaults are the RvS code's (scottemmons/rvs, `policies.RvS` and
    experiments/config/d4rl/gym_rvs_r.cfg): 2x1024 ReLU, Adam 1e-3 held
    constant, the average reward to go, a Gaussian with a state-independent
    std fitted by negative log-likelihood (`policy="gaussian"`; its mean is
    the deterministic action), no dropout for the D4RL gym tasks (the class
    default there is 0.1).  Departures: batch 256 (the class default; the gym
    config's 16384 is a choice of `batch_size`), the Gaussian's mean is
    tanh-squashed in [-1, 1] action units (offrl's `GaussianPolicy`), and
    observations are normalised and returns scaled by `return_scale`, where
    RvS feeds both raw.  `policy="deterministic"` fits a tanh policy by MSE
    in [-1, 1] action units instead.
    """

    _param_rules = {"conditioning": choice(*CONDITIONINGS), "policy": choice("gaussian", "deterministic"),
                    "return_scale": _SCALE, "dropout": _DROPOUT}
    _predict_options = ("target_return", "target_horizon")

    def __init__(
        self,
        *,
        conditioning: str = "avg_rtg",
        policy: str = "gaussian",
        return_scale: float = 1e-3,
        hidden_dims: Sequence[int] = (1024, 1024),
        dropout: float = 0.0,
        lr: float = 1e-3,
        batch_size: int = 256,
        n_steps: int = 1_000_000,
        normalize_observations: bool = True,
        precision: str = "fp32",
        compile: bool | str = False,
        log_every: int = 100,
        device: str = "auto",
        random_state: Any = None,
    ) -> None:
        self.conditioning = conditioning
        self.policy = policy
        self.return_scale = return_scale
        self.hidden_dims = hidden_dims
        self.dropout = dropout
        self.lr = lr
        self.batch_size = batch_size
        self.n_steps = n_steps
        self.normalize_observations = normalize_observations
        self.precision = precision
        self.compile = compile
        self.log_every = log_every
        self.device = device
        self.random_state = random_state

    @property
    def _command_dim(self) -> int:
        return 2 if self.conditioning == "udrl" else 1

    def _build(self, spec: dict[str, Any]) -> None:
        obs_dim, act_dim, hidden = spec["observation_dim"], spec["action_dim"], tuple(self.hidden_dims)
        in_dim = obs_dim + self._command_dim
        if self.policy == "gaussian":
            self.policy_ = GaussianPolicy(in_dim, act_dim, hidden, spec["action_low"], spec["action_high"],
                                          dropout=self.dropout)
        else:
            self.policy_ = DeterministicPolicy(in_dim, act_dim, hidden, spec["action_low"], spec["action_high"])
            if self.dropout > 0:
                self.policy_.net = MLP(in_dim, act_dim, hidden, dropout=self.dropout)
        self.policy_.to(self.device_)
        self.optimizer_ = make_adam(self.policy_.parameters(), self.lr, self.device_)
        self._loss = self._maybe_compile(self._loss_eager)

    def _extra_columns(self, dataset: Dataset) -> dict[str, np.ndarray]:
        return {"commands": rvs_commands(dataset, self.conditioning, self.return_scale, self.spec_["horizon"])}

    def _loss_eager(self, obs: torch.Tensor, commands: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            inputs = torch.cat([obs, commands], dim=-1)
            if self.policy == "gaussian":
                return nll_bc_loss(self.policy_.log_prob(inputs, actions))
            return mse_bc_loss(self.policy_.to_unit(self.policy_(inputs)[0]), self.policy_.to_unit(actions))

    def _update(self, batch: Batch, step: int) -> dict[str, torch.Tensor]:
        loss = self._loss(batch.observations, batch.extras["commands"], batch.actions)
        self.optimizer_.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer_.step()
        return {"bc_loss": loss.detach()}

    # ------------------------------------------------------------------ acting
    def _commands(self, remaining: np.ndarray, targets: np.ndarray, timesteps: np.ndarray,
                  target_horizon: Any = None) -> torch.Tensor:
        """Commands (n, command_dim) at steps `timesteps` with `remaining` of the `targets` still to get."""
        if target_horizon is not None and self.conditioning != "udrl":
            raise ValueError(f"target_horizon is a command of conditioning='udrl' only; this RvS uses "
                             f"{self.conditioning!r}")
        scale = float(self.return_scale)
        if self.conditioning == "avg_rtg":  # the target average reward per step, fixed for the episode
            columns = [targets * scale]
        else:
            columns = [remaining * scale]
        if self.conditioning == "udrl":
            horizon = self.spec_["target_horizon"] if target_horizon is None else float(target_horizon)
            if not (math.isfinite(horizon) and horizon >= 1):
                raise ValueError(f"target_horizon must be a number of steps >= 1, got {target_horizon!r}")
            columns.append(np.maximum(horizon - np.asarray(timesteps, np.float64), 1.0) / self.spec_["horizon"])
        return torch.as_tensor(np.stack(columns, axis=1), dtype=torch.float32, device=self.device_)

    def _policy_actions(self, obs: torch.Tensor, commands: torch.Tensor, deterministic: bool) -> torch.Tensor:
        inputs = torch.cat([obs, commands], dim=-1)
        return self.policy_(inputs, deterministic=deterministic, with_log_prob=False)[0]

    def _act(self, obs: torch.Tensor, deterministic: bool, target_return: Any = None,
             target_horizon: Any = None) -> torch.Tensor:
        targets = self._targets(target_return, len(obs))
        commands = self._commands(targets, targets, np.zeros(len(obs)), target_horizon)
        return self._policy_actions(obs, commands, deterministic)

    def make_actor(self, deterministic: bool = True, target_return: Any = None, target_horizon: Any = None) -> Actor:
        """An Actor conditioned on `target_return` (default: the dataset's best episode return); with "udrl" the
        desired horizon starts at `target_horizon` (default: that episode's length) and counts down."""
        self._check_fitted()
        if target_horizon is not None:
            self._commands(np.zeros(1), np.zeros(1), np.zeros(1), target_horizon)  # refuse a bad horizon now
        return _RvSActor(self, deterministic, target_return, target_horizon)

    def _export_actor(self, target_return: Any = None, target_horizon: Any = None) -> nn.Module:
        """obs -> action with the command of an episode's first step fixed (RvS's "avg_rtg" acts with it all along)."""
        targets = self._targets(target_return, 1)
        return _FixedCommandActor(self.policy_, self._commands(targets, targets, np.zeros(1), target_horizon))


class _RvSActor(_ReturnActor):
    def __init__(self, algo: RvS, deterministic: bool, target_return: Any, target_horizon: Any) -> None:
        self.target_horizon = target_horizon
        super().__init__(algo, deterministic, target_return)

    def act(self, observations: np.ndarray, timesteps: np.ndarray) -> np.ndarray:
        algo = self.algo
        self._check_envs(observations)
        with _inference(algo):
            obs = algo._obs(observations)
            commands = algo._commands(self.remaining, self.targets, timesteps, self.target_horizon)
            return algo._policy_actions(obs, commands, self.deterministic).float().cpu().numpy()


class _FixedCommandActor(nn.Module):
    def __init__(self, policy: nn.Module, command: torch.Tensor) -> None:
        super().__init__()
        self.policy = policy
        self.register_buffer("command", command.reshape(1, -1).float())

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        inputs = torch.cat([obs, self.command.expand(obs.shape[0], -1)], dim=-1)
        return self.policy(inputs, deterministic=True, with_log_prob=False)[0]


# ---------------------------------------------------------------------------------------------- Decision Transformer


class _Block(nn.Module):
    """A GPT-2 block (pre-LN): x + attn(LN(x)), then x + MLP(LN(x)); ReLU MLP of width 4d as the DT code's."""

    def __init__(self, dim: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads, self.dropout = n_heads, dropout
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, n, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.resid_dropout(self.proj(y.transpose(1, 2).reshape(b, n, d)))
        return x + self.resid_dropout(self.out(F.relu(self.fc(self.ln_2(x)))))


class DecisionTransformerNetwork(_ScaledPolicy):
    """DT's model: (return, state, action) tokens per step plus a learned timestep embedding (no positions),
    LayerNorm, GPT-2 blocks, a final LayerNorm and tanh actions in [-1, 1] units from each state token."""

    def __init__(self, observation_dim: int, action_dim: int, embed_dim: int, n_layers: int, n_heads: int,
                 dropout: float, max_ep_len: int, action_low: Any = None, action_high: Any = None) -> None:
        super().__init__(action_low, action_high, action_dim)
        self.max_ep_len = int(max_ep_len)
        self.embed_timestep = nn.Embedding(self.max_ep_len, embed_dim)
        self.embed_return = nn.Linear(1, embed_dim)
        self.embed_state = nn.Linear(observation_dim, embed_dim)
        self.embed_action = nn.Linear(action_dim, embed_dim)
        self.embed_ln = nn.LayerNorm(embed_dim)
        self.embed_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block(embed_dim, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(embed_dim)
        self.predict_action = nn.Linear(embed_dim, action_dim)
        for block in self.blocks:  # GPT-2's initialisation of the transformer (the embeddings keep torch's)
            for name, layer in block.named_children():
                if isinstance(layer, nn.Linear):
                    std = 0.02 / math.sqrt(2 * n_layers) if name in ("proj", "out") else 0.02
                    nn.init.normal_(layer.weight, 0.0, std)
                    nn.init.zeros_(layer.bias)

    def forward(self, observations: torch.Tensor, unit_actions: torch.Tensor, returns_to_go: torch.Tensor,
                timesteps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Unit actions (B, K, act_dim) predicted at every step of (B, K) windows; `mask` False marks padding."""
        b, k = mask.shape
        time = self.embed_timestep(timesteps.long().clamp(0, self.max_ep_len - 1))
        tokens = torch.stack([self.embed_return(returns_to_go.unsqueeze(-1)) + time,
                              self.embed_state(observations) + time,
                              self.embed_action(unit_actions) + time], dim=2).reshape(b, 3 * k, -1)
        x = self.embed_dropout(self.embed_ln(tokens))
        n = 3 * k
        # Causal, no padded key, and each token always sees itself (so a padded row is never all -inf, i.e. NaN).
        causal = torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()
        keys = mask.repeat_interleave(3, dim=1)[:, None, None, :]
        attend = causal & (keys | torch.eye(n, dtype=torch.bool, device=mask.device))
        for block in self.blocks:
            x = block(x, attend)
        states = self.ln_f(x).view(b, k, 3, -1)[:, :, 1]
        return torch.tanh(_fp32_head(self.predict_action, states))


def _make_adamw(params: Any, lr: float, weight_decay: float) -> torch.optim.AdamW:
    params = list(params)
    with contextlib.suppress(RuntimeError, TypeError, ValueError):  # fused where this torch has it on the device
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=True)


class DecisionTransformer(_ReturnConditioned):
    """Decision Transformer on windows of `context_length` steps, left-padded so the newest step is last.

    Defaults are the official gym code's (kzl/decision-transformer,
    gym/experiment.py): K = 20, 128-d, 3 layers, 1 head, ReLU, dropout 0.1,
    AdamW 1e-4 with weight decay 1e-4 and a linear warm-up over 10,000 steps,
    gradient norm clipped at 0.25 (SequenceTrainer), batch 64, returns scaled
    by 1/1000, max_ep_len 1000 (timesteps beyond it use the last embedding),
    100k steps (10 x 10,000) and normalised observations.  One departure:
    actions are embedded and regressed in [-1, 1] units of the action bounds
    (the same as the official code on [-1, 1] action spaces).  The blocks are
    GPT-2's pre-LN ones with `scaled_dot_product_attention`; padded steps are
    masked out of attention and out of the loss.
    """

    _param_rules = {
        "context_length": integer(1), "embed_dim": integer(1), "n_layers": integer(1), "n_heads": integer(1),
        "dropout": _DROPOUT, "weight_decay": real(0, None), "warmup_steps": integer(1),
        "grad_clip": real(0, None, closed="neither", none=True), "return_scale": _SCALE, "max_ep_len": integer(1),
    }

    def __init__(
        self,
        *,
        context_length: int = 20,
        embed_dim: int = 128,
        n_layers: int = 3,
        n_heads: int = 1,
        dropout: float = 0.1,
        lr: float = 1e-4,
        weight_decay: float = 1e-4,
        warmup_steps: int = 10_000,
        grad_clip: float | None = 0.25,
        batch_size: int = 64,
        return_scale: float = 1e-3,
        max_ep_len: int = 1000,
        n_steps: int = 100_000,
        normalize_observations: bool = True,
        precision: str = "fp32",
        compile: bool | str = False,
        log_every: int = 100,
        device: str = "auto",
        random_state: Any = None,
    ) -> None:
        self.context_length = context_length
        self.embed_dim = embed_dim
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.dropout = dropout
        self.lr = lr
        self.weight_decay = weight_decay
        self.warmup_steps = warmup_steps
        self.grad_clip = grad_clip
        self.batch_size = batch_size
        self.return_scale = return_scale
        self.max_ep_len = max_ep_len
        self.n_steps = n_steps
        self.normalize_observations = normalize_observations
        self.precision = precision
        self.compile = compile
        self.log_every = log_every
        self.device = device
        self.random_state = random_state

    def _build(self, spec: dict[str, Any]) -> None:
        if self.embed_dim % self.n_heads:
            raise ValueError(f"embed_dim ({self.embed_dim}) must be a multiple of n_heads ({self.n_heads})")
        self.policy_ = DecisionTransformerNetwork(
            spec["observation_dim"], spec["action_dim"], self.embed_dim, self.n_layers, self.n_heads, self.dropout,
            self.max_ep_len, spec["action_low"], spec["action_high"]).to(self.device_)
        self.optimizer_ = _make_adamw(self.policy_.parameters(), self.lr, self.weight_decay)
        self._loss = self._maybe_compile(self._loss_eager)

    def _make_sampler(self, dataset: Dataset) -> SegmentSampler:
        device = self.device_
        with torch.no_grad():
            columns = {
                "observations": self.obs_normalizer_(torch.from_numpy(dataset.observations).to(device)),
                "actions": torch.from_numpy(dataset.actions).to(device),
                "returns_to_go": torch.from_numpy(dataset.returns_to_go() * np.float32(self.return_scale)).to(device),
            }
        return SegmentSampler(columns, dataset.episode_starts, self.batch_size, self.context_length, padding="left")

    def _loss_eager(self, observations: torch.Tensor, actions: torch.Tensor, returns_to_go: torch.Tensor,
                    timesteps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The masked action MSE of (B, K) windows (normalised observations, scaled returns to go)."""
        with self._autocast():
            unit_actions = self.policy_.to_unit(actions)
            predicted = self.policy_(observations, unit_actions, returns_to_go, timesteps, mask)
            return masked_action_loss(predicted, unit_actions, mask)

    def _update(self, batch: SegmentBatch, step: int) -> dict[str, torch.Tensor]:
        lr = self.lr * min((step + 1) / self.warmup_steps, 1.0)  # the official LambdaLR warm-up
        for group in self.optimizer_.param_groups:
            group["lr"] = lr
        loss = self._loss(batch.observations, batch.actions, batch.returns_to_go, batch.timesteps, batch.mask)
        self.optimizer_.zero_grad(set_to_none=True)
        loss.backward()
        if self.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.policy_.parameters(), self.grad_clip)
        self.optimizer_.step()
        return {"action_loss": loss.detach()}

    # ------------------------------------------------------------------ acting
    def _act(self, obs: torch.Tensor, deterministic: bool, target_return: Any = None) -> torch.Tensor:
        """The first step of an episode: a context of one (target, observation) pair at timestep 0."""
        n = len(obs)
        rtg = torch.as_tensor(self._targets(target_return, n) * self.return_scale, dtype=torch.float32,
                              device=obs.device)
        zeros = torch.zeros(n, 1, self.spec_["action_dim"], device=obs.device)
        steps = torch.zeros(n, 1, dtype=torch.long, device=obs.device)
        mask = torch.ones(n, 1, dtype=torch.bool, device=obs.device)
        with self._autocast():
            unit = self.policy_(obs[:, None], zeros, rtg[:, None], steps, mask)[:, -1]
        return self.policy_.to_env(unit.float())

    def make_actor(self, deterministic: bool = True, target_return: Any = None) -> Actor:
        """An Actor that keeps each env's last `context_length` (return to go, observation, action, timestep)."""
        return _DTActor(self, deterministic, target_return)

    def _export_actor(self, **options: Any) -> nn.Module:
        # A ValueError (not NotImplementedError) so that the CLI's `offrl export` reports it in one line.
        raise ValueError(
            "DecisionTransformer acts on the last context_length steps of (return to go, observation, action), "
            "which a stateless observation -> action module cannot carry; save the model (save / offrl.load) and act "
            "through make_actor() instead")


class _DTActor(_ReturnActor):
    """Rolling left-padded windows, one per env; an env whose episode ended starts again from an empty context."""

    def reset(self, n_envs: int) -> None:
        super().reset(n_envs)
        algo, device = self.algo, self.algo.device_
        k, spec = algo.context_length, algo.spec_
        self.observations = torch.zeros(n_envs, k, spec["observation_dim"], device=device)
        self.unit_actions = torch.zeros(n_envs, k, spec["action_dim"], device=device)
        self.returns_to_go = torch.zeros(n_envs, k, device=device)
        self.timesteps = torch.zeros(n_envs, k, dtype=torch.long, device=device)
        self.context_lengths = np.zeros(n_envs, np.int64)

    def act(self, observations: np.ndarray, timesteps: np.ndarray) -> np.ndarray:
        algo = self.algo
        k = algo.context_length
        self._check_envs(observations)
        with _inference(algo):
            obs = algo._obs(observations)
            device = obs.device
            rtg = torch.as_tensor(self.remaining * algo.return_scale, dtype=torch.float32, device=device)
            steps = torch.as_tensor(np.asarray(timesteps).reshape(-1), dtype=torch.long, device=device)

            def push(window: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
                return torch.cat([window[:, 1:], new[:, None]], dim=1)

            self.observations = push(self.observations, obs)
            self.unit_actions = push(self.unit_actions, torch.zeros_like(self.unit_actions[:, 0]))
            self.returns_to_go = push(self.returns_to_go, rtg)
            self.timesteps = push(self.timesteps, steps)
            self.context_lengths = np.minimum(self.context_lengths + 1, k)
            lengths = torch.as_tensor(self.context_lengths, device=device)
            mask = torch.arange(k, device=device) >= (k - lengths)[:, None]
            with algo._autocast():
                unit = algo.policy_(self.observations, self.unit_actions, self.returns_to_go, self.timesteps,
                                    mask)[:, -1].float()
            self.unit_actions[:, -1] = unit
            return algo.policy_.to_env(unit).cpu().numpy()

    def observe(self, rewards: np.ndarray, episode_over: np.ndarray) -> None:
        super().observe(rewards, episode_over)
        over = np.asarray(episode_over, bool).reshape(-1)
        self.context_lengths[over] = 0
