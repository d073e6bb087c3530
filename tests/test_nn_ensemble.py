"""Critic ensembles under higher-order autodiff and member subsets.

Every check compares against a reference ensemble written with plain
`torch.baddbmm`, which autograd and functorch differentiate natively: double
backward (gradient penalties), forward-mode AD and `torch.func` transforms
must give what the reference gives, and `members=` may be an index tensor.
"""

from __future__ import annotations

import pytest
import torch
from torch.autograd.forward_ad import dual_level, make_dual, unpack_dual
from torch.func import functional_call, grad, jacrev, jvp, vmap
from torch.nn import functional as F

from offrl.nn import EnsembleLinear, EnsembleMLP, QEnsemble, _EnsembleLayerNorm


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny networks gain nothing from more threads, and a shared CPU punishes OpenMP spinning."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference_mlp(mlp: EnsembleMLP, x: torch.Tensor, members: torch.Tensor | None = None) -> torch.Tensor:
    """`mlp`'s function written with baddbmm and plain indexing only."""
    index = torch.arange(mlp.n_members) if members is None else members
    if x.dim() == 2:
        x = x.unsqueeze(0).expand(len(index), -1, -1)
    for layer in mlp.layers:
        if isinstance(layer, EnsembleLinear):
            x = torch.baddbmm(layer.bias[index], x.to(layer.weight.dtype), layer.weight[index])
        elif isinstance(layer, _EnsembleLayerNorm):
            x = F.layer_norm(x, x.shape[-1:]) * layer.weight[index] + layer.bias[index]
        else:
            x = layer(x)
    return x


def reference_q(q: QEnsemble, obs: torch.Tensor, actions: torch.Tensor,
                members: torch.Tensor | None = None) -> torch.Tensor:
    lead = obs.shape[:-1]
    x = torch.cat([obs, actions], dim=-1).reshape(-1, obs.shape[-1] + actions.shape[-1])
    return reference_mlp(q.net, x, members).reshape(-1, *lead)


