"""MeanFlow behaviour cloning on the ring-of-Gaussians toy: which training detail lets OFQL's one-step samples
(a = eps - u(s, eps, 0, 1)) find the modes in a short budget (issue 13; results in benchmarks/RESULTS.md).

The ring, its context bit and the mode criterion are the test suite's (tests/test_generative_algos.py), so the
shares printed here are the ones the OFQL ring test asserts on.  The loss is written out (the JVP target through
torch.func.jvp) so that the variants can change one thing at a time:

    python experiments/meanflow_ring.py                                   # the committed recipe
    python experiments/meanflow_ring.py --adaptive 1                      # MeanFlow's adaptive loss weight, p = 1
    python experiments/meanflow_ring.py --condition t,t-r                 # the network sees (t, t - r)
    python experiments/meanflow_ring.py --times uniform --flow-ratio 0.25
    python experiments/meanflow_ring.py --time-dim 0 --lr 3e-3 --steps 6000   # raw times, no embedding
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_generative_algos import context_obs, mode_shares, ring_dataset  # noqa: E402

from offrl.nn.generative import ConditionalMLP  # noqa: E402


def train(steps: int, lr: float, time_dim: int, time_scale: float, adaptive: float, condition: str,
          flow_ratio: float, times: str, hidden: tuple[int, ...], seed: int, batch_size: int = 256) -> ConditionalMLP:
    torch.manual_seed(seed)
    data = ring_dataset()
    obs_all, act_all = torch.as_tensor(data.observations), torch.as_tensor(data.actions)
    net = ConditionalMLP(1, 2, hidden, time_dim, 2, "mish", time_scale=time_scale)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)

    def u(obs, x, r, t):
        return net(obs, x, r, t) if condition == "r,t" else net(obs, x, t, t - r)

    for _ in range(steps):
        idx = torch.randint(0, len(obs_all), (batch_size,), generator=gen)
        obs, a = obs_all[idx], act_all[idx]
        eps = torch.randn(a.shape, generator=gen)
        draws = (torch.sigmoid(-0.4 + torch.randn((batch_size, 2), generator=gen)) if times == "logit-normal"
                 else torch.rand((batch_size, 2), generator=gen))
        t, r = draws.max(1, keepdim=True).values, draws.min(1, keepdim=True).values
        r = torch.where(torch.rand((batch_size, 1), generator=gen) < flow_ratio, t, r)
        x_t, v = (1 - t) * a + t * eps, eps - a
        with torch.no_grad():  # u_tgt = v - (t - r) du/dt along the path, a stop-gradient
            _, dudt = torch.func.jvp(lambda x, r_, t_: u(obs, x, r_, t_), (x_t, r, t),
                                     (v, torch.zeros_like(r), torch.ones_like(t)))
            target = v - (t - r) * dudt
        err = ((u(obs, x_t, r, t) - target) ** 2).sum(-1)
        if adaptive:  # MeanFlow's adaptive weight 1 / (err + c)^p, itself a stop-gradient
            err = err / (err.detach() + 1e-3) ** adaptive
        opt.zero_grad()
        err.mean().backward()
        opt.step()
    net.condition = condition
    return net


def one_step_shares(net: ConditionalMLP, seed: int) -> list[tuple[float, float, float]]:
    """Per context: (share near any of its modes, smallest share near one mode, mean radius)."""
    gen = torch.Generator().manual_seed(seed + 1)
    out = []
    with torch.no_grad():
        for context in (0, 1):
            obs = torch.as_tensor(context_obs(context))
            eps = torch.randn((len(obs), 2), generator=gen)
            zero, one = torch.zeros(len(obs), 1), torch.ones(len(obs), 1)
            times = (zero, one) if net.condition == "r,t" else (one, one)
            actions = (eps - net(obs, eps, *times)).numpy()
            per_mode, near = mode_shares(actions, context)
            out.append((near, float(per_mode.min()), float(np.linalg.norm(actions, axis=1).mean())))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--time-dim", type=int, default=64, help="0: the times enter as raw numbers")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--adaptive", type=float, default=0.0, help="p of the adaptive loss weight (0: plain)")
    parser.add_argument("--condition", choices=["r,t", "t,t-r"], default="r,t")
    parser.add_argument("--flow-ratio", type=float, default=0.5)
    parser.add_argument("--times", choices=["logit-normal", "uniform"], default="logit-normal")
    parser.add_argument("--hidden", default="256,256")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.process_time()
    net = train(args.steps, args.lr, args.time_dim, args.time_scale, args.adaptive, args.condition,
                args.flow_ratio, args.times, tuple(int(h) for h in args.hidden.split(",")), args.seed)
    shares = one_step_shares(net, args.seed)
    print(" ".join(f"context {c}: near a mode {n:.2f}, least-visited mode {m:.2f}, radius {r:.2f};"
                   for c, (n, m, r) in enumerate(shares)), f"({time.process_time() - start:.0f} s CPU)")


if __name__ == "__main__":
    main()
