"""How good an MBRCSL run's kept roll-outs really are, on Pendulum (deterministic, so a roll-out replays exactly).

    OFFRL_DATA_DIR=/tmp/offrl-iql-data python experiments/mbrcsl_probe.py RUN/model.pt [--dataset SPEC]

Regenerates the run's kept roll-outs from its saved model and behaviour policy (the same generator stream as
`fit`), replays each roll-out's actions open loop in the real Pendulum-v1 from its start state, and prints the
model's returns next to the true ones (issue 15's note in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse

import gymnasium as gym
import numpy as np

import offrl
from offrl.algos.base import _seed_from
from offrl.datasets import load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="an MBRCSL model file (a sweep run's model.pt)")
    parser.add_argument("--dataset", default="offrl:pendulum-medium-replay-v1", help="the data it was fitted on")
    args = parser.parse_args()
    algo = offrl.load(args.model)
    data = load(args.dataset)
    rollouts = algo._rollouts(data, algo._generator(_seed_from(algo.random_state), 3))
    if rollouts is None:
        print("no roll-out beat the threshold")
        return
    model_returns = rollouts.episode_returns()
    env = gym.make("Pendulum-v1").unwrapped
    true_returns = np.zeros(rollouts.n_episodes)
    for e in range(rollouts.n_episodes):
        first, end = rollouts.episode_starts[e], rollouts.episode_starts[e + 1]
        cos, sin, speed = rollouts.observations[first]
        env.reset(seed=0)
        env.state = np.array([np.arctan2(sin, cos), speed])
        for t in range(first, end):
            true_returns[e] += env.step(rollouts.actions[t])[1]
    print(f"kept {rollouts.n_episodes} roll-outs (threshold {algo.return_threshold_:.1f}); model returns mean "
          f"{model_returns.mean():.1f}, best {model_returns.max():.1f}; open-loop true returns mean "
          f"{true_returns.mean():.1f}, best {true_returns.max():.1f}; correlation "
          f"{np.corrcoef(model_returns, true_returns)[0, 1]:.2f}; logged episodes' mean {data.episode_returns().mean():.1f}")


if __name__ == "__main__":
    main()
