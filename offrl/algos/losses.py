"""Losses that more than one algorithm trains with, written once.

Each is the exact expression its algorithms used before they shared it (same
operations, same reduction order), so the shared version changes no bit of a
run.  Losses that belong to a single method (IQL's expectile, TD3+BC's
lambda-scaled actor, CQL's logsumexp gap, FQE's member-weighted Bellman
error) stay in that method's module.

`LearnedScale` is the module behind the learned multipliers these losses
train (SAC's temperature alpha, CQL's Lagrange multiplier alpha'): it stores
the log of the value as its parameter and returns the value when called.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["critic_td_loss", "mse_bc_loss", "sac_actor_loss", "temperature_loss", "LearnedScale"]


def critic_td_loss(q: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Sum over the critics of the mean squared TD error: q (n_critics, batch), target (batch,).

    The TD part of every ensemble critic (TD3+BC, IQL, CQL, SAC): each member
    regresses on the same target, and summing keeps each member's gradient
    that of its own squared error.
    """
    return ((q - target) ** 2).mean(dim=1).sum()


def mse_bc_loss(predicted: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """Mean squared error to the logged actions (BC's deterministic policy, TD3+BC's BC term)."""
    return ((predicted - actions) ** 2).mean()


def sac_actor_loss(log_prob: torch.Tensor, q: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """E [alpha log pi(a|s) - Q(s, a)] with a ~ pi(s) reparameterised (alpha passed detached).

    With `q = log pi(a_data | s)` it is the entropy-regularised behaviour
    cloning loss CQL's first `bc_steps` train the actor with.
    """
    return (alpha * log_prob - q).mean()


def temperature_loss(log_alpha: torch.Tensor, log_prob: torch.Tensor, target_entropy: float) -> torch.Tensor:
    """SAC's automatic entropy tuning, -E log alpha (log pi(a|s) + target entropy), in the log-alpha
    parameterisation (the gradient reaches `log_alpha` only)."""
    return -(log_alpha * (log_prob.detach() + target_entropy)).mean()


class LearnedScale(nn.Module):
    """A positive learned multiplier: `log_value` is the parameter, calling the module returns exp(log_value).

    A module rather than a bare tensor so model files and checkpoints keep it
    with the networks.
    """

    def __init__(self, init_value: float) -> None:
        super().__init__()
        if not init_value > 0:
            raise ValueError(f"init_value must be positive (the parameter is its log), got {init_value}")
        self.log_value = nn.Parameter(torch.tensor(math.log(init_value), dtype=torch.float32))

    def forward(self) -> torch.Tensor:
        return self.log_value.exp()