class ReferenceQ(torch.nn.Module):
    """`reference_q` as a module, so `functional_call` can swap the critic's parameters in it."""

    def __init__(self, q: QEnsemble) -> None:
        super().__init__()
        self.q = q

    def forward(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return reference_q(self.q, obs, actions)


def critic(n: int = 3, layer_norm: bool = False, dtype: torch.dtype = torch.float64) -> QEnsemble:
    torch.manual_seed(0)
    return QEnsemble(4, 2, n_critics=n, hidden_dims=(8, 8), layer_norm=layer_norm).to(dtype)


def uses_narrow_kernel(out: torch.Tensor) -> bool:
    """Whether `out`'s graph runs through the narrow-head kernel (so a check exercises it, not baddbmm)."""
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "NarrowEnsembleMatmul" in type(node).__name__:
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


# ------------------------------------------------------------------ double backward


@pytest.mark.parametrize("out_dim", [1, 3])
def test_narrow_layer_passes_gradcheck_and_gradgradcheck(out_dim: int) -> None:
    torch.manual_seed(0)
    layer = EnsembleLinear(3, 5, out_dim).double()
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    weight = layer.weight.detach().clone().requires_grad_()
    bias = layer.bias.detach().clone().requires_grad_()

    def f(x, weight, bias):
        return functional_call(layer, {"weight": weight, "bias": bias}, (x,))

    assert uses_narrow_kernel(f(x, weight, bias))
    assert torch.autograd.gradcheck(f, (x, weight, bias))
    assert torch.autograd.gradgradcheck(f, (x, weight, bias))


def test_critic_gradgradcheck_through_the_head() -> None:
    q = critic(n=2, layer_norm=True)
    obs = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    actions = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    head = q.net.layers[-1]
    weight = head.weight.detach().clone().requires_grad_()

    def f(obs, actions, weight):
        return functional_call(q, {"net.layers.6.weight": weight}, (obs, actions))

    assert uses_narrow_kernel(f(obs, actions, weight))
    assert torch.autograd.gradgradcheck(f, (obs, actions, weight))


@pytest.mark.parametrize("members", [None, torch.tensor([2, 0])])
def test_gradient_penalty_double_backward_matches_reference(members: torch.Tensor | None) -> None:
    """grad(Q, actions, create_graph=True) then backward reaches every weight, as with baddbmm."""
    q = critic(n=3)
    obs = torch.randn(16, 4, dtype=torch.float64)
    actions = torch.randn(16, 2, dtype=torch.float64)

    def penalty_grads(forward):
        q.zero_grad(set_to_none=True)
        a = actions.clone().requires_grad_()
        (g,) = torch.autograd.grad(forward(q, obs, a, members).sum(), a, create_graph=True)
        ((g.norm(dim=-1) - 1) ** 2).mean().backward()
        return g.detach(), {name: p.grad for name, p in q.named_parameters()}

    g, grads = penalty_grads(QEnsemble.forward)
    g_ref, grads_ref = penalty_grads(reference_q)
    torch.testing.assert_close(g, g_ref)
    for name, reference in grads_ref.items():
        if reference is None:  # the head's bias does not enter dQ/da, for a plain layer either
            assert grads[name] is None, name
        else:
            assert grads[name] is not None, f"{name} got no gradient under double backward"
            torch.testing.assert_close(grads[name], reference, msg=name)
    assert grads["net.layers.4.weight"].abs().sum() > 0  # the head's weights take part


def test_first_order_backward_is_unchanged_by_create_graph() -> None:
    """The differentiable backward computes the same per-member products, so values keep their bits."""
    q = critic(n=2, dtype=torch.float32)
    obs, actions = torch.randn(32, 4), torch.randn(32, 2, requires_grad=True)
    plain = torch.autograd.grad(q(obs, actions).sum(), [actions, *q.parameters()])
    graph = torch.autograd.grad(q(obs, actions).sum(), [actions, *q.parameters()], create_graph=True)
    for a, b in zip(plain, graph):
        assert torch.equal(a, b.detach())


# ------------------------------------------------------------------ forward mode and torch.func


def test_forward_mode_ad_matches_reference() -> None:
    """torch.autograd.forward_ad (dual tensors) through a narrow head, tangents on input and weight."""
    torch.manual_seed(0)
    layer = EnsembleLinear(3, 5, 1).double()
    x, x_dot = torch.randn(3, 4, 5, dtype=torch.float64), torch.randn(3, 4, 5, dtype=torch.float64)
    w_dot = torch.randn_like(layer.weight)
    with dual_level():
        out = functional_call(layer, {"weight": make_dual(layer.weight.detach(), w_dot)}, (make_dual(x, x_dot),))
        value, tangent = unpack_dual(out)
    _, expected = jvp(lambda x, w: torch.baddbmm(layer.bias.detach(), x, w), (x, layer.weight.detach()),
                      (x_dot, w_dot))
    torch.testing.assert_close(value, torch.baddbmm(layer.bias, x, layer.weight).detach())
    torch.testing.assert_close(tangent, expected)


@pytest.mark.parametrize("layer_norm", [False, True])
def test_func_jvp_matches_reference(layer_norm: bool) -> None:
    q = critic(layer_norm=layer_norm)
    obs, actions = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    obs_dot, actions_dot = torch.randn_like(obs), torch.randn_like(actions)
    out, tangent = jvp(q, (obs, actions), (obs_dot, actions_dot))
    out_ref, tangent_ref = jvp(lambda o, a: reference_q(q, o, a), (obs, actions), (obs_dot, actions_dot))
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(tangent, tangent_ref)

    # a tangent in parameter space (e.g. a MeanFlow-style target differentiates through the weights)
    params = {name: p.detach() for name, p in q.named_parameters()}
    params_dot = {name: torch.randn_like(p) for name, p in params.items()}
    _, tangent = jvp(lambda p: functional_call(q, p, (obs, actions)), (params,), (params_dot,))
    reference = ReferenceQ(q)
    _, tangent_ref = jvp(lambda p: functional_call(reference, {f"q.{k}": v for k, v in p.items()}, (obs, actions)),
                         (params,), (params_dot,))
    torch.testing.assert_close(tangent, tangent_ref)

    # EnsembleMLP and a lone EnsembleLinear head, 3-D input
    x, x_dot = torch.randn(3, 5, 6, dtype=torch.float64), torch.randn(3, 5, 6, dtype=torch.float64)
    head = EnsembleLinear(3, 6, 1).double()
    torch.testing.assert_close(jvp(head, (x,), (x_dot,))[1], torch.bmm(x_dot, head.weight.detach()))
    mlp = EnsembleMLP(3, 6, 2, (8,), layer_norm=layer_norm).double()
    torch.testing.assert_close(jvp(mlp, (x,), (x_dot,)), jvp(lambda v: reference_mlp(mlp, v), (x,), (x_dot,)))


@pytest.mark.parametrize("layer_norm", [False, True])
def test_vmap_grad_and_jacrev_match_reference(layer_norm: bool) -> None:
    q = critic(layer_norm=layer_norm)
    obs, actions = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)

    # per-sample evaluation under vmap equals the batched call
    per_sample = vmap(q)(obs, actions)  # (6, n_critics)
    torch.testing.assert_close(per_sample, reference_q(q, obs, actions).T)
    torch.testing.assert_close(per_sample, q(obs, actions).T)

    # per-sample action gradients (a gradient penalty or DDPG-style actor gradient, vectorised)
    def q_min(o, a):
        return q(o, a).min()

    def q_min_ref(o, a):
        return reference_q(q, o, a).min()

    torch.testing.assert_close(vmap(grad(q_min, argnums=1))(obs, actions),
                               vmap(grad(q_min_ref, argnums=1))(obs, actions))
    torch.testing.assert_close(jacrev(q, argnums=1)(obs, actions),
                               jacrev(lambda o, a: reference_q(q, o, a), argnums=1)(obs, actions))

    # vmap over a leading batch of 3-D ensemble inputs through EnsembleMLP and EnsembleLinear
    mlp = EnsembleMLP(3, 6, 1, (8, 8), layer_norm=layer_norm).double()
    x = torch.randn(2, 3, 5, 6, dtype=torch.float64)
    torch.testing.assert_close(vmap(mlp)(x), torch.stack([reference_mlp(mlp, v) for v in x]))
    head = mlp.layers[-1]
    h = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    torch.testing.assert_close(vmap(head)(h), torch.stack([torch.baddbmm(head.bias, v, head.weight) for v in h]))


