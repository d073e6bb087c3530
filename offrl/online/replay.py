"""A replay buffer for online learners: preallocated tensors, vectorised add and sample.

Transitions live in fixed-size torch tensors on the training device (a ring:
once full, the oldest rows are overwritten), so `sample` is one
`torch.randint` plus one `index_select` per column, exactly like
`Dataset.sample`, and returns the same `Batch`.  `add` takes one transition
or a batch of them (a vector env's step).  `state_dict` / `load_state_dict`
make the buffer part of a checkpoint, and `to_dataset` turns the stored
history back into a `Dataset` (D4RL's medium-replay is such a slice).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from offrl.datasets.core import Batch, Dataset

__all__ = ["ReplayBuffer"]

_VECTORS = ("observations", "actions", "next_observations")
_SCALARS = ("rewards", "terminals", "timeouts", "behavior_log_probs")
_COLUMNS = _VECTORS + _SCALARS


class ReplayBuffer:
    """Fixed-capacity transition store.

    Columns (float32): `observations`, `actions`, `next_observations`
    (capacity, dim) and `rewards`, `terminals` (true MDP ends, no
    bootstrapping), `timeouts` (episode cut by a time limit), and
    `behavior_log_probs` (log-density of the action under the policy that
    chose it) of shape (capacity,).  Rows are kept in insertion order modulo
    the ring; `n_added` counts every transition ever added.
    """

    def __init__(self, capacity: int, observation_dim: int, action_dim: int, device: str | torch.device = "cpu",
                 extra_columns: Sequence[str] = ()) -> None:
        capacity = int(capacity)
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.observation_dim = int(observation_dim)
        self.action_dim = int(action_dim)
        self.device = torch.device(device)
        dims = {"observations": self.observation_dim, "actions": self.action_dim, "next_observations": self.observation_dim}
        self.columns: dict[str, torch.Tensor] = {}
        self.extra_columns = tuple(extra_columns)
        clash = sorted(set(self.extra_columns) & set(_COLUMNS))
        if clash:
            raise ValueError(f"extra_columns {clash} clash with the buffer's own columns; rename them")
        for name in _COLUMNS + self.extra_columns:
            shape = (capacity, dims[name]) if name in dims else (capacity,)
            self.columns[name] = torch.zeros(shape, dtype=torch.float32, device=self.device)
        # On the CPU, numpy views of the same memory make single-row writes cheap.
        self._numpy = {k: v.numpy() for k, v in self.columns.items()} if self.device.type == "cpu" else None
        self.position = 0  # next row to write
        self.size = 0
        self.n_added = 0

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return (f"ReplayBuffer(size={self.size}, capacity={self.capacity}, observation_dim={self.observation_dim}, "
                f"action_dim={self.action_dim}, device={str(self.device)!r})")

    # ------------------------------------------------------------------ writing
    def add(
        self,
        observations: Any,
        actions: Any,
        rewards: Any,
        next_observations: Any,
        terminals: Any,
        timeouts: Any = 0.0,
        behavior_log_probs: Any = 0.0,
        extras: Mapping[str, Any] | None = None,
    ) -> None:
        """Add one transition (obs of shape (obs_dim,)) or a batch (leading dimension k).

        `extras` holds a value per transition for each of the buffer's `extra_columns` (e.g. Cal-QL's
        Monte-Carlo returns); they default to 0.
        """
        obs = np.asarray(observations, dtype=np.float32)
        single = obs.ndim == 1
        k = 1 if single else obs.shape[0]
        if obs.reshape(k, -1).shape[1] != self.observation_dim:
            raise ValueError(f"observations has shape {obs.shape}; expected (k, {self.observation_dim}) or ({self.observation_dim},)")
        values = {
            "observations": obs.reshape(k, self.observation_dim),
            "actions": np.asarray(actions, dtype=np.float32).reshape(k, self.action_dim),
            "next_observations": np.asarray(next_observations, dtype=np.float32).reshape(k, self.observation_dim),
        }
        extras = dict(extras or {})
        unknown = sorted(set(extras) - set(self.extra_columns))
        if unknown:
            raise ValueError(f"extras {unknown} are not columns of this buffer (extra_columns={list(self.extra_columns)})")
        for name, value in (("rewards", rewards), ("terminals", terminals), ("timeouts", timeouts),
                            ("behavior_log_probs", behavior_log_probs),
                            *((name, extras.get(name, 0.0)) for name in self.extra_columns)):
            array = np.asarray(value, dtype=np.float32).reshape(-1)
            if array.size == 1 and k > 1:
                array = np.broadcast_to(array, (k,))
            if array.shape != (k,):
                raise ValueError(f"{name} has {array.size} values for {k} transitions")
            values[name] = array
        if k > self.capacity:  # only the newest `capacity` rows survive
            values = {name: v[k - self.capacity:] for name, v in values.items()}
            self.n_added += k - self.capacity
            k = self.capacity
        rows = (self.position + np.arange(k)) % self.capacity
        if self._numpy is not None:
            if k == 1:
                row = int(rows[0])
                for name, value in values.items():
                    self._numpy[name][row] = value[0]
            else:
                for name, value in values.items():
                    self._numpy[name][rows] = value
        else:
            index = torch.as_tensor(rows, device=self.device)
            for name, value in values.items():
                self.columns[name].index_copy_(0, index, torch.as_tensor(np.ascontiguousarray(value), device=self.device))
        self.position = int((self.position + k) % self.capacity)
        self.size = min(self.size + k, self.capacity)
        self.n_added += k

    # ------------------------------------------------------------------ reading
    def sample(self, batch_size: int, generator: torch.Generator | None = None) -> Batch:
        """`batch_size` stored transitions drawn uniformly with replacement, as a `Batch`."""
        if self.size == 0:
            raise ValueError("the replay buffer is empty; add transitions before sampling")
        index_device = generator.device if generator is not None else self.device
        index = torch.randint(self.size, (batch_size,), generator=generator, device=index_device)
        if index.device != self.device:
            index = index.to(self.device)
        return Dataset.gather(index, self.columns)

    def chronological_rows(self) -> np.ndarray:
        """Indices of the stored rows from oldest to newest."""
        if self.size < self.capacity:
            return np.arange(self.size)
        return (self.position + np.arange(self.capacity)) % self.capacity

    def to_dataset(self, start: int = 0, stop: int | None = None, **kwargs: Any) -> Dataset:
        """Stored transitions `start:stop` (positions in insertion order among the stored rows) as a `Dataset`.

        Episodes end at `terminals` or `timeouts`; a final episode still in
        progress at `stop` becomes a cut (timeout).  `kwargs` go to
        `Dataset.from_arrays` (action bounds, metadata).
        """
        rows = self.chronological_rows()[start:stop]
        if len(rows) == 0:
            raise ValueError(f"rows {start}:{stop} of a buffer holding {self.size} transitions are empty")
        index = torch.as_tensor(rows, device=self.device)
        data = {k: v.index_select(0, index).cpu().numpy() for k, v in self.columns.items() if k in _COLUMNS}
        return Dataset.from_arrays(
            observations=data["observations"],
            actions=data["actions"],
            rewards=data["rewards"],
            terminals=data["terminals"],
            timeouts=data["timeouts"],
            next_observations=data["next_observations"],
            behavior_log_probs=data["behavior_log_probs"],
            **kwargs,
        )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Stored rows and counters (tensors and ints only, so `torch.load(weights_only=True)` reads it)."""
        return {
            "capacity": self.capacity,
            "observation_dim": self.observation_dim,
            "action_dim": self.action_dim,
            "position": self.position,
            "size": self.size,
            "n_added": self.n_added,
            "extra_columns": list(self.extra_columns),
            "columns": {k: v[: self.size].cpu().clone() for k, v in self.columns.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key in ("capacity", "observation_dim", "action_dim"):
            if int(state[key]) != getattr(self, key):
                raise ValueError(f"replay buffer state has {key}={state[key]} but this buffer has {getattr(self, key)}")
        size = int(state["size"])
        for name, value in state["columns"].items():
            self.columns[name][:size].copy_(value.to(self.device))
        self.position = int(state["position"])
        self.size = size
        self.n_added = int(state["n_added"])

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], device: str | torch.device = "cpu") -> "ReplayBuffer":
        buffer = cls(int(state["capacity"]), int(state["observation_dim"]), int(state["action_dim"]), device,
                     extra_columns=tuple(state.get("extra_columns", ())))
        buffer.load_state_dict(state)
        return buffer

    @classmethod
    def from_dataset(cls, dataset: Dataset, capacity: int | None = None, device: str | torch.device = "cpu",
                     extras: Mapping[str, np.ndarray] | None = None) -> "ReplayBuffer":
        """A buffer pre-filled with a Dataset's transitions (e.g. offline data for online fine-tuning).

        `extras` are per-transition extra columns (name -> array of n_transitions values).
        """
        if dataset.discrete_actions is not None:
            raise ValueError("ReplayBuffer stores continuous actions; this dataset has a discrete action space")
        capacity = dataset.n_transitions if capacity is None else int(capacity)
        extras = dict(extras or {})
        buffer = cls(capacity, dataset.observation_dim, dataset.action_dim, device, extra_columns=tuple(extras))
        log_probs = dataset.behavior_log_probs if dataset.behavior_log_probs is not None else 0.0
        buffer.add(dataset.observations, dataset.actions, dataset.rewards, dataset.next_observations,
                   dataset.terminals, dataset.timeouts, log_probs, extras=extras)
        return buffer
