"""The generative core of the diffusion and flow policies (Diffusion-QL, EDP, FQL, OFQL).

Every model here generates an action conditioned on an observation, and
every source of randomness is a `torch.Generator` argument, so an estimator
seeded by its `random_state` samples the same actions on every run.

- `sinusoidal_embedding` / `ConditionalMLP`: the denoiser or velocity
  network a(s, x, t[, r]): observation, noisy action and one or two times.
- `VPSchedule`: the variance-preserving DDPM schedule of Diffusion-QL,
  epsilon prediction, `q_sample`, and the DDPM and DDIM samplers.
- Flow matching (FQL's convention: x_t = (1 - t) z + t a, velocity a - z,
  t = 0 is noise): `flow_matching_loss`, `euler_sample`, `midpoint_sample`.
- Average velocity (MeanFlow, OFQL's convention: a_t = (1 - t) a + t eps,
  v = eps - a, t = 1 is noise): u(a_t, r, t) is the mean velocity over
  [r, t], learnt towards u_tgt = v - (t - r)(v . d_a u + d_t u), the total
  derivative by one `torch.func.jvp`; one network evaluation gives an action,
  a = eps - u(eps, 0, 1).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from offrl.nn import MLP, _activation, _ScaledPolicy

__all__ = [
    "sinusoidal_embedding",
    "ConditionalMLP",
    "VPSchedule",
    "flow_matching_loss",
    "euler_sample",
    "midpoint_sample",
    "meanflow_target",
    "meanflow_loss",
    "meanflow_path",
    "meanflow_sample",
    "DiffusionPolicy",
    "FlowPolicy",
    "OneStepPolicy",
    "MeanFlowPolicy",
]


def sinusoidal_embedding(t: torch.Tensor, dim: int, max_period: float = 10_000.0) -> torch.Tensor:
    """(..., dim) features [sin(t w_k), cos(t w_k)], w_k = max_period^(-k / (dim/2)) (Transformer / DDPM style)."""
    if dim < 2 or dim % 2:
        raise ValueError(f"the time embedding's dim must be an even number >= 2, got {dim}")
    half = dim // 2
    dtype = t.dtype if t.is_floating_point() else torch.float32
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=dtype, device=t.device) / half)
    angles = t.to(dtype).unsqueeze(-1) * freqs
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class ConditionalMLP(nn.Module):
    """x_out = f(s, x, t_1..t_k): Diffusion-QL's denoiser (Mish MLP with a small time MLP on sinusoidal features).

    `n_times` is 1 for DDPM and flow matching, 2 for the average velocity
    u(x, r, t).  Times are floats: DDPM step indices or flow times in [0, 1]
    (scaled by `time_scale` first, so that [0, 1] spans many periods).
    """

    def __init__(self, obs_dim: int, act_dim: int, hidden_dims: Sequence[int] = (256, 256, 256),
                 time_dim: int = 16, n_times: int = 1, activation: str = "mish", time_scale: float = 1.0,
                 layer_norm: bool = False) -> None:
        super().__init__()
        self.time_dim, self.n_times, self.time_scale = int(time_dim), int(n_times), float(time_scale)
        if self.time_dim:
            self.time_mlp = nn.Sequential(nn.Linear(self.time_dim, 2 * self.time_dim), _activation(activation)(),
                                          nn.Linear(2 * self.time_dim, self.time_dim))
        # time_dim=0: the times enter as raw numbers (FQL's velocity network concatenates t itself).
        width = self.time_dim or 1
        self.net = MLP(obs_dim + act_dim + self.n_times * width, act_dim, hidden_dims, activation=activation,
                       layer_norm=layer_norm)

    def forward(self, obs: torch.Tensor, x: torch.Tensor, *times: torch.Tensor) -> torch.Tensor:
        if len(times) != self.n_times:
            raise ValueError(f"this network takes {self.n_times} time input(s), got {len(times)}")
        embedded = [self._embed(t.reshape(x.shape[:-1])) for t in times]
        return self.net(torch.cat([x, *[e.to(x.dtype) if not self.time_dim else e for e in embedded], obs], dim=-1))

    def _embed(self, t: torch.Tensor) -> torch.Tensor:
        if self.time_dim:
            return self.time_mlp(sinusoidal_embedding(self.time_scale * t, self.time_dim))
        return (self.time_scale * t).unsqueeze(-1)

    def forward_at(self, obs: torch.Tensor, x: torch.Tensor, times: Sequence[float]) -> torch.Tensor:
        """`forward` with every row at the same times (floats): acting, where a one-step policy always asks for
        u(s, eps, 0, 1).  The time features are computed once for the batch, in one small pass of the time
        network over the (kept) sinusoidal features of those constants, and broadcast."""
        if len(times) != self.n_times:
            raise ValueError(f"this network takes {self.n_times} time input(s), got {len(times)}")
        if self.time_dim:
            # sin/cos of constants depend on nothing learnt, so they are kept; the time network is not (its
            # weights change with every step), so it runs on every call.
            key = (tuple(float(t) for t in times), x.device)
            cache = self.__dict__.setdefault("_sinusoid_cache", {})
            sinusoids = cache.get(key)
            if sinusoids is None:
                scaled = self.time_scale * torch.tensor(key[0], dtype=torch.float32, device=x.device)
                sinusoids = cache[key] = sinusoidal_embedding(scaled, self.time_dim)
            features = self.time_mlp(sinusoids).reshape(1, -1)
        else:
            features = torch.tensor([[self.time_scale * float(t) for t in times]], dtype=x.dtype, device=x.device)
        if torch.jit.is_tracing():  # a traced module must take any batch size: broadcast, no recorded size
            features = torch.zeros_like(x[:, :1]) + features
        else:
            features = features.expand(x.shape[0], -1)
        return self.net(torch.cat([x, features, obs], dim=-1))

    @property
    def has_tangent_pass(self) -> bool:
        """Whether `forward_with_tangent` covers every layer (Linear and the elementwise activations)."""
        modules = [*self.net, *(self.time_mlp if self.time_dim else ())]
        return all(isinstance(m, nn.Linear) or type(m) in _ACTIVATION_DERIVATIVES for m in modules)

    def forward_with_tangent(self, obs: torch.Tensor, x: torch.Tensor, times: Sequence[torch.Tensor],
                             x_tangent: torch.Tensor, time_tangents: Sequence[torch.Tensor | None]
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(f, J f . tangent): the output and its directional derivative, in one pass (the observation held fixed).

        The same numbers as `torch.func.jvp` (tests check it), at about twice
        a forward pass: each Linear multiplies the stacked [value; tangent]
        rows in one matmul, each activation scales the tangent by its
        derivative.  A time tangent of None is zero (MeanFlow's r).
        """
        n = x.shape[0]
        parts, tangents = [x], [x_tangent]
        for t, dt in zip(times, time_tangents):
            t = (self.time_scale * t).reshape(x.shape[:-1])
            dt = None if dt is None else (self.time_scale * dt).reshape(x.shape[:-1])
            if not self.time_dim:
                parts.append(t.unsqueeze(-1).to(x.dtype))
                tangents.append(torch.zeros_like(parts[-1]) if dt is None else dt.unsqueeze(-1).to(x.dtype))
                continue
            emb = sinusoidal_embedding(t, self.time_dim)
            if dt is None:
                parts.append(self.time_mlp(emb))
                tangents.append(torch.zeros_like(parts[-1]))
                continue
            half = self.time_dim // 2
            freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, dtype=emb.dtype, device=emb.device) / half)
            sin, cos = emb[..., :half], emb[..., half:]
            d_emb = torch.cat([cos * freqs, -sin * freqs], dim=-1) * dt.unsqueeze(-1).to(emb.dtype)
            value, tangent = _sequential_with_tangent(self.time_mlp, emb, d_emb, n)
            parts.append(value)
            tangents.append(tangent)
        parts.append(obs)
        tangents.append(torch.zeros_like(obs))
        return _sequential_with_tangent(self.net, torch.cat(parts, dim=-1), torch.cat(tangents, dim=-1), n,
                                        fp32_head=True)


