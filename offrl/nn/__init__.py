"""Networks shared by every algorithm: MLPs, batched ensembles and policies.

Ensembles (twin or N critics) are one module whose weights carry a leading
member dimension and run as one `torch.baddbmm`, never a Python list of
networks, so evaluating N critics costs one kernel call per layer.
"""

from __future__ import annotations

import contextlib
import math
import operator
from typing import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.autograd import forward_ad
from torch.nn import functional as F

__all__ = [
    "MLP",
    "EnsembleLinear",
    "EnsembleMLP",
    "QEnsemble",
    "ValueNetwork",
    "TanhGaussianPolicy",
    "GaussianPolicy",
    "DeterministicPolicy",
    "ACTIVATIONS",
    "soft_update_",
    "flush_denormals",
]

ACTIVATIONS = {"relu": nn.ReLU, "mish": nn.Mish, "tanh": nn.Tanh, "gelu": nn.GELU, "silu": nn.SiLU}


def _fp32_head(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, cast_input: bool = True
               ) -> torch.Tensor:
    """Apply the output layer in fp32, also under bf16/fp16 autocast.

    Hidden layers are where the FLOPs are; keeping the (tiny) output layer in
    fp32 keeps Q-values, means and log-stds -- and so every loss and TD
    target computed from them -- at full precision (a bf16 Q-value of 300
    would be quantised to steps of 2).  `cast_input=False` is for layers
    that take a low-precision input and cast it themselves.
    """
    if torch.is_autocast_enabled(x.device.type):
        with torch.autocast(x.device.type, enabled=False):
            return layer(x.float() if cast_input else x)
    return layer(x)


