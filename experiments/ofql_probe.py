"""What a trained generative policy does at a few pendulum states (issue 13's OFQL diagnosis in
benchmarks/RESULTS.md): the spread of its sampled actions per state, and where its critic puts the best action.

    python experiments/ofql_probe.py <run>/OFQL/seed0/model.pt [--states 5] [--samples 2000]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import offrl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--states", type=int, default=5)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    algo = offrl.load(args.model)
    rng = np.random.default_rng(args.seed)
    angle, velocity = rng.uniform(-np.pi, np.pi, args.states), rng.uniform(-8, 8, args.states)
    obs = torch.tensor(np.stack([np.cos(angle), np.sin(angle), velocity], 1), dtype=torch.float32)
    grid = torch.linspace(-1, 1, 41)
    print(f"{type(algo).__name__}: unit actions (5/25/50/75/95th percentiles) per state, share outside [-1, 1], "
          "and the critic's best action on a 41-point grid")
    with torch.no_grad():
        norm = algo.obs_normalizer_(obs)
        policy = algo.policy_
        for i in range(args.states):
            rows = norm[i:i + 1].expand(args.samples, -1)
            unit = policy.sample_unit(rows).reshape(-1)
            q_policy = algo.critic_(rows, policy.to_env(unit.clamp(-1, 1).reshape(-1, 1))).min(0).values.reshape(-1)
            q_grid = algo.critic_(norm[i:i + 1].expand(len(grid), -1), policy.to_env(grid.reshape(-1, 1)))
            q_grid = q_grid.min(0).values.reshape(-1)
            pct = np.percentile(unit.numpy(), [5, 25, 50, 75, 95])
            print(f"state {i} (angle {angle[i]:+.2f}, velocity {velocity[i]:+.2f}): "
                  f"{' '.join(f'{p:+.2f}' for p in pct)}; outside {float((unit.abs() > 1).float().mean()):.3f}; "
                  f"best grid action {float(grid[q_grid.argmax()]):+.2f}, Q there {float(q_grid.max()):.1f}, "
                  f"Q at the policy's median sample {float(q_policy.median()):.1f}")


if __name__ == "__main__":
    main()
