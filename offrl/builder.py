"""D4RL's recipe on any gymnasium continuous-control env, with no download.

`build("hopper-medium-v5")` trains SAC online on `Hopper-v5` once per
(env, seed, budget), keeping a snapshot of the policy at every evaluation
point, and collects the D4RL kinds from that one run:

- random: a uniform policy;
- medium: the snapshot whose (sampled-action) evaluation return lies closest
  to one third of the way from the random policy's return to the expert's;
- expert: the final policy (`expert="best"`: the best evaluated snapshot, for
  short budgets whose final policy has fallen back; see `build`);
- medium-replay: the run's replay buffer up to the medium snapshot;
- medium-expert: medium and expert concatenated.

Actions are sampled from the policies (not their means) and every transition
records the behaviour policy's log-probability of its action (a uniform
density for random actions).  Reference scores are the random and expert
policies' mean returns over `ref_episodes` episodes and are stored as Minari's
ref_min_score / ref_max_score.

This module sits above the algorithms (it trains SAC, through SAC's public
API only); the data layer's `offrl.datasets.built` names the datasets, holds
the layout under `$OFFRL_DATA_DIR` and loads what was built, so that
`offrl.datasets.load("offrl:<name>")` needs no algorithm.  `build` makes
what is missing and reports; `load_or_build` also returns the datasets.

A build is cached under a key that holds the request and SAC's full
configuration (every `get_params()` value that changes the run), so a new
SAC default never passes for an old one: `build` refuses a cached build
made with another configuration (`force=True` rebuilds it) and
`load_or_build` rebuilds it.  A build interrupted in SAC training resumes
from its last checkpoint (at an episode boundary) to the same result; a
dataset appears only once completely written.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from offrl.algos.sac import SAC, episode_seed
from offrl.datasets.built import (
    DEFAULT_EVAL_EPISODES,
    DEFAULT_N_ENVS,
    DEFAULT_REF_EPISODES,
    KINDS,
    BuildRequest,
    data_root,
    dataset_path,
    json_value,
    load_built,
    load_built_files,
    parse_name,
    read_json,
    read_metadata,
    resolve,
)
from offrl.datasets.core import Dataset, atomic_write_path
from offrl.datasets.d4rl import D4RL_REF_SCORES
from offrl.datasets.files import wait_for_lock
from offrl.online.replay import ReplayBuffer

__all__ = ["BuildReport", "build", "load_or_build", "check_build", "sac_config", "UNKEYED_SAC_PARAMS",
           "BUILD_LOCK_TIMEOUT"]

MEDIUM_SCORE = 100.0 / 3.0  # D4RL's medium: a third of the way from random to expert
# Below this D4RL-normalised score an expert has not learnt the task (D4RL's SAC experts score ~100-110): its
# kinds will not resemble D4RL's, and the medium policy (a third of the way to it) is barely above random.
WEAK_EXPERT_D4RL_SCORE = 50.0
_MIN_LEARNING_EVALS = 3
_MIN_UPDATES = 1000  # no SAC run reaches a medium policy on these tasks in fewer gradient steps
# Independent random streams (env resets, action noise) of one build.
_EVAL, _REF, _COLLECT = 2, 3, 4
_KIND_STREAM = {"random": 0, "medium": 1, "expert": 2}
# SAC's parameters that are not in the cache key's `sac_params`, and why.  Every other `SAC.get_params()` value is.
UNKEYED_SAC_PARAMS = {
    "n_steps": "the key's sac_steps",
    "random_state": "the key's seed",
    "device": "where the run computes, not what (as before: a cache serves CPU and GPU builds alike)",
    "log_every": "how often losses are checked and logged; it does not change the run",
}
# SAC parameters added after datasets were built, each with the value that reproduces those builds: a stored build
# configuration without one was made with that value, so it still matches (and is not rebuilt).
SAC_PARAMS_SINCE = {"n_critics": 2, "critic_layer_norm": False}
# SAC settings a build may not take from sac_params (the builder sets them).
_BUILDER_SAC_PARAMS = ("n_steps", "random_state", "device")
# How long a build waits for another process building the same SAC run (seconds; a full D4RL budget takes hours).
BUILD_LOCK_TIMEOUT = 48 * 3600.0


# ---------------------------------------------------------------------- configuration
def _check_env(env_id: str) -> dict[str, Any]:
    """Make the env once: a clear error for missing dependencies and for non-Box action spaces."""
    import gymnasium as gym

    try:
        env = gym.make(env_id)
    except Exception as err:
        raise ValueError(f"cannot make gymnasium env {env_id!r} ({type(err).__name__}: {err})") from err
    try:
        if not isinstance(env.action_space, gym.spaces.Box):
            raise ValueError(
                f"{env_id} has a {type(env.action_space).__name__} action space ({env.action_space}); offrl.builder "
                "trains SAC, which needs a continuous (Box) action space"
            )
        spec = SAC.spec_from_env(env)
        spec["max_episode_steps"] = env.spec.max_episode_steps if env.spec is not None else None
        return spec
    finally:
        env.close()


def sac_config(sac_params: Mapping[str, Any], sac_steps: int) -> dict[str, Any]:
    """SAC's full configuration for a build: SAC's current defaults, then `sac_params`, with the replay buffer
    holding the whole run.  Every `SAC.get_params()` value but `UNKEYED_SAC_PARAMS`, as JSON values."""
    params = SAC().get_params(deep=False)
    for key in UNKEYED_SAC_PARAMS:
        params.pop(key, None)
    params.update({k: v for k, v in sac_params.items() if k not in UNKEYED_SAC_PARAMS})
    params["buffer_size"] = int(sac_steps)
    return {k: json_value(k, v) for k, v in sorted(params.items())}


@dataclass
class _Config:
    request: BuildRequest
    sac_params: dict[str, Any]  # SAC's full configuration (the cache key's part)
    sac_unkeyed: dict[str, Any]  # SAC settings given in sac_params that do not change the run (log_every)
    checkpoint_every: int
    device: str

    # The request's fields, read often.
    target = property(lambda self: self.request.target)
    seed = property(lambda self: self.request.seed)
    sac_steps = property(lambda self: self.request.sac_steps)
    n_transitions = property(lambda self: self.request.n_transitions)
    eval_every = property(lambda self: self.request.eval_every)
    eval_episodes = property(lambda self: self.request.eval_episodes)
    ref_episodes = property(lambda self: self.request.ref_episodes)
    n_envs = property(lambda self: self.request.n_envs)
    expert = property(lambda self: self.request.expert)

    def run_config(self) -> dict[str, Any]:
        """Everything that determines the SAC run (and so the snapshots and reference scores): the run's key."""
        return {**self.request.run_fields(), "sac_params": self.sac_params}

    def data_config(self) -> dict[str, Any]:
        """The run's key and the collection settings: a dataset's key."""
        return {**self.run_config(), **self.request.collection_fields()}

    def key(self, name: str) -> str:
        """The run-state key (and policy file stem) of 'expert' / 'medium' for this expert choice: one SAC run
        serves both choices, each with its own reference score and medium snapshot."""
        return name if self.expert == "final" else f"{name}@{self.expert}"

    def expert_and_medium(self, state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """This choice's expert and medium records from the run state."""
        expert = {"step": self.sac_steps, **state[self.key("expert")]}
        return expert, state.get(self.key("medium"))

    def namespace(self) -> str:
        return self.request.namespace()

    def dataset_id(self, kind: str) -> str:
        return self.request.dataset_id(kind)

    def make_sac(self) -> SAC:
        """The SAC of this build's run (not fitted)."""
        params = {**self.sac_params, **self.sac_unkeyed}
        if isinstance(params.get("hidden_dims"), list):
            params["hidden_dims"] = tuple(params["hidden_dims"])
        return SAC(**params, n_steps=self.sac_steps, random_state=self.seed, device=self.device)


def _config_diff(stored: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """'field stored -> current' for every field that differs (sac_params field by field)."""
    diffs = []
    for key in sorted(set(stored) | set(current)):
        old, new = stored.get(key, "<absent>"), current.get(key, "<absent>")
        if key == "sac_params" and isinstance(old, dict) and isinstance(new, dict):
            old = {**SAC_PARAMS_SINCE, **old}
            diffs += [f"sac_params.{k} {old.get(k, '<absent>')!r} -> {new.get(k, '<absent>')!r}"
                      for k in sorted(set(old) | set(new)) if old.get(k, "<absent>") != new.get(k, "<absent>")]
        elif old != new:
            diffs.append(f"{key} {old!r} -> {new!r}")
    return diffs


def _make_config(
    name: str,
    *,
    n_transitions: int | None,
    seed: int,
    sac_steps: int | None,
    eval_every: int | None,
    eval_episodes: int,
    ref_episodes: int,
    sac_params: Mapping[str, Any] | None,
    n_envs: int,
    checkpoint_every: int | None,
    device: str,
    expert: str,
    env_id: str | None,
) -> _Config:
    target = parse_name(name, env_id)
    user = dict(sac_params or {})
    allowed = sorted(set(SAC().get_params(deep=False)) - set(_BUILDER_SAC_PARAMS))
    unknown = sorted(set(user) - set(allowed))
    if unknown:
        raise ValueError(f"unknown SAC parameter(s) {unknown} in sac_params; SAC takes {allowed}")
    request = resolve(target, seed=seed, n_transitions=n_transitions, sac_steps=sac_steps, eval_every=eval_every,
                      eval_episodes=eval_episodes, ref_episodes=ref_episodes, sac_params=user, n_envs=n_envs,
                      expert=expert)
    sac_steps = request.sac_steps
    if "buffer_size" in user and int(user["buffer_size"]) < sac_steps:
        raise ValueError(f"sac_params buffer_size={user['buffer_size']} is smaller than sac_steps={sac_steps}; "
                         "medium-replay needs the whole run's replay buffer")
    params = sac_config(request.sac_params, sac_steps)
    learning_starts, eval_every = int(params["learning_starts"]), request.eval_every
    # A medium policy needs training beyond the warm-up and a few evaluated snapshots to choose from.
    learning_evals = sum(1 for s in range(eval_every, sac_steps + 1, eval_every) if s > learning_starts)
    if sac_steps - learning_starts < _MIN_UPDATES or learning_evals < _MIN_LEARNING_EVALS:
        need = learning_starts + max(_MIN_UPDATES, _MIN_LEARNING_EVALS * eval_every)
        raise ValueError(
            f"a SAC budget of sac_steps={sac_steps} is too small to reach a medium policy: SAC takes "
            f"{learning_starts} random warm-up steps, leaving {max(sac_steps - learning_starts, 0)} gradient steps "
            f"(at least {_MIN_UPDATES} are needed) and {learning_evals} evaluated snapshot(s) every {eval_every} steps "
            f"(at least {_MIN_LEARNING_EVALS}). Use sac_steps >= {need} (the default for {target.env} is "
            f"{request.default_sac_steps:,}), or lower sac_params['learning_starts'] / eval_every for a quick build"
        )
    unkeyed = {k: v for k, v in user.items() if k in UNKEYED_SAC_PARAMS}
    cfg = _Config(request=request, sac_params=params, sac_unkeyed=unkeyed,
                  checkpoint_every=int(checkpoint_every or max(sac_steps // 20, 1)), device=device)
    cfg.make_sac().check_params()  # a bad SAC setting fails here, not hours into the build
    return cfg


def check_build(
    name: str,
    n_transitions: int | None = None,
    seed: int = 0,
    *,
    sac_steps: int | None = None,
    eval_every: int | None = None,
    eval_episodes: int = DEFAULT_EVAL_EPISODES,
    ref_episodes: int = DEFAULT_REF_EPISODES,
    sac_params: Mapping[str, Any] | None = None,
    n_envs: int = DEFAULT_N_ENVS,
    checkpoint_every: int | None = None,
    env_id: str | None = None,
    device: str = "auto",
    expert: str = "final",
) -> None:
    """Check what `build` would check before any work (the name, the budget, SAC's settings), without building:
    ValueError (or TypeError) naming the problem.  A sweep calls it for an `offrl:` dataset built on first use."""
    _make_config(name, n_transitions=n_transitions, seed=seed, sac_steps=sac_steps, eval_every=eval_every,
                 eval_episodes=eval_episodes, ref_episodes=ref_episodes, sac_params=sac_params, n_envs=n_envs,
                 checkpoint_every=checkpoint_every, device=device, expert=expert, env_id=env_id)


# ---------------------------------------------------------------------- roll-outs
Actor = Callable[[np.ndarray], "tuple[np.ndarray, np.ndarray]"]


def _uniform_actor(spec: Mapping[str, Any], generator: torch.Generator) -> Actor:
    low = torch.as_tensor(spec["action_low"], dtype=torch.float32)
    high = torch.as_tensor(spec["action_high"], dtype=torch.float32)
    log_prob = float(-torch.log(high - low).sum())

    def act(obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        u = torch.rand((len(obs), len(low)), generator=generator)
        return (low + (high - low) * u).numpy(), np.full(len(obs), log_prob, np.float32)

    return act


def _policy_actor(sac: Any, generator: torch.Generator) -> Actor:
    device = sac.device_

    def act(obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        obs_t = sac.obs_normalizer_(torch.as_tensor(obs, dtype=torch.float32, device=device))
        action, log_prob = sac.sample_with_log_prob(obs_t, generator)
        return action.cpu().numpy(), log_prob.float().cpu().numpy()

    return act


def _generator(device: Any, *seed_parts: int) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(episode_seed(*seed_parts) % 2**63)
    return generator


class _EnvPool:
    """A few copies of one env stepped together, so the policy acts on batches."""

    def __init__(self, env_id: str, n_envs: int) -> None:
        import gymnasium as gym

        self.env_id = env_id
        self.envs = [gym.make(env_id) for _ in range(n_envs)]

    def close(self) -> None:
        for env in self.envs:
            env.close()

    def _ensure(self, n: int) -> None:
        import gymnasium as gym

        while len(self.envs) < n:
            self.envs.append(gym.make(self.env_id))

    def episode_returns(self, act: Actor, reset_seeds: Sequence[int], max_parallel: int) -> np.ndarray:
        """Undiscounted return of one episode per reset seed (in that order)."""
        n = len(reset_seeds)
        m = min(n, max_parallel)
        self._ensure(m)
        returns = np.zeros(n)
        queue = list(range(n))
        current: list[int | None] = [None] * m
        obs: list[np.ndarray | None] = [None] * m
        for i in range(m):
            current[i] = queue.pop(0)
            obs[i] = self.envs[i].reset(seed=int(reset_seeds[current[i]]))[0]
        while any(c is not None for c in current):
            active = [i for i in range(m) if current[i] is not None]
            actions, _ = act(np.stack([np.asarray(obs[i], np.float32) for i in active]))
            for j, i in enumerate(active):
                next_obs, reward, terminated, truncated, _ = self.envs[i].step(actions[j])
                returns[current[i]] += float(reward)
                if terminated or truncated:
                    if queue:
                        current[i] = queue.pop(0)
                        obs[i] = self.envs[i].reset(seed=int(reset_seeds[current[i]]))[0]
                    else:
                        current[i] = None
                else:
                    obs[i] = next_obs
        return returns

    def collect(self, act: Actor, n_transitions: int, n_envs: int, seed: int, stream: int,
                spec: Mapping[str, Any], progress: bool, desc: str) -> Dataset:
        """`n_transitions` steps from `n_envs` envs; env i fills a contiguous block of rows.

        Episodes end at termination or truncation; each env's last episode is
        cut at its share of the budget (a timeout, like D4RL's final episode).
        """
        from tqdm.auto import tqdm

        m = min(n_envs, n_transitions)
        self._ensure(m)
        budgets = np.full(m, n_transitions // m) + (np.arange(m) < n_transitions % m)
        offsets = np.concatenate([[0], np.cumsum(budgets)[:-1]])
        obs_dim, act_dim = int(spec["observation_dim"]), int(spec["action_dim"])
        observations = np.empty((n_transitions, obs_dim), np.float32)
        next_observations = np.empty((n_transitions, obs_dim), np.float32)
        actions = np.empty((n_transitions, act_dim), np.float32)
        rewards = np.empty(n_transitions, np.float32)
        terminals = np.zeros(n_transitions, np.float32)
        timeouts = np.zeros(n_transitions, np.float32)
        ends = np.zeros(n_transitions, bool)
        log_probs = np.empty(n_transitions, np.float32)
        counts = np.zeros(m, np.int64)
        episodes = np.zeros(m, np.int64)
        obs = [self.envs[i].reset(seed=episode_seed(seed, stream, i, 0))[0] for i in range(m)]
        bar = tqdm(total=n_transitions, desc=desc, disable=not progress, dynamic_ncols=True, unit="step", leave=False)
        try:
            while True:
                active = np.flatnonzero(counts < budgets)
                if len(active) == 0:
                    break
                batch_obs = np.stack([np.asarray(obs[i], np.float32) for i in active])
                batch_actions, batch_log_probs = act(batch_obs)
                for j, i in enumerate(active):
                    row = offsets[i] + counts[i]
                    next_obs, reward, terminated, truncated, _ = self.envs[i].step(batch_actions[j])
                    observations[row] = batch_obs[j]
                    actions[row] = batch_actions[j]
                    log_probs[row] = batch_log_probs[j]
                    rewards[row] = reward
                    next_observations[row] = next_obs
                    counts[i] += 1
                    if terminated or truncated:
                        terminals[row] = float(terminated)
                        timeouts[row] = float(truncated and not terminated)
                        ends[row] = True
                        episodes[i] += 1
                        obs[i] = self.envs[i].reset(seed=episode_seed(seed, stream, i, episodes[i]))[0]
                    else:
                        obs[i] = next_obs
                bar.update(len(active))
        finally:
            bar.close()
        cut = offsets + budgets - 1
        cut_rows = cut[~ends[cut]]  # episodes stopped by the budget, not by the env
        timeouts[cut] = np.where(ends[cut], timeouts[cut], 1.0)
        ends[cut] = True
        starts = np.concatenate([[0], np.flatnonzero(ends) + 1])
        cut_episodes = (np.searchsorted(starts, cut_rows, side="right") - 1).tolist()
        return Dataset(
            observations=observations, actions=actions, rewards=rewards, terminals=terminals, timeouts=timeouts,
            next_observations=next_observations, episode_starts=starts, behavior_log_probs=log_probs,
            action_low=spec["action_low"], action_high=spec["action_high"], metadata={"cut_episodes": cut_episodes},
        )


# ---------------------------------------------------------------------- files
def _write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write_path(path) as tmp, open(tmp, "w") as f:
        json.dump(value, f, indent=1, sort_keys=True)


@contextlib.contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    """Run with `n` torch CPU threads (restored afterwards); None leaves torch's setting alone."""
    if n is None:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _read_record(path: Path, what: str, hint: str) -> dict[str, Any]:
    """A JSON record of the build cache; a damaged one raises ValueError naming it and how to rebuild."""
    try:
        value = read_json(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"{what} {path} is damaged ({type(err).__name__}: {err}); rebuild with {hint}") from err
    if not isinstance(value, dict):
        raise ValueError(f"{what} {path} holds a {type(value).__name__}, not a mapping; rebuild with {hint}")
    return value


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_stale_tmp(data_dir: Path) -> None:
    """Remove half-written datasets of builds that were killed."""
    tmp_root = data_dir / ".tmp"
    if not tmp_root.is_dir():
        return
    for entry in tmp_root.iterdir():
        pid = entry.name.split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


def _ensure_namespaces(data_dir: Path, namespace: str) -> None:
    """Minari namespace metadata files for `namespace` and its parents (so `minari list` shows them)."""
    parts = namespace.split("/")
    for i in range(1, len(parts) + 1):
        path = data_dir.joinpath(*parts[:i], "namespace_metadata.json")
        if not path.exists():
            _write_json(path, {})


def weak_expert_problem(env: str, env_id: str, expert_return: float, sac_steps: int, seed: int) -> str | None:
    """Why a built expert is too weak to stand in for D4RL's, or None (also for envs D4RL has no scores for).

    A SAC run can settle in a poor optimum, and which runs do depends on the seed and even on the MuJoCo release:
    the same recipe and seed learnt hopper under MuJoCo 3.17.0 and not under 4.0.0.  The builder's own normalisation
    (random to this expert) hides that, so compare with D4RL's expert.
    """
    if env not in D4RL_REF_SCORES:
        return None
    low, high = D4RL_REF_SCORES[env]
    score = 100.0 * (expert_return - low) / (high - low)
    if score >= WEAK_EXPERT_D4RL_SCORE:
        return None
    return (f"{env_id}: the SAC expert of this build (seed {seed}, {sac_steps:,} SAC steps) returns {expert_return:.1f}, "
            f"a D4RL-normalised score of {score:.1f} (D4RL's {env} expert returns {high:g}); the run did not learn the "
            f"task, so the built kinds will not resemble D4RL's. Build again with another seed (--seed) or more SAC "
            f"steps (--sac-steps), or use --expert best if an earlier snapshot learnt it")


# ---------------------------------------------------------------------- report
@dataclass
class BuildReport:
    """What a build produced: per-kind dataset ids, sizes, returns and normalised scores."""

    name: str
    env_id: str
    seed: int
    sac_steps: int
    n_transitions: int
    data_dir: str
    run_dir: str
    ref_min_score: float
    ref_max_score: float
    medium_step: int
    medium_eval_score: float
    expert_deterministic_return: float | None
    datasets: dict[str, dict[str, Any]] = field(default_factory=dict)
    policies: dict[str, str] = field(default_factory=dict)
    built: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    expert_step: int | None = None
    # The record of what the SAC run was made with (`software_versions()`; None for a run recorded before versions
    # were), and where this machine differs from it: name -> (recorded, here).  Not part of the cache key, since
    # data made elsewhere are still valid data, but a rebuild here may not repeat them.
    software: dict[str, str] | None = None
    software_changed: dict[str, tuple[str, str]] = field(default_factory=dict)

    def format(self) -> str:
        lines = [
            f"{self.env_id}: seed {self.seed}, SAC {self.sac_steps:,} steps, {self.n_transitions:,} transitions per kind",
            f"reference scores: random {self.ref_min_score:.2f}, expert {self.ref_max_score:.2f}"
            + (f" (SAC step {self.expert_step:,})" if self.expert_step is not None else "")
            + (f" (expert's mean action: {self.expert_deterministic_return:.2f})"
               if self.expert_deterministic_return is not None else ""),
            f"medium policy: SAC step {self.medium_step:,} (evaluation score {self.medium_eval_score:.1f})",
            "",
            "returns and normalised scores over complete episodes (not those cut by the transition budget):",
            f"{'kind':<15} {'transitions':>12} {'episodes':>9} {'return (mean ± std)':>24} {'normalised':>10}  minari id",
        ]
        for kind in KINDS:
            info = self.datasets.get(kind)
            if info is None:
                continue
            status = "" if kind in self.built else "  (cached)"
            lines.append(
                f"{kind:<15} {info['n_transitions']:>12,} {info['n_episodes']:>9,} "
                f"{info['return_mean']:>13.2f} ± {info['return_std']:<8.2f} {info['normalized_score_mean']:>10.1f}  "
                f"{info['dataset_id']}{status}"
            )
        lines += ["", f"written to {self.data_dir} (Minari root; set MINARI_DATASETS_PATH={self.data_dir} to use minari directly)"]
        for kind, path in self.policies.items():
            lines.append(f"{kind} policy: {path}  (offrl.load)")
        stages = ", ".join(f"{k} {v:.1f} s" for k, v in self.timings.items())
        if self.software:
            lines.append("made with: " + ", ".join(f"{k} {v}" for k, v in self.software.items()))
        if self.software_changed:
            changed = "; ".join(f"{k} {here!r} (made with {recorded!r})"
                                for k, (recorded, here) in self.software_changed.items())
            lines.append(f"note: this machine differs from the one the SAC run was made on: {changed}. The cached "
                         "data stay valid, but a rebuild here (--force) may not repeat them: builds differ across CPU "
                         "models and MuJoCo releases")
        lines.append(f"elapsed {self.elapsed_s:.1f} s" + (f" ({stages})" if stages else ""))
        return "\n".join(lines)


def _summary(ds: Dataset, ref_min: float, ref_max: float) -> dict[str, Any]:
    """Sizes, and returns / normalised scores over the complete episodes (those not cut by the budget)."""
    returns = ds.episode_returns()
    complete = np.ones(len(returns), bool)
    complete[np.asarray(ds.metadata.get("cut_episodes", []), dtype=np.int64)] = False
    if complete.any():
        returns = returns[complete]
    scores = 100.0 * (returns - ref_min) / (ref_max - ref_min)
    return {
        "n_transitions": ds.n_transitions,
        "n_episodes": ds.n_episodes,
        "cut_episodes": list(map(int, ds.metadata.get("cut_episodes", []))),
        "return_mean": float(returns.mean()),
        "return_std": float(returns.std()),
        "normalized_score_mean": float(scores.mean()),
        "normalized_score_std": float(scores.std()),
    }


def software_versions() -> dict[str, str]:
    """The versions a SAC run's numbers depend on, recorded with the run (not part of its cache key).

    The same recipe and seed learnt Hopper on one machine and plateaued on others (benchmarks/RESULTS.md,
    "Dataset builds"), and under one MuJoCo version gave different runs on an Intel and an AMD CPU; a record
    of torch, numpy, gymnasium and MuJoCo, of torch's CPU kernels and of the CPU model says which.
    """
    import importlib.metadata
    import platform

    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "cpu_capability": str(torch.backends.cpu.get_cpu_capability()), "cpu": cpu_model()}
    for package in ("numpy", "gymnasium", "mujoco"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions


def software_differences(recorded: Mapping[str, str] | None, here: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """name -> (recorded, here) for each entry of a software record that this machine's record does not repeat."""
    if not recorded:
        return {}
    return {k: (str(v), str(here.get(k, "not recorded"))) for k, v in recorded.items() if str(here.get(k)) != str(v)}


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what `platform` knows, else "unknown"."""
    import platform

    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
        for line in cpuinfo:
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    return platform.processor() or platform.machine() or "unknown"


# ---------------------------------------------------------------------- the build
class _Builder:
    def __init__(self, cfg: _Config, data_dir: Path, progress: bool) -> None:
        self.cfg = cfg
        self.data_dir = data_dir
        self.run_dir = cfg.request.run_dir(data_dir)
        self.progress = progress
        self.state_path = self.run_dir / "run.json"
        self.spec: dict[str, Any] = {}
        self.pool: _EnvPool | None = None
        self.hint = cfg.request.rebuild_hint()  # what a damaged cache file's error tells the user to run

    def load_policy(self, path: Path) -> Any:
        """A snapshot or policy file of the SAC run; a damaged one raises ValueError naming it and the rebuild."""
        import offrl

        try:
            return offrl.load(path, device=self.cfg.device)
        except (ValueError, OSError) as err:
            raise ValueError(f"{err}; the build cache under {self.run_dir} is damaged: rebuild with {self.hint}") from err

    def log(self, message: str) -> None:
        if self.progress:
            from tqdm.auto import tqdm

            tqdm.write(message)

    # -- state
    def stale(self, kinds: Sequence[str]) -> list[str]:
        """What in this run's cache was built with another configuration ('what: differences'); empty if nothing."""
        found = []
        if self.state_path.exists():
            stored = _read_record(self.state_path, "the SAC run's state", self.hint).get("config") or {}
            diff = _config_diff(stored if isinstance(stored, dict) else {}, self.cfg.run_config())
            if diff:
                found.append(f"the SAC run {self.run_dir}: {', '.join(diff)}")
        for kind in kinds:
            meta = read_metadata(self.data_dir, self.cfg.dataset_id(kind))
            if meta is not None:
                diff = _config_diff(meta.get("offrl_build", {}).get("config") or {}, self.cfg.data_config())
                if diff:
                    found.append(f"{dataset_path(self.data_dir, self.cfg.dataset_id(kind))}: {', '.join(diff)}")
        return found

    def wipe(self) -> None:
        """Delete this build's datasets (every kind of its variant, this recipe version's only) and its SAC run,
        keeping the lock."""
        for kind in KINDS:
            shutil.rmtree(dataset_path(self.data_dir, self.cfg.dataset_id(kind)), ignore_errors=True)
        for path in self.run_dir.iterdir():
            if path.name != "lock":
                shutil.rmtree(path) if path.is_dir() else path.unlink()

    def load_state(self) -> dict[str, Any]:
        if self.state_path.exists():
            return _read_record(self.state_path, "the SAC run's state", self.hint)  # its config was checked by `stale`
        return {"config": self.cfg.run_config()}

    def save_state(self, state: dict[str, Any]) -> None:
        _write_json(self.state_path, state)

    def snapshot_path(self, step: int) -> Path:
        return self.run_dir / "snapshots" / f"step_{step:09d}.pt"

    @property
    def replay_path(self) -> Path:
        """The whole run's replay buffer (`ReplayBuffer.state_dict()`), written once SAC has finished."""
        return self.run_dir / "replay_buffer.pt"

    # -- stages
    def references_random(self, state: dict[str, Any]) -> None:
        if "random" in state:
            return
        seeds = [episode_seed(self.cfg.seed, _REF, k) for k in range(self.cfg.ref_episodes)]
        act = _uniform_actor(self.spec, _generator("cpu", self.cfg.seed, _REF, 0))
        returns = self.pool.episode_returns(act, seeds, self.cfg.n_envs)
        state["random"] = {"return_mean": float(returns.mean()), "return_std": float(returns.std()),
                           "n_episodes": len(returns)}
        self.save_state(state)
        self.log(f"random policy: return {returns.mean():.2f} ± {returns.std():.2f} over {len(returns)} episodes")

    def train(self, state: dict[str, Any]) -> None:
        if state.get("trained") and self.replay_path.exists():
            return
        cfg = self.cfg
        if "software" not in state:  # the versions the run started with (a resumed run keeps its first record)
            state["software"] = software_versions()
            self.save_state(state)
        sac = cfg.make_sac()
        eval_seeds = [episode_seed(cfg.seed, _EVAL, k) for k in range(cfg.eval_episodes)]
        learning_starts = int(cfg.sac_params["learning_starts"])

        def snapshot(model: Any, step: int, row: Mapping[str, float]) -> None:
            act = _policy_actor(model, _generator(model.device_, cfg.seed, _EVAL, step))
            returns = self.pool.episode_returns(act, eval_seeds, cfg.n_envs)
            model.save(self.snapshot_path(step))
            _write_json(self.snapshot_path(step).with_suffix(".json"),
                        {"step": step, "return_mean": float(returns.mean()), "return_std": float(returns.std())})
            if step > learning_starts or step == cfg.sac_steps:
                self.log(f"SAC step {step:,}: return {returns.mean():.2f} ± {returns.std():.2f} (sampled actions)")

        import gymnasium as gym

        env = gym.make(cfg.target.env_id)
        try:
            # A finished run resumes to itself at once, with its replay buffer.
            sac.fit_online(env, cfg.sac_steps, eval_every=cfg.eval_every, callbacks=[snapshot],
                           checkpoint_path=self.run_dir / "sac_checkpoint.pt", checkpoint_every=cfg.checkpoint_every,
                           resume=True, progress=self.progress)
        finally:
            env.close()
        buffer = sac.replay_buffer_
        if len(buffer) != cfg.sac_steps:
            raise RuntimeError(f"SAC's replay buffer holds {len(buffer)} transitions after a {cfg.sac_steps}-step run; "
                               f"medium-replay needs all of them (rebuild with force=True)")
        with atomic_write_path(self.replay_path) as tmp:
            torch.save(buffer.state_dict(), tmp)
        state["trained"] = True
        state["device"] = str(sac.device_)
        self.save_state(state)

    def snapshot_records(self) -> list[dict[str, Any]]:
        """The evaluated snapshots after SAC's warm-up (step, return_mean, return_std), in step order."""
        learning_starts = int(self.cfg.sac_params["learning_starts"])
        records = []
        for path in sorted((self.run_dir / "snapshots").glob("step_*.json")):
            record = _read_record(path, "the snapshot record", self.hint)
            if not (isinstance(record.get("step"), int) and isinstance(record.get("return_mean"), (int, float))):
                raise ValueError(f"the snapshot record {path} lacks its step or return_mean ({record}); rebuild "
                                 f"with {self.hint}")
            if learning_starts < record["step"] <= self.cfg.sac_steps and self.snapshot_path(record["step"]).exists():
                records.append(record)
        if not records:
            raise ValueError(f"no evaluated SAC snapshots found in {self.run_dir / 'snapshots'}; rebuild with force=True")
        return records

    def references_expert(self, state: dict[str, Any]) -> None:
        cfg = self.cfg
        key = cfg.key("expert")
        if key in state:
            return
        from offrl.evaluation import evaluate_policy

        if cfg.expert == "best":  # first snapshot with the highest evaluation return
            step = max(self.snapshot_records(), key=lambda r: (r["return_mean"], -r["step"]))["step"]
        else:
            step = cfg.sac_steps
        expert = self.load_policy(self.snapshot_path(step))
        seeds = [episode_seed(cfg.seed, _REF, k) for k in range(cfg.ref_episodes)]
        returns = self.pool.episode_returns(_policy_actor(expert, _generator(expert.device_, cfg.seed, _REF, 1)),
                                            seeds, cfg.n_envs)
        deterministic = evaluate_policy(expert.predict, self.pool.envs[0], n_episodes=cfg.eval_episodes, seed=cfg.seed)
        state[key] = {"return_mean": float(returns.mean()), "return_std": float(returns.std()), "step": int(step),
                      "n_episodes": len(returns), "deterministic_return_mean": deterministic["return_mean"]}
        self.save_state(state)
        which = "final" if cfg.expert == "final" else f"best snapshot, SAC step {step:,}"
        self.log(f"expert policy ({which}): return {returns.mean():.2f} ± {returns.std():.2f} over {len(returns)} "
                 f"episodes (mean action: {deterministic['return_mean']:.2f})")
        problem = weak_expert_problem(cfg.target.env, cfg.target.env_id, float(returns.mean()), cfg.sac_steps, cfg.seed)
        if problem:
            warnings.warn(problem, stacklevel=3)

    def select_medium(self, state: dict[str, Any]) -> None:
        cfg = self.cfg
        if cfg.key("medium") in state:
            return
        expert = cfg.expert_and_medium(state)[0]
        expert_step = int(expert["step"])
        ref_min, ref_max = state["random"]["return_mean"], expert["return_mean"]
        if not ref_max > ref_min:
            raise ValueError(
                f"the {cfg.expert} SAC policy of {cfg.target.env_id} (return {ref_max:.2f}) is no better than the random "
                f"policy ({ref_min:.2f}) after {cfg.sac_steps:,} SAC steps, so normalised scores and a medium policy are "
                f"undefined; increase sac_steps (the default for {cfg.target.env} is "
                f"{cfg.request.default_sac_steps:,})"
            )
        records = [dict(r, score=100.0 * (r["return_mean"] - ref_min) / (ref_max - ref_min))
                   for r in self.snapshot_records() if r["step"] < expert_step]
        if not records:
            raise ValueError(f"no evaluated SAC snapshot precedes the expert (step {expert_step:,}) in "
                             f"{self.run_dir / 'snapshots'}, so there is no medium policy; evaluate more often (eval_every)")
        best = min(records, key=lambda r: (abs(r["score"] - MEDIUM_SCORE), r["step"]))
        if abs(best["score"] - MEDIUM_SCORE) > 15:
            warnings.warn(
                f"{cfg.target.env_id}: no SAC snapshot scored near {MEDIUM_SCORE:.0f}; the closest (step {best['step']}) "
                f"scored {best['score']:.1f}. Evaluate more often (eval_every) or change the SAC budget",
                stacklevel=3,
            )
        for kind, step in (("medium", best["step"]), ("expert", expert_step)):
            path = self.policy_path(kind)
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_write_path(path) as tmp:
                shutil.copyfile(self.snapshot_path(step), tmp)
        state[cfg.key("medium")] = {"step": int(best["step"]), "eval_return_mean": best["return_mean"],
                                    "eval_score": best["score"]}
        self.save_state(state)
        self.log(f"medium policy: SAC step {best['step']:,} (evaluation return {best['return_mean']:.2f}, "
                 f"normalised score {best['score']:.1f})")

    def policy_path(self, kind: str) -> Path:
        return self.run_dir / "policies" / f"{self.cfg.key(kind)}.pt"

    # -- datasets
    def make_dataset(self, kind: str, state: dict[str, Any], made: dict[str, Dataset]) -> Dataset:
        cfg = self.cfg
        if kind in ("random", "medium", "expert"):
            stream = _KIND_STREAM[kind]
            noise = _generator("cpu", cfg.seed, _COLLECT, stream)
            if kind == "random":
                act = _uniform_actor(self.spec, noise)
            else:
                policy = self.load_policy(self.policy_path(kind))
                act = _policy_actor(policy, _generator(policy.device_, cfg.seed, _COLLECT, stream))
            return self.pool.collect(act, cfg.n_transitions, cfg.n_envs, cfg.seed, _COLLECT * 10 + stream, self.spec,
                                     self.progress, f"collect {kind}")
        if kind == "medium-replay":
            buffer = self.load_replay_buffer()
            step = state[cfg.key("medium")]["step"]
            ds = buffer.to_dataset(0, step, action_low=self.spec["action_low"], action_high=self.spec["action_high"])
            # Did the medium step end an episode?  The row's own flags, read where it is not the slice's last row
            # (the medium snapshot precedes the expert's, so a next row always exists).
            after = buffer.to_dataset(step - 1, step + 1)
            ended = after.n_transitions == 2 and bool(after.terminals[0] > 0 or after.timeouts[0] > 0)
            ds.metadata["cut_episodes"] = [] if ended else [ds.n_episodes - 1]
            return ds
        if kind == "medium-expert":
            # medium and expert: made in this build, built before, or collected now (the same streams, so the same
            # rows as building them on their own)
            parts = []
            for part in ("medium", "expert"):
                if part not in made:
                    built = read_metadata(self.data_dir, cfg.dataset_id(part)) is not None
                    made[part] = self.load_kind(part) if built else self.make_dataset(part, state, made)
                parts.append(made[part])
            cut = list(parts[0].metadata.get("cut_episodes", []))
            cut += [e + parts[0].n_episodes for e in parts[1].metadata.get("cut_episodes", [])]
            return Dataset.concatenate(parts, metadata={"cut_episodes": cut})
        raise ValueError(f"unknown dataset kind {kind!r}")

    def load_replay_buffer(self) -> ReplayBuffer:
        """The whole run's replay buffer; a truncated or damaged file raises ValueError naming it."""
        try:
            return ReplayBuffer.from_state_dict(torch.load(self.replay_path, map_location="cpu", weights_only=True))
        except (OSError, RuntimeError, KeyError, TypeError, ValueError, EOFError) as err:
            raise ValueError(f"the SAC run's replay buffer {self.replay_path} is damaged ({type(err).__name__}: "
                             f"{err}); rebuild with {self.hint}") from err

    def load_kind(self, kind: str) -> Dataset:
        ds = load_built_files(self.cfg.dataset_id(kind), self.data_dir, self.cfg.target.dataset_name(kind), self.hint)
        meta = read_metadata(self.data_dir, self.cfg.dataset_id(kind)) or {}
        ds.metadata["cut_episodes"] = meta.get("offrl_build", {}).get("cut_episodes", [])
        return ds

    def write(self, kind: str, ds: Dataset, state: dict[str, Any]) -> dict[str, Any]:
        from offrl.datasets.minari import to_minari

        cfg = self.cfg
        dataset_id = cfg.dataset_id(kind)
        expert, medium = cfg.expert_and_medium(state)
        ref_min, ref_max = state["random"]["return_mean"], expert["return_mean"]
        info = {
            "name": cfg.target.dataset_name(kind),
            "kind": kind,
            "dataset_id": dataset_id,
            "env_id": cfg.target.env_id,
            "config": cfg.data_config(),
            "medium_step": medium["step"],
            "expert_step": expert["step"],
            "behavior_policy": None if kind in ("random", "medium-replay", "medium-expert")
            else str(self.policy_path(kind)),
            "run_dir": str(self.run_dir),
            "ref_min_score": ref_min,
            "ref_max_score": ref_max,
            "medium_eval_score": medium["eval_score"],
            "expert_deterministic_return": expert.get("deterministic_return_mean"),
            "software": state.get("software"),  # None for a SAC run recorded before versions were
            **_summary(ds, ref_min, ref_max),
        }
        description = (
            f"offrl.builder: {kind} data on {cfg.target.env_id} (D4RL recipe), SAC seed {cfg.seed}, "
            f"{cfg.sac_steps} SAC steps, medium = SAC step {medium['step']}, expert = SAC step "
            f"{expert['step']} ({cfg.expert}); actions sampled from the "
            "behaviour policy, whose log-probabilities are in the step info 'action_log_probs'"
        )
        tmp_root = self.data_dir / ".tmp" / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        final = dataset_path(self.data_dir, dataset_id)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # minari's notes about eval_env / spaces
                md = to_minari(ds, dataset_id, env=cfg.target.env_id, ref_min_score=ref_min, ref_max_score=ref_max,
                               data_path=tmp_root, description=description, algorithm_name="offrl SAC (offrl.builder)",
                               eval_env=cfg.target.env_id)
                md.storage.update_metadata({"offrl_build": info})
            del md
            final.parent.mkdir(parents=True, exist_ok=True)
            _ensure_namespaces(self.data_dir, cfg.namespace())
            if final.exists():
                shutil.rmtree(final)
            os.rename(dataset_path(tmp_root, dataset_id), final)
        finally:
            shutil.rmtree(tmp_root, ignore_errors=True)
        info["path"] = str(final)
        return info


def build(
    name: str,
    n_transitions: int | None = None,
    seed: int = 0,
    *,
    sac_steps: int | None = None,
    eval_every: int | None = None,
    eval_episodes: int = DEFAULT_EVAL_EPISODES,
    ref_episodes: int = DEFAULT_REF_EPISODES,
    sac_params: Mapping[str, Any] | None = None,
    n_envs: int = DEFAULT_N_ENVS,
    checkpoint_every: int | None = None,
    env_id: str | None = None,
    data_dir: str | os.PathLike | None = None,
    device: str = "auto",
    force: bool = False,
    rebuild_stale: bool = False,
    progress: bool = True,
    threads: int | None = 1,
    expert: str = "final",
    lock_timeout: float | None = BUILD_LOCK_TIMEOUT,
) -> BuildReport:
    """Build the D4RL-style dataset(s) `name` on a gymnasium env (those already built are kept) and report.

    `name` is `<env>-<kind>-v<env version>` (e.g. `"hopper-medium-v5"`,
    `"pendulum-medium-replay-v1"`); the kind `*` builds all five.  Budgets
    default per env (`offrl.datasets.built.BUILD_DEFAULTS`): `sac_steps` SAC
    environment steps and `n_transitions` per collected kind (medium-replay
    holds the run's first `medium step` transitions, medium-expert twice
    `n_transitions`).  `eval_every` is the snapshot interval,
    `eval_episodes` the episodes per snapshot evaluation and `ref_episodes`
    those of the reference scores.  `sac_params` overrides SAC
    hyper-parameters (e.g. `{"learning_starts": 1000}`), `n_envs` is the
    number of envs stepped together during collection, `env_id` an explicit
    gymnasium id.  The same name, seed and budget give the same data on
    the same machine; an interrupted build resumes where it stopped.
    A cached build made with another configuration (e.g. after a SAC
    default changed) raises ValueError naming the differences, unless
    `force=True` (rebuild everything of this variant from scratch) or
    `rebuild_stale=True` (rebuild only then).  `threads` sets torch's CPU
    threads during the build (1 by default: SAC's small networks gain
    little from more, lose a lot on a busy machine, and a fixed count keeps
    results reproducible).  `expert="best"` makes the best evaluated
    snapshot the expert (reference score, expert data, and the medium
    snapshot chosen before it) instead of D4RL's final policy: for short
    budgets whose last policy has fallen back.  It reuses the same SAC run
    and is cached under its own ids (`...-best`).  A second process building
    the same SAC run waits for the first (up to `lock_timeout` seconds, then
    `LockTimeoutError`; None waits for ever) and uses what it built.  A
    damaged cache file raises ValueError naming it and the rebuild command.
    """
    start = time.perf_counter()
    cfg = _make_config(name, n_transitions=n_transitions, seed=seed, sac_steps=sac_steps, eval_every=eval_every,
                       eval_episodes=eval_episodes, ref_episodes=ref_episodes, sac_params=sac_params, n_envs=n_envs,
                       checkpoint_every=checkpoint_every, device=device, expert=expert, env_id=env_id)
    target = cfg.target
    root = data_root(data_dir)
    spec = _check_env(target.env_id)  # unknown deps, discrete actions: fail before touching the disk
    builder = _Builder(cfg, root, progress)
    builder.spec = spec
    timings: dict[str, float] = {}

    def timed(stage: str, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            timings[stage] = timings.get(stage, 0.0) + time.perf_counter() - t0

    # A second process building the same SAC run waits here, then finds (below) what the first one built.
    with wait_for_lock(builder.run_dir / "lock", f"building {target.env_key} ({cfg.request.run_variant})",
                       timeout=lock_timeout), _torch_threads(threads):
        stale = [] if force else builder.stale(target.kinds)
        if stale and not rebuild_stale:
            raise ValueError(f"cached build(s) made with a different configuration: {'; '.join(stale)}. Pass "
                             "force=True (`offrl datasets build ... --force`) to rebuild them")
        if force or stale:
            builder.log("rebuilding: " + ("force=True" if force else "; ".join(stale)))
            builder.wipe()
        _clean_stale_tmp(root)
        datasets: dict[str, dict[str, Any]] = {}
        todo = []
        for kind in target.kinds:
            meta = read_metadata(root, cfg.dataset_id(kind))
            if meta is not None:  # `stale` found its config to be this one's
                datasets[kind] = {**meta["offrl_build"], "path": str(dataset_path(root, cfg.dataset_id(kind)))}
            else:
                todo.append(kind)
        state = builder.load_state()
        if todo:
            builder.pool = _EnvPool(target.env_id, min(cfg.n_envs, 4))
            try:
                timed("reference scores", builder.references_random, state)
                timed("SAC training", builder.train, state)
                timed("reference scores", builder.references_expert, state)
                builder.select_medium(state)
                made: dict[str, Dataset] = {}
                for kind in todo:
                    ds = timed(f"collect {kind}", builder.make_dataset, kind, state, made)
                    if kind in ("medium", "expert") and "medium-expert" in todo:
                        made[kind] = ds
                    datasets[kind] = timed(f"write {kind}", builder.write, kind, ds, state)
                    builder.log(f"wrote {cfg.dataset_id(kind)}: {ds.n_transitions:,} transitions, {ds.n_episodes:,} "
                                f"episodes, normalised score {datasets[kind]['normalized_score_mean']:.1f}")
            finally:
                builder.pool.close()
    if cfg.key("medium") in state:
        expert, medium = cfg.expert_and_medium(state)
        refs = {"ref_min_score": state["random"]["return_mean"], "ref_max_score": expert["return_mean"],
                "medium_step": medium["step"], "medium_eval_score": medium["eval_score"],
                "expert_deterministic_return": expert.get("deterministic_return_mean"),
                "expert_step": expert["step"]}
    else:  # every kind was cached and the run's state is gone: the datasets' metadata holds the same facts
        first = next(iter(datasets.values()))
        refs = {k: first.get(k) for k in ("ref_min_score", "ref_max_score", "medium_step", "medium_eval_score",
                                          "expert_deterministic_return", "expert_step")}
    software = state.get("software") or next((d.get("software") for d in datasets.values() if d.get("software")), None)
    return BuildReport(
        name=name, env_id=target.env_id, seed=cfg.seed, sac_steps=cfg.sac_steps, n_transitions=cfg.n_transitions,
        data_dir=str(root), run_dir=str(builder.run_dir), **refs,
        datasets={k: datasets[k] for k in KINDS if k in datasets},
        policies={k: str(builder.policy_path(k)) for k in ("medium", "expert")},
        built=[k for k in KINDS if k in todo], elapsed_s=time.perf_counter() - start, timings=timings,
        software=software, software_changed=software_differences(software, software_versions()),
    )


def load_or_build(
    name: str,
    n_transitions: int | None = None,
    seed: int = 0,
    *,
    sac_steps: int | None = None,
    eval_every: int | None = None,
    eval_episodes: int = DEFAULT_EVAL_EPISODES,
    ref_episodes: int = DEFAULT_REF_EPISODES,
    sac_params: Mapping[str, Any] | None = None,
    n_envs: int = DEFAULT_N_ENVS,
    checkpoint_every: int | None = None,
    env_id: str | None = None,
    data_dir: str | os.PathLike | None = None,
    device: str = "auto",
    force: bool = False,
    progress: bool = True,
    threads: int | None = 1,
    expert: str = "final",
    lock_timeout: float | None = BUILD_LOCK_TIMEOUT,
) -> Dataset | dict[str, Dataset]:
    """The dataset `name` (a dict kind -> Dataset for the kind `*`), built first if it is not yet.

    Takes `build`'s arguments.  A cached dataset made with another
    configuration is rebuilt (`build(..., rebuild_stale=True)`); one that
    is current is loaded as `offrl.datasets.load("offrl:<name>", ...)` would.
    """
    report = build(name, n_transitions, seed, sac_steps=sac_steps, eval_every=eval_every, eval_episodes=eval_episodes,
                   ref_episodes=ref_episodes, sac_params=sac_params, n_envs=n_envs, checkpoint_every=checkpoint_every,
                   env_id=env_id, data_dir=data_dir, device=device, force=force, rebuild_stale=True,
                   progress=progress, threads=threads, expert=expert, lock_timeout=lock_timeout)
    target = parse_name(name, env_id)
    budget = dict(seed=seed, n_transitions=n_transitions, sac_steps=sac_steps, eval_every=eval_every,
                  eval_episodes=eval_episodes, ref_episodes=ref_episodes, sac_params=sac_params, n_envs=n_envs,
                  env_id=env_id, data_dir=data_dir, expert=expert)
    loaded = {kind: load_built(target.dataset_name(kind), **budget) for kind in report.datasets}
    return loaded if len(target.kinds) > 1 else loaded[target.kinds[0]]