# ------------------------------------------------------------------ member subsets


@pytest.mark.parametrize("layer_norm", [False, True])
def test_index_tensor_members_select_rows_in_order(layer_norm: bool) -> None:
    q = critic(n=5, layer_norm=layer_norm, dtype=torch.float32)
    obs, actions = torch.randn(7, 4), torch.randn(7, 2)
    full = q(obs, actions)
    for index in (torch.tensor([3, 1]), torch.tensor([4]), torch.tensor([0, 0, 2]), torch.tensor([-1, 1]),
                  torch.randperm(5, generator=torch.Generator().manual_seed(1))[:2],
                  torch.tensor([2, 4], dtype=torch.int32)):
        out = q(obs, actions, members=index)
        assert out.shape == (len(index), 7)
        torch.testing.assert_close(out, full[index.long()], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out, reference_q(q, obs, actions, index.long()), rtol=1e-6, atol=1e-6)

    # a slice, an int and the equivalent index tensors agree exactly
    assert torch.equal(q(obs, actions, members=slice(1, 3)), q(obs, actions, members=torch.tensor([1, 2])))
    assert torch.equal(q(obs, actions, members=2), q(obs, actions, members=torch.tensor([2])))
    assert torch.equal(q(obs, actions, members=-1), q(obs, actions, members=slice(4, 5)))
    assert q(obs, actions, members=0).shape == (1, 7)

    # leading sample dimensions (CQL's sampled actions) with a subset
    obs3, actions3 = torch.randn(4, 7, 4), torch.randn(4, 7, 2)
    out = q(obs3, actions3, members=torch.tensor([3, 0]))
    assert out.shape == (2, 4, 7)
    torch.testing.assert_close(out, q(obs3, actions3)[[3, 0]], rtol=1e-6, atol=1e-6)


def test_index_tensor_members_train_only_the_selected_members() -> None:
    q = critic(n=4, dtype=torch.float32)
    obs, actions = torch.randn(8, 4), torch.randn(8, 2)
    q(obs, actions, members=torch.tensor([2, 0])).sum().backward()
    for name, p in q.named_parameters():
        assert p.grad[[1, 3]].abs().sum() == 0, name
        assert p.grad[[0, 2]].abs().sum() > 0, name

    # repeated members accumulate, like evaluating the member twice
    q.zero_grad()
    q(obs, actions, members=torch.tensor([1, 1])).sum().backward()
    twice = [p.grad.clone() for p in q.parameters()]
    q.zero_grad()
    (2 * q(obs, actions, members=1)).sum().backward()
    for a, b in zip(twice, q.parameters()):
        torch.testing.assert_close(a, b.grad)


