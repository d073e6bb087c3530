"""A small-budget learning check: IQL improves clearly over its initial policy on Pendulum-v1 data.

The dataset is recorded here (seconds, no SAC run): a third uniform-random
episodes, a third and a third of an energy-pumping swing-up controller with
heavy (sigma 2) and very heavy (sigma 4) action noise, so the data mix good
and bad behaviour as a medium-replay dataset does.  The full acceptance runs
on `offrl datasets build` datasets are recorded in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from offrl.algos import IQL
from offrl.datasets import Dataset


def swing_up(obs: np.ndarray, rng: np.random.Generator, noise: float) -> float:
    cos, sin, speed = obs
    if cos > 0.8:  # near the top: PD control
        torque = -10.0 * np.arctan2(sin, cos) - 2.0 * speed
    else:  # pump energy (0 at rest upright) until there is enough to swing up
        energy = 0.5 * speed**2 + 15.0 * (cos - 1.0)
        torque = 2.0 * np.sign(speed) if energy < 0 else -0.5 * speed
    return float(np.clip(torque + noise * rng.normal(), -2.0, 2.0))


def pendulum_mixed_dataset(n_episodes: int = 30, seed: int = 0) -> Dataset:
    env = gym.make("Pendulum-v1")
    rng = np.random.default_rng(seed)
    episodes = []
    for i in range(n_episodes):
        obs, _ = env.reset(seed=1000 + i)
        observations, actions, rewards = [obs], [], []
        for _ in range(200):
            action = rng.uniform(-2, 2) if i % 3 == 0 else swing_up(obs, rng, 2.0 if i % 3 == 1 else 4.0)
            obs, reward, _, _, _ = env.step(np.array([action], np.float32))
            observations.append(obs)
            actions.append([action])
            rewards.append(reward)
        episodes.append({"observations": np.array(observations), "actions": np.array(actions),
                         "rewards": np.array(rewards), "truncations": [False] * 199 + [True]})
    return Dataset.from_episodes(episodes, action_low=-2.0, action_high=2.0,
                                 metadata={"name": "pendulum-mixed", "env_id": "Pendulum-v1"})


@pytest.mark.slow
def test_iql_improves_clearly_over_its_initial_policy_on_pendulum():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dataset = pendulum_mixed_dataset()
        data_mean = float(dataset.episode_returns().mean())  # about -800
        algo = IQL(random_state=0)  # the paper's defaults
        algo.fit(dataset, n_steps=0, progress=False)
        initial = algo.evaluate("Pendulum-v1", n_episodes=5, seed=0)["return_mean"]  # about -1350
        algo.fit(dataset, n_steps=3000, progress=False)
        final = algo.evaluate("Pendulum-v1", n_episodes=10, seed=0)["return_mean"]  # about -390
    finally:
        torch.set_num_threads(threads)
    assert final > initial + 400, (initial, final)
    assert final > data_mean, (data_mean, final)
