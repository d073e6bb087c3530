"""Policy roll-outs in gymnasium environments (single or vector), shared by every estimator.

Roll-outs act through an `Actor`: reset at the start of a run, asked for
actions with the observations and each env's time step, and told the
rewards and which episodes ended.  A stateless policy (a function of the
observation) is wrapped in `FunctionActor`; a policy that needs its recent
context (a transformer) or the time step (a guide that hands over
mid-episode) keeps that state in its own Actor (`estimator.make_actor()`).
"""

from __future__ import annotations

import abc
import math
from typing import Any, Callable, Mapping

import numpy as np

__all__ = ["evaluate_policy", "make_env", "Actor", "FunctionActor", "as_actor"]


class Actor(abc.ABC):
    """The stateful acting interface of evaluation and OPE roll-outs.

    `reset(n_envs)` starts `n_envs` parallel episodes; `act(observations,
    timesteps)` gets (n_envs, obs_dim) observations and each env's step
    within its episode and returns (n_envs, ...) actions; `observe(rewards,
    episode_over)` reports the step's rewards, and for each env whose
    `episode_over` is True the next `act` starts a new episode (clear that
    env's context).
    """

    def reset(self, n_envs: int) -> None:
        """Start `n_envs` episodes; an actor without context has nothing to clear."""

    @abc.abstractmethod
    def act(self, observations: np.ndarray, timesteps: np.ndarray) -> np.ndarray:
        """Actions (n_envs, ...) for observations (n_envs, obs_dim) at each env's step within its episode."""

    def observe(self, rewards: np.ndarray, episode_over: np.ndarray) -> None:
        """Take the step's rewards and episode ends; an actor without context keeps none of it."""


class FunctionActor(Actor):
    """A stateless policy (batch of observations -> batch of actions) as an Actor."""

    def __init__(self, policy: Callable[[np.ndarray], np.ndarray]) -> None:
        self.policy = policy

    def act(self, observations: np.ndarray, timesteps: np.ndarray) -> np.ndarray:
        return self.policy(observations)


def as_actor(policy: Any) -> Actor:
    """An Actor from an Actor, an estimator with `make_actor()`, or a function of the observations."""
    if isinstance(policy, Actor):
        return policy
    if hasattr(policy, "make_actor"):
        return policy.make_actor()
    if callable(policy):
        return FunctionActor(policy)
    raise TypeError(f"policy must be an Actor, an estimator or a function of observations, got {type(policy).__name__}")


def make_env(env: Any) -> Any:
    """An env instance from an env or a gymnasium id."""
    if isinstance(env, str):
        import gymnasium as gym

        try:
            return gym.make(env)
        except Exception as err:
            raise ValueError(f"cannot make gymnasium env {env!r} ({err}); pass a registered id or an env instance") from err
    return env


def evaluate_policy(
    policy: Callable[[np.ndarray], np.ndarray] | Actor | Any,
    env: Any,
    n_episodes: int = 10,
    seed: int = 0,
    reference: Mapping[str, Any] | None = None,
    gamma: float | None = None,
    max_steps: int | None = None,
) -> dict[str, Any]:
    """Run `policy` for `n_episodes` episodes: an `Actor`, an estimator (its `make_actor()`), or a function
    from a batch of observations to a batch of actions.

    Episode i of a single env is reset with seed `seed + i`.  A gymnasium
    vector env is reset once with `seed` and each sub-env contributes its
    first episodes, so short episodes are not favoured.  Returns mean/std
    return (and normalised score when `reference` has ref_min/max_score, and
    the discounted return when `gamma` is given).
    """
    import gymnasium as gym

    if n_episodes < 1:
        raise ValueError(f"n_episodes must be at least 1, got {n_episodes}")
    env = make_env(env)
    actor = as_actor(policy)
    if isinstance(env, gym.vector.VectorEnv):
        if max_steps is not None:
            raise ValueError("max_steps is not supported for vector envs; wrap each env in a TimeLimit instead")
        returns, discounted, lengths = _rollout_vector(actor, env, n_episodes, seed, gamma)
    else:
        returns, discounted, lengths = [], [], []
        for i in range(n_episodes):
            obs, _ = env.reset(seed=seed + i)
            actor.reset(1)
            total, disc, t, done = 0.0, 0.0, 0, False
            while not done:
                action = actor.act(np.asarray(obs, np.float32)[None], np.array([t]))[0]
                obs, reward, terminated, truncated, _ = env.step(action)
                total += float(reward)
                disc += (gamma ** t if gamma is not None else 0.0) * float(reward)
                t += 1
                done = terminated or truncated or (max_steps is not None and t >= max_steps)
                actor.observe(np.array([float(reward)]), np.array([done]))
            returns.append(total)
            discounted.append(disc)
            lengths.append(t)
    returns_arr = np.asarray(returns, np.float64)
    result: dict[str, Any] = {
        "return_mean": float(returns_arr.mean()),
        "return_std": float(returns_arr.std()),
        "length_mean": float(np.mean(lengths)),
        "n_episodes": len(returns),
        "returns": returns_arr.tolist(),
    }
    if gamma is not None:
        result["discounted_return_mean"] = float(np.mean(discounted))
        result["discounted_return_std"] = float(np.std(discounted))
        result["discounted_returns"] = list(map(float, discounted))
    if reference is not None and reference.get("ref_min_score") is not None and reference.get("ref_max_score") is not None:
        low, high = float(reference["ref_min_score"]), float(reference["ref_max_score"])
        scores = 100.0 * (returns_arr - low) / (high - low)
        result["normalized_score_mean"] = float(scores.mean())
        result["normalized_score_std"] = float(scores.std())
    return result


def _rollout_vector(actor: Actor, env: Any, n_episodes: int, seed: int, gamma: float | None) -> tuple[list, list, list]:
    import gymnasium as gym

    n_envs = env.num_envs
    quota = math.ceil(n_episodes / n_envs)
    per_env: list[list[tuple[float, float, int]]] = [[] for _ in range(n_envs)]
    next_step_reset = env.metadata.get("autoreset_mode", gym.vector.AutoresetMode.NEXT_STEP) == gym.vector.AutoresetMode.NEXT_STEP
    obs, _ = env.reset(seed=seed)
    total = np.zeros(n_envs)
    disc = np.zeros(n_envs)
    steps = np.zeros(n_envs, dtype=np.int64)
    resetting = np.zeros(n_envs, dtype=bool)
    actor.reset(n_envs)
    while min(len(p) for p in per_env) < quota:
        actions = actor.act(np.asarray(obs, np.float32), steps.copy())
        obs, reward, terminated, truncated, _ = env.step(actions)
        active = ~resetting
        total[active] += reward[active]
        if gamma is not None:
            disc[active] += (gamma ** steps[active]) * reward[active]
        steps[active] += 1
        done = (terminated | truncated) & active
        # An env that was resetting acted on a stale observation: clear its context again.
        actor.observe(np.where(active, reward, 0.0), done | resetting)
        for i in np.flatnonzero(done):
            if len(per_env[i]) < quota:
                per_env[i].append((float(total[i]), float(disc[i]), int(steps[i])))
            total[i] = disc[i] = 0.0
            steps[i] = 0
        resetting = done if next_step_reset else np.zeros(n_envs, dtype=bool)
    episodes = [ep for i in range(quota) for p in per_env for ep in p[i:i + 1]][:n_episodes]
    return [e[0] for e in episodes], [e[1] for e in episodes], [e[2] for e in episodes]
