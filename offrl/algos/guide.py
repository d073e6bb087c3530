"""Guided offline RL (GORL; Yang, Wang, Zhang, Huang & Song, 2023): a per-sample balance, learned from a few
expert demonstrations, between policy improvement and the behaviour constraint.

A policy-constraint algorithm trades the two with one constant for the whole
dataset (TD3+BC's alpha, IQL's temperature beta).  GORL replaces it by
alpha * w(s, a) for every sample, where a small guiding network w outputs a
scale in (0, 2) (2 sigmoid(h), so an untrained guide, whose last layer starts
at zero, outputs exactly 1 and leaves the base algorithm unchanged), divided
by its mean over the batch unless `Guide(normalize=False)`.  The guide is
trained by a meta-gradient, as a bi-level problem:

    virtual step:  theta'(w) = theta - eta grad_theta L_actor(theta; w)        (one SGD step)
    guide loss:    L_guide(w) = L_BC(theta'(w); expert batch)                   (the actor's own BC loss)
    guide update:  phi <- Adam(phi, grad_phi L_guide)    (second order, through theta'(w))
    actor update:  the base algorithm's step with the updated guide's scales (not differentiated)

so a sample's improvement is amplified when that makes the policy closer to
the expert's actions after the step, and damped when it pulls the policy
away.  The expert batch is drawn from the guide's own stream (seeded per step),
so guiding never changes the base algorithm's random numbers: with a frozen
guide (`Guide(lr=0)`) the run is the base algorithm's, bit for bit.

Plugged into `TD3PlusBC(guide=...)` (scales the Q term per sample) and
`IQL(guide=...)` (scales the advantage temperature per sample).  The guide
parameter is a `Guide`, an expert `Dataset` or load spec (default guide
settings), or a dict of `Guide` parameters.  It is saved with the model (the
expert episodes included) and the guiding network is a fitted module
(`guide_net_`).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import sklearn.base
import torch
from torch import nn
from torch.func import functional_call

from offrl.algos.params import Rule, boolean, integer, layer_sizes, real
from offrl.datasets.core import Dataset
from offrl.datasets.transformers import FittedStateMixin
from offrl.nn import MLP

__all__ = ["Guide", "GuideNetwork", "as_guide", "guided_scales", "load_demonstrations", "GUIDE_RULE",
           "DEMONSTRATIONS_RULE"]


def _is_demonstrations(value: Any) -> bool:
    return isinstance(value, (Dataset, str, os.PathLike))


#: The `guide=` parameter's rule: None, a Guide, an expert Dataset or load spec, or a dict of Guide parameters.
GUIDE_RULE = Rule(lambda v: v is None or isinstance(v, Guide) or _is_demonstrations(v) or isinstance(v, Mapping),
                  "None, an offrl.algos.guide.Guide, an expert Dataset or load spec, or a dict of Guide parameters")
#: Expert demonstrations given as a parameter (ReCOIL's `expert=`, Guide's): a Dataset or a load spec.
DEMONSTRATIONS_RULE = Rule(lambda v: v is None or _is_demonstrations(v), "an offrl Dataset or a dataset load spec")


class GuideNetwork(nn.Module):
    """w(s, a) = 2 sigmoid(MLP(s, a)) in (0, 2); the output layer starts at zero, so an untrained guide gives 1."""

    def __init__(self, observation_dim: int, action_dim: int, hidden_dims: Sequence[int] = (256, 256)) -> None:
        super().__init__()
        self.net = MLP(observation_dim + action_dim, 1, hidden_dims)
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return 2.0 * torch.sigmoid(self.net(torch.cat([obs, actions], dim=-1)).squeeze(-1))


def load_demonstrations(expert: Any, dataset: Dataset, owner: str) -> Dataset:
    """`expert` (a Dataset or load spec) as a Dataset with actions, of the same task as `dataset`."""
    from offrl.datasets import load as load_dataset

    if expert is None:
        raise ValueError(f"{owner} needs expert demonstrations: pass {owner}(expert=<Dataset or load spec>), e.g. a "
                         "few episodes of an expert dataset (dataset.subset(range(5)))")
    if isinstance(expert, (str, os.PathLike)):
        expert = load_dataset(expert)
    if not isinstance(expert, Dataset):
        raise TypeError(f"{owner} expert must be an offrl Dataset or a load spec, got {type(expert).__name__}")
    expert.require_labels("actions", context=f"{owner} expert")
    if (expert.observation_dim, expert.action_dim) != (dataset.observation_dim, dataset.action_dim):
        raise ValueError(
            f"{owner} expert has observation/action dims {(expert.observation_dim, expert.action_dim)} but the "
            f"training dataset has {(dataset.observation_dim, dataset.action_dim)}; give demonstrations of the same "
            "task")
    return expert


class Guide(FittedStateMixin, sklearn.base.BaseEstimator):
    """The guiding network's settings and the expert demonstrations it learns from.

    `expert`: a Dataset (with actions) or a load spec; a handful of episodes is
    what the method is for (the paper: "hundreds guide millions").
    `lr`: the guide's Adam learning rate (0 freezes it at the constant 1).
    `virtual_lr`: the SGD step size of the virtual actor update (None: the
    algorithm's actor learning rate).  `batch_size`: expert transitions per
    guide step.  `normalize` (default True): divide the scales by their mean
    over the batch, so the guide shifts the improvement between samples but
    cannot raise or lower it for the whole batch (the per-batch normalisation
    of meta-learned sample weights, as in learning-to-reweight and
    Meta-Weight-Net).  Without it the guide drove every scale toward 0 on
    hopper medium-expert, turning TD3+BC and IQL into near behaviour cloning
    (benchmarks/RESULTS.md, issue 14); False is the guide before 2026-12-06.
    `fit(dataset)` loads the expert data and checks it against the training
    dataset; the algorithm calls it on a clone.
    """

    _param_rules = {"expert": DEMONSTRATIONS_RULE, "hidden_dims": layer_sizes(), "lr": real(0, None),
                    "virtual_lr": real(0, None, closed="neither", none=True), "batch_size": integer(1),
                    "normalize": boolean()}

    def __init__(self, expert: Any = None, *, hidden_dims: Sequence[int] = (256, 256), lr: float = 1e-4,
                 virtual_lr: float | None = None, batch_size: int = 256, normalize: bool = True) -> None:
        self.expert = expert
        self.hidden_dims = hidden_dims
        self.lr = lr
        self.virtual_lr = virtual_lr
        self.batch_size = batch_size
        self.normalize = normalize

    def fit(self, X: Dataset, y: None = None) -> "Guide":
        """Load the expert demonstrations into `expert_` and check them against the training dataset `X`."""
        from offrl.algos.params import check_params

        check_params(self)
        expert = load_demonstrations(self.expert, X, "Guide")
        self.expert_ = expert
        return self


def as_guide(value: Any) -> Guide | None:
    """The `guide=` parameter as a Guide: None, a Guide, a Dataset or load spec, or a dict of Guide parameters."""
    if value is None or isinstance(value, Guide):
        return value
    if isinstance(value, (Dataset, str, os.PathLike)):
        return Guide(expert=value)
    if isinstance(value, Mapping):
        try:
            return Guide(**value)
        except TypeError as err:
            raise TypeError(f"guide settings {sorted(value)} are not Guide parameters ({err}); use expert, "
                            "hidden_dims, lr, virtual_lr, batch_size, normalize") from err
    raise TypeError(f"guide must be None, an offrl.algos.guide.Guide, an expert Dataset or load spec, or a dict of "
                    f"Guide parameters; got {type(value).__name__}")


class GuidedMixin:
    """What an algorithm needs to take `guide=`: building the guide, drawing expert batches, the meta step.

    Declares the `guide` parameter's rule; the algorithm adds `guide` to its `__init__`.

    The algorithm calls `_build_guide(spec)` in `_build` (after its own
    networks), `_prepare_guide(dataset)` when training data is known, and
    `guided_scales(...)` in its update.  Nothing here touches the base
    algorithm's parameters, optimisers or random numbers.
    """

    guide: Any
    _param_rules = {"guide": GUIDE_RULE}

    def _build_guide(self, spec: dict[str, Any]) -> None:
        guide = as_guide(self.guide)
        if guide is None:
            return
        # The guide's initial weights and expert draws come from its own seed, so the global stream the base
        # algorithm uses (initialisation, target noise) is the same as without a guide.
        self.guide_seed_ = int(getattr(self, "guide_seed_", torch.initial_seed() % (2**62) + 1))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.guide_seed_)
            self.guide_net_ = GuideNetwork(spec["observation_dim"], spec["action_dim"],
                                           tuple(guide.hidden_dims)).to(self.device_)
        self.guide_optimizer_ = torch.optim.Adam(self.guide_net_.parameters(), lr=float(guide.lr))
        self._guide_expert = None

    def _prepare_guide(self, dataset: Dataset) -> None:
        """Expert observations (normalised like the training data) and actions as tensors on the device."""
        guide = as_guide(self.guide)
        if guide is None:
            return
        fitted = sklearn.base.clone(guide).fit(dataset) if not hasattr(guide, "expert_") else guide
        expert = fitted.expert_
        with torch.no_grad():
            obs = self.obs_normalizer_(torch.as_tensor(np.ascontiguousarray(expert.observations, np.float32),
                                                       device=self.device_))
        actions = torch.as_tensor(np.ascontiguousarray(expert.actions, np.float32), device=self.device_)
        virtual_lr = fitted.virtual_lr if fitted.virtual_lr is not None else getattr(self, "actor_lr", 3e-4)
        self._guide_expert = (obs, actions, int(fitted.batch_size), float(virtual_lr))
        self._guide_normalize = bool(fitted.normalize)
        self._guide_generator = torch.Generator(device=obs.device)

    def _expert_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        if getattr(self, "_guide_expert", None) is None:
            raise RuntimeError(f"{type(self).__name__}: the guide's expert data is not prepared; fit the model first")
        obs, actions, batch_size, virtual_lr = self._guide_expert
        generator = self._guide_generator
        generator.manual_seed(self.guide_seed_ * 1_000_003 + int(step))  # a stream per step: resume-exact
        index = torch.randint(len(obs), (batch_size,), generator=generator, device=obs.device)
        return obs[index], actions[index], virtual_lr


def guided_scales(algo: Any, obs: torch.Tensor, actions: torch.Tensor, step: int,
                  actor_loss_of: Callable[[Mapping[str, torch.Tensor], torch.Tensor], torch.Tensor],
                  expert_loss_of: Callable[[Mapping[str, torch.Tensor], torch.Tensor, torch.Tensor], torch.Tensor],
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One guide update by the meta-gradient, then the updated guide's scales for this batch (detached).

    `actor_loss_of(params, scales)` is the base actor loss with the policy's
    parameters `params` (a name -> tensor mapping used with
    `torch.func.functional_call`) and per-sample scales; `expert_loss_of(params,
    expert_obs, expert_actions)` the policy's BC loss on expert data.
    """
    net, optimizer = algo.guide_net_, algo.guide_optimizer_
    expert_obs, expert_actions, virtual_lr = algo._expert_batch(step)
    params = dict(algo.policy_.named_parameters())

    def scales_of(batch_obs: torch.Tensor, batch_actions: torch.Tensor) -> torch.Tensor:
        w = net(batch_obs, batch_actions)
        return w / w.mean() if algo._guide_normalize else w

    scales = scales_of(obs, actions)
    grads = torch.autograd.grad(actor_loss_of(params, scales), list(params.values()), create_graph=True)
    virtual = {name: p - virtual_lr * g for (name, p), g in zip(params.items(), grads)}
    guide_loss = expert_loss_of(virtual, expert_obs, expert_actions)
    guide_params = list(net.parameters())
    guide_grads = torch.autograd.grad(guide_loss, guide_params)
    optimizer.zero_grad(set_to_none=True)
    for p, g in zip(guide_params, guide_grads):
        p.grad = g
    optimizer.step()
    with torch.no_grad():
        scales = scales_of(obs, actions)
    return scales, {"guide_loss": guide_loss.detach(), "guide_scale_mean": scales.mean(), "guide_scale_std": scales.std()}


class _Method(nn.Module):
    """Calls one method of the wrapped module, so `functional_call` can reach methods other than forward."""

    def __init__(self, module: nn.Module, method: str) -> None:
        super().__init__()
        self.module = module
        self.method = method

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.module, self.method)(*args, **kwargs)


def call_policy(policy: nn.Module, params: Mapping[str, torch.Tensor], *args: Any, method: str = "forward",
                **kwargs: Any) -> Any:
    """`policy.<method>(*args)` computed with `params` in place of its parameters (its buffers stay)."""
    return functional_call(_Method(policy, method), {f"module.{k}": v for k, v in params.items()}, args, kwargs)