def _activation(name: str) -> type[nn.Module]:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is unknown; choose one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class MLP(nn.Sequential):
    """Linear -> [LayerNorm] -> act -> [Dropout] ... -> Linear."""

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        hidden_dims: Sequence[int] = (256, 256),
        activation: str = "relu",
        layer_norm: bool = False,
        dropout: float = 0.0,
    ) -> None:
        layers: list[nn.Module] = []
        last = in_dim
        for width in hidden_dims:
            layers.append(nn.Linear(last, width))
            if layer_norm:
                layers.append(nn.LayerNorm(width))
            layers.append(_activation(activation)())
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            last = width
        layers.append(nn.Linear(last, out_dim))
        super().__init__(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = len(self) - 1
        for i, layer in enumerate(self):
            x = _fp32_head(layer, x) if i == last else layer(x)
        return x


def _resolve_members(members: slice | int | torch.Tensor | None, n_members: int) -> slice | torch.Tensor | None:
    """Check a `members=` selection against `n_members` and return it in the form the layers index with.

    None stays None (every member); a slice stays the same slice (a view of
    the weights, as before); an int becomes a one-member slice, so the
    member dimension is kept; an index tensor becomes 1-D, in its order,
    repeats allowed (bootstrap-style subsets).  Checking a tensor's range
    reads one bool back from its device, once per network call.
    """
    if members is None:
        return None
    if isinstance(members, slice):
        if members.step is not None and members.step <= 0:
            raise ValueError(f"members={members} needs a positive step (tensors cannot be sliced backwards); "
                             "pass an index tensor such as torch.tensor([3, 1]) for another order")
        if len(range(n_members)[members]) == 0:
            raise ValueError(f"members={members} selects none of the {n_members} members; "
                             f"pass a slice inside range({n_members})")
        return members
    if isinstance(members, torch.Tensor):
        if members.dtype == torch.bool or members.is_floating_point() or members.is_complex():
            raise TypeError(f"members must be an integer index tensor, got dtype {members.dtype}; "
                            "for a boolean mask pass mask.nonzero().squeeze(1)")
        if members.dim() > 1:
            raise ValueError(f"members must be a 1-D index tensor, got shape {tuple(members.shape)}")
        index = members.reshape(-1)
        if index.numel() == 0:
            raise ValueError("members is an empty index tensor; select at least one member")
        out_of_range = (index < -n_members) | (index >= n_members)
        if bool(out_of_range.any()):
            bad = index[out_of_range].tolist()
            raise IndexError(f"members holds indices {bad} out of range for an ensemble of {n_members} members; "
                             f"indices must lie in [-{n_members}, {n_members - 1}]")
        return index
    if isinstance(members, bool) or not hasattr(type(members), "__index__"):  # ints and numpy ints pass
        raise TypeError(f"members must be a slice, an int or an integer index tensor, got {type(members).__name__}")
    members = operator.index(members)
    if not -n_members <= members < n_members:
        raise IndexError(f"members={members} is out of range for an ensemble of {n_members} members; "
                         f"pass an index in [-{n_members}, {n_members - 1}]")
    first = members % n_members
    return slice(first, first + 1)


def _n_selected(members: slice | torch.Tensor | None, n_members: int) -> int:
    """How many members a resolved selection evaluates."""
    if members is None:
        return n_members
    if isinstance(members, slice):
        return len(range(n_members)[members])
    return members.numel()


def _transforms_active() -> bool:
    """Whether forward-mode AD (a `dual_level`), a `torch.func` transform (vmap, jvp, grad, ...) or a
    TorchScript trace (policy export with a critic inside) is running.

    Under them the ensemble runs as plain `torch.baddbmm`, which every
    transform knows, instead of the hand-written narrow-head kernel.
    """
    return (forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active()
            or torch.jit.is_tracing())


class _NarrowEnsembleMatmul(torch.autograd.Function):
    """bias + x @ weight member by member with 2-D matmuls, for narrow outputs (Q-value heads).

    A batched matmul with one output column runs as a slow batched
    matrix-vector product on CPU (about 10x the time of the same work as
    2-D matmuls).  Inputs may be bf16 (under autocast) while weights, bias
    and the output stay fp32; the input's gradient comes back in its dtype.

    First-order backward writes into preallocated buffers.  Under
    `create_graph=True` (gradient penalties, second-order methods) it
    computes the same per-member products with differentiable ops, so double
    backward gets real gradients and the first-order values keep their bits.
    Forward-mode AD and functorch transforms never reach this function
    (`EnsembleLinear` runs `torch.baddbmm` under them), so it needs no `jvp`
    or `vmap` rule -- and so `torch.compile` traces it without a graph break,
    which a custom `jvp` would cause.
    """

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        out = torch.empty((x.shape[0], x.shape[1], weight.shape[-1]), dtype=weight.dtype, device=x.device)
        for i in range(x.shape[0]):
            torch.addmm(bias[i], x[i].to(weight.dtype), weight[i], out=out[i])
        return out

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
        x, weight, _ = inputs
        ctx.save_for_backward(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        low = grad.to(x.dtype)
        members = range(x.shape[0])
        if torch.is_grad_enabled():  # create_graph=True: build the gradient from differentiable ops
            grad_x = torch.stack([torch.mm(low[i], weight[i].t().to(x.dtype)) for i in members]) if need_x else None
            grad_w = torch.stack([torch.mm(x[i].t(), low[i]) for i in members]).to(weight.dtype) if need_w else None
        else:
            grad_x = torch.empty_like(x) if need_x else None
            grad_w = torch.empty_like(weight) if need_w else None
            for i in members:
                if grad_x is not None:
                    torch.mm(low[i], weight[i].t().to(x.dtype), out=grad_x[i])
                if grad_w is not None:
                    grad_w[i] = torch.mm(x[i].t(), low[i])
        return grad_x, grad_w, (grad.sum(1, keepdim=True) if need_b else None)


class EnsembleLinear(nn.Module):
    """`n_members` independent linear layers applied as one batched matmul.

    Input (n_members, batch, in_dim) -> output (n_members, batch, out_dim).
    Initialised like `nn.Linear` member by member.  Narrow layers (out_dim
    <= 8, e.g. Q-value heads) run member by member as 2-D matmuls, which is
    much faster on CPU than a batched matrix-vector product.  Under
    forward-mode AD and `torch.func` transforms (`vmap`, `jvp`, `grad`,
    `jacrev`) every layer runs as `torch.baddbmm`, which they transform
    natively; double backward (`create_graph=True`) works on both paths.
    """

    narrow: int = 8

    def __init__(self, n_members: int, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_members, in_dim, out_dim))
        self.bias = nn.Parameter(torch.empty(n_members, 1, out_dim))
        bound = 1.0 / math.sqrt(in_dim)
        # kaiming_uniform(a=sqrt(5)) on (out, in) equals U(-1/sqrt(in), 1/sqrt(in)).
        nn.init.uniform_(self.weight, -bound, bound)
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, members: slice | int | torch.Tensor | None = None) -> torch.Tensor:
        """`members` (a slice, an int or an index tensor) evaluates only those members, in that order.

        `x` then holds one row per selected member on its first dimension.
        """
        return self._forward_selected(x, _resolve_members(members, self.weight.shape[0]))

    def _forward_selected(self, x: torch.Tensor, members: slice | torch.Tensor | None) -> torch.Tensor:
        """`forward` with a selection already checked by `_resolve_members` (an ensemble checks it once)."""
        weight, bias = (self.weight, self.bias) if members is None else (self.weight[members], self.bias[members])
        if (weight.shape[-1] <= self.narrow and x.dim() == 3 and x.shape[0] == weight.shape[0]
                and not torch.is_autocast_enabled(x.device.type)):
            if not _transforms_active():
                return _NarrowEnsembleMatmul.apply(x.contiguous(), weight, bias)
            # The kernel casts a low-precision input itself; baddbmm needs it cast first.
            x = x.to(weight.dtype)
        return torch.baddbmm(bias, x, weight)