def _mish_derivative(h: torch.Tensor) -> torch.Tensor:
    tanh_sp = torch.tanh(F.softplus(h))
    return tanh_sp + h * torch.sigmoid(h) * (1.0 - tanh_sp * tanh_sp)


def _gelu_derivative(h: torch.Tensor) -> torch.Tensor:  # exact (erf) GELU, torch's default
    return 0.5 * (1.0 + torch.erf(h / math.sqrt(2.0))) + h * torch.exp(-0.5 * h * h) / math.sqrt(2.0 * math.pi)


def _silu_derivative(h: torch.Tensor) -> torch.Tensor:
    sig = torch.sigmoid(h)
    return sig * (1.0 + h * (1.0 - sig))


_ACTIVATION_DERIVATIVES: dict[type, Callable[[torch.Tensor], torch.Tensor]] = {
    nn.Mish: _mish_derivative,
    nn.ReLU: lambda h: (h > 0).to(h.dtype),
    nn.Tanh: lambda h: 1.0 - torch.tanh(h) ** 2,
    nn.GELU: _gelu_derivative,
    nn.SiLU: _silu_derivative,
}


def _sequential_with_tangent(layers: nn.Sequential, h: torch.Tensor, dh: torch.Tensor, n: int,
                             fp32_head: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Push (value, tangent) through Linear / activation layers; value and tangent share each matmul."""
    last = len(layers) - 1
    stacked = torch.cat([h, dh])
    for i, layer in enumerate(layers):
        if isinstance(layer, nn.Linear):
            if fp32_head and i == last and torch.is_autocast_enabled(stacked.device.type):
                with torch.autocast(stacked.device.type, enabled=False):
                    out = F.linear(stacked.float(), layer.weight)
            else:
                out = F.linear(stacked, layer.weight)
            value, tangent = out[:n], out[n:]
            if layer.bias is not None:
                value = value + layer.bias.to(value.dtype)
            stacked = torch.cat([value, tangent])
        else:
            value, tangent = stacked[:n], stacked[n:]
            stacked = torch.cat([layer(value), _ACTIVATION_DERIVATIVES[type(layer)](value) * tangent])
    return stacked[:n], stacked[n:]


# ---------------------------------------------------------------------- DDPM (epsilon prediction)
class VPSchedule(nn.Module):
    """Diffusion-QL's variance-preserving schedule with T steps (beta_min 0.1, beta_max 10).

    alpha_t = exp(-b_min / T - (b_max - b_min)(2t - 1) / (2 T^2)), t = 1..T,
    beta_t = 1 - alpha_t; buffers hold the cumulative products and the
    posterior coefficients, so sampling is a handful of tensor ops per step.
    """

    def __init__(self, n_steps: int = 5, beta_min: float = 0.1, beta_max: float = 10.0) -> None:
        super().__init__()
        if int(n_steps) < 1:
            raise ValueError(f"n_steps must be at least 1, got {n_steps}")
        self.n_steps = int(n_steps)
        t = np.arange(1, self.n_steps + 1, dtype=np.float64)
        alphas = np.exp(-beta_min / self.n_steps - 0.5 * (beta_max - beta_min) * (2 * t - 1) / self.n_steps**2)
        betas = 1.0 - alphas
        cumprod = np.cumprod(alphas)
        previous = np.append(1.0, cumprod[:-1])
        variance = betas * (1.0 - previous) / (1.0 - cumprod)
        buffers = {
            "betas": betas, "alphas_cumprod": cumprod, "alphas_cumprod_prev": previous,
            "sqrt_alphas_cumprod": np.sqrt(cumprod), "sqrt_one_minus_alphas_cumprod": np.sqrt(1.0 - cumprod),
            "sqrt_recip_alphas_cumprod": np.sqrt(1.0 / cumprod), "sqrt_recipm1_alphas_cumprod": np.sqrt(1.0 / cumprod - 1),
            "posterior_log_variance": np.log(np.maximum(variance, 1e-20)),
            "posterior_mean_coef1": betas * np.sqrt(previous) / (1.0 - cumprod),
            "posterior_mean_coef2": (1.0 - previous) * np.sqrt(alphas) / (1.0 - cumprod),
        }
        for name, value in buffers.items():
            self.register_buffer(name, torch.as_tensor(value, dtype=torch.float32))

    @staticmethod
    def _at(values: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return values[t].unsqueeze(-1)

    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps (t: step indices 0..T-1)."""
        return self._at(self.sqrt_alphas_cumprod, t) * x0 + self._at(self.sqrt_one_minus_alphas_cumprod, t) * noise

    def predict_x0(self, x_t: torch.Tensor, t: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        """The clean action the noise prediction implies: (x_t - sqrt(1 - abar_t) eps) / sqrt(abar_t)."""
        return self._at(self.sqrt_recip_alphas_cumprod, t) * x_t - self._at(self.sqrt_recipm1_alphas_cumprod, t) * eps

    def noised(self, actions: torch.Tensor, generator: torch.Generator | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(t, eps, x_t): a uniform step index per row, its noise and the noised action (one forward process draw)."""
        t = torch.randint(self.n_steps, (actions.shape[0],), device=actions.device, generator=generator)
        noise = torch.randn(actions.shape, device=actions.device, generator=generator)
        return t, noise, self.q_sample(actions, t, noise)

    def loss(self, model: Callable[..., torch.Tensor], obs: torch.Tensor, actions: torch.Tensor,
             generator: torch.Generator | None = None, weights: torch.Tensor | None = None) -> torch.Tensor:
        """Epsilon-prediction BC loss E w |eps - eps_theta(s, x_t, t)|^2 with t uniform over the steps.

        `weights` (batch,) weight each row (EDP's advantage-weighted variant); None is the plain mean.
        """
        t, noise, x_t = self.noised(actions, generator)
        per_row = ((model(obs, x_t, t.float()) - noise) ** 2).mean(-1)
        return per_row.mean() if weights is None else (weights * per_row).mean()

    @property
    def noise_count(self) -> int:
        """Noise vectors one DDPM sample consumes: the start x_T and one per step but the last."""
        return self.n_steps

    def sample(self, model: Callable[..., torch.Tensor], obs: torch.Tensor, act_dim: int,
               generator: torch.Generator | None = None, method: str = "ddpm", clip: float | None = 1.0,
               noise: torch.Tensor | None = None, step_noise: torch.Tensor | None = None) -> torch.Tensor:
        """Actions by the reverse chain from N(0, I): "ddpm" (ancestral) or "ddim" (deterministic, eta = 0).

        Gradients flow through the chain (Diffusion-QL's actor loss needs
        them).  `clip` bounds each step's predicted clean action, as the
        official code does for a [-1, 1] action box; `noise` fixes the start
        x_T and `step_noise` (n_steps - 1, batch, act_dim) the DDPM step
        noises, so a fixed noise table gives a deterministic, traceable chain.
        """
        if method not in ("ddpm", "ddim"):
            raise ValueError(f"method must be 'ddpm' or 'ddim', got {method!r}")
        shape = (obs.shape[0], act_dim)
        x = torch.randn(shape, device=obs.device, generator=generator) if noise is None else noise
        one = torch.ones_like(x[:, 0])
        for step in reversed(range(self.n_steps)):
            eps = model(obs, x, one * step)
            x0 = self.sqrt_recip_alphas_cumprod[step] * x - self.sqrt_recipm1_alphas_cumprod[step] * eps
            if clip is not None:
                x0 = x0.clamp(-clip, clip)
            if method == "ddim":
                previous = self.alphas_cumprod_prev[step]
                # the noise the clipped x0 implies, so that a clipped step stays on the same DDIM path
                eps = (x - self.sqrt_alphas_cumprod[step] * x0) / self.sqrt_one_minus_alphas_cumprod[step]
                x = previous.sqrt() * x0 + (1.0 - previous).sqrt() * eps
            else:
                mean = self.posterior_mean_coef1[step] * x0 + self.posterior_mean_coef2[step] * x
                if step > 0:
                    if step_noise is not None:
                        z = step_noise[step - 1]
                    else:
                        z = torch.randn(shape, device=obs.device, generator=generator)
                    x = mean + (0.5 * self.posterior_log_variance[step]).exp() * z
                else:
                    x = mean
        return x


# ---------------------------------------------------------------------- flow matching (t = 0 noise, t = 1 data)
def flow_matching_loss(model: Callable[..., torch.Tensor], obs: torch.Tensor, actions: torch.Tensor,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """FQL's BC loss E |v(s, x_t, t) - (a - z)|^2, x_t = (1 - t) z + t a, t ~ U[0, 1], z ~ N(0, I)."""
    z = torch.randn(actions.shape, device=actions.device, generator=generator)
    t = torch.rand((len(actions), 1), device=actions.device, generator=generator)
    x_t = (1.0 - t) * z + t * actions
    return ((model(obs, x_t, t) - (actions - z)) ** 2).mean()


def _flow_start(obs: torch.Tensor, act_dim: int, generator: torch.Generator | None,
                noise: torch.Tensor | None) -> torch.Tensor:
    return torch.randn((obs.shape[0], act_dim), device=obs.device, generator=generator) if noise is None else noise


def euler_sample(model: Callable[..., torch.Tensor], obs: torch.Tensor, act_dim: int, n_steps: int = 10,
                 generator: torch.Generator | None = None, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Integrate dx/dt = v(s, x, t) from noise at t = 0 to t = 1 with `n_steps` Euler steps."""
    x = _flow_start(obs, act_dim, generator, noise)
    dt = 1.0 / n_steps
    one = torch.ones_like(x[:, :1])  # times built from the input, so a traced sampler takes any batch size
    for k in range(n_steps):
        x = x + dt * model(obs, x, one * (k * dt))
    return x


def midpoint_sample(model: Callable[..., torch.Tensor], obs: torch.Tensor, act_dim: int, n_steps: int = 5,
                    generator: torch.Generator | None = None, noise: torch.Tensor | None = None) -> torch.Tensor:
    """The same ODE with the explicit midpoint rule (second order, two evaluations per step)."""
    x = _flow_start(obs, act_dim, generator, noise)
    dt = 1.0 / n_steps
    one = torch.ones_like(x[:, :1])
    for k in range(n_steps):
        t = one * (k * dt)
        half = x + 0.5 * dt * model(obs, x, t)
        x = x + dt * model(obs, half, t + 0.5 * dt)
    return x


# ---------------------------------------------------------------------- average velocity (t = 0 data, t = 1 noise)
def meanflow_target(model: Callable[..., torch.Tensor], obs: torch.Tensor, x_t: torch.Tensor, r: torch.Tensor,
                    t: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(u, u_tgt): u(s, x_t, r, t) and its MeanFlow target v - (t - r) du/dt, detached.

    du/dt is the total derivative along the path, v . d_x u + d_t u (r held
    fixed): one forward-mode pass with tangents (v, 0, 1), by
    `ConditionalMLP.forward_with_tangent` (about twice a forward pass) or,
    for any other model, `torch.func.jvp`.
    """
    if isinstance(model, ConditionalMLP) and model.has_tangent_pass:  # the hand-written pass, same numbers
        value, dudt = model.forward_with_tangent(obs, x_t, (r, t), v, (None, torch.ones_like(t)))
    else:
        def u(x: torch.Tensor, r_: torch.Tensor, t_: torch.Tensor) -> torch.Tensor:
            return model(obs, x, r_, t_)

        value, dudt = torch.func.jvp(u, (x_t, r, t), (v, torch.zeros_like(r), torch.ones_like(t)))
    return value, (v - (t - r) * dudt).detach()


def meanflow_loss(model: Callable[..., torch.Tensor], obs: torch.Tensor, actions: torch.Tensor,
                  generator: torch.Generator | None = None, flow_ratio: float = 0.5, mu: float = -0.4,
                  sigma: float = 1.0) -> torch.Tensor:
    """OFQL's BC loss E |u(s, a_t, r, t) - sg(u_tgt)|^2.

    a_t = (1 - t) a + t eps, v = eps - a; (t, r) are two logit-normal(mu,
    sigma) draws ordered so that r <= t, and with probability `flow_ratio`
    r = t (plain flow matching, where the target is v).
    """
    x_t, r, t, v = meanflow_path(actions, generator, flow_ratio, mu, sigma)
    with torch.no_grad():  # the target is a stop-gradient: no graph for the tangent pass
        _, target = meanflow_target(model, obs, x_t, r, t, v)
    return ((model(obs, x_t, r, t) - target) ** 2).mean()


def meanflow_path(actions: torch.Tensor, generator: torch.Generator | None = None, flow_ratio: float = 0.5,
                  mu: float = -0.4, sigma: float = 1.0) -> tuple[torch.Tensor, ...]:
    """(a_t, r, t, v) of one MeanFlow training draw: eps ~ N(0, I), logit-normal times with r <= t (r = t with
    probability `flow_ratio`), a_t = (1 - t) a + t eps, v = eps - a."""
    n = actions.shape[0]
    eps = torch.randn(actions.shape, device=actions.device, generator=generator)
    times = torch.sigmoid(mu + sigma * torch.randn((n, 2), device=actions.device, generator=generator))
    t, r = times.max(dim=1, keepdim=True).values, times.min(dim=1, keepdim=True).values
    same = torch.rand((n, 1), device=actions.device, generator=generator) < flow_ratio
    r = torch.where(same, t, r)
    return (1.0 - t) * actions + t * eps, r, t, eps - actions


def meanflow_sample(model: Callable[..., torch.Tensor], obs: torch.Tensor, act_dim: int,
                    generator: torch.Generator | None = None, noise: torch.Tensor | None = None,
                    n_steps: int = 1) -> torch.Tensor:
    """Actions in `n_steps` average-velocity jumps from noise at t = 1 (one step: a = eps - u(eps, 0, 1))."""
    x = _flow_start(obs, act_dim, generator, noise)
    one = torch.ones_like(x[:, :1])
    for k in range(n_steps):
        t, r = 1.0 - k / n_steps, 1.0 - (k + 1) / n_steps
        if isinstance(model, ConditionalMLP):  # constant times: their features computed once
            x = x - (t - r) * model.forward_at(obs, x, (r, t))
        else:
            x = x - (t - r) * model(obs, x, one * r, one * t)
    return x


# ---------------------------------------------------------------------- policies: networks + samplers in env units
class _GenerativePolicy(_ScaledPolicy):
    """A generative policy in the [-1, 1] action box, mapped to the env's bounds.

    `forward(obs, noise)` is the whole sampler with its randomness given:
    `noise` holds `noise_count` vectors per row, (noise_count, batch,
    act_dim), so a fixed noise table makes acting deterministic and
    traceable (TorchScript export).  `sample_unit(obs, generator)` draws
    the noise itself and keeps the graph (for Q-gradient actor losses).
    `bc_loss(obs, actions)` is the model's own generative loss on
    env-unit dataset actions.
    """

    noise_count = 1

    def __init__(self, action_dim: int, action_low=None, action_high=None) -> None:
        super().__init__(action_low, action_high, action_dim)
        self.action_dim = int(action_dim)

    def draw_noise(self, obs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.randn((self.noise_count, obs.shape[0], self.action_dim), device=obs.device, generator=generator)

    def sample_unit(self, obs: torch.Tensor, generator: torch.Generator | None = None,
                    noise: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, obs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return self.to_env(self.sample_unit(obs, noise=noise).clamp(-1.0, 1.0))


class DiffusionPolicy(_GenerativePolicy):
    """Diffusion-QL's actor: an epsilon-prediction denoiser on the VP schedule (DDPM or DDIM sampling)."""

    def __init__(self, observation_dim: int, action_dim: int, hidden_dims: Sequence[int] = (256, 256, 256),
                 n_diffusion_steps: int = 5, time_dim: int = 16, action_low=None, action_high=None,
                 activation: str = "mish", sampler: str = "ddpm") -> None:
        super().__init__(action_dim, action_low, action_high)
        if sampler not in ("ddpm", "ddim"):
            raise ValueError(f"sampler must be 'ddpm' or 'ddim', got {sampler!r}")
        self.denoiser = ConditionalMLP(observation_dim, action_dim, hidden_dims, time_dim, 1, activation)
        self.schedule = VPSchedule(n_diffusion_steps)
        self.sampler = sampler
        self.noise_count = self.schedule.n_steps if sampler == "ddpm" else 1

    def sample_unit(self, obs, generator=None, noise=None):
        start, steps = (None, None) if noise is None else (noise[0], noise[1:])
        return self.schedule.sample(self.denoiser, obs, self.action_dim, generator, self.sampler, clip=1.0,
                                    noise=start, step_noise=steps)

    def bc_loss(self, obs: torch.Tensor, actions: torch.Tensor, generator: torch.Generator | None = None,
                weights: torch.Tensor | None = None) -> torch.Tensor:
        return self.schedule.loss(self.denoiser, obs, self.to_unit(actions), generator, weights)


class FlowPolicy(_GenerativePolicy):
    """FQL's behaviour flow: a velocity field v(s, x_t, t) integrated by Euler steps from noise at t = 0."""

    def __init__(self, observation_dim: int, action_dim: int, hidden_dims: Sequence[int] = (512, 512, 512, 512),
                 flow_steps: int = 10, time_dim: int = 0, action_low=None, action_high=None,
                 activation: str = "gelu", layer_norm: bool = False) -> None:
        super().__init__(action_dim, action_low, action_high)
        self.velocity = ConditionalMLP(observation_dim, action_dim, hidden_dims, time_dim, 1, activation,
                                       layer_norm=layer_norm)
        self.flow_steps = int(flow_steps)

    def sample_unit(self, obs, generator=None, noise=None):
        return euler_sample(self.velocity, obs, self.action_dim, self.flow_steps, generator,
                            None if noise is None else noise[0])

    def bc_loss(self, obs: torch.Tensor, actions: torch.Tensor, generator: torch.Generator | None = None
                ) -> torch.Tensor:
        return flow_matching_loss(self.velocity, obs, self.to_unit(actions), generator)


class OneStepPolicy(_GenerativePolicy):
    """FQL's one-step policy mu(s, z): noise to action in one network evaluation (unclipped in `sample_unit`)."""

    def __init__(self, observation_dim: int, action_dim: int, hidden_dims: Sequence[int] = (512, 512, 512, 512),
                 action_low=None, action_high=None, activation: str = "gelu", layer_norm: bool = False) -> None:
        super().__init__(action_dim, action_low, action_high)
        self.net = MLP(observation_dim + action_dim, action_dim, hidden_dims, activation, layer_norm)

    def sample_unit(self, obs, generator=None, noise=None):
        z = self.draw_noise(obs, generator)[0] if noise is None else noise[0]
        return self.net(torch.cat([obs, z], dim=-1))


class MeanFlowPolicy(_GenerativePolicy):
    """OFQL's actor: an average-velocity field u(s, a_t, r, t); a = eps - u(s, eps, 0, 1) in one evaluation."""

    def __init__(self, observation_dim: int, action_dim: int, hidden_dims: Sequence[int] = (256, 256, 256),
                 time_dim: int = 64, action_low=None, action_high=None, activation: str = "mish",
                 sample_steps: int = 1, flow_ratio: float = 0.5, time_mu: float = -0.4,
                 time_sigma: float = 1.0) -> None:
        super().__init__(action_dim, action_low, action_high)
        self.velocity = ConditionalMLP(observation_dim, action_dim, hidden_dims, time_dim, 2, activation)
        self.sample_steps = int(sample_steps)
        self.flow_ratio, self.time_mu, self.time_sigma = float(flow_ratio), float(time_mu), float(time_sigma)

    def sample_unit(self, obs, generator=None, noise=None):
        if self.sample_steps == 1:  # a = eps - u(s, eps, 0, 1), the acting path kept to the fewest operations
            eps = self.draw_noise(obs, generator)[0] if noise is None else noise[0]
            return eps - self.velocity.forward_at(obs, eps, (0.0, 1.0))
        return meanflow_sample(self.velocity, obs, self.action_dim, generator, None if noise is None else noise[0],
                               self.sample_steps)

    def bc_loss(self, obs: torch.Tensor, actions: torch.Tensor, generator: torch.Generator | None = None
                ) -> torch.Tensor:
        return meanflow_loss(self.velocity, obs, self.to_unit(actions), generator, self.flow_ratio, self.time_mu,
                             self.time_sigma)

    def bc_loss_and_sample(self, obs: torch.Tensor, actions: torch.Tensor, generator: torch.Generator | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MeanFlow BC loss, one-step unit actions with gradients): OFQL's two actor terms from one forward
        pass over the stacked rows [(a_t, r, t); (eps, 0, 1)] (`sample_steps` = 1)."""
        x_t, r, t, v = meanflow_path(self.to_unit(actions), generator, self.flow_ratio, self.time_mu,
                                     self.time_sigma)
        with torch.no_grad():
            _, target = meanflow_target(self.velocity, obs, x_t, r, t, v)
        eps = torch.randn(x_t.shape, device=x_t.device, generator=generator)
        u = self.velocity(torch.cat([obs, obs]), torch.cat([x_t, eps]), torch.cat([r, torch.zeros_like(r)]),
                          torch.cat([t, torch.ones_like(t)]))
        u_bc, u_pi = u.chunk(2)
        return ((u_bc - target) ** 2).mean(), eps - u_pi
