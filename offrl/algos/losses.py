"""Losses that more than one algorithm trains with, written once.

Each is the exact expression its algorithms used before they shared it (same
operations, same reduction order), so the shared version changes no bit of a
run.  Losses that belong to a single method (TD3+BC's lambda-scaled actor,
CQL's logsumexp gap, FQE's member-weighted Bellman error) stay in that
method's module.

The value losses of the implicit (in-sample) family sit together here.  Each
takes `diff = Q'(s, a) - V(s)` (per sample) and is minimised, over a constant
V, at a statistic of the Q-values: IQL's expectile, XQL's Gumbel
log-sum-exp, and dual RL's chi-square and total-variation optima
(docs/algorithms/dual.md derives each).  Dual RL (Sikchi et al., 2023) shows
that they are one objective, the dual over visitation distributions, under
different f-divergences, so `VALUE_LOSSES` maps the divergence to its loss:

    expectile:  |tau - 1(x < 0)| x^2                       (IQL)
    reverse KL: exp(z) - z - 1,  z = x / beta               (XQL, "kl" in f-DVL)
    chi-square: lam max(x + x^2 / 4, 0) - (1 - lam) x
    total var.: lam max(x, 0) - (1 - lam) x

`LearnedScale` is the module behind the learned multipliers these losses
train (SAC's temperature alpha, CQL's Lagrange multiplier alpha'): it stores
the log of the value as its parameter and returns the value when called.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["critic_td_loss", "huber_td_loss", "mse_bc_loss", "sac_actor_loss", "temperature_loss", "LearnedScale",
           "expectile_loss", "gumbel_loss", "chi_square_loss", "total_variation_loss", "VALUE_LOSSES", "value_loss",
           "awr_weights", "awr_actor_loss"]


def critic_td_loss(q: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Sum over the critics of the mean squared TD error: q (n_critics, batch), target (batch,).

    The TD part of every ensemble critic (TD3+BC, IQL, CQL, SAC): each member
    regresses on the same target, and summing keeps each member's gradient
    that of its own squared error.
    """
    return ((q - target) ** 2).mean(dim=1).sum()


def huber_td_loss(q: torch.Tensor, target: torch.Tensor, delta: float = 20.0) -> torch.Tensor:
    """Sum over the critics of the mean Huber error (quadratic within `delta`, linear beyond): XQL's critic loss,
    which keeps one large TD error (a Gumbel-sized value jump) from dominating the step."""
    return torch.nn.functional.huber_loss(q, target.expand_as(q), reduction="none", delta=delta).mean(dim=1).sum()


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


# ---------------------------------------------------------------------------------------------- value losses


def expectile_loss(diff: torch.Tensor, expectile: float) -> torch.Tensor:
    """E |tau - 1(diff < 0)| diff^2: an asymmetric L2 whose minimiser is the tau-expectile (IQL)."""
    weight = torch.where(diff > 0, expectile, 1.0 - expectile)
    return (weight * diff**2).mean()


def gumbel_loss(diff: torch.Tensor, beta: float, max_clip: float | None = 7.0) -> torch.Tensor:
    """Gumbel regression E[exp(z) - z - 1], z = diff / beta, computed so that it cannot overflow (XQL).

    Its minimiser over a constant V is the soft maximum beta log E exp(Q / beta).
    A naive exp(z) overflows float32 once z > 88 (a Q-value gap of 88 beta).
    Following the authors, z is clipped from above at `max_clip` and the loss
    is divided by exp(max(z_max, -1)) (not differentiated):
    exp(z - m) - z exp(-m) - exp(-m) has the same stationary point and its
    exponent never exceeds 0, so a batch with one huge gap takes a bounded step.
    """
    z, scale = _clipped_and_offset(diff / beta, max_clip)
    return (torch.exp(z - scale) - z * torch.exp(-scale) - torch.exp(-scale)).mean()