class _EnsembleLayerNorm(nn.Module):
    def __init__(self, n_members: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n_members, 1, width))
        self.bias = nn.Parameter(torch.zeros(n_members, 1, width))

    def forward(self, x: torch.Tensor, members: slice | int | torch.Tensor | None = None) -> torch.Tensor:
        """`members` as in `EnsembleLinear.forward`."""
        return self._forward_selected(x, _resolve_members(members, self.weight.shape[0]))

    def _forward_selected(self, x: torch.Tensor, members: slice | torch.Tensor | None) -> torch.Tensor:
        """`forward` with a selection already checked by `_resolve_members`."""
        if members is None:
            return F.layer_norm(x, x.shape[-1:]) * self.weight + self.bias
        return F.layer_norm(x, x.shape[-1:]) * self.weight[members] + self.bias[members]


class EnsembleMLP(nn.Module):
    """An ensemble of MLPs; input (batch, in) or (n_members, batch, in) -> (n_members, batch, out)."""

    def __init__(
        self,
        n_members: int,
        in_dim: int,
        out_dim: int,
        hidden_dims: Sequence[int] = (256, 256),
        activation: str = "relu",
        layer_norm: bool = False,
    ) -> None:
        super().__init__()
        self.n_members = n_members
        layers: list[nn.Module] = []
        last = in_dim
        for width in hidden_dims:
            layers.append(EnsembleLinear(n_members, last, width))
            if layer_norm:
                layers.append(_EnsembleLayerNorm(n_members, width))
            layers.append(_activation(activation)())
            last = width
        layers.append(EnsembleLinear(n_members, last, out_dim))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, members: slice | int | torch.Tensor | None = None) -> torch.Tensor:
        """`members` evaluates only those members, one output row each, in the order given.

        A slice (`slice(0, 1)`), an int (one member, dimension kept) or an
        index tensor (`torch.randperm(10)[:2]`, REDQ-style random subsets).
        A 3-D `x` then holds one row per selected member.
        """
        members = _resolve_members(members, self.n_members)
        n = _n_selected(members, self.n_members)
        if x.dim() == 2:
            x = x.unsqueeze(0).expand(n, -1, -1)
        elif x.dim() == 3 and x.shape[0] != n:
            raise ValueError(f"x has {x.shape[0]} rows on its member dimension but {n} members are evaluated; "
                             "pass (batch, in_dim) or (n_selected_members, batch, in_dim)")
        layers = self.layers
        last = len(layers) - 1
        for i, layer in enumerate(layers):
            if i == last:  # a narrow head (_NarrowEnsembleMatmul) casts its input member by member itself
                x = _fp32_head(lambda h: layer._forward_selected(h, members), x,
                               cast_input=layer.weight.shape[-1] > layer.narrow)
            elif isinstance(layer, (EnsembleLinear, _EnsembleLayerNorm)):
                x = layer._forward_selected(x, members)
            else:
                x = layer(x)
        return x


