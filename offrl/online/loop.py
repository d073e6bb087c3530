"""The one online loop: act in environments, store transitions, update, monitor, checkpoint, resume.

`SAC.fit_online` (learning from scratch) and `OfflineAlgorithm.fit_online`
(fine-tuning a fitted offline algorithm) both run `run_online`.  What differs
between them, and between fine-tuning recipes, is an `OnlineStrategy`
(`offrl.online.strategies`): the warm-up (how many steps, with uniform or
policy actions), the update-to-data ratio, what the replay buffer starts
with and how a batch is drawn, the critics the update uses, who acts (a
guide for the first steps of an episode, an optimistic choice among
samples).  A new strategy overrides one of its small methods; the loop
stays one.

The loop talks to the agent through three methods, so it needs nothing from
`offrl.algos`:

- `agent._online_act(obs, generator) -> (actions, log_probs)`: exploration
  actions (env units) for raw observations (k, obs_dim), drawn with `generator`;
- `agent._online_update(batch) -> dict[str, Tensor]`: one gradient step on a
  replay batch of raw transitions;
- `agent._online_extra_names()` and `agent._online_extras(episode: Dataset)
  -> dict[str, ndarray]`: extra per-transition columns the update needs
  (e.g. Cal-QL's Monte-Carlo returns), computed once an episode is
  complete; none for most agents.
  When an agent has extras, an episode's transitions enter the buffer at
  its end (Cal-QL's online recipe), else at every step.

Environments: one env, a gymnasium id with `n_envs`, or a list of envs,
stepped in lock step with one batched policy call.  Episode j (counted over
all envs in the order they end) is reset with seed
`episode_seed(seed, 1, j)`, so a run is repeatable.  Checkpoints are
written at steps where every env is at an episode boundary (always true
for one env at an episode's end), so a resumed run continues exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

from offrl.datasets.core import Dataset
from offrl.monitor import TrainingMonitor, read_checkpoint, write_checkpoint
from offrl.online.replay import ReplayBuffer
from offrl.online.strategies import OnlineStrategy

__all__ = ["OnlineStrategy", "run_online", "episode_seed", "make_envs", "OnlineNames"]

TRAIN_STREAM = 1  # the seed stream of training episode resets (evaluation uses its own seeds)


def episode_seed(seed: int, stream: int, *index: int) -> int:
    """A seed for episode `index` of stream `stream` (e.g. an env reset), independent across streams and indices."""
    return int(np.random.SeedSequence([int(seed) % 2**63, int(stream), *map(int, index)]).generate_state(1)[0])


@dataclass(frozen=True)
class OnlineNames:
    """The fitted attributes a run keeps its counters in (SAC's are the plain names; fine-tuning's say `online_`)."""

    steps: str = "n_steps_done_"
    episodes: str = "n_episodes_done_"
    updates: str = "n_updates_done_"
    returns: str = "episode_returns_"
    history: str = "history_"
    seed: str = "seed_"


FINE_TUNING_NAMES = OnlineNames("online_steps_done_", "online_episodes_done_", "online_updates_done_",
                                "online_episode_returns_", "online_history_", "online_seed_")


def make_envs(env: Any, n_envs: int = 1) -> list[Any]:
    """A list of env instances: from an env, a list of envs, or a gymnasium id (made `n_envs` times)."""
    from offrl.evaluation import make_env

    if isinstance(env, (list, tuple)):
        envs = list(env)
    elif isinstance(env, str):
        envs = [make_env(env) for _ in range(int(n_envs))]
    else:
        if int(n_envs) != 1:
            raise ValueError("n_envs > 1 needs a gymnasium id (or a list of envs), not one env instance")
        envs = [make_env(env)]
    if not envs:
        raise ValueError("env is an empty list; pass at least one environment")
    import gymnasium as gym

    if any(isinstance(e, gym.vector.VectorEnv) for e in envs):
        raise ValueError("pass a gymnasium id with n_envs=..., or a list of envs, instead of a gymnasium VectorEnv "
                         "(the loop resets each env with its own seed)")
    return envs


def run_online(agent: Any, envs: list[Any], n_steps: int, *, strategy: OnlineStrategy, **options: Any) -> Any:
    """Run `agent` online for `n_steps` environment steps (see `_run_online`); returns `agent`.

    Whatever happens, the agent gets its own update options back from the
    strategy at the end (they hold only during the run).
    """
    try:
        return _run_online(agent, envs, n_steps, strategy=strategy, **options)
    finally:
        strategy.teardown(agent)


def _run_online(
    agent: Any,
    envs: list[Any],
    n_steps: int,
    *,
    strategy: OnlineStrategy,
    names: OnlineNames,
    start_fresh: Callable[[], None],
    batch_size: int,
    buffer_size: int,
    offline_dataset: Dataset | None = None,
    eval_env: Any = None,
    eval_every: int | None = None,
    eval_episodes: int = 10,
    callbacks: Iterable[Callable[[Any, int, dict[str, float]], Any]] = (),
    log_every: int = 1000,
    log_dir: str | Path | None = None,
    checkpoint_path: str | Path | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    progress: bool = True,
    seed: int,
    desc: str | None = None,
) -> Any:
    """Run `agent` online for `n_steps` environment steps (see the module docstring); returns `agent`.

    `start_fresh()` prepares the agent for a new run (SAC builds its
    networks from the env here; a fitted offline algorithm keeps its own).
    Callbacks run at each evaluation step (every `eval_every` steps) as
    `callback(agent, step, row)`; returning False stops the run.  With
    `checkpoint_path`, the whole run (networks, optimisers, replay buffer,
    RNGs, strategy state) is written at the first all-envs episode boundary
    after every `checkpoint_every` steps and at the end; `resume=True`
    continues from it to the same result as an uninterrupted run.
    """
    n_steps = int(n_steps)
    if n_steps < 1:
        raise ValueError(f"n_steps must be at least 1, got {n_steps}")
    checkpoint = None if checkpoint_path is None else Path(checkpoint_path)
    if resume and checkpoint is None:
        raise ValueError("resume=True needs a checkpoint (checkpoint_path or log_dir) to resume from")
    device = agent.device_
    generator = torch.Generator(device=device)
    extra_names = list(agent._online_extra_names())
    resumed = resume and checkpoint is not None and checkpoint.exists()
    if resumed:
        state = read_checkpoint(checkpoint, agent, generator, key="online_checkpoint",
                                required=("replay_buffer", "episode_returns", "at_episode_boundary"))
        setattr(agent, names.history, list(state["history"]))
        agent.replay_buffer_ = ReplayBuffer.from_state_dict(state["replay_buffer"], device)
        setattr(agent, names.returns, list(map(float, state["episode_returns"])))
        strategy.setup(agent, envs, offline_dataset, extra_names, fresh=False, seed=int(seed))
        strategy.load_state_dict(state.get("strategy", {}))
        if getattr(agent, names.steps) >= n_steps:
            return agent  # the run had already finished
        if not state["at_episode_boundary"]:
            raise ValueError(
                f"checkpoint {checkpoint} ends a finished run of {getattr(agent, names.steps)} steps in mid-episode, "
                f"so it cannot be continued to {n_steps} steps; train a new run (resume=False)")
    else:
        run_seed = int(seed)
        torch.manual_seed(run_seed)
        generator.manual_seed(run_seed)
        start_fresh()
        strategy.setup(agent, envs, offline_dataset, extra_names, fresh=True, seed=run_seed)
        setattr(agent, names.seed, run_seed)
        agent.replay_buffer_ = strategy.initial_buffer(agent, min(int(buffer_size), n_steps), offline_dataset, extra_names)
        for attr in (names.steps, names.episodes, names.updates):
            setattr(agent, attr, 0)
        setattr(agent, names.returns, [])
        setattr(agent, names.history, [])
    spec = agent.spec_
    for env in envs:
        _check_env_matches(env, spec)
    run_seed = getattr(agent, names.seed)
    start = getattr(agent, names.steps)
    buffer: ReplayBuffer = agent.replay_buffer_
    returns: list[float] = getattr(agent, names.returns)
    history: list = getattr(agent, names.history)
    low = torch.as_tensor(spec["action_low"], device=device)
    high = torch.as_tensor(spec["action_high"], device=device)
    uniform_log_prob = float(-np.log(np.asarray(spec["action_high"]) - np.asarray(spec["action_low"])).sum())

    def uniform(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        actions = low + (high - low) * torch.rand((k, *low.shape), generator=generator, device=device)
        return actions, torch.full((k,), uniform_log_prob, device=device)

    n_envs = len(envs)
    episode_return = np.zeros(n_envs)
    pending: list[list[tuple]] = [[] for _ in range(n_envs)]  # transitions held until episode end (agents with extras)
    episode_steps = np.zeros(n_envs, np.int64)  # steps of each env's current episode (JSRL's guide counts them)
    observations = []
    for i, env in enumerate(envs):  # runs start and resume at an episode boundary, each reset seeded by its index
        obs, _ = env.reset(seed=episode_seed(run_seed, TRAIN_STREAM, getattr(agent, names.episodes) + len(observations)))
        observations.append(np.asarray(obs, np.float32))
        if not resumed:  # a resumed strategy's state already holds what its start of episode decided
            strategy.episode_start(i)
    batch_size = int(strategy.batch_size or batch_size)
    next_episode = getattr(agent, names.episodes) + n_envs  # index of the next reset
    last_checkpoint = start
    metrics: dict[str, torch.Tensor] = {}
    monitor = TrainingMonitor(agent, n_steps, start=start, log_every=log_every, eval_env=eval_env, eval_every=eval_every,
                              eval_episodes=eval_episodes, callbacks=callbacks, callbacks_on="eval", log_dir=log_dir,
                              resume=resumed, progress=progress, desc=desc, checkpoint_path=checkpoint, history=history,
                              row_extras=lambda: {**({"train_return": returns[-1]} if returns else {}),
                                                  **strategy.log_values()})
    agent._set_training_mode(True)
    step = start
    try:
        while step < n_steps:
            k = min(n_envs, n_steps - step)
            obs_batch = np.stack(observations[:k])
            actions_t, log_probs_t = strategy.act(agent, obs_batch, step, generator, uniform, episode_steps[:k])
            actions = actions_t.detach().cpu().numpy()
            log_probs = log_probs_t.detach().float().cpu().numpy()
            all_at_boundary = True
            for i in range(k):
                next_obs, reward, terminated, truncated, _ = envs[i].step(actions[i])
                row = (observations[i], actions[i], float(reward), np.asarray(next_obs, np.float32), float(terminated),
                       float(truncated and not terminated), float(log_probs[i]))
                if extra_names:
                    pending[i].append(row)
                else:
                    buffer.add(*row)
                episode_return[i] += float(reward)
                episode_steps[i] += 1
                if terminated or truncated:
                    if extra_names:
                        _add_episode(agent, buffer, pending[i])
                        pending[i] = []
                    returns.append(float(episode_return[i]))
                    setattr(agent, names.episodes, getattr(agent, names.episodes) + 1)
                    strategy.episode_end(i, float(episode_return[i]))
                    episode_return[i] = 0.0
                    episode_steps[i] = 0
                    obs, _ = envs[i].reset(seed=episode_seed(run_seed, TRAIN_STREAM, next_episode))
                    next_episode += 1
                    observations[i] = np.asarray(obs, np.float32)
                    strategy.episode_start(i)
                else:
                    observations[i] = np.asarray(next_obs, np.float32)
                    all_at_boundary = False
            prev, step = step, step + k
            if step > strategy.warmup_steps and strategy.can_sample(buffer):
                for _ in range(strategy.utd_ratio * k):
                    metrics = agent._online_update(strategy.sample(buffer, batch_size, generator))
                    setattr(agent, names.updates, getattr(agent, names.updates) + 1)
            setattr(agent, names.steps, step)
            if all_at_boundary and returns:
                monitor.set_postfix({"return": f"{returns[-1]:.1f}",
                                     **{key: f"{v:.3g}" for key, v in list(monitor.values.items())[:3]}})

            def write(step: int = step, at_boundary: bool = all_at_boundary) -> None:
                nonlocal last_checkpoint
                if checkpoint is None:
                    return
                if step == n_steps or (at_boundary and checkpoint_every and step - last_checkpoint >= checkpoint_every):
                    agent.online_strategy_ = strategy.describe()
                    write_checkpoint(checkpoint, agent, generator, step, key="online_checkpoint", history=history,
                                     extra={"at_episode_boundary": bool(at_boundary),
                                            "replay_buffer": buffer.state_dict(),
                                            "episode_returns": list(map(float, returns)),
                                            "strategy": strategy.state_dict()})
                    last_checkpoint = step

            if not monitor.after_step(step, metrics, prev=prev, before_callbacks=write):
                break
    finally:
        monitor.close()
    agent.online_strategy_ = strategy.describe()
    agent.last_metrics_ = {key: float(v) for key, v in metrics.items()}
    return agent


def _add_episode(agent: Any, buffer: ReplayBuffer, rows: list[tuple]) -> None:
    obs, actions, rewards, next_obs, terminals, timeouts, log_probs = (np.asarray(c) for c in zip(*rows))
    timeouts = timeouts.copy()
    timeouts[-1] = 0.0 if terminals[-1] else 1.0
    episode = Dataset(observations=obs, actions=actions, rewards=rewards, terminals=terminals, timeouts=timeouts,
                      next_observations=next_obs, episode_starts=np.array([0, len(rows)]))
    buffer.add(obs, actions, rewards, next_obs, terminals, timeouts, log_probs, extras=agent._online_extras(episode))


def _check_env_matches(env: Any, spec: Mapping[str, Any]) -> None:
    obs_shape = getattr(env.observation_space, "shape", None)
    act_shape = getattr(env.action_space, "shape", None)
    obs_dim = int(np.prod(obs_shape)) if obs_shape else None
    act_dim = int(np.prod(act_shape)) if act_shape else None
    if (obs_dim, act_dim) != (spec["observation_dim"], spec["action_dim"]):
        name = env.spec.id if getattr(env, "spec", None) is not None else type(env).__name__
        raise ValueError(f"{name} has observation/action dims {(obs_dim, act_dim)} but the agent was built for "
                         f"{(spec['observation_dim'], spec['action_dim'])}; fine-tune in the task the agent learned")

