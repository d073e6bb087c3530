"""`Dataset`: the one in-memory form of logged decision data.

Transitions are stored column-wise as float32 numpy arrays, and episodes are
contiguous slices described by `episode_starts` (length n_episodes + 1), so
every per-episode computation is a slice or a `reduceat`.  Torch views of the
columns are made once per device and reused, so `sample` is a handful of
`index_select` calls with no per-sample Python.

Rewards and actions are labels a log may lack (the input of reward and action
labellers): wholly (the column is None) or per row (a boolean mask, True =
labelled, with 0 stored in the unlabelled rows).  Whatever needs a missing
label raises a ValueError that names the column and how to fill it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

__all__ = ["Dataset", "Batch", "atomic_write_path", "episode_timesteps", "episode_returns_to_go", "LABELS"]

# Files without missing labels are written as format 1, byte for byte as before labels could be missing, so
# every offrl reads them.  Files with missing or masked labels are format 2, which an older offrl refuses
# instead of reading the placeholder zeros of unlabelled rows as data.
FORMAT_VERSION = 1
MASKED_FORMAT_VERSION = 2
_READABLE_FORMATS = (FORMAT_VERSION, MASKED_FORMAT_VERSION)
_REQUIRED = ("observations", "actions", "rewards", "terminals", "timeouts", "next_observations")
_OPTIONAL = ("behavior_log_probs",)
COLUMNS = _REQUIRED + _OPTIONAL
_COLUMN_SET = frozenset(COLUMNS)

LABELS = ("rewards", "actions")
"""Columns that may be missing, wholly or per row."""
_MASK_KEYS = {"rewards": "reward_mask", "actions": "action_mask"}
_FILL_HINT = {
    "rewards": "fill them with dataset.with_rewards(...) or a labeller from offrl.reward_labeling "
               "(e.g. OTRewardLabeler, RewardModelLabeler)",
    "actions": "fill them with dataset.with_actions(...) or a labeller from offrl.reward_labeling "
               "(e.g. InverseDynamicsLabeler)",
}


@dataclass
class Batch:
    """A batch of transitions as torch tensors on one device.

    `actions` or `rewards` is None when the batch was drawn from data that
    lacks that label (an algorithm that needs it refuses such data at fit).
    `extras` carries algorithm-specific per-transition columns (e.g. Cal-QL's
    Monte-Carlo returns, a mixture's source index) drawn with the same indices.
    """

    observations: torch.Tensor
    actions: torch.Tensor | None
    rewards: torch.Tensor | None
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
    if ndim == 2 and array.shape[1] == 0:
        raise ValueError(f"{name} has 0 columns (shape {array.shape}); every step needs at least one value")
    return np.ascontiguousarray(array, dtype=np.float32)


MAX_DISCRETE_ACTIONS = 2**24
"""The most discrete actions a Dataset holds: float32 (the action column's dtype) stores every index below it exactly."""


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _as_discrete_count(value: Any) -> int | None:
    """The number of discrete actions (an integer, possibly written as 3.0), or None."""
    if value is None:
        return None
    numeric = isinstance(value, (int, np.integer, float, np.floating)) and not isinstance(value, (bool, np.bool_))
    if not numeric or not float(value).is_integer() or value < 1:
        raise ValueError(f"discrete_actions must be a positive integer (the number of actions), got {value!r}")
    count = int(value)
    if count > MAX_DISCRETE_ACTIONS:
        raise ValueError(
            f"discrete_actions = {count} exceeds 2**24 = {MAX_DISCRETE_ACTIONS}, the most actions whose indices "
            "a float32 action column stores exactly; encode such an action as several smaller ones"
        )
    return count


def _check_exact_indices(name: str, raw: Any, converted: np.ndarray, labelled: np.ndarray | None) -> None:
    """Discrete action indices survive the float32 cast unchanged (in labelled rows; unlabelled ones may hold anything)."""
    raw = np.asarray(raw)
    if raw.dtype in (np.float32, np.bool_) or raw.size != converted.size:
        return  # nothing to lose (a size mismatch is reported by the row checks)
    wide = raw.astype(np.float64).reshape(converted.shape)
    changed = (wide != converted) & np.isfinite(wide)
    if labelled is not None and len(labelled) == len(changed):
        changed &= labelled[:, None]
    if changed.any():
        row, col = np.argwhere(changed)[0]
        value = raw.reshape(converted.shape)[row, col].item()
        raise ValueError(
            f"{name} has value {value} at row {int(row)}, which float32 stores as {converted[row, col]:.9g}; discrete "
            f"actions are integer indices below discrete_actions (at most 2**24 = {MAX_DISCRETE_ACTIONS})"
        )


def _as_bounds(name: str, value: Any, action_dim: int) -> np.ndarray | None:
    """An action bound as a finite float32 array of action_dim values (a scalar is broadcast), or None."""
    if value is None:
        return None
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be numbers (a scalar or one per action dimension), got {value!r}") from err
    if array.ndim == 0:
        array = np.full(action_dim, array)
    elif array.ndim != 1:
        raise ValueError(f"{name} has shape {array.shape}; pass a scalar or one bound per action dimension "
                         f"(shape ({action_dim},))")
    elif len(array) != action_dim:
        raise ValueError(f"{name} has {len(array)} values but the action space has {action_dim} dimensions; pass a "
                         "scalar or one bound per action dimension")
    array = array.astype(np.float32)
    bad = np.flatnonzero(~np.isfinite(array))
    if len(bad):
        raise ValueError(f"{name} contains NaN or inf at dimension {int(bad[0])}; pass finite bounds, or None when "
                         "they are unknown (algorithms then use the range of the logged actions)")
    return array


def _as_episode_starts(value: Any, name: str = "episode_starts") -> np.ndarray:
    """Episode offsets as int64; integral floats (3.0) are read exactly, anything else is refused, never truncated."""
    array = np.asarray(value)
    integer = np.issubdtype(array.dtype, np.integer)
    if array.dtype == np.bool_ or not (integer or np.issubdtype(array.dtype, np.floating)):
        raise ValueError(f"{name} must be integer row offsets, got dtype {array.dtype} ({array.reshape(-1)[:5].tolist()}...)")
    if not integer:
        flat = array.reshape(-1)
        bad = np.flatnonzero(~np.isfinite(flat) | (flat != np.round(flat)))
        if len(bad):
            raise ValueError(f"{name} must be integer row offsets, got {flat[bad[0]]} at position {int(bad[0])}")
    return array.astype(np.int64)


def _check_flags_at_episode_ends(terminals: np.ndarray, timeouts: np.ndarray, starts: np.ndarray) -> None:
    """Terminals and timeouts only on the last row of an episode: a flag ends its episode."""
    is_last = np.zeros(int(starts[-1]), dtype=bool)
    is_last[starts[1:] - 1] = True
    for name, column in (("terminals", terminals), ("timeouts", timeouts)):
        inside = np.flatnonzero((column > 0) & ~is_last)
        if len(inside):
            row = int(inside[0])
            episode = int(np.searchsorted(starts, row, side="right") - 1)
            raise ValueError(
                f"{name} is set at row {row}, inside episode {episode} (rows {int(starts[episode])}-"
                f"{int(starts[episode + 1]) - 1}) rather than at its last row; a terminal or timeout ends its episode: "
                f"start a new episode after row {row} (episode_starts) or clear the flag"
            )


def _check_finite(name: str, array: np.ndarray, labelled: np.ndarray | None = None) -> None:
    """Every value finite, in the rows that are labelled (all rows when `labelled` is None)."""
    bad_values = ~np.isfinite(array)
    if labelled is not None:
        bad_values &= labelled.reshape((-1,) + (1,) * (array.ndim - 1))
    if bad_values.any():
        bad = np.argwhere(bad_values)[0]
        hint = (f"; or mark the row unlabelled with {_MASK_KEYS[name]}=" if name in _MASK_KEYS else "")
        raise ValueError(
            f"{name} contains NaN or inf at row {int(bad[0])}; remove or impute that row before building a "
            f"Dataset{hint}"
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


def _as_mask(name: str, value: Any, n: int) -> np.ndarray | None:
    """A label mask as a bool array of n rows (True = labelled), or None."""
    if value is None:
        return None
    mask = np.asarray(value)
    if mask.dtype != bool:
        if mask.dtype == object or not np.issubdtype(mask.dtype, np.number) or np.any((mask != 0) & (mask != 1)):
            raise ValueError(f"{name} must be a boolean array (True = labelled), got dtype {mask.dtype}")
        mask = mask != 0
    if mask.shape != (n,):
        raise ValueError(f"{name} has shape {mask.shape}; expected one flag per transition, ({n},)")
    return mask


def _apply_label_mask(name: str, values: np.ndarray | None, mask: np.ndarray | None
                      ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The canonical (values, mask) of a label column.

    Unlabelled rows hold 0 (never NaN); the mask is None when every row is
    labelled, and the values are None when no row is.
    """
    if values is None:
        if mask is not None and mask.any():
            raise ValueError(
                f"{_MASK_KEYS[name]} marks {int(mask.sum())} rows as labelled but {name} is None; pass the {name}"
            )
        return None, None
    if mask is None or mask.all():
        return values, None
    if not mask.any():
        return None, None
    values = np.where(mask.reshape((-1,) + (1,) * (values.ndim - 1)), values, np.float32(0)).astype(np.float32)
    mask = mask.copy()
    mask.flags.writeable = False
    return values, mask


def episode_timesteps(episode_starts: np.ndarray) -> np.ndarray:
    """Step index of every transition within its episode (int64), from episode offsets."""
    starts = np.asarray(episode_starts, dtype=np.int64)
    return np.arange(starts[-1], dtype=np.int64) - np.repeat(starts[:-1], np.diff(starts))


def episode_returns_to_go(rewards: np.ndarray, episode_starts: np.ndarray, gamma: float = 1.0) -> np.ndarray:
    """Discounted return from each step to the end of its episode (float32).

    One reverse discounted cumulative sum over the whole array, then
    subtract what leaks in from later episodes:
    G_all[t] = G_episode[t] + gamma ** (end - t) * G_all[end].
    """
    from scipy.signal import lfilter

    gamma = float(gamma)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], got {gamma}")
    starts = np.asarray(episode_starts, dtype=np.int64)
    rewards = np.asarray(rewards, dtype=np.float64)
    g_all = lfilter([1.0], [1.0, -gamma], rewards[::-1])[::-1]
    ends = np.repeat(starts[1:], np.diff(starts))
    leak = np.append(g_all, 0.0)[ends] * gamma ** (ends - np.arange(len(rewards))).astype(np.float64)
    return (g_all - leak).astype(np.float32)


class Dataset:
    """Logged transitions with episode structure.

    Columns (float32): `observations` (N, obs_dim), `actions` (N, act_dim),
    `rewards` (N,), `terminals` (N,), `timeouts` (N,),
    `next_observations` (N, obs_dim) and optionally `behavior_log_probs` (N,).
    `terminals` marks a true end of the MDP (no bootstrapping);
    `timeouts` marks a cut (time limit or end of log) where the value of the
    next state still counts.  Episode i is rows
    `episode_starts[i]:episode_starts[i + 1]`, and a flag may only be set on
    an episode's last row.  A step logged as both terminal and timeout is a
    terminal, everywhere (`from_arrays`, `from_episodes`, `from_pandas`, the
    D4RL and Minari readers), as in gymnasium: `terminated` means no
    bootstrap whatever `truncated` says.

    `action_low` / `action_high` are the action space's finite bounds (a
    scalar or one per dimension); None means unknown, and algorithms then
    use the range of the logged actions.

    Rewards and actions may be missing: `rewards=None` / `actions=None` when
    the log has none (then `action_dim=` or per-dimension action bounds give
    the action dimension), or a per-row `reward_mask` / `action_mask`
    (True = labelled; unlabelled rows may hold anything in the input, NaN
    included, and are stored as 0).  See `label_mask`, `missing_labels`,
    `with_rewards` and `with_actions`.

    Build one with `from_arrays`, `from_episodes`, `from_pandas`,
    `offrl.datasets.load` or `Dataset.load`.
    """

    def __init__(
        self,
        *,
        observations: np.ndarray,
        actions: np.ndarray | None,
        rewards: np.ndarray | None,
        terminals: np.ndarray,
        timeouts: np.ndarray,
        next_observations: np.ndarray,
        episode_starts: np.ndarray,
        behavior_log_probs: np.ndarray | None = None,
        action_low: np.ndarray | Sequence[float] | float | None = None,
        action_high: np.ndarray | Sequence[float] | float | None = None,
        discrete_actions: int | None = None,
        action_dim: int | None = None,
        reward_mask: np.ndarray | None = None,
        action_mask: np.ndarray | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        self.observations = _as_float32("observations", observations, 2)
        n = len(self.observations)
        raw_actions = actions
        actions = None if actions is None else _as_float32("actions", actions, 2)
        rewards = None if rewards is None else _as_float32("rewards", rewards, 1)
        for name, column in (("actions", actions), ("rewards", rewards)):
            if column is not None and len(column) != n:
                raise ValueError(
                    f"{name} has {len(column)} rows but observations has {n}; every column needs one row per transition"
                )
        self.discrete_actions = _as_discrete_count(discrete_actions)
        self._action_dim = _resolve_action_dim(actions, action_dim, action_low, action_high, self.discrete_actions)
        action_mask = _as_mask("action_mask", action_mask, n)
        if self.discrete_actions is not None and actions is not None:
            _check_exact_indices("actions", raw_actions, actions, action_mask)
        self.rewards, reward_mask = _apply_label_mask("rewards", rewards, _as_mask("reward_mask", reward_mask, n))
        self.actions, action_mask = _apply_label_mask("actions", actions, action_mask)
        self._label_masks: dict[str, np.ndarray] = {
            k: m for k, m in (("rewards", reward_mask), ("actions", action_mask)) if m is not None
        }
        self.terminals = _as_float32("terminals", terminals, 1)
        self.timeouts = _as_float32("timeouts", timeouts, 1)
        self.next_observations = _as_float32("next_observations", next_observations, 2)
        self.behavior_log_probs = (
            None if behavior_log_probs is None else _as_float32("behavior_log_probs", behavior_log_probs, 1)
        )
        self.episode_starts = _as_episode_starts(episode_starts)
        self.action_low = _as_bounds("action_low", action_low, self._action_dim)
        self.action_high = _as_bounds("action_high", action_high, self._action_dim)
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
                _check_finite(name, column)  # unlabelled rows already hold 0
        for name in ("terminals", "timeouts"):
            _check_flags(name, getattr(self, name))
        both = np.flatnonzero((self.terminals > 0) & (self.timeouts > 0))
        if len(both):
            raise ValueError(
                f"terminals and timeouts are both set at row {int(both[0])}; a step either ends the MDP (terminal) "
                "or is cut by a time limit (timeout): clear the timeout (from_arrays, from_episodes, from_pandas and "
                "the D4RL and Minari readers count such a step as terminal)"
            )
        starts = self.episode_starts
        if starts.ndim != 1 or len(starts) < 2 or starts[0] != 0 or starts[-1] != n or np.any(np.diff(starts) <= 0):
            raise ValueError(
                "episode_starts must increase strictly from 0 to n_transitions "
                f"({n}); got {starts[:5].tolist()}...{starts[-3:].tolist()}"
            )
        _check_flags_at_episode_ends(self.terminals, self.timeouts, starts)
        if self.action_low is not None and self.action_high is not None:
            bad = np.flatnonzero(~(self.action_low < self.action_high))
            if len(bad):
                j = int(bad[0])
                raise ValueError(
                    f"action_low[{j}] = {self.action_low[j]:.6g} is not below action_high[{j}] = "
                    f"{self.action_high[j]:.6g}; pass the action space's bounds, low below high in every dimension"
                )
        self._validate_actions()

    def _validate_actions(self) -> None:
        """Labelled actions lie in the action space (unlabelled rows hold a placeholder and are skipped)."""
        if self.actions is None:
            return
        labelled = self._label_masks.get("actions")
        if self.discrete_actions is not None:
            a = self.actions
            if a.shape[1] != 1:
                raise ValueError(f"actions must have one column of action indices for a discrete action space, got {a.shape[1]}")
            outside = (a[:, 0] != np.round(a[:, 0])) | (a[:, 0] < 0) | (a[:, 0] >= self.discrete_actions)
            bad = np.flatnonzero(outside if labelled is None else outside & labelled)
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
            if labelled is not None:
                mask &= labelled[:, None]
            if mask.any():
                row, col = np.argwhere(mask)[0]
                raise ValueError(
                    f"actions[{int(row)}, {int(col)}] = {self.actions[row, col]:.6g} lies outside the action space "
                    f"({name} = {bound[col]:.6g}); clip the actions or pass the correct action bounds"
                )

    # ------------------------------------------------------------------ labels
    def label_mask(self, name: str) -> np.ndarray | None:
        """Which rows of label column `name` ("rewards" or "actions") hold a value.

        None when every row is labelled, else a read-only bool array (True =
        labelled), all False when the column is missing wholly.
        """
        _check_label_name(name)
        if getattr(self, name) is None:
            return np.zeros(self.n_transitions, dtype=bool)
        return self._label_masks.get(name)

    def is_labelled(self, name: str) -> bool:
        """Whether every row of label column `name` ("rewards" or "actions") has a value."""
        return self.label_mask(name) is None

    def missing_labels(self) -> list[str]:
        """The label columns ("rewards", "actions") that are not fully labelled."""
        return [name for name in LABELS if not self.is_labelled(name)]

    def n_labelled(self, name: str) -> int:
        """Number of rows whose label `name` has a value."""
        mask = self.label_mask(name)
        return self.n_transitions if mask is None else int(mask.sum())

    def require_labels(self, *names: str, context: str | None = None) -> None:
        """Raise a ValueError naming the column and how to fill it when any of `names` is not fully labelled.

        `context` says who needs them (e.g. "IQL"), for the message.
        """
        for name in names or LABELS:
            _check_label_name(name)
            if self.is_labelled(name):
                continue
            n_missing = self.n_transitions - self.n_labelled(name)
            who = f"{context} needs {name}, but " if context else ""
            drop = (f" (or, where {name} are not used, drop them with dataset.without_{name}())"
                    if n_missing < self.n_transitions else "")
            raise ValueError(
                f"{who}{name} are missing for {n_missing} of {self.n_transitions} transitions of this dataset; "
                f"{_FILL_HINT[name]}{drop}"
            )

    def with_rewards(self, rewards: Any, mask: Any = None) -> "Dataset":
        """A copy with rewards filled in (e.g. by a reward labeller).

        Without `mask` every row takes the new value and the rewards become
        fully labelled.  With `mask` (True = take the new value) only those
        rows are replaced and become labelled; the others keep their value or
        unlabelled state (their entries in `rewards` are ignored, NaN allowed).
        """
        return self._with_label("rewards", rewards, mask)

    def with_actions(self, actions: Any, mask: Any = None) -> "Dataset":
        """A copy with actions filled in (e.g. by an inverse-dynamics labeller); `mask` as in `with_rewards`."""
        return self._with_label("actions", actions, mask)

    def without_rewards(self, keep: Any = None) -> "Dataset":
        """A copy whose rewards are missing: wholly, or (with `keep`, True = keep) in the rows where keep is False."""
        return self._without_label("rewards", keep)

    def without_actions(self, keep: Any = None) -> "Dataset":
        """A copy whose actions are missing: wholly, or (with `keep`, True = keep) in the rows where keep is False."""
        return self._without_label("actions", keep)

    def _with_label(self, name: str, values: Any, mask: Any) -> "Dataset":
        n = self.n_transitions
        new = _as_float32(name, values, 2 if name == "actions" else 1)
        if len(new) != n:
            raise ValueError(f"{name} has {len(new)} rows but observations has {n}; pass one {name[:-1]} per transition")
        if name == "actions" and new.shape[1] != self.action_dim:
            raise ValueError(f"actions has {new.shape[1]} columns but the dataset's action_dim is {self.action_dim}")
        columns = self._columns()
        masks = self._masks()
        take = _as_mask("mask", mask, n)
        if name == "actions" and self.discrete_actions is not None:
            _check_exact_indices("actions", values, new, take)
        if take is None:
            columns[name], masks[name] = new, None
        else:
            old = columns[name] if columns[name] is not None else np.zeros_like(new)
            current = self.label_mask(name)
            # Rows not taken keep their value and state: a NaN in `values` there never reaches the column.
            columns[name] = np.where(take.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
            masks[name] = None if current is None else take | current
        return self._like(columns, self.episode_starts, masks=masks)

    def _without_label(self, name: str, keep: Any) -> "Dataset":
        _check_label_name(name)
        columns = self._columns()
        masks = self._masks()
        keep_rows = _as_mask("keep", keep, self.n_transitions)
        if keep_rows is None:
            columns[name], masks[name] = None, None
        else:
            current = self.label_mask(name)
            masks[name] = keep_rows if current is None else keep_rows & current
        return self._like(columns, self.episode_starts, masks=masks)

    def _columns(self) -> dict[str, np.ndarray | None]:
        return {k: getattr(self, k) for k in COLUMNS}

    def _masks(self) -> dict[str, np.ndarray | None]:
        """Label masks for the constructor (None = fully labelled, or absent with the column)."""
        return {name: self._label_masks.get(name) for name in LABELS}

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
        action_dim: int | None = None,
        reward_mask: Any = None,
        action_mask: Any = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> "Dataset":
        """Build from flat per-transition arrays.

        Episodes end where `terminals` or `timeouts` is set (or at
        `episode_starts` when given; a flag must then sit on an episode's
        last row).  A row flagged as both is a terminal.  When
        `next_observations` is omitted it is taken from the following row
        within each episode; the last step of an episode that was cut (not
        terminal) then has no successor and is dropped, and the step before
        it becomes the episode's timeout, as in D4RL's `qlearning_dataset`
        but keeping episode boundaries.

        `actions` or `rewards` may be None (missing) and `reward_mask` /
        `action_mask` mark per row which values are labelled; see `Dataset`.
        """
        obs = _as_float32("observations", observations, 2)
        n = len(obs)
        if n == 0:
            raise ValueError("observations is empty; a Dataset needs at least one transition")
        rewards_arr = None if rewards is None else _as_float32("rewards", rewards, 1)
        terminals_arr = np.zeros(n, np.float32) if terminals is None else _as_float32("terminals", terminals, 1)
        timeouts_arr = np.zeros(n, np.float32) if timeouts is None else _as_float32("timeouts", timeouts, 1)
        actions_arr = None if actions is None else _as_float32("actions", actions, 2)
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
        masks = {"rewards": _as_mask("reward_mask", reward_mask, n), "actions": _as_mask("action_mask", action_mask, n)}
        discrete_actions = _as_discrete_count(discrete_actions)
        if discrete_actions is not None and actions_arr is not None:
            _check_exact_indices("actions", actions, actions_arr, masks["actions"])
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
                _check_finite(name, column, masks.get(name))
        for name, column in (("terminals", terminals_arr), ("timeouts", timeouts_arr)):
            _check_flags(name, column)
        if episode_starts is None:
            starts = _ends_to_starts((terminals_arr > 0) | (timeouts_arr > 0), n)
        else:
            starts = _as_episode_starts(episode_starts).reshape(-1)
            if len(starts) == 0 or starts[-1] != n:
                starts = np.append(starts, n)
            if starts[0] != 0 or np.any(np.diff(starts) <= 0) or starts[-1] != n:
                raise ValueError(
                    f"episode_starts must start at 0 and increase strictly up to n_transitions ({n}); "
                    f"got {np.asarray(episode_starts).reshape(-1)[:5].tolist()}..."
                )
            # checked here, before rows are dropped, so that the row numbers are the caller's
            _check_flags_at_episode_ends(terminals_arr, timeouts_arr, starts)
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
            masks = {k: (None if v is None else v[keep]) for k, v in masks.items()}
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
            action_dim=action_dim,
            reward_mask=masks["rewards"],
            action_mask=masks["actions"],
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
        action_dim: int | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> "Dataset":
        """Build from a list of per-episode dicts.

        Each dict has `observations` (T + 1 rows, Minari style, or T rows with
        `next_observations`), `actions` (T), `rewards` (T) and optionally
        `terminals`/`terminations`, `timeouts`/`truncations` and
        `behavior_log_probs`.  If neither flag is given, an episode counts as
        cut by a time limit; a last step flagged as both is a terminal.  An
        episode whose actions or rewards were not logged has `actions: None`
        / `rewards: None`; optional `action_mask` / `reward_mask` entries (T
        flags, True = labelled) mark single unlabelled steps, as
        `Dataset.episode` returns them.  All episodes share one observation
        and action width.
        """
        parts: dict[str, list[np.ndarray | None]] = {k: [] for k in COLUMNS}
        mask_parts: dict[str, list[np.ndarray]] = {name: [] for name in LABELS}
        lengths = []
        has_log_probs = None
        widths: dict[str, tuple[int, int]] = {}  # column -> (width, first episode that had it)
        discrete_actions = _as_discrete_count(discrete_actions)
        for i, episode in enumerate(episodes):
            if "actions" not in episode or "rewards" not in episode or "observations" not in episode:
                raise ValueError(
                    f"episode {i} needs 'observations', 'actions' and 'rewards' entries "
                    "(actions or rewards None where the log lacks them)"
                )
            actions = None if episode["actions"] is None else _as_float32(f"episode {i} actions", episode["actions"], 2)
            rewards = None if episode["rewards"] is None else _as_float32(f"episode {i} rewards", episode["rewards"], 1)
            obs = _as_float32(f"episode {i} observations", episode["observations"], 2)
            has_next = "next_observations" in episode
            if actions is not None:
                t, unit = len(actions), "actions"
            elif rewards is not None:
                t, unit = len(rewards), "rewards"
            else:  # neither label logged: the observations give the length
                t, unit = (len(episode["next_observations"]) if has_next else len(obs) - 1), "steps"
            if t <= 0:
                raise ValueError(f"episode {i} has no {unit}; drop empty episodes")
            if has_next:
                next_obs = _as_float32(f"episode {i} next_observations", episode["next_observations"], 2)
            elif len(obs) == t + 1:
                obs, next_obs = obs[:-1], obs[1:]
            else:
                raise ValueError(
                    f"episode {i} has {len(obs)} observations for {t} {unit}; pass T + 1 observations "
                    "(including the final one) or a next_observations entry"
                )
            if len(obs) != t:
                raise ValueError(f"episode {i} observations has {len(obs)} rows but {unit} has {t}")
            if len(next_obs) != t:
                raise ValueError(f"episode {i} next_observations has {len(next_obs)} rows but {unit} has {t}")
            if next_obs.shape[1] != obs.shape[1]:
                raise ValueError(f"episode {i} next_observations has {next_obs.shape[1]} columns but observations has "
                                 f"{obs.shape[1]}; they must describe the same state space")
            for name, values in (("observations", obs), ("actions", actions)):
                if values is None:
                    continue
                width, first = widths.setdefault(name, (values.shape[1], i))
                if values.shape[1] != width:
                    raise ValueError(f"episode {i} {name} has {values.shape[1]} columns but episode {first} has {width}; "
                                     "all episodes must share one observation and action space")
            if rewards is not None and len(rewards) != t:
                raise ValueError(f"episode {i} rewards has {len(rewards)} rows but {unit} has {t}")
            for name, values in (("rewards", rewards), ("actions", actions)):
                key = _MASK_KEYS[name]
                mask = _as_mask(f"episode {i} {key}", episode.get(key), t)
                if values is None:
                    mask = np.zeros(t, bool)
                    if episode.get(key) is not None and np.any(episode[key]):
                        raise ValueError(f"episode {i} {key} marks steps as labelled but its {name} is None")
                mask_parts[name].append(np.ones(t, bool) if mask is None else mask)
                if values is not None:
                    _check_finite(f"episode {i} {name}", values, mask)
                if name == "actions" and values is not None and discrete_actions is not None:
                    _check_exact_indices(f"episode {i} actions", episode["actions"], values, mask)
            terminals = _flag(episode, ("terminals", "terminations"), t, i, unit)
            timeouts = _flag(episode, ("timeouts", "truncations"), t, i, unit)
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
                    raise ValueError(f"episode {i} behavior_log_probs has {len(log_probs)} rows but {unit} has {t}")
                parts["behavior_log_probs"].append(log_probs)
            lengths.append(t)
        if not lengths:
            raise ValueError("episodes is empty; a Dataset needs at least one episode")
        # Episodes without actions or rewards get placeholder rows of the right width; their mask is False.
        width = widths["actions"][0] if "actions" in widths else None
        columns: dict[str, np.ndarray | None] = {}
        masks: dict[str, np.ndarray | None] = {}
        for k, v in parts.items():
            if k in LABELS:
                present = [x for x in v if x is not None]
                if not present:
                    columns[k], masks[k] = None, None
                    continue
                columns[k] = np.concatenate([x if x is not None else _placeholder(k, t, width)
                                             for x, t in zip(v, lengths)])
                masks[k] = np.concatenate(mask_parts[k])
            else:
                columns[k] = np.concatenate(v) if v else None
        return cls(
            **columns,
            episode_starts=np.concatenate([[0], np.cumsum(lengths)]),
            action_low=action_low,
            action_high=action_high,
            discrete_actions=discrete_actions,
            action_dim=action_dim if action_dim is not None else width,
            reward_mask=masks["rewards"],
            action_mask=masks["actions"],
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
        reward_column: str | None = "reward",
        terminal_column: str = "terminal",
        timeout_column: str = "timeout",
        episode_column: str | None = "episode_id",
        log_prob_column: str = "behavior_log_prob",
        step_column: str | None = "step",
        **kwargs: Any,
    ) -> "Dataset":
        """Build from a DataFrame with one row per transition.

        By default columns follow `to_pandas`: `obs_0..`, `action_0..`,
        `next_obs_0..` (optional), `reward`, `terminal`, `timeout`,
        `episode_id`, `step` (optional) and `behavior_log_prob` (optional).
        Rows of an episode must be contiguous and in time order: when the
        `step` column is there, rows whose step does not increase within an
        episode are refused (and, without next-observation columns, steps
        must be consecutive, since the next observation is the following
        row); `step_column=None` reads the rows as they come.  A terminal or
        timeout may only be set on an episode's last row.  NaN in the reward or
        action columns marks a missing label; `reward_column=None` or
        `action_columns=()` (with `action_dim=...`) reads a log without them.
        Other keyword arguments go to `from_arrays`.
        """
        columns = list(df.columns)

        def pick(explicit: Sequence[str] | None, prefix: str, required: bool) -> list[str] | None:
            if explicit is not None:
                missing = [c for c in explicit if c not in columns]
                if missing:
                    raise ValueError(f"DataFrame has no column(s) {missing}; available: {columns}")
                return list(explicit) or None
            found = sorted((c for c in columns if isinstance(c, str) and c.startswith(prefix) and c[len(prefix):].isdigit()),
                           key=lambda c: int(c[len(prefix):]))
            if required and not found:
                kind = "observation" if prefix == "obs_" else "action"
                extra = "" if prefix == "obs_" else " (or action_columns=() with action_dim=... for a log without actions)"
                raise ValueError(
                    f"DataFrame has no '{prefix}0', '{prefix}1', ... columns; pass {kind}_columns=[...] naming them{extra}"
                )
            return found or None

        obs_cols = pick(observation_columns, "obs_", True)
        act_cols = pick(action_columns, "action_", True)
        next_cols = pick(next_observation_columns, "next_obs_", False)
        if reward_column is not None and reward_column not in columns:
            raise ValueError(
                f"DataFrame has no reward column '{reward_column}'; pass reward_column=... (None for a log without rewards)"
            )
        get = lambda name: df[name].to_numpy() if name in columns else None  # noqa: E731
        starts = None
        if episode_column is not None and episode_column in columns:
            ids = df[episode_column].to_numpy()
            change = np.flatnonzero(ids[1:] != ids[:-1]) + 1
            starts = np.concatenate([[0], change, [len(ids)]])
            if len(np.unique(ids)) != len(starts) - 1:
                raise ValueError(f"rows of each {episode_column} must be contiguous; sort the DataFrame by episode and step")
        if step_column is not None and step_column in columns:
            _check_steps_in_order(df, step_column, starts, terminal_column, timeout_column, next_cols is None)
        rewards = reward_mask = None
        if reward_column is not None:
            rewards = _as_float32(f"column {reward_column!r}", df[reward_column].to_numpy(), 1)
            reward_mask = ~np.isnan(rewards)
        actions = action_mask = None
        if act_cols is not None:
            # float64 keeps discrete action indices exact until from_arrays checks them
            actions = _frame_values(df, act_cols, "action", np.float64)
            nan = np.isnan(actions)
            partial = np.flatnonzero(nan.any(1) & ~nan.all(1))
            if len(partial):
                raise ValueError(
                    f"row {int(partial[0])} has NaN in some but not all of the action columns {act_cols}; "
                    "an action is either logged (all columns) or missing (all NaN)"
                )
            action_mask = ~nan[:, 0]
        return cls.from_arrays(
            observations=_frame_values(df, obs_cols, "observation", np.float32),
            actions=actions,
            rewards=rewards,
            terminals=get(terminal_column),
            timeouts=get(timeout_column),
            next_observations=None if next_cols is None else _frame_values(df, next_cols, "next-observation", np.float32),
            behavior_log_probs=get(log_prob_column),
            episode_starts=starts,
            reward_mask=kwargs.pop("reward_mask", reward_mask),
            action_mask=kwargs.pop("action_mask", action_mask),
            **kwargs,
        )

    def to_pandas(self) -> Any:
        """One row per transition; `Dataset.from_pandas(ds.to_pandas())` round-trips.

        Missing rewards or actions are NaN.
        """
        import pandas as pd

        data: dict[str, np.ndarray] = {}
        lengths = np.diff(self.episode_starts)
        data["episode_id"] = np.repeat(np.arange(self.n_episodes), lengths)
        data["step"] = self.timesteps()
        for j in range(self.observation_dim):
            data[f"obs_{j}"] = self.observations[:, j]
        actions = self._with_nan("actions")
        for j in range(self.action_dim):
            data[f"action_{j}"] = actions[:, j]
        data["reward"] = self._with_nan("rewards")
        data["terminal"] = self.terminals
        data["timeout"] = self.timeouts
        for j in range(self.observation_dim):
            data[f"next_obs_{j}"] = self.next_observations[:, j]
        if self.behavior_log_probs is not None:
            data["behavior_log_prob"] = self.behavior_log_probs
        return pd.DataFrame(data)

    def _with_nan(self, name: str) -> np.ndarray:
        """Label column `name` with NaN in its unlabelled rows (a copy when any row is unlabelled)."""
        values = getattr(self, name)
        mask = self.label_mask(name)
        if mask is None:
            return values
        shape = (self.n_transitions, self.action_dim) if name == "actions" else (self.n_transitions,)
        out = np.full(shape, np.nan, np.float32)
        if values is not None:
            out[mask] = values[mask]
        return out

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
        return self._action_dim

    @property
    def has_behavior_log_probs(self) -> bool:
        return self.behavior_log_probs is not None

    def __len__(self) -> int:
        return self.n_transitions

    def __repr__(self) -> str:
        name = self.metadata.get("name")
        missing = [
            f"{label} missing" + ("" if getattr(self, label) is None else f" in {len(self) - self.n_labelled(label)} rows")
            for label in self.missing_labels()
        ]
        return (
            f"Dataset({'name=' + repr(name) + ', ' if name else ''}n_transitions={self.n_transitions}, "
            f"n_episodes={self.n_episodes}, observation_dim={self.observation_dim}, action_dim={self.action_dim}"
            f"{', behavior_log_probs' if self.has_behavior_log_probs else ''}"
            f"{''.join(', ' + m for m in missing)})"
        )

    def episode_lengths(self) -> np.ndarray:
        return np.diff(self.episode_starts)

    def timesteps(self) -> np.ndarray:
        """Step index of every transition within its episode (int64, 0 at each episode's first step)."""
        return episode_timesteps(self.episode_starts)

    def episode_returns(self, gamma: float = 1.0) -> np.ndarray:
        """Sum of rewards per episode (discounted when gamma < 1)."""
        self.require_labels("rewards", context="episode_returns")
        if gamma == 1.0:
            return np.add.reduceat(self.rewards.astype(np.float64), self.episode_starts[:-1])
        steps = self.timesteps()
        return np.add.reduceat(self.rewards * gamma ** steps.astype(np.float64), self.episode_starts[:-1])

    def returns_to_go(self, gamma: float = 1.0) -> np.ndarray:
        """Discounted Monte-Carlo return from each step to the end of its episode (float32)."""
        self.require_labels("rewards", context="returns_to_go")
        return episode_returns_to_go(self.rewards, self.episode_starts, gamma)

    def observation_stats(self, eps: float = 1e-3) -> tuple[np.ndarray, np.ndarray]:
        """Mean and std of observations (std floored at `eps`) for normalisation."""
        mean = self.observations.mean(axis=0, dtype=np.float64)
        std = self.observations.std(axis=0, dtype=np.float64)
        return mean.astype(np.float32), np.maximum(std, eps).astype(np.float32)

    # ------------------------------------------------------------------ episodes
    def episode(self, index: int) -> dict[str, np.ndarray | None]:
        """Episode `index` as a dict of column slices (views, not copies).

        A label missing wholly is None; one missing in some rows comes with
        its mask slice (`reward_mask` / `action_mask`, True = labelled), so
        `Dataset.from_episodes(list(ds))` keeps the labels as they are.
        """
        if not -self.n_episodes <= index < self.n_episodes:
            raise IndexError(f"episode index {index} out of range for {self.n_episodes} episodes")
        index %= self.n_episodes
        s, e = self.episode_starts[index], self.episode_starts[index + 1]
        out: dict[str, np.ndarray | None] = {}
        for k in COLUMNS:
            column = getattr(self, k)
            if column is not None:
                out[k] = column[s:e]
            elif k in LABELS:
                out[k] = None
        for name, mask in self._label_masks.items():
            out[_MASK_KEYS[name]] = mask[s:e]
        return out

    def __iter__(self) -> Iterator[dict[str, np.ndarray | None]]:
        for i in range(self.n_episodes):
            yield self.episode(i)

    def _like(self, columns: dict[str, np.ndarray | None], starts: np.ndarray, metadata: dict | None = None,
              masks: Mapping[str, np.ndarray | None] | None = None) -> "Dataset":
        masks = self._masks() if masks is None else masks
        return Dataset(
            **columns,
            episode_starts=starts,
            action_low=self.action_low,
            action_high=self.action_high,
            discrete_actions=self.discrete_actions,
            action_dim=self.action_dim,
            reward_mask=masks.get("rewards"),
            action_mask=masks.get("actions"),
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
        masks = {k: (None if m is None else m[rows]) for k, m in self._masks().items()}
        return self._like(columns, np.concatenate([[0], np.cumsum(lengths)]), masks=masks)

    @staticmethod
    def concatenate(datasets: Sequence["Dataset"], metadata: Mapping[str, Any] | None = None) -> "Dataset":
        """Concatenate datasets episode-wise (spaces and log-prob presence must agree).

        Labelled and unlabelled datasets concatenate to one whose label masks
        say which rows came with rewards and actions.
        """
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
        columns: dict[str, np.ndarray | None] = {}
        masks: dict[str, np.ndarray | None] = {}
        for k in COLUMNS:
            if k in LABELS and any(not d.is_labelled(k) for d in datasets):
                columns[k] = np.concatenate([getattr(d, k) if getattr(d, k) is not None
                                             else _placeholder(k, d.n_transitions, d.action_dim) for d in datasets])
                masks[k] = np.concatenate([np.ones(d.n_transitions, bool) if d.is_labelled(k) else d.label_mask(k)
                                           for d in datasets])
            else:
                columns[k] = None if getattr(first, k) is None else np.concatenate([getattr(d, k) for d in datasets])
                masks[k] = None
        offsets = np.cumsum([0] + [d.n_transitions for d in datasets[:-1]])
        starts = np.concatenate([d.episode_starts[:-1] + o for d, o in zip(datasets, offsets)] + [[sum(len(d) for d in datasets)]])
        meta = dict(first.metadata) if metadata is None else dict(metadata)
        return first._like(columns, starts, meta, masks=masks)

    def __add__(self, other: "Dataset") -> "Dataset":
        if not isinstance(other, Dataset):
            return NotImplemented
        return Dataset.concatenate([self, other])

    def without_behavior_log_probs(self) -> "Dataset":
        columns = self._columns()
        columns["behavior_log_probs"] = None
        return self._like(columns, self.episode_starts)

    # ------------------------------------------------------------------ sampling
    def tensors(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """The columns as torch tensors on `device` (made once and cached; CPU tensors share memory).

        A label missing wholly is left out; one missing in some rows raises a
        ValueError (its placeholder zeros must not pass for data).
        """
        for name in LABELS:
            if name in self._label_masks:
                self.require_labels(name, context="Dataset.tensors/sample")
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
        seeded generator gives a repeatable stream of batches.  A label
        missing wholly is None in the batch; one missing in some rows raises.
        """
        batch_size = _positive_int(batch_size, "batch_size")
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
        """Rows `index` of tensor columns as a Batch (columns that are not Dataset columns go to `extras`;
        absent actions or rewards are None)."""
        picked = {k: v.index_select(0, index) for k, v in columns.items() if k in _COLUMN_SET}
        extras = {k: v.index_select(0, index) for k, v in columns.items() if k not in _COLUMN_SET}
        for name in LABELS:
            picked.setdefault(name, None)
        return Batch(indices=index, extras=extras, **picked)

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | os.PathLike) -> None:
        """Write an uncompressed `.npz` (no pickles) atomically.

        Label masks are stored as bool arrays `reward_mask` / `action_mask`;
        a file with missing labels is format 2, which older offrl refuses.
        """
        path = os.fspath(path)
        arrays = {k: getattr(self, k) for k in COLUMNS if getattr(self, k) is not None}
        arrays["episode_starts"] = self.episode_starts
        header: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "discrete_actions": self.discrete_actions,
            "action_low": None if self.action_low is None else self.action_low.tolist(),
            "action_high": None if self.action_high is None else self.action_high.tolist(),
            "metadata": self.metadata,
        }
        if self.missing_labels():
            header["format_version"] = MASKED_FORMAT_VERSION
            header["action_dim"] = self.action_dim
            for name, mask in self._label_masks.items():
                arrays[_MASK_KEYS[name]] = np.asarray(mask)
        arrays["header"] = np.frombuffer(json.dumps(header, default=_json_default).encode(), dtype=np.uint8)
        with atomic_write_path(path, suffix=".npz") as tmp:
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Dataset":
        """Read a file written by `save` (never unpickles).

        A file that is truncated, not an `.npz` or not written by `save`
        raises a ValueError naming the file; so does one whose columns do
        not make a valid Dataset.
        """
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no dataset file at {path}; write one with Dataset.save(path)")
        header, columns, masks, starts = _read_npz(path)
        try:
            return cls(
                **columns,
                episode_starts=starts,
                action_low=header["action_low"],
                action_high=header["action_high"],
                discrete_actions=header["discrete_actions"],
                action_dim=header.get("action_dim"),
                reward_mask=masks["rewards"],
                action_mask=masks["actions"],
                metadata=header["metadata"],
            )
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from err
        except TypeError as err:  # e.g. a header whose metadata is not a mapping
            raise TypeError(f"{path}: {err}") from err


_HEADER_KEYS = ("format_version", "discrete_actions", "action_low", "action_high", "metadata")


def _read_npz(path: str) -> tuple[dict[str, Any], dict[str, np.ndarray | None], dict[str, np.ndarray | None], np.ndarray]:
    """(header, columns, label masks, episode_starts) of a `Dataset.save` file, or a ValueError naming the file."""
    import zipfile
    import zlib

    def unreadable(reason: object) -> ValueError:
        return ValueError(f"{path} is not a readable offrl Dataset file ({reason}); it may be truncated or written by "
                          "another program: write it again with Dataset.save")

    try:
        data = np.load(path, allow_pickle=False)
    except PermissionError:
        raise
    except ValueError as err:  # numpy's guess that it holds a pickle, which offrl never loads
        raise unreadable("it is neither an .npz archive nor a .npy array") from err
    except (OSError, EOFError, zipfile.BadZipFile) as err:
        raise unreadable(err) from err
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise unreadable("it holds a single array, not the named arrays that Dataset.save writes")
    with data:
        if "header" not in data:
            raise ValueError(f"{path} is not an offrl Dataset file (no header); write it with Dataset.save")
        try:
            header = json.loads(bytes(data["header"]).decode())
            names = set(data.files)
            columns = {k: (data[k] if k in names else None) for k in COLUMNS}
            masks = {name: (data[key] if key in names else None) for name, key in _MASK_KEYS.items()}
            starts = data["episode_starts"] if "episode_starts" in names else None
        # ValueError: bad JSON or UTF-8, or numpy refusing a pickled (object) array
        except (ValueError, zipfile.BadZipFile, zlib.error, EOFError, OSError) as err:
            raise unreadable(err) from err
    if not isinstance(header, dict):
        raise unreadable("its header is not a JSON object")
    if header.get("format_version") not in _READABLE_FORMATS:
        raise ValueError(
            f"{path} has Dataset format {header.get('format_version')}, this offrl reads formats "
            f"{list(_READABLE_FORMATS)}; re-save it with a matching offrl version"
        )
    missing = [k for k in _HEADER_KEYS if k not in header]
    if missing:
        raise unreadable(f"its header lacks {missing}")
    if header["format_version"] == FORMAT_VERSION:
        absent = [k for k in _REQUIRED if columns[k] is None]
        if absent:
            raise ValueError(f"{path} lacks column(s) {absent}; the file is damaged, write it again with Dataset.save")
    if starts is None:
        raise unreadable("it lacks episode_starts")
    return header, columns, masks, starts


def _placeholder(name: str, n: int, action_dim: int | None) -> np.ndarray:
    """Zeros standing in for n unlabelled rows of label column `name`."""
    return np.zeros((n, action_dim) if name == "actions" else (n,), np.float32)


def _check_label_name(name: str) -> None:
    if name not in LABELS:
        raise ValueError(f"label name must be one of {LABELS}, got {name!r}")


def _resolve_action_dim(actions: np.ndarray | None, action_dim: int | None, action_low: Any, action_high: Any,
                        discrete_actions: int | None) -> int:
    """The action dimension: from the actions, else `action_dim`, a discrete space (1) or per-dimension bounds."""
    if action_dim is not None:
        action_dim = int(action_dim)
        if action_dim < 1:
            raise ValueError(f"action_dim must be a positive integer, got {action_dim}")
    if actions is not None:
        if action_dim is not None and action_dim != actions.shape[1]:
            raise ValueError(f"action_dim is {action_dim} but actions has {actions.shape[1]} columns; drop action_dim or fix it")
        return actions.shape[1]
    if discrete_actions is not None:
        if action_dim not in (None, 1):
            raise ValueError(f"action_dim is {action_dim} but a discrete action space has one column of action indices")
        return 1
    if action_dim is not None:
        return action_dim
    sizes = {name: np.size(b) for name, b in (("action_low", action_low), ("action_high", action_high))
             if b is not None and np.ndim(b) >= 1}
    if len(set(sizes.values())) == 1:
        return sizes.popitem()[1]
    if len(sizes) == 2:
        raise ValueError(f"action_low has {sizes['action_low']} values but action_high has {sizes['action_high']}; "
                         "pass one bound per action dimension in both")
    raise ValueError(
        "actions is None (not logged), so the action dimension is unknown; pass action_dim=... "
        "(or per-dimension action_low/action_high, or discrete_actions)"
    )


def _same_bounds(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"metadata value {value!r} is not JSON serialisable")


def _flag(episode: Mapping[str, Any], names: tuple[str, ...], t: int, i: int, unit: str = "actions") -> np.ndarray:
    for name in names:
        if name in episode:
            flag = _as_float32(f"episode {i} {name}", episode[name], 1)
            if len(flag) != t:
                raise ValueError(f"episode {i} {name} has {len(flag)} rows but {unit} has {t}")
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


def _frame_values(df: Any, cols: list[str], kind: str, dtype: Any) -> np.ndarray:
    """DataFrame columns as one numeric array (missing values as NaN), or a ValueError naming them."""
    try:
        return df[cols].to_numpy(dtype=dtype, na_value=np.nan)
    except (TypeError, ValueError) as err:
        raise ValueError(f"the {kind} columns {cols} must be numeric ({err}); convert them to numbers") from err


def _check_steps_in_order(df: Any, step_column: str, starts: np.ndarray | None, terminal_column: str,
                          timeout_column: str, consecutive: bool) -> None:
    """A DataFrame's steps increase within each episode (by exactly 1 when next observations come from the next row)."""
    _as_float32(f"column {step_column!r}", df[step_column].to_numpy(), 1)  # numeric and one-dimensional
    steps = np.asarray(df[step_column].to_numpy(), np.float64).reshape(-1)  # float64: exact for steps beyond 2**24
    _check_finite(f"column {step_column!r}", steps)
    n = len(steps)
    if starts is None:  # episodes end at the flags, as from_arrays splits them
        ends = np.zeros(n, dtype=bool)
        for name in (terminal_column, timeout_column):
            if name in df.columns:
                ends |= _as_float32(f"column {name!r}", df[name].to_numpy(), 1) != 0
        starts = _ends_to_starts(ends, n)
    same_episode = np.ones(max(n - 1, 0), dtype=bool)
    same_episode[starts[1:-1] - 1] = False  # row r -> r + 1 crosses into a new episode
    step = np.diff(steps)
    bad = np.flatnonzero(same_episode & ((step != 1) if consecutive else (step <= 0)))
    if len(bad):
        row = int(bad[0]) + 1
        episode = int(np.searchsorted(starts, row, side="right") - 1)
        before, after = (df[step_column].iloc[row - 1], df[step_column].iloc[row])
        before, after = (v.item() if hasattr(v, "item") else v for v in (before, after))
        if step[row - 1] > 0:
            why = ("steps must be consecutive: without next-observation columns the next observation is taken from "
                   "the following row; add next_obs_* columns or fill the gap")
        else:
            why = "rows of an episode must be in time order: sort the DataFrame by episode and step"
        raise ValueError(f"column {step_column!r} goes from {before} to {after} at row {row} (episode {episode}); "
                         f"{why} (or pass step_column=None to read the rows as they come)")