def test_members_on_layers_and_ensemble_mlp() -> None:
    torch.manual_seed(0)
    layer, norm = EnsembleLinear(4, 3, 2), _EnsembleLayerNorm(4, 3)
    x = torch.randn(2, 5, 3)
    index = torch.tensor([3, 1])
    torch.testing.assert_close(layer(x, members=index), torch.baddbmm(layer.bias[index], x, layer.weight[index]))
    torch.testing.assert_close(norm(x, members=index), F.layer_norm(x, (3,)) * norm.weight[index] + norm.bias[index])
    assert layer(x[:1], members=2).shape == (1, 5, 2)
    mlp = EnsembleMLP(4, 3, 2, (8,))
    torch.testing.assert_close(mlp(x, members=index), reference_mlp(mlp, x, index))
    torch.testing.assert_close(mlp(x[0], members=index), reference_mlp(mlp, x[0], index))


@pytest.mark.parametrize("members, error, match", [
    (torch.tensor([0, 4]), IndexError, r"members holds indices \[4\] out of range for an ensemble of 4"),
    (torch.tensor([-5]), IndexError, "out of range"),
    (4, IndexError, "members=4 is out of range"),
    (-5, IndexError, "out of range"),
    (slice(4, 6), ValueError, "selects none of the 4 members"),
    (slice(3, 0, -1), ValueError, "positive step"),
    (torch.tensor([], dtype=torch.long), ValueError, "empty index tensor"),
    (torch.tensor([[0, 1]]), ValueError, "1-D index tensor"),
    (torch.tensor([0.0, 1.0]), TypeError, "integer index tensor"),
    (torch.tensor([True, False, True, False]), TypeError, "mask.nonzero"),
    ([0, 1], TypeError, "got list"),
    (True, TypeError, "got bool"),
])
def test_bad_members_raise_clear_errors(members, error, match) -> None:
    q = QEnsemble(4, 2, n_critics=4, hidden_dims=(8,))
    obs, actions = torch.randn(3, 4), torch.randn(3, 2)
    with pytest.raises(error, match=match):
        q(obs, actions, members=members)
    with pytest.raises(error, match=match):
        q.net.layers[0](torch.randn(2, 3, 6), members=members)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_index_tensor_members_on_the_device() -> None:
    q = critic(n=4, dtype=torch.float32)
    obs, actions = torch.randn(8, 4), torch.randn(8, 2)
    expected = q(obs, actions, members=torch.tensor([3, 1]))
    q_gpu = q.cuda()
    for index in (torch.tensor([3, 1], device="cuda"), torch.tensor([3, 1])):
        out = q_gpu(obs.cuda(), actions.cuda(), members=index)
        torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(IndexError, match="out of range"):
        q_gpu(obs.cuda(), actions.cuda(), members=torch.tensor([0, 4], device="cuda"))


def test_ensemble_input_must_match_the_selection() -> None:
    mlp = EnsembleMLP(4, 3, 1, (8,))
    with pytest.raises(ValueError, match="x has 4 rows on its member dimension but 2 members"):
        mlp(torch.randn(4, 5, 3), members=torch.tensor([0, 1]))


# ------------------------------------------------------------------ precision


@pytest.mark.parametrize("members", [None, slice(0, 1), torch.tensor([2, 0])])
def test_bf16_autocast_returns_fp32_q_values(members) -> None:
    q = critic(n=3, dtype=torch.float32)
    obs, actions = torch.randn(16, 4), torch.randn(16, 2, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = q(obs, actions, members=members)
        per_sample = vmap(q, in_dims=(0, 0, None))(obs, actions, members)  # the functorch path casts too
    assert out.dtype == torch.float32 and per_sample.dtype == torch.float32
    torch.testing.assert_close(per_sample.T, out, rtol=2e-2, atol=2e-2)
    full = q(obs, actions).detach()
    index = torch.arange(3)[members] if members is not None else torch.arange(3)
    torch.testing.assert_close(out.detach(), full[index], rtol=5e-2, atol=5e-2)
    out.sum().backward()
    assert actions.grad.dtype == torch.float32 and torch.isfinite(actions.grad).all()
