"""How good an MBRCSL run's kept roll-outs really are: where they leave the logged data, and on Pendulum (deterministic,
so a roll-out replays exactly) their true returns.

    OFFRL_DATA_DIR=/tmp/offrl-iql-data python experiments/mbrcsl_probe.py RUN/model.pt [--dataset SPEC]
    OFFRL_DATA_DIR=/tmp/offrl-data-mj3 python experiments/mbrcsl_probe.py RUN/model.pt \
        --dataset offrl:hopper-medium-v5 --sac-steps 300000

Regenerates the run's kept roll-outs from its saved model and behaviour policy (the same generator stream as
`fit`) and prints their model returns and lengths, the largest per-step model reward against the logged one, and how
many roll-out steps lie outside the logged observations' per-dimension range (where the learned model, and its
learned termination, have no data).  On Pendulum-v1 it also replays each roll-out's actions open loop in the real
environment from its start state and prints the true returns (issue 15's notes in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse

import gymnasium as gym
import numpy as np

import offrl
from offrl.algos.base import _seed_from
from offrl.datasets import load


def pendulum_true_returns(rollouts) -> np.ndarray:
    env = gym.make("Pendulum-v1").unwrapped
    true_returns = np.zeros(rollouts.n_episodes)
    for e in range(rollouts.n_episodes):
        first, end = rollouts.episode_starts[e], rollouts.episode_starts[e + 1]
        cos, sin, speed = rollouts.observations[first]
        env.reset(seed=0)
        env.state = np.array([np.arctan2(sin, cos), speed])
        for t in range(first, end):
            true_returns[e] += env.step(rollouts.actions[t])[1]
    return true_returns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="an MBRCSL model file (a sweep run's model.pt)")
    parser.add_argument("--dataset", default="offrl:pendulum-medium-replay-v1", help="the data it was fitted on")
    parser.add_argument("--sac-steps", type=int, default=None, help="the build's SAC budget (offrl: specs)")
    args = parser.parse_args()
    algo = offrl.load(args.model)
    data = load(args.dataset) if args.sac_steps is None else load(args.dataset, sac_steps=args.sac_steps)
    rollouts = algo._rollouts(data, algo._generator(_seed_from(algo.random_state), 3))
    if rollouts is None:
        print(f"no roll-out beat the threshold {algo.return_threshold_:.1f} (best {algo.rollout_return_max_:.1f})")
        return
    model_returns = rollouts.episode_returns()
    print(f"kept {rollouts.n_episodes} roll-outs (threshold {algo.return_threshold_:.1f}); model returns mean "
          f"{model_returns.mean():.1f}, median {np.median(model_returns):.1f}, best {model_returns.max():.1f}; lengths "
          f"{rollouts.episode_lengths().min()}-{rollouts.episode_lengths().max()}; logged episodes' mean return "
          f"{data.episode_returns().mean():.1f}")
    low, high = data.observations.min(0), data.observations.max(0)
    outside = ((rollouts.observations < low) | (rollouts.observations > high)).any(1)
    bounds = list(zip(rollouts.episode_starts[:-1], rollouts.episode_starts[1:]))
    first_exit = [int(np.argmax(outside[s:e])) for s, e in bounds if outside[s:e].any()]
    print(f"largest per-step model reward {rollouts.rewards.max():.2f} (logged: {data.rewards.max():.2f}); "
          f"{100 * outside.mean():.1f}% of roll-out steps outside the logged observation range; "
          f"{len(first_exit)} of {len(bounds)} roll-outs leave it"
          + (f", first at step {np.median(first_exit):.0f} (median)" if first_exit else ""))
    if data.metadata.get("env_id") == "Pendulum-v1":
        true_returns = pendulum_true_returns(rollouts)
        print(f"open-loop true returns mean {true_returns.mean():.1f}, best {true_returns.max():.1f}; correlation "
              f"with the model's {np.corrcoef(model_returns, true_returns)[0, 1]:.2f}")


if __name__ == "__main__":
    main()