class QEnsemble(nn.Module):
    """N state-action critics in one module: Q(s, a) -> (n_critics, batch).

    `obs` and `actions` may carry any matching leading shape (e.g.
    (n_samples, batch, dim) for CQL's sampled actions); the result has
    shape (n_critics, *leading).
    """

    def __init__(
        self,
        observation_dim: int,
        action_dim: int,
        n_critics: int = 2,
        hidden_dims: Sequence[int] = (256, 256),
        activation: str = "relu",
        layer_norm: bool = False,
    ) -> None:
        super().__init__()
        self.n_critics = n_critics
        self.net = EnsembleMLP(n_critics, observation_dim + action_dim, 1, hidden_dims, activation, layer_norm)

    def forward(self, obs: torch.Tensor, actions: torch.Tensor,
                members: slice | int | torch.Tensor | None = None) -> torch.Tensor:
        """Q-values (n_selected, *leading); `members` as in `EnsembleMLP.forward` (e.g. 2 random of 10 critics)."""
        lead = obs.shape[:-1]
        x = torch.cat([obs, actions], dim=-1).reshape(-1, obs.shape[-1] + actions.shape[-1])
        return self.net(x, members).reshape(-1, *lead)


class ValueNetwork(nn.Module):
    """V(s) -> (batch,)."""

    def __init__(self, observation_dim: int, hidden_dims: Sequence[int] = (256, 256), activation: str = "relu",
                 layer_norm: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = MLP(observation_dim, 1, hidden_dims, activation, layer_norm, dropout)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs).squeeze(-1)


class _ScaledPolicy(nn.Module):
    """Holds the affine map from the network's [-1, 1] actions to the env's bounds."""

    def __init__(self, action_low: torch.Tensor | None, action_high: torch.Tensor | None, action_dim: int) -> None:
        super().__init__()
        low = -torch.ones(action_dim) if action_low is None else torch.as_tensor(action_low, dtype=torch.float32)
        high = torch.ones(action_dim) if action_high is None else torch.as_tensor(action_high, dtype=torch.float32)
        self.register_buffer("action_scale", (high - low) / 2)
        self.register_buffer("action_bias", (high + low) / 2)

    def to_env(self, unit_action: torch.Tensor) -> torch.Tensor:
        return unit_action * self.action_scale + self.action_bias

    def to_unit(self, action: torch.Tensor) -> torch.Tensor:
        return (action - self.action_bias) / self.action_scale

    def clamp_to_bounds(self, action: torch.Tensor) -> torch.Tensor:
        """`action` (in the env's units) clipped into the env's action box, e.g. after adding noise."""
        return torch.minimum(torch.maximum(action, self.action_bias - self.action_scale),
                             self.action_bias + self.action_scale)


