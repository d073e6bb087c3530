"""The stateful acting interface: roll-outs reset the actor, pass each env's time step and report episode ends."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from offrl.algos import BC
from offrl.evaluation import Actor, FunctionActor, as_actor, evaluate_policy
from offrl.ope.harness import true_policy_value
from conftest import pendulum_shaped_dataset

pytestmark = pytest.mark.usefixtures("one_thread")


class RecordingActor(Actor):
    """Acts with zeros and keeps, per env, the time steps it was asked at within the current episode."""

    def __init__(self) -> None:
        self.resets: list[int] = []
        self.episodes: list[list[int]] = []

    def reset(self, n_envs: int) -> None:
        self.resets.append(n_envs)
        self.current = [[] for _ in range(n_envs)]

    def act(self, observations: np.ndarray, timesteps: np.ndarray) -> np.ndarray:
        for i, t in enumerate(timesteps):
            self.current[i].append(int(t))
        return np.zeros((len(observations), 1), np.float32)

    def observe(self, rewards: np.ndarray, episode_over: np.ndarray) -> None:
        for i in np.flatnonzero(episode_over):
            if self.current[i]:
                self.episodes.append(self.current[i])
            self.current[i] = []


def test_single_env_roll_outs_reset_and_count_steps():
    actor = RecordingActor()
    env = gym.make("Pendulum-v1", max_episode_steps=7)
    out = evaluate_policy(actor, env, n_episodes=3)
    assert actor.resets == [1, 1, 1] and out["n_episodes"] == 3
    assert actor.episodes == [list(range(7))] * 3


def test_vector_env_roll_outs_keep_each_envs_context():
    actor = RecordingActor()
    env = gym.make_vec("Pendulum-v1", num_envs=2, vectorization_mode="sync", max_episode_steps=5)
    evaluate_policy(actor, env, n_episodes=4)
    assert actor.resets == [2]
    # Every episode starts at time step 0 and counts up. Gymnasium's next-step autoreset spends one step on
    # the finished episode's last observation; the actor is told to clear that env again right after it, so
    # the stale step stays a context of its own (the one-step entries) and never leaks into the next episode.
    assert all(e == list(range(len(e))) for e in actor.episodes)
    real = [e for e in actor.episodes if len(e) > 1]
    assert len(real) >= 4 and all(len(e) == 5 for e in real)
    assert all(len(e) in (1, 5) for e in actor.episodes)


def test_estimators_act_through_make_actor_and_options_are_checked():
    data = pendulum_shaped_dataset(n_episodes=2, length=10)
    bc = BC(hidden_dims=(16, 16), random_state=0).fit(data, n_steps=2, progress=False)
    actor = as_actor(bc)
    assert isinstance(actor, FunctionActor)
    obs = data.observations[:3]
    np.testing.assert_array_equal(actor.act(obs, np.zeros(3, np.int64)), bc.predict(obs))
    with pytest.raises(TypeError, match="takes no options"):
        bc.evaluate("Pendulum-v1", n_episodes=1, target_return=10.0)
    with pytest.raises(TypeError, match="Actor, an estimator or a function"):
        as_actor(42)


def test_ope_true_values_use_a_stateful_policy_actor():
    data = pendulum_shaped_dataset(n_episodes=2, length=10)

    class ContextBC(BC):
        """A policy whose actions depend on the time step, as a transformer's or a guide's would."""

        def make_actor(self, deterministic=True, **options):
            actor = RecordingActor()
            actor.act = lambda obs, t: np.where(t[:, None] < 2, 2.0, -2.0).astype(np.float32)
            self.last_actor = actor
            return actor

    policy = ContextBC(hidden_dims=(16, 16), random_state=0).fit(data, n_steps=2, progress=False)
    env = gym.make("Pendulum-v1", max_episode_steps=4)
    value = true_policy_value(env, policy, gamma=0.9, n_rollouts=2)
    assert policy.last_actor.resets == [1, 1] and value["n"] == 2
