"""The generative core (offrl/nn/generative.py): schedules, samplers and the MeanFlow JVP target.

Samplers are checked against oracle models of a point mass, for which every
sampler must land exactly on the point; the MeanFlow target against a
finite-difference estimate of the total derivative.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from offrl.nn.generative import (
    ConditionalMLP,
    VPSchedule,
    euler_sample,
    flow_matching_loss,
    meanflow_loss,
    meanflow_path,
    meanflow_sample,
    meanflow_target,
    midpoint_sample,
    sinusoidal_embedding,
)

pytestmark = pytest.mark.usefixtures("one_thread")

POINT = torch.tensor([[0.3, -0.7]])


def test_sinusoidal_embedding():
    emb = sinusoidal_embedding(torch.tensor([0.0, 2.0]), 8)
    assert emb.shape == (2, 8)
    assert torch.equal(emb[0], torch.tensor([0.0] * 4 + [1.0] * 4))
    freqs = 10_000.0 ** (-torch.arange(4) / 4)
    assert torch.allclose(emb[1], torch.cat([torch.sin(2 * freqs), torch.cos(2 * freqs)]))
    with pytest.raises(ValueError, match="even number"):
        sinusoidal_embedding(torch.zeros(1), 7)


def test_vp_schedule_is_diffusion_ql_s():
    schedule = VPSchedule(5)
    t = np.arange(1, 6)
    alphas = np.exp(-0.1 / 5 - 0.5 * (10 - 0.1) * (2 * t - 1) / 25)
    np.testing.assert_allclose(schedule.betas.numpy(), 1 - alphas, rtol=1e-6)
    np.testing.assert_allclose(schedule.alphas_cumprod.numpy(), np.cumprod(alphas), rtol=1e-6)
    x0, noise, step = torch.randn(4, 2), torch.randn(4, 2), torch.tensor([0, 1, 3, 4])
    x_t = schedule.q_sample(x0, step, noise)
    assert torch.allclose(schedule.predict_x0(x_t, step, noise), x0, atol=1e-5)


def _oracle_eps(schedule):
    """The exact noise prediction when every action is POINT."""
    def model(obs, x, t):
        t = t.long()
        return (x - schedule._at(schedule.sqrt_alphas_cumprod, t) * POINT) / schedule._at(
            schedule.sqrt_one_minus_alphas_cumprod, t)
    return model


@pytest.mark.parametrize("method", ["ddpm", "ddim"])
def test_ddpm_and_ddim_land_on_a_point_mass(method):
    schedule = VPSchedule(5)
    obs = torch.zeros(16, 3)
    out = schedule.sample(_oracle_eps(schedule), obs, 2, torch.Generator().manual_seed(0), method=method)
    assert torch.allclose(out, POINT.expand(16, 2), atol=1e-5)
    assert schedule.loss(_oracle_eps(schedule), obs, POINT.expand(16, 2), torch.Generator().manual_seed(0)) < 1e-9


def test_ddpm_samples_are_seeded_and_differentiable():
    schedule = VPSchedule(5)
    net = ConditionalMLP(3, 2, (32, 32))
    obs = torch.randn(8, 3)
    a = schedule.sample(net, obs, 2, torch.Generator().manual_seed(1))
    b = schedule.sample(net, obs, 2, torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and not torch.equal(a, schedule.sample(net, obs, 2, torch.Generator().manual_seed(2)))
    a.sum().backward()  # Diffusion-QL's actor loss backpropagates through the whole chain
    assert all(p.grad is not None for p in net.parameters())


def test_flow_samplers_land_on_a_point_mass():
    def velocity(obs, x, t):  # FQL's straight path from x at time t to POINT at time 1
        return (POINT - x) / (1.0 - t)

    obs = torch.zeros(16, 3)
    for sampler in (euler_sample, midpoint_sample):
        out = sampler(velocity, obs, 2, n_steps=4, generator=torch.Generator().manual_seed(0))
        assert torch.allclose(out, POINT.expand(16, 2), atol=1e-5), sampler.__name__
    # the oracle of flow matching's target: v(x_t, t) = a - z exactly
    z_to_a = ConditionalMLP(3, 2, (8,))
    assert flow_matching_loss(z_to_a, obs, POINT.expand(16, 2), torch.Generator().manual_seed(0)) > 0


def test_meanflow_one_step_and_zero_loss_for_the_exact_average_velocity():
    def mean_velocity(obs, x, r, t):  # OFQL's path a_t = (1 - t) POINT + t eps: u = v = (x - POINT) / t
        return (x - POINT) / t

    obs = torch.zeros(16, 3)
    out = meanflow_sample(mean_velocity, obs, 2, torch.Generator().manual_seed(0))
    assert torch.allclose(out, POINT.expand(16, 2), atol=1e-6)
    loss = meanflow_loss(mean_velocity, obs, POINT.expand(16, 2), torch.Generator().manual_seed(0))
    assert loss < 1e-9


def test_meanflow_jvp_target_equals_a_finite_difference():
    torch.manual_seed(0)
    net = ConditionalMLP(3, 2, (32, 32), n_times=2, time_scale=10.0).double()
    obs, x = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    r = torch.rand(5, 1, dtype=torch.float64) * 0.4
    t = 0.5 + torch.rand(5, 1, dtype=torch.float64) * 0.4
    v = torch.randn(5, 2, dtype=torch.float64)
    u, target = meanflow_target(net, obs, x, r, t, v)
    h = 1e-5
    with torch.no_grad():
        dudt = (net(obs, x + h * v, r, t + h) - net(obs, x - h * v, r, t - h)) / (2 * h)
    assert torch.allclose(u, net(obs, x, r, t))
    assert torch.allclose(target, v - (t - r) * dudt, atol=1e-7)
    assert not target.requires_grad  # the target is a stop-gradient


def test_meanflow_learns_a_two_mode_distribution_in_one_step():
    """Two modes conditioned on a context bit: one network evaluation per action still covers both."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    net = ConditionalMLP(1, 1, (64, 64), n_times=2, time_scale=10.0)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(600):
        context = torch.randint(2, (256, 1), generator=g).float()
        sign = torch.randint(2, (256, 1), generator=g).float() * 2 - 1
        actions = sign * (0.3 + 0.4 * context) + 0.02 * torch.randn(256, 1, generator=g)  # modes ±0.3 or ±0.7
        loss = meanflow_loss(net, context, actions, g)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        for bit, centre in ((0.0, 0.3), (1.0, 0.7)):
            out = meanflow_sample(net, torch.full((2000, 1), bit), 1, torch.Generator().manual_seed(1))
            near = (out - centre).abs() < 0.2, (out + centre).abs() < 0.2
            # each mode holds a good share (0.24-0.36 here; a unimodal Gaussian between them would hold ~0)
            assert near[0].float().mean() > 0.15 and near[1].float().mean() > 0.15, (bit, out.mean(), out.std())