def _clipped_and_offset(z: torch.Tensor, max_clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """z clipped from above at `max_clip`, and the authors' offset a = max(z_max, -1) (not differentiated), by which
    both Gumbel losses shift their exponent so that it never exceeds 0."""
    if max_clip is not None:
        z = z.clamp(max=max_clip)
    return z, z.max().detach().clamp(min=-1.0)


def gumbel_log_loss(diff: torch.Tensor, beta: float, max_clip: float | None = 7.0) -> torch.Tensor:
    """The log of XQL's Gumbel loss, log(E[exp(z) - z - 1] + 1), z = diff / beta (the authors' `--log_loss`).

    Same minimiser as `gumbel_loss` (the soft maximum beta log E exp(Q / beta)); its gradient
    E[(exp(z) - 1) dz] / E[exp(z) - z] is the textbook Gumbel gradient divided by the loss + 1, an
    adaptive step size.  As the authors do, that gradient is computed analytically: the
    weights use z clipped at `max_clip` and offset by a = max(z_max, -1) (not
    differentiated), so nothing overflows, and multiply the unclipped z.  The returned
    value is log(E[exp(z) - z - 1] + 1) of the clipped z.
    """
    z = diff / beta
    clipped, offset = _clipped_and_offset(z, max_clip)
    shifted, floor = torch.exp(clipped - offset), torch.exp(-offset)  # e^(z - a), e^-a
    denominator = (shifted - clipped * floor).mean()  # e^-a (E[e^z - z])
    weight = ((shifted - floor) / denominator).detach()
    surrogate = (weight * z).mean()  # its gradient is the analytic one
    return surrogate - surrogate.detach() + (offset + torch.log(denominator)).detach()


def chi_square_loss(diff: torch.Tensor, lam: float, beta: float = 1.0) -> torch.Tensor:
    """f-DVL's chi-square value loss E[lam max(y + y^2/4, 0) - (1 - lam) y], y = diff / beta.

    y + y^2/4 is the convex conjugate of the chi-square generator; the max with
    0 is the paper's f_p* (the visitation ratio stays non-negative).  The
    loss grows only quadratically, where the Gumbel loss grows exponentially.
    """
    y = diff / beta
    return (lam * torch.clamp(y + y * y / 4.0, min=0.0) - (1.0 - lam) * y).mean()


def total_variation_loss(diff: torch.Tensor, lam: float, beta: float = 1.0) -> torch.Tensor:
    """f-DVL's total-variation value loss E[lam max(y, 0) - (1 - lam) y], y = diff / beta: a pinball loss whose
    minimiser is the (2 lam - 1) / lam quantile of the Q-values."""
    y = diff / beta
    return (lam * torch.clamp(y, min=0.0) - (1.0 - lam) * y).mean()


VALUE_LOSSES = ("expectile", "kl", "chi2", "tv")


def value_loss(divergence: str, diff: torch.Tensor, *, expectile: float = 0.7, lam: float = 0.7, beta: float = 1.0,
               max_clip: float | None = 7.0) -> torch.Tensor:
    """The implicit value loss of `divergence` ("expectile", "kl" = Gumbel, "chi2", "tv") on diff = Q' - V.

    `beta` and `max_clip` apply to "kl" only, `lam` to "chi2" and "tv", `expectile` to "expectile"."""
    if divergence == "expectile":
        return expectile_loss(diff, expectile)
    if divergence == "kl":
        return gumbel_loss(diff, beta, max_clip)
    if divergence == "chi2":  # the authors' chi-square and TV losses take the raw gap (beta is the Gumbel's)
        return chi_square_loss(diff, lam)
    if divergence == "tv":
        return total_variation_loss(diff, lam)
    raise ValueError(f"divergence must be one of {VALUE_LOSSES}, got {divergence!r}")


def awr_weights(advantage: torch.Tensor, beta: float | torch.Tensor, max_weight: float = 100.0) -> torch.Tensor:
    """AWR's sample weights min(exp(beta A), max_weight), A not differentiated.

    `beta` may be a per-sample tensor (GORL's guided temperature), differentiated by the guide's meta-gradient:
    the exponent is capped one above log(max_weight) first, so exp never overflows to inf (whose gradient times
    the clip's zero is NaN); the weights are the same numbers as min(exp(beta A), max_weight)."""
    exponent = (beta * advantage.detach()).clamp(max=math.log(max_weight) + 1.0)
    return torch.exp(exponent).clamp(max=max_weight)


def awr_actor_loss(advantage: torch.Tensor, log_prob: torch.Tensor, beta: float | torch.Tensor,
                   max_weight: float = 100.0) -> torch.Tensor:
    """Advantage-weighted regression: -E min(exp(beta A), max_weight) log pi(a|s), weights as `awr_weights`."""
    return -(awr_weights(advantage, beta, max_weight) * log_prob).mean()
