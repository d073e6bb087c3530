"""Behaviour cloning: imitate the logged actions.

Continuous actions: a deterministic tanh policy trained with MSE (as in
CORL/TD3+BC), or `policy="gaussian"` maximising log pi(a|s).  Discrete
actions: a softmax classifier trained with cross-entropy.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.nn import functional as F

from offrl.algos.base import OfflineAlgorithm, make_adam
from offrl.algos.params import choice
from offrl.algos.losses import mse_bc_loss
from offrl.datasets.core import Batch
from offrl.nn import MLP, DeterministicPolicy, TanhGaussianPolicy

__all__ = ["BC", "nll_bc_loss"]


def nll_bc_loss(log_prob: torch.Tensor) -> torch.Tensor:
    """Negative mean log-likelihood of the logged actions (the Gaussian policy's BC loss)."""
    return -log_prob.mean()


class BC(OfflineAlgorithm):
    """Behaviour cloning.

    Parameters follow CORL's BC: 256x256 ReLU MLP, Adam 3e-4, batch 256,
    normalised observations.
    """

    supports_discrete_actions = True
    required_labels = ("actions",)  # behaviour cloning needs no rewards
    _param_rules = {"policy": choice("deterministic", "gaussian")}

    def __init__(
        self,
        *,
        policy: str = "deterministic",
        hidden_dims: Sequence[int] = (256, 256),
        lr: float = 3e-4,
        batch_size: int = 256,
        n_steps: int = 1_000_000,
        normalize_observations: bool = True,
        precision: str = "fp32",
        compile: bool | str = False,
        log_every: int = 100,
        device: str = "auto",
        random_state: Any = None,
    ) -> None:
        self.policy = policy
        self.hidden_dims = hidden_dims
        self.lr = lr
        self.batch_size = batch_size
        self.n_steps = n_steps
        self.normalize_observations = normalize_observations
        self.precision = precision
        self.compile = compile
        self.log_every = log_every
        self.device = device
        self.random_state = random_state

    def _build(self, spec: dict[str, Any]) -> None:
        obs_dim, act_dim = spec["observation_dim"], spec["action_dim"]
        if spec.get("discrete_actions") is not None:
            self.policy_ = MLP(obs_dim, spec["discrete_actions"], self.hidden_dims)
        elif self.policy == "deterministic":
            self.policy_ = DeterministicPolicy(obs_dim, act_dim, self.hidden_dims, spec["action_low"], spec["action_high"])
        elif self.policy == "gaussian":
            self.policy_ = TanhGaussianPolicy(obs_dim, act_dim, self.hidden_dims, spec["action_low"], spec["action_high"])
        else:
            raise ValueError(f"policy must be 'deterministic' or 'gaussian', got {self.policy!r}")
        self.policy_.to(self.device_)
        self.optimizer_ = make_adam(self.policy_.parameters(), self.lr, self.device_)
        self._loss = self._maybe_compile(self._loss_eager)

    def _loss_eager(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            if self.spec_.get("discrete_actions") is not None:
                return F.cross_entropy(self.policy_(obs), actions[:, 0].long())
            if self.policy == "deterministic":
                return mse_bc_loss(self.policy_(obs)[0], actions)
            return nll_bc_loss(self.policy_.log_prob(obs, actions))

    def _update(self, batch: Batch, step: int) -> dict[str, torch.Tensor]:
        loss = self._loss(batch.observations, batch.actions)
        self.optimizer_.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer_.step()
        return {"bc_loss": loss.detach()}

    def _act(self, obs: torch.Tensor, deterministic: bool) -> torch.Tensor:
        if self.spec_.get("discrete_actions") is not None:
            logits = self.policy_(obs)
            if deterministic:
                return logits.argmax(-1, keepdim=True)
            return torch.multinomial(logits.softmax(-1), 1)
        return self.policy_(obs, deterministic=deterministic, with_log_prob=False)[0]

    def _export_actor(self) -> torch.nn.Module:
        if self.spec_.get("discrete_actions") is not None:
            return _ArgmaxActor(self.policy_)
        return super()._export_actor()


class _ArgmaxActor(torch.nn.Module):
    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs).argmax(-1)