@pytest.mark.parametrize("activation, time_dim, time_scale", [("mish", 16, 10.0), ("gelu", 0, 1.0),
                                                              ("relu", 8, 1.0), ("silu", 8, 3.0)])
def test_the_hand_written_tangent_pass_equals_torch_func_jvp(activation, time_dim, time_scale):
    torch.manual_seed(1)
    net = ConditionalMLP(3, 2, (32, 32), time_dim=time_dim, n_times=2, activation=activation,
                         time_scale=time_scale).double()
    assert net.has_tangent_pass
    obs, x, v = (torch.randn(6, d, dtype=torch.float64) for d in (3, 2, 2))
    r, t = torch.rand(6, 1, dtype=torch.float64) * 0.4, 0.5 + torch.rand(6, 1, dtype=torch.float64) * 0.4
    value, tangent = net.forward_with_tangent(obs, x, (r, t), v, (None, torch.ones_like(t)))
    ref_value, ref_tangent = torch.func.jvp(lambda x_, r_, t_: net(obs, x_, r_, t_), (x, r, t),
                                            (v, torch.zeros_like(r), torch.ones_like(t)))
    assert torch.allclose(value, ref_value, atol=1e-12)
    assert torch.allclose(tangent, ref_tangent, atol=1e-10)
    assert not ConditionalMLP(3, 2, (8,), layer_norm=True).has_tangent_pass  # falls back to torch.func.jvp


def test_the_meanflow_policy_s_stacked_pass_gives_its_loss_and_one_step_actions():
    from offrl.nn.generative import MeanFlowPolicy

    torch.manual_seed(0)
    policy = MeanFlowPolicy(3, 2, (32, 32), time_dim=8)
    obs, actions = torch.randn(16, 3), torch.rand(16, 2) * 2 - 1
    loss, unit = policy.bc_loss_and_sample(obs, actions, torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    x_t, r, t, v = meanflow_path(actions, g)
    _, target = meanflow_target(policy.velocity, obs, x_t, r, t, v)
    eps = torch.randn(x_t.shape, generator=g)
    assert torch.allclose(loss, ((policy.velocity(obs, x_t, r, t) - target) ** 2).mean(), atol=1e-6)
    assert torch.allclose(unit, policy.sample_unit(obs, noise=eps.unsqueeze(0)), atol=1e-6)
    loss.backward()
    assert all(p.grad is not None for p in policy.parameters())


def test_constant_time_features_follow_the_weights_after_in_place_and_fused_adam_steps():
    """forward_at keeps only the sinusoids of its constant times: a fused Adam step leaves a weight's version
    counter where it was, so nothing learnt may be cached."""
    torch.manual_seed(0)
    net = ConditionalMLP(3, 2, (16,), time_dim=8, n_times=2)
    obs, x = torch.randn(5, 3), torch.randn(5, 2)
    one = torch.ones(5, 1)
    optimizer = torch.optim.Adam(net.parameters(), lr=0.1, fused=True)
    for _ in range(3):
        with torch.no_grad():
            assert torch.allclose(net.forward_at(obs, x, (0.0, 1.0)), net(obs, x, 0 * one, one), atol=1e-6)
        loss = net.forward_at(obs, x, (0.0, 1.0)).pow(2).sum()  # with gradients the time network is trained
        optimizer.zero_grad()
        loss.backward()
        assert net.time_mlp[0].weight.grad is not None
        optimizer.step()
