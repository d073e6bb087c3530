"""`Dataset`: the one in-memory form of logged decision data.

Transitions are stored column-wise as float32 numpy arrays, and episodes are
contiguous slices described by `episode_starts` (length n_episodes + 1), so
every per-episode computation is a slice or a `reduceat`.  Torch views of the
columns are made once per device and reused, so `sample` is a handful of
`index_select` calls with no per-sample Python.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

__all__ = ["Dataset", "Batch", "atomic_write_path"]

FORMAT_VERSION = 1
_REQUIRED = ("observations", "actions", "rewards", "terminals", "timeouts", "next_observations")
_OPTIONAL = ("behavior_log_probs",)
COLUMNS = _REQUIRED + _OPTIONAL
_COLUMN_SET = frozenset(COLUMNS)


@dataclass
class Batch:
    """A batch of transitions as torch tensors on one device.

    `extras` carries algorithm-specific per-transition columns (e.g. Cal-QL's
    Monte-Carlo returns) drawn with the same indices.
    """

    observations: torch.Tensor
    actions: torch.Tensor
    rewards: torch.Tensor
    terminals: torch.Tensor
    timeouts: torch.Tensor
    next_observations: torch.Tensor
    behavior_log_probs: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


class atomic_write_path:
    """Context manager giving a temporary path that is renamed onto `path` on success.

    Nothing half written is ever visible at `path`: on an exception the
    temporary file is removed and `path` is untouched.
    """

    def __init__(self, path: str | os.PathLike, suffix: str = "") -> None:
        self.path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        base = os.path.basename(self.path)
        self.tmp = os.path.join(directory, f".{base}.tmp-{os.getpid()}{suffix}")

    def __enter__(self) -> str:
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                os.replace(self.tmp, self.path)
        finally:
            # After a failed body or a failed rename (e.g. `path` is a directory)
            # the temporary file must not be left behind.
            if os.path.exists(self.tmp):
                os.remove(self.tmp)


def _as_float32(name: str, value: Any, ndim: int) -> np.ndarray:
    try:
        array = np.asarray(value)
    except Exception as err:  # ragged lists and the like
        raise ValueError(f"{name} could not be converted to an array ({err}); pass a numeric array") from err
    if array.dtype == object or not (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
        raise ValueError(f"{name} has non-numeric dtype {array.dtype}; pass a numeric array")
    if ndim == 1 and array.ndim == 2 and array.shape[1] == 1:
        array = array[:, 0]  # D4RL stores rewards/terminals as (N, 1)
    if ndim == 2 and array.ndim == 1:
        array = array[:, None]  # a 1-d observation or action per step
    if array.ndim != ndim:
        shape = "(n_transitions,)" if ndim == 1 else "(n_transitions, dim)"
        raise ValueError(f"{name} has shape {array.shape}; expected {shape}")
    return np.ascontiguousarray(array, dtype=np.float32)


def _check_finite(name: str, array: np.ndarray) -> None:
    finite = np.isfinite(array)
    if not finite.all():
        bad = np.argwhere(~finite)[0]
        raise ValueError(
            f"{name} contains NaN or inf at row {int(bad[0])}; remove or impute that row before building a Dataset"
        )


def _check_flags(name: str, array: np.ndarray) -> None:
    bad = np.flatnonzero((array != 0) & (array != 1))
    if len(bad):
        raise ValueError(f"{name} must be 0 or 1, found {array[bad[0]]} at row {int(bad[0])}")


def _ends_to_starts(episode_ends: np.ndarray, n: int) -> np.ndarray:
    """Episode start offsets from a boolean 'this step ends an episode' mask."""
    ends = np.flatnonzero(episode_ends)
    if len(ends) == 0 or ends[-1] != n - 1:
        ends = np.append(ends, n - 1)
    return np.concatenate([[0], ends + 1]).astype(np.int64)


class Dataset:
    """Logged transitions with episode structure.

    Columns (float32): `observations` (N, obs_dim), `actions` (N, act_dim),
    `rewards` (N,), `terminals` (N,), `timeouts` (N,),
    `next_observations` (N, obs_dim) and optionally `behavior_log_probs` (N,).
    `terminals` marks a true end of the MDP (no bootstrapping);
    `timeouts` marks a cut (time limit or end of log) where the value of the
    next state still counts.  Episode i is rows
    `episode_starts[i]:episode_starts[i + 1]`.

    Build one with `from_arrays`, `from_episodes`, `from_pandas`,
    `offrl.datasets.load` or `Dataset.load`.
    """

    def __init__(
        self,
        *,
        observations: np.ndarray,
        actions: np.ndarray,
        rewards: np.ndarray,
        terminals: np.ndarray,
        timeouts: np.ndarray,
        next_observations: np.ndarray,
        episode_starts: np.ndarray,
        behavior_log_probs: np.ndarray | None = None,
        action_low: np.ndarray | Sequence[float] | float | None = None,
        action_high: np.ndarray | Sequence[float] | float | None = None,
        discrete_actions: int | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        self.observations = _as_float32("observations", observations, 2)
        self.actions = _as_float32("actions", actions, 2)
        self.rewards = _as_float32("rewards", rewards, 1)
        self.terminals = _as_float32("terminals", terminals, 1)
        self.timeouts = _as_float32("timeouts", timeouts, 1)
        self.next_observations = _as_float32("next_observations", next_observations, 2)
        self.behavior_log_probs = (
            None if behavior_log_probs is None else _as_float32("behavior_log_probs", behavior_log_probs, 1)
        )
        self.episode_starts = np.asarray(episode_starts, dtype=np.int64)
        self.discrete_actions = None if discrete_actions is None else int(discrete_actions)
        self.action_low = None if action_low is None else np.broadcast_to(
            np.asarray(action_low, dtype=np.float32), (self.actions.shape[1],)).copy()
        self.action_high = None if action_high is None else np.broadcast_to(
            np.asarray(action_high, dtype=np.float32), (self.actions.shape[1],)).copy()
        self.metadata: dict[str, Any] = dict(metadata or {})
        self._torch_cache: dict[str, dict[str, torch.Tensor]] = {}
        self._validate()

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        n = len(self.observations)
        if n == 0:
            raise ValueError("observations is empty; a Dataset needs at least one transition")
        for name in COLUMNS[1:]:
            column = getattr(self, name)
            if column is not None and len(column) != n:
                raise ValueError(
                    f"{name} has {len(column)} rows but observations has {n}; every column needs one row per transition"
                )
        if self.next_observations.shape[1] != self.observations.shape[1]:
            raise ValueError(
                f"next_observations has dimension {self.next_observations.shape[1]} but observations has "
                f"{self.observations.shape[1]}; they must describe the same state space"
            )
        for name in COLUMNS:
            column = getattr(self, name)
            if column is not None:
                _check_finite(name, column)
        for name in ("terminals", "timeouts"):
            _check_flags(name, getattr(self, name))
        both = np.flatnonzero((self.terminals > 0) & (self.timeouts > 0))
        if len(both):
            raise ValueError(
                f"terminals and timeouts are both set at row {int(both[0])}; a step either ends the MDP (terminal) "
                "or is cut by a time limit (timeout): clear one of them (D4RL counts such a step as a timeout)"
            )
        starts = self.episode_starts
        if starts.ndim != 1 or len(starts) < 2 or starts[0] != 0 or starts[-1] != n or np.any(np.diff(starts) <= 0):
            raise ValueError(
                "episode_starts must increase strictly from 0 to n_transitions "
                f"({n}); got {starts[:5].tolist()}...{starts[-3:].tolist()}"
            )
        self._validate_actions()

    def _validate_actions(self) -> None:
        if self.discrete_actions is not None:
            a = self.actions
            if a.shape[1] != 1:
                raise ValueError(f"actions must have one column of action indices for a discrete action space, got {a.shape[1]}")
            bad = np.flatnonzero((a[:, 0] != np.round(a[:, 0])) | (a[:, 0] < 0) | (a[:, 0] >= self.discrete_actions))
            if len(bad):
                raise ValueError(
                    f"actions has value {a[bad[0], 0]} at row {int(bad[0])}, outside the discrete action space "
                    f"{{0, ..., {self.discrete_actions - 1}}}; fix the logged action or pass the right number of actions"
                )
            return
        for bound, name, outside in (
            (self.action_low, "action_low", lambda a, b: a < b - 1e-6),
            (self.action_high, "action_high", lambda a, b: a > b + 1e-6),
        ):
            if bound is None:
                continue
            mask = outside(self.actions, bound)
            if mask.any():
                row, col = np.argwhere(mask)[0]
                raise ValueError(
                    f"actions[{int(row)}, {int(col)}] = {self.actions[row, col]:.6g} lies outside the action space "
                    f"({name} = {bound[col]:.6g}); clip the actions or pass the correct action bounds"
                )

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_arrays(
        cls,
        observations: Any,
        actions: Any,
        rewards: Any,
        terminals: Any = None,
        timeouts: Any = None,
        next_observations: Any = None,
        behavior_log_probs: Any = None,
        *,
        episode_starts: Any = None,
        action_low: Any = None,
        action_high: Any = None,
        discrete_actions: int | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> "Dataset":
        """Build from flat per-transition arrays.

        Episodes end where `terminals` or `timeouts` is set (or at
        `episode_starts` when given).  When `next_observations` is omitted it
        is taken from the following row within each episode; the last step of
        an episode that was cut (not terminal) then has no successor and is
        dropped, and the step before it becomes the episode's timeout, as in
        D4RL's `qlearning_dataset` but keeping episode boundaries.
        """
        obs = _as_float32("observations", observations, 2)
        n = len(obs)
        if n == 0:
            raise ValueError("observations is empty; a Dataset needs at least one transition")
        rewards_arr = _as_float32("rewards", rewards, 1)
        terminals_arr = np.zeros(n, np.float32) if terminals is None else _as_float32("terminals", terminals, 1)
        timeouts_arr = np.zeros(n, np.float32) if timeouts is None else _as_float32("timeouts", timeouts, 1)
        actions_arr = _as_float32("actions", actions, 2)
        log_probs_arr = None if behavior_log_probs is None else _as_float32("behavior_log_probs", behavior_log_probs, 1)
        for name, column in (
            ("actions", actions_arr),
            ("rewards", rewards_arr),
            ("terminals", terminals_arr),
            ("timeouts", timeouts_arr),
            ("behavior_log_probs", log_probs_arr),
        ):
            if column is not None and len(column) != n:
                raise ValueError(
                    f"{name} has {len(column)} rows but observations has {n}; every column needs one row per transition"
                )
        # Check values here, before rows are dropped, so that reported row
        # numbers are the caller's rows.
        for name, column in (
            ("observations", obs),
            ("actions", actions_arr),
            ("rewards", rewards_arr),
            ("terminals", terminals_arr),
            ("timeouts", timeouts_arr),
            ("behavior_log_probs", log_probs_arr),
        ):
            if column is not None:
                _check_finite(name, column)
        for name, column in (("terminals", terminals_arr), ("timeouts", timeouts_arr)):
            _check_flags(name, column)
        if episode_starts is None:
            starts = _ends_to_starts((terminals_arr > 0) | (timeouts_arr > 0), n)
        else:
            starts = np.asarray(episode_starts, dtype=np.int64).reshape(-1)
            if len(starts) == 0 or starts[-1] != n:
                starts = np.append(starts, n)
            if starts[0] != 0 or np.any(np.diff(starts) <= 0) or starts[-1] != n:
                raise ValueError(
                    f"episode_starts must start at 0 and increase strictly up to n_transitions ({n}); "
                    f"got {np.asarray(episode_starts).reshape(-1)[:5].tolist()}..."
                )
        # A cut (the final step of an episode that is not terminal) is a timeout.
        last = starts[1:] - 1
        timeouts_arr = timeouts_arr.copy()
        timeouts_arr[last] = np.where(terminals_arr[last] > 0, 0.0, 1.0)
        columns = dict(
            observations=obs,
            actions=actions_arr,
            rewards=rewards_arr,
            terminals=terminals_arr,
            timeouts=timeouts_arr,
            behavior_log_probs=log_probs_arr,
        )
        if next_observations is None:
            keep, starts = _successor_rows(starts, terminals_arr)
            next_rows = np.minimum(keep + 1, n - 1)
            columns = {k: (None if v is None else v[keep]) for k, v in columns.items()}
            columns["next_observations"] = obs[next_rows]
            last = starts[1:] - 1
            columns["timeouts"][last] = np.where(columns["terminals"][last] > 0, 0.0, 1.0)
        else:
            columns["next_observations"] = next_observations
        return cls(
            **columns,
            episode_starts=starts,
            action_low=action_low,
            action_high=action_high,
            discrete_actions=discrete_actions,
            metadata=metadata,
        )

    @classmethod
    def from_episodes(
        cls,
        episodes: Iterable[Mapping[str, Any]],
        *,
        action_low: Any = None,
        action_high: Any = None,
        discrete_actions: int | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> "Dataset":
        """Build from a list of per-episode dicts.

        Each dict has `observations` (T + 1 rows, Minari style, or T rows with
        `next_observations`), `actions` (T), `rewards` (T) and optionally
        `terminals`/`terminations`, `timeouts`/`truncations` and
        `behavior_log_probs`.  If neither flag is given, an episode counts as
        cut by a time limit.
        """
        parts: dict[str, list[np.ndarray]] = {k: [] for k in COLUMNS}
        lengths = []
        has_log_probs = None
        for i, episode in enumerate(episodes):
            if "actions" not in episode or "rewards" not in episode or "observations" not in episode:
                raise ValueError(f"episode {i} needs 'observations', 'actions' and 'rewards' entries")
            actions = _as_float32(f"episode {i} actions", episode["actions"], 2)
            t = len(actions)
            if t == 0:
                raise ValueError(f"episode {i} has no actions; drop empty episodes")
            obs = _as_float32(f"episode {i} observations", episode["observations"], 2)
            if "next_observations" in episode:
                next_obs = _as_float32(f"episode {i} next_observations", episode["next_observations"], 2)
            elif len(obs) == t + 1:
                obs, next_obs = obs[:-1], obs[1:]
            else:
                raise ValueError(
                    f"episode {i} has {len(obs)} observations for {t} actions; pass T + 1 observations "
                    "(including the final one) or a next_observations entry"
                )
            if len(obs) != t:
                raise ValueError(f"episode {i} observations has {len(obs)} rows but actions has {t}")
            if len(next_obs) != t:
                raise ValueError(f"episode {i} next_observations has {len(next_obs)} rows but actions has {t}")
            rewards = _as_float32(f"episode {i} rewards", episode["rewards"], 1)
            if len(rewards) != t:
                raise ValueError(f"episode {i} rewards has {len(rewards)} rows but actions has {t}")
            terminals = _flag(episode, ("terminals", "terminations"), t, i)
            timeouts = _flag(episode, ("timeouts", "truncations"), t, i)
            early = np.flatnonzero((terminals[:-1] > 0) | (timeouts[:-1] > 0))
            if len(early):
                raise ValueError(
                    f"episode {i} is flagged terminal or truncated at step {int(early[0])}, before its last step "
                    f"({t - 1}); split it into separate episodes"
                )
            if terminals[-1]:
                timeouts[-1] = 0.0
            elif not timeouts[-1]:
                timeouts[-1] = 1.0
            log_probs = episode.get("behavior_log_probs")
            if has_log_probs is None:
                has_log_probs = log_probs is not None
            elif has_log_probs != (log_probs is not None):
                raise ValueError(
                    f"episode {i} {'lacks' if log_probs is None else 'has'} behavior_log_probs unlike episode 0; "
                    "give them for every episode or for none"
                )
            parts["observations"].append(obs)
            parts["next_observations"].append(next_obs)
            parts["actions"].append(actions)
            parts["rewards"].append(rewards)
            parts["terminals"].append(terminals)
            parts["timeouts"].append(timeouts)
            if log_probs is not None:
                log_probs = _as_float32(f"episode {i} behavior_log_probs", log_probs, 1)
                if len(log_probs) != t:
                    raise ValueError(f"episode {i} behavior_log_probs has {len(log_probs)} rows but actions has {t}")
                parts["behavior_log_probs"].append(log_probs)
            lengths.append(t)
        if not lengths:
            raise ValueError("episodes is empty; a Dataset needs at least one episode")
        columns = {k: (np.concatenate(v) if v else None) for k, v in parts.items()}
        return cls(
            **columns,
            episode_starts=np.concatenate([[0], np.cumsum(lengths)]),
            action_low=action_low,
            action_high=action_high,
            discrete_actions=discrete_actions,
            metadata=metadata,
        )

    @classmethod
    def from_pandas(
        cls,
        df: Any,
        *,
        observation_columns: Sequence[str] | None = None,
        action_columns: Sequence[str] | None = None,
        next_observation_columns: Sequence[str] | None = None,
        reward_column: str = "reward",
        terminal_column: str = "terminal",
        timeout_column: str = "timeout",
        episode_column: str | None = "episode_id",
        log_prob_column: str = "behavior_log_prob",
        **kwargs: Any,
    ) -> "Dataset":
        """Build from a DataFrame with one row per transition.

        By default columns follow `to_pandas`: `obs_0..`, `action_0..`,
        `next_obs_0..` (optional), `reward`, `terminal`, `timeout`,
        `episode_id` and `behavior_log_prob` (optional).  Rows of an
        episode must be contiguous and in time order.
        """
        columns = list(df.columns)

        def pick(explicit: Sequence[str] | None, prefix: str, required: bool) -> list[str] | None:
            if explicit is not None:
                missing = [c for c in explicit if c not in columns]
                if missing:
                    raise ValueError(f"DataFrame has no column(s) {missing}; available: {columns}")
                return list(explicit)
            found = sorted((c for c in columns if isinstance(c, str) and c.startswith(prefix) and c[len(prefix):].isdigit()),
                           key=lambda c: int(c[len(prefix):]))
            if required and not found:
                raise ValueError(
                    f"DataFrame has no '{prefix}0', '{prefix}1', ... columns; pass "
                    f"{'observation' if prefix == 'obs_' else 'action'}_columns=[...] naming them"
                )
            return found or None

        obs_cols = pick(observation_columns, "obs_", True)
        act_cols = pick(action_columns, "action_", True)
        next_cols = pick(next_observation_columns, "next_obs_", False)
        if reward_column not in columns:
            raise ValueError(f"DataFrame has no reward column '{reward_column}'; pass reward_column=...")
        get = lambda name: df[name].to_numpy() if name in columns else None  # noqa: E731
        starts = None
        if episode_column is not None and episode_column in columns:
            ids = df[episode_column].to_numpy()
            change = np.flatnonzero(ids[1:] != ids[:-1]) + 1
            starts = np.concatenate([[0], change, [len(ids)]])
            if len(np.unique(ids)) != len(starts) - 1:
                raise ValueError(f"rows of each {episode_column} must be contiguous; sort the DataFrame by episode and step")
        return cls.from_arrays(
            observations=df[obs_cols].to_numpy(np.float32),
            actions=df[act_cols].to_numpy(np.float32),
            rewards=get(reward_column),
            terminals=get(terminal_column),
            timeouts=get(timeout_column),
            next_observations=None if next_cols is None else df[next_cols].to_numpy(np.float32),
            behavior_log_probs=get(log_prob_column),
            episode_starts=starts,
            **kwargs,
        )

    def to_pandas(self) -> Any:
        """One row per transition; `Dataset.from_pandas(ds.to_pandas())` round-trips."""
        import pandas as pd

        data: dict[str, np.ndarray] = {}
        lengths = np.diff(self.episode_starts)
        data["episode_id"] = np.repeat(np.arange(self.n_episodes), lengths)
        data["step"] = np.arange(self.n_transitions) - np.repeat(self.episode_starts[:-1], lengths)
        for j in range(self.observation_dim):
            data[f"obs_{j}"] = self.observations[:, j]
        for j in range(self.action_dim):
            data[f"action_{j}"] = self.actions[:, j]
        data["reward"] = self.rewards
        data["terminal"] = self.terminals
        data["timeout"] = self.timeouts
        for j in range(self.observation_dim):
            data[f"next_obs_{j}"] = self.next_observations[:, j]
        if self.behavior_log_probs is not None:
            data["behavior_log_prob"] = self.behavior_log_probs
        return pd.DataFrame(data)

    # ------------------------------------------------------------------ shape & stats
    @property
    def n_transitions(self) -> int:
        return len(self.observations)

    @property
    def n_episodes(self) -> int:
        return len(self.episode_starts) - 1

    @property
    def observation_dim(self) -> int:
        return self.observations.shape[1]

    @property
    def action_dim(self) -> int:
        return self.actions.shape[1]

    @property
    def has_behavior_log_probs(self) -> bool:
        return self.behavior_log_probs is not None

    def __len__(self) -> int:
        return self.n_transitions

    def __repr__(self) -> str:
        name = self.metadata.get("name")
        return (
            f"Dataset({'name=' + repr(name) + ', ' if name else ''}n_transitions={self.n_transitions}, "
            f"n_episodes={self.n_episodes}, observation_dim={self.observation_dim}, action_dim={self.action_dim}"
            f"{', behavior_log_probs' if self.has_behavior_log_probs else ''})"
        )

    def episode_lengths(self) -> np.ndarray:
        return np.diff(self.episode_starts)

    def episode_returns(self, gamma: float = 1.0) -> np.ndarray:
        """Sum of rewards per episode (discounted when gamma < 1)."""
        if gamma == 1.0:
            return np.add.reduceat(self.rewards.astype(np.float64), self.episode_starts[:-1])
        steps = np.arange(self.n_transitions) - np.repeat(self.episode_starts[:-1], self.episode_lengths())
        return np.add.reduceat(self.rewards * gamma ** steps.astype(np.float64), self.episode_starts[:-1])

    def returns_to_go(self, gamma: float = 1.0) -> np.ndarray:
        """Discounted Monte-Carlo return from each step to the end of its episode (float32)."""
        from scipy.signal import lfilter

        # One reverse discounted cumulative sum over the whole array, then
        # subtract what leaks in from later episodes:
        # G_all[t] = G_episode[t] + gamma ** (end - t) * G_all[end].
        rewards = self.rewards.astype(np.float64)
        g_all = lfilter([1.0], [1.0, -float(gamma)], rewards[::-1])[::-1]
        ends = np.repeat(self.episode_starts[1:], self.episode_lengths())
        leak = np.append(g_all, 0.0)[ends] * float(gamma) ** (ends - np.arange(self.n_transitions)).astype(np.float64)
        return (g_all - leak).astype(np.float32)

    def observation_stats(self, eps: float = 1e-3) -> tuple[np.ndarray, np.ndarray]:
        """Mean and std of observations (std floored at `eps`) for normalisation."""
        mean = self.observations.mean(axis=0, dtype=np.float64)
        std = self.observations.std(axis=0, dtype=np.float64)
        return mean.astype(np.float32), np.maximum(std, eps).astype(np.float32)

    # ------------------------------------------------------------------ episodes
    def episode(self, index: int) -> dict[str, np.ndarray]:
        """Episode `index` as a dict of column slices (views, not copies)."""
        if not -self.n_episodes <= index < self.n_episodes:
            raise IndexError(f"episode index {index} out of range for {self.n_episodes} episodes")
        index %= self.n_episodes
        s, e = self.episode_starts[index], self.episode_starts[index + 1]
        return {k: getattr(self, k)[s:e] for k in COLUMNS if getattr(self, k) is not None}

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        for i in range(self.n_episodes):
            yield self.episode(i)

    def _like(self, columns: dict[str, np.ndarray | None], starts: np.ndarray, metadata: dict | None = None) -> "Dataset":
        return Dataset(
            **columns,
            episode_starts=starts,
            action_low=self.action_low,
            action_high=self.action_high,
            discrete_actions=self.discrete_actions,
            metadata=self.metadata if metadata is None else metadata,
        )

    def subset(self, episode_indices: Sequence[int] | np.ndarray) -> "Dataset":
        """A new Dataset with the given episodes, in the given order."""
        idx = np.asarray(episode_indices, dtype=np.int64).reshape(-1)
        if len(idx) == 0:
            raise ValueError("episode_indices is empty; a subset needs at least one episode")
        if idx.min() < -self.n_episodes or idx.max() >= self.n_episodes:
            raise ValueError(f"episode_indices must lie in [0, {self.n_episodes}); got {idx.min()}..{idx.max()}")
        idx %= self.n_episodes
        lengths = self.episode_lengths()[idx]
        rows = np.repeat(self.episode_starts[idx] - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
        rows += np.arange(lengths.sum())
        columns = {k: (None if getattr(self, k) is None else getattr(self, k)[rows]) for k in COLUMNS}
        return self._like(columns, np.concatenate([[0], np.cumsum(lengths)]))

    @staticmethod
    def concatenate(datasets: Sequence["Dataset"], metadata: Mapping[str, Any] | None = None) -> "Dataset":
        """Concatenate datasets episode-wise (spaces and log-prob presence must agree)."""
        datasets = list(datasets)
        if not datasets:
            raise ValueError("datasets is empty; pass at least one Dataset to concatenate")
        first = datasets[0]
        for i, ds in enumerate(datasets[1:], 1):
            if (ds.observation_dim, ds.action_dim) != (first.observation_dim, first.action_dim):
                raise ValueError(
                    f"dataset {i} has observation/action dims {(ds.observation_dim, ds.action_dim)} but dataset 0 has "
                    f"{(first.observation_dim, first.action_dim)}; only datasets of the same task can be concatenated"
                )
            if ds.discrete_actions != first.discrete_actions or not (
                _same_bounds(ds.action_low, first.action_low) and _same_bounds(ds.action_high, first.action_high)
            ):
                raise ValueError(
                    f"dataset {i} has a different action space than dataset 0 (bounds or number of discrete actions); "
                    "only datasets of the same task can be concatenated"
                )
            if ds.has_behavior_log_probs != first.has_behavior_log_probs:
                raise ValueError(
                    f"dataset {i} {'has' if ds.has_behavior_log_probs else 'lacks'} behavior_log_probs unlike dataset 0; "
                    "drop them from all (ds.without_behavior_log_probs()) before concatenating"
                )
        columns = {
            k: (None if getattr(first, k) is None else np.concatenate([getattr(d, k) for d in datasets])) for k in COLUMNS
        }
        offsets = np.cumsum([0] + [d.n_transitions for d in datasets[:-1]])
        starts = np.concatenate([d.episode_starts[:-1] + o for d, o in zip(datasets, offsets)] + [[sum(len(d) for d in datasets)]])
        meta = dict(first.metadata) if metadata is None else dict(metadata)
        return first._like(columns, starts, meta)

    def __add__(self, other: "Dataset") -> "Dataset":
        if not isinstance(other, Dataset):
            return NotImplemented
        return Dataset.concatenate([self, other])

    def without_behavior_log_probs(self) -> "Dataset":
        columns = {k: getattr(self, k) for k in COLUMNS}
        columns["behavior_log_probs"] = None
        return self._like(columns, self.episode_starts)

    def with_rewards(self, rewards: np.ndarray) -> "Dataset":
        """A copy with new rewards (e.g. from a reward labeler)."""
        columns = {k: getattr(self, k) for k in COLUMNS}
        columns["rewards"] = rewards
        return self._like(columns, self.episode_starts)

    # ------------------------------------------------------------------ sampling
    def tensors(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """The columns as torch tensors on `device` (made once and cached; CPU tensors share memory)."""
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())  # "cuda" and "cuda:0" share one copy
        key = str(dev)
        if key not in self._torch_cache:
            self._torch_cache[key] = {
                k: torch.from_numpy(getattr(self, k)).to(dev) for k in COLUMNS if getattr(self, k) is not None
            }
        return self._torch_cache[key]

    def sample(
        self,
        batch_size: int,
        generator: torch.Generator | None = None,
        device: str | torch.device | None = None,
    ) -> Batch:
        """Draw `batch_size` transitions uniformly with replacement.

        The indices come from `torch.randint` on the generator's device, so a
        seeded generator gives a repeatable stream of batches.
        """
        if device is None:
            device = generator.device if generator is not None else "cpu"
        columns = self.tensors(device)
        index_device = generator.device if generator is not None else device
        index = torch.randint(self.n_transitions, (batch_size,), generator=generator, device=index_device)
        if generator is not None and index.device != columns["observations"].device:
            index = index.to(columns["observations"].device)  # e.g. a CPU generator feeding a GPU batch
        return self.gather(index, columns)

    @staticmethod
    def gather(index: torch.Tensor, columns: Mapping[str, torch.Tensor]) -> Batch:
        """Rows `index` of tensor columns as a Batch (columns that are not Dataset columns go to `extras`)."""
        picked = {k: v.index_select(0, index) for k, v in columns.items() if k in _COLUMN_SET}
        extras = {k: v.index_select(0, index) for k, v in columns.items() if k not in _COLUMN_SET}
        return Batch(indices=index, extras=extras, **picked)

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | os.PathLike) -> None:
        """Write an uncompressed `.npz` (no pickles) atomically."""
        path = os.fspath(path)
        arrays = {k: getattr(self, k) for k in COLUMNS if getattr(self, k) is not None}
        arrays["episode_starts"] = self.episode_starts
        header = {
            "format_version": FORMAT_VERSION,
            "discrete_actions": self.discrete_actions,
            "action_low": None if self.action_low is None else self.action_low.tolist(),
            "action_high": None if self.action_high is None else self.action_high.tolist(),
            "metadata": self.metadata,
        }
        arrays["header"] = np.frombuffer(json.dumps(header, default=_json_default).encode(), dtype=np.uint8)
        with atomic_write_path(path, suffix=".npz") as tmp:
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Dataset":
        """Read a file written by `save` (never unpickles)."""
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no dataset file at {path}; write one with Dataset.save(path)")
        with np.load(path, allow_pickle=False) as data:
            if "header" not in data:
                raise ValueError(f"{path} is not an offrl Dataset file (no header); write it with Dataset.save")
            header = json.loads(bytes(data["header"]).decode())
            if header.get("format_version") != FORMAT_VERSION:
                raise ValueError(
                    f"{path} has Dataset format {header.get('format_version')}, this offrl reads {FORMAT_VERSION}; "
                    "re-save it with a matching offrl version"
                )
            columns = {k: (data[k] if k in data else None) for k in COLUMNS}
            starts = data["episode_starts"]
        return cls(
            **columns,
            episode_starts=starts,
            action_low=header["action_low"],
            action_high=header["action_high"],
            discrete_actions=header["discrete_actions"],
            metadata=header["metadata"],
        )


def _same_bounds(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"metadata value {value!r} is not JSON serialisable")


def _flag(episode: Mapping[str, Any], names: tuple[str, ...], t: int, i: int) -> np.ndarray:
    for name in names:
        if name in episode:
            flag = _as_float32(f"episode {i} {name}", episode[name], 1)
            if len(flag) != t:
                raise ValueError(f"episode {i} {name} has {len(flag)} rows but actions has {t}")
            return flag.copy()
    return np.zeros(t, np.float32)


def _successor_rows(starts: np.ndarray, terminals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows that have a known successor, and the episode offsets after dropping the rest.

    The final row of a cut (non-terminal) episode has no recorded next
    observation, so it is dropped; an episode left empty disappears.
    """
    n = starts[-1]
    keep = np.ones(n, dtype=bool)
    last = starts[1:] - 1
    keep[last[terminals[last] == 0]] = False
    lengths = np.add.reduceat(keep.astype(np.int64), starts[:-1])
    lengths = lengths[lengths > 0]
    if len(lengths) == 0:
        raise ValueError(
            "no transition has a known next observation (every episode is a single cut step); "
            "pass next_observations explicitly"
        )
    return np.flatnonzero(keep), np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