class TanhGaussianPolicy(_ScaledPolicy):
    """SAC's policy: a = scale * tanh(u) + bias, u ~ N(mu(s), sigma(s)).

    Log-probabilities are of the action in env units (change of variables
    through tanh and the affine scale), so they are what a dataset records.
    """

    def __init__(
        self,
        observation_dim: int,
        action_dim: int,
        hidden_dims: Sequence[int] = (256, 256),
        action_low: torch.Tensor | None = None,
        action_high: torch.Tensor | None = None,
        log_std_min: float = -20.0,
        log_std_max: float = 2.0,
        activation: str = "relu",
    ) -> None:
        super().__init__(action_low, action_high, action_dim)
        self.log_std_min, self.log_std_max = log_std_min, log_std_max
        self.net = MLP(observation_dim, 2 * action_dim, hidden_dims, activation)

    def distribution_params(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, log_std = self.net(obs).chunk(2, dim=-1)
        return mean, log_std.clamp(self.log_std_min, self.log_std_max)

    def _squashed_log_prob(self, u: torch.Tensor, mean: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
        normal = -0.5 * ((u - mean) / log_std.exp()) ** 2 - log_std - 0.5 * math.log(2 * math.pi)
        # log(1 - tanh(u)^2) computed stably as 2 * (log 2 - u - softplus(-2u)).
        log_det = 2.0 * (math.log(2.0) - u - F.softplus(-2.0 * u))
        return (normal - log_det - torch.log(self.action_scale)).sum(-1)

    def forward(self, obs: torch.Tensor, deterministic: bool = False, with_log_prob: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Reparameterised sample (or the mean action) and its log-probability."""
        mean, log_std = self.distribution_params(obs)
        u = mean if deterministic else mean + log_std.exp() * torch.randn_like(mean)
        action = self.to_env(torch.tanh(u))
        return action, (self._squashed_log_prob(u, mean, log_std) if with_log_prob else None)

    def sample_from_params(self, mean: torch.Tensor, log_std: torch.Tensor, n_samples: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """`n_samples` reparameterised actions per row from `distribution_params` output.

        Returns actions (n_samples, *mean.shape) and log-probs (n_samples, *mean.shape[:-1]).
        One network pass serves many samples (CQL draws 10 actions per state).
        """
        noise = torch.randn((n_samples, *mean.shape), dtype=mean.dtype, device=mean.device)
        u = mean + log_std.exp() * noise
        return self.to_env(torch.tanh(u)), self._squashed_log_prob(u, mean, log_std)

    def log_prob(self, obs: torch.Tensor, actions: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        """log pi(a | s) of given env-unit actions."""
        mean, log_std = self.distribution_params(obs)
        unit = self.to_unit(actions).clamp(-1 + eps, 1 - eps)
        return self._squashed_log_prob(torch.atanh(unit), mean, log_std)


class GaussianPolicy(_ScaledPolicy):
    """IQL's policy: N(tanh(mu(s)), exp(log_std)) in unit action space, state-independent log-std."""

    def __init__(
        self,
        observation_dim: int,
        action_dim: int,
        hidden_dims: Sequence[int] = (256, 256),
        action_low: torch.Tensor | None = None,
        action_high: torch.Tensor | None = None,
        log_std_min: float = -5.0,
        log_std_max: float = 2.0,
        dropout: float = 0.0,
        activation: str = "relu",
    ) -> None:
        super().__init__(action_low, action_high, action_dim)
        self.log_std_min, self.log_std_max = log_std_min, log_std_max
        self.net = MLP(observation_dim, action_dim, hidden_dims, activation, dropout=dropout)
        self.log_std = nn.Parameter(torch.zeros(action_dim))

    def distribution_params(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = torch.tanh(self.net(obs))
        return mean, self.log_std.clamp(self.log_std_min, self.log_std_max).expand_as(mean)

    def log_prob(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        mean, log_std = self.distribution_params(obs)
        unit = self.to_unit(actions)
        normal = -0.5 * ((unit - mean) / log_std.exp()) ** 2 - log_std - 0.5 * math.log(2 * math.pi)
        return (normal - torch.log(self.action_scale)).sum(-1)

    def forward(self, obs: torch.Tensor, deterministic: bool = False, with_log_prob: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        mean, log_std = self.distribution_params(obs)
        unit = mean if deterministic else mean + log_std.exp() * torch.randn_like(mean)
        action = self.to_env(unit.clamp(-1.0, 1.0))
        if not with_log_prob:
            return action, None
        normal = -0.5 * ((unit - mean) / log_std.exp()) ** 2 - log_std - 0.5 * math.log(2 * math.pi)
        return action, (normal - torch.log(self.action_scale)).sum(-1)


class DeterministicPolicy(_ScaledPolicy):
    """TD3's actor: a = scale * tanh(f(s)) + bias."""

    def __init__(
        self,
        observation_dim: int,
        action_dim: int,
        hidden_dims: Sequence[int] = (256, 256),
        action_low: torch.Tensor | None = None,
        action_high: torch.Tensor | None = None,
        activation: str = "relu",
    ) -> None:
        super().__init__(action_low, action_high, action_dim)
        self.net = MLP(observation_dim, action_dim, hidden_dims, activation)

    def forward(self, obs: torch.Tensor, deterministic: bool = True, with_log_prob: bool = False
                ) -> tuple[torch.Tensor, None]:
        return self.to_env(torch.tanh(self.net(obs))), None


_flush_depth = 0


@contextlib.contextmanager
def flush_denormals() -> Iterator[None]:
    """Flush float32 denormals to zero on the CPU while the block runs (nested blocks allowed; off again after).

    L2 weight decay drives the weights of dead units below float32's smallest normal (1.2e-38); CPU matmuls
    with a fraction of a percent of such weights run several times slower (MBRCSL's 1024-wide policy 3.2x,
    a labeller's 256-wide reward model 2.4x in training and 10x in prediction).  Values that small change no
    result that matters.  torch cannot report the current setting, so the outermost block leaves flushing off
    even if the caller had turned it on.
    """
    global _flush_depth
    flushing = torch.set_flush_denormal(True)
    _flush_depth += 1
    try:
        yield
    finally:
        _flush_depth -= 1
        if flushing and _flush_depth == 0:
            torch.set_flush_denormal(False)


@torch.no_grad()
def soft_update_(target: nn.Module, source: nn.Module, tau: float) -> None:
    """Polyak averaging target <- (1 - tau) * target + tau * source, as one foreach kernel."""
    target_params = list(target.parameters())
    torch._foreach_lerp_(target_params, list(source.parameters()), tau)
