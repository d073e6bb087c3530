"""Batch samplers over tensor columns that already live on the training device.

Every sampler packs its columns into one (N, D) float32 tensor, so drawing a
batch is one `torch.randint` per source plus one `index_select`; the batch's
columns are split views of the gathered rows (contiguous along the feature
dimension, which the first matmul of a network wants anyway).  No per-sample
Python runs.

- `TransitionSampler`: uniform transitions (offline RL's default);
- `MixtureSampler`: fixed per-batch fractions from several transition
  sources (RLPD's offline/online halves, ReCOIL's expert and mixed data);
- `SegmentSampler`: K-step windows within episodes with returns to go,
  timesteps and a padding mask (Decision Transformer and its relatives).

Each has `sample(generator) -> batch`; a seeded generator repeats the stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from offrl.datasets.core import (LABELS, Batch, Dataset, _as_episode_starts, _positive_int, episode_returns_to_go,
                                 episode_timesteps)

__all__ = ["TransitionSampler", "MixtureSampler", "SegmentSampler", "SegmentBatch", "allocate_counts"]

_BATCH_ORDER = ("observations", "actions", "rewards", "terminals", "timeouts", "next_observations", "behavior_log_probs")
_BATCH_FIELDS = frozenset(_BATCH_ORDER)
_TRANSITION_REQUIRED = ("observations", "next_observations", "terminals", "timeouts")
_SEGMENT_FIELDS = frozenset(("observations", "actions", "rewards", "returns_to_go", "terminals"))


class _Packed:
    """Columns of N rows packed into one contiguous (N, D) float32 tensor, and split back after a gather."""

    def __init__(self, columns: Mapping[str, torch.Tensor], owner: str) -> None:
        if not columns:
            raise ValueError(f"{owner} needs at least one column; pass a mapping of name -> tensor")
        n = device = None
        for name, value in columns.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{owner}: column {name!r} is a {type(value).__name__}; pass torch tensors")
            if value.dim() not in (1, 2):
                raise ValueError(f"{owner}: column {name!r} has shape {tuple(value.shape)}; pass (N,) or (N, d) tensors")
            if n is None:
                n, device, first = value.shape[0], value.device, name
            elif value.shape[0] != n:
                raise ValueError(f"{owner}: column {name!r} has {value.shape[0]} rows but {first!r} has {n}")
            elif value.device != device:
                raise ValueError(f"{owner}: column {name!r} is on {value.device} but {first!r} is on {device}; "
                                 "move every column to the training device")
        self.names = list(columns)
        self.vector = {k: v.dim() == 1 for k, v in columns.items()}
        parts = [v.reshape(n, -1).float() for v in columns.values()]
        self.widths = [p.shape[1] for p in parts]
        self.packed = torch.cat(parts, dim=1).contiguous()
        self.n = int(n)
        self.device = device

    def layout(self) -> list[tuple[str, int, bool]]:
        return [(k, w, self.vector[k]) for k, w in zip(self.names, self.widths)]

    def split(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Gathered rows (..., D) as named views; (N,) columns lose their feature dimension."""
        dim = rows.dim() - 1
        return {name: (value.squeeze(dim) if self.vector[name] else value)
                for name, value in zip(self.names, rows.split(self.widths, dim=dim))}


def _draw(n: int, count: int, generator: torch.Generator | None, device: torch.device, owner: str) -> torch.Tensor:
    """`count` uniform row indices in [0, n) from the generator, on the columns' device."""
    if n <= 0:
        raise ValueError(f"{owner} has no rows to draw from (n = {n}); add data before sampling")
    index = torch.randint(n, (count,), generator=generator,
                          device=generator.device if generator is not None else device)
    return index if index.device == device else index.to(device)  # e.g. a CPU generator feeding a GPU batch


def _dataset_columns(dataset: Dataset, names: Sequence[str], owner: str) -> dict[str, np.ndarray]:
    """Dataset columns by name; a label missing wholly is left out, one missing in some rows raises."""
    out = {}
    for name in names:
        value = getattr(dataset, name)
        if name in LABELS and not dataset.is_labelled(name) and value is not None:
            dataset.require_labels(name, context=owner)
        if value is not None:
            out[name] = value
    return out


def _to_device(arrays: Mapping[str, Any], device: str | torch.device) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(np.ascontiguousarray(v, dtype=np.float32)).to(device) for k, v in arrays.items()}


# ---------------------------------------------------------------------------------------------- transitions


class TransitionSampler:
    """Uniform transitions with replacement from tensor columns, one `index_select` per batch.

    `columns` must hold observations, next_observations, terminals and
    timeouts; actions and rewards may be absent (unlabelled data: None in the
    batch), and names that are not `Batch` fields go to `Batch.extras`.
    Every column is packed as float32.

    `n` is the number of rows drawn from (the first `n` of `capacity`); it
    may be changed, with `write` filling rows, so a growing replay buffer can
    be a source of a `MixtureSampler` (RLPD's online half).
    """

    def __init__(self, columns: Mapping[str, torch.Tensor], batch_size: int) -> None:
        missing = [k for k in _TRANSITION_REQUIRED if k not in columns]
        if missing:
            raise ValueError(f"TransitionSampler columns lack {missing}; a transition batch needs "
                             f"{list(_TRANSITION_REQUIRED)} (and usually actions and rewards)")
        self.batch_size = _positive_int(batch_size, "TransitionSampler batch_size")  # before packing any data
        self._packed = _Packed(columns, "TransitionSampler")
        self._n = self._packed.n

    @classmethod
    def from_dataset(cls, dataset: Dataset, batch_size: int, *, device: str | torch.device = "cpu",
                     extras: Mapping[str, Any] | None = None) -> "TransitionSampler":
        """A sampler over a Dataset's columns as they are (no normalisation), plus per-transition `extras`
        (which may also replace a column, e.g. transformed rewards)."""
        arrays = _dataset_columns(dataset, _BATCH_ORDER, "TransitionSampler")
        arrays.update(extras or {})
        return cls(_to_device(arrays, device), batch_size)

    # ------------------------------------------------------------------ size
    @property
    def n(self) -> int:
        """Rows drawn from."""
        return self._n

    @n.setter
    def n(self, value: int) -> None:
        value = int(value)
        if not 0 <= value <= self.capacity:
            raise ValueError(f"n must lie in [0, capacity = {self.capacity}], got {value}")
        self._n = value

    @property
    def capacity(self) -> int:
        """Rows stored."""
        return self._packed.n

    @property
    def device(self) -> torch.device:
        return self._packed.device

    @property
    def names(self) -> list[str]:
        return list(self._packed.names)

    def write(self, rows: torch.Tensor, columns: Mapping[str, torch.Tensor]) -> None:
        """Overwrite stored rows `rows` with new values of every column (e.g. fresh online transitions)."""
        rows = torch.as_tensor(rows, dtype=torch.int64, device=self.device).reshape(-1)
        if set(columns) != set(self._packed.names):
            raise ValueError(f"write needs exactly the sampler's columns {self._packed.names}, got {list(columns)}")
        if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= self.capacity):
            raise ValueError(f"write rows must lie in [0, capacity = {self.capacity})")
        parts = []
        for name, width in zip(self._packed.names, self._packed.widths):
            value = torch.as_tensor(columns[name], device=self.device).reshape(len(rows), -1)
            if value.shape[1] != width:
                raise ValueError(f"write: column {name!r} has width {value.shape[1]}, the sampler stores {width}")
            parts.append(value.float())
        self._packed.packed.index_copy_(0, rows, torch.cat(parts, dim=1))

    # ------------------------------------------------------------------ drawing
    def sample(self, generator: torch.Generator | None = None) -> Batch:
        """`batch_size` rows drawn as `torch.randint(n, (batch_size,), generator=generator, device=generator.device)`."""
        index = _draw(self._n, self.batch_size, generator, self._packed.device, "TransitionSampler")
        return self._batch(self._packed.packed.index_select(0, index), index)

    def gather(self, index: torch.Tensor) -> Batch:
        """Rows `index` as a Batch."""
        return self._batch(self._packed.packed.index_select(0, index), index)

    def _batch(self, rows: torch.Tensor, index: torch.Tensor) -> Batch:
        fields: dict[str, torch.Tensor | None] = {"actions": None, "rewards": None}
        extras: dict[str, torch.Tensor] = {}
        for name, value in self._packed.split(rows).items():
            (fields if name in _BATCH_FIELDS else extras)[name] = value
        return Batch(indices=index, extras=extras, **fields)


# ---------------------------------------------------------------------------------------------- mixtures


def allocate_counts(fractions: Sequence[float], total: int) -> list[int]:
    """Integer counts proportional to `fractions` that sum to `total` (largest-remainder rounding, ties to the
    earlier source)."""
    quotas = [float(f) * total for f in fractions]
    counts = [int(math.floor(q)) for q in quotas]
    order = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


class MixtureSampler:
    """Each batch takes a fixed number of rows from each source, in source order.

    The counts are `fractions * batch_size`, rounded by largest remainder so
    that they sum to `batch_size`, and are the same in every batch.
    `extras["source"]` (int64) holds each row's source index and
    `indices` its row within that source.  Sources must store the same
    columns (names, order, widths) on one device, and may differ in size.
    """

    def __init__(self, samplers: Sequence[TransitionSampler], fractions: Sequence[float], batch_size: int) -> None:
        self.samplers = list(samplers)
        if not self.samplers:
            raise ValueError("MixtureSampler needs at least one source sampler")
        for i, s in enumerate(self.samplers):
            if not isinstance(s, TransitionSampler):
                raise TypeError(f"MixtureSampler source {i} is a {type(s).__name__}; pass TransitionSamplers")
        fractions = [float(f) for f in fractions]
        if len(fractions) != len(self.samplers):
            raise ValueError(f"MixtureSampler got {len(fractions)} fractions for {len(self.samplers)} sources; "
                             "give one fraction per source")
        bad = [f for f in fractions if not (math.isfinite(f) and f > 0)]
        if bad:
            raise ValueError(f"MixtureSampler fractions must be positive, got {fractions}")
        if abs(sum(fractions) - 1.0) > 1e-6:
            raise ValueError(f"MixtureSampler fractions must sum to 1, got {fractions} (sum {sum(fractions):.6g})")
        self.fractions = tuple(fractions)
        self.batch_size = _positive_int(batch_size, "MixtureSampler batch_size")
        self.counts = allocate_counts(fractions, self.batch_size)
        empty = [i for i, c in enumerate(self.counts) if c == 0]
        if empty:
            raise ValueError(f"MixtureSampler: source {empty[0]} (fraction {fractions[empty[0]]}) gets no row of a "
                             f"batch of {self.batch_size}; raise the batch size or the fraction")
        first = self.samplers[0]._packed
        for i, s in enumerate(self.samplers[1:], 1):
            if s._packed.layout() != first.layout():
                raise ValueError(
                    f"MixtureSampler source {i} has columns {_describe(s._packed)} but source 0 has "
                    f"{_describe(first)}; build every source with the same columns in the same order"
                )
            if s.device != first.device:
                raise ValueError(f"MixtureSampler source {i} is on {s.device} but source 0 is on {first.device}")
        self.source = torch.repeat_interleave(
            torch.arange(len(self.samplers), device=first.device),
            torch.tensor(self.counts, device=first.device),
        )

    def sample(self, generator: torch.Generator | None = None) -> Batch:
        """One batch: `counts[i]` rows of source i (drawn like `TransitionSampler.sample`, source 0 first)."""
        rows, indices = [], []
        for i, (s, count) in enumerate(zip(self.samplers, self.counts)):
            index = _draw(s.n, count, generator, s.device, f"MixtureSampler source {i}")
            rows.append(s._packed.packed.index_select(0, index))
            indices.append(index)
        batch = self.samplers[0]._batch(torch.cat(rows), torch.cat(indices))
        batch.extras["source"] = self.source  # the same every batch: shared, do not modify in place
        return batch


def _describe(packed: _Packed) -> str:
    return "[" + ", ".join(f"{k}:{w}" for k, w in zip(packed.names, packed.widths)) + "]"


# ---------------------------------------------------------------------------------------------- segments


@dataclass
class SegmentBatch:
    """K-step windows of episodes, shape (B, K, ...); padded steps are zero with `mask` False.

    `returns_to_go` is the (discounted) return from each step to its
    episode's end, `timesteps` the step index within the episode, `starts`
    the row of each window's first step and `indices` the row of every step
    (-1 where padded).  Columns a source lacks (e.g. unlabelled rewards) are
    None; other columns are in `extras`.
    """

    observations: torch.Tensor
    actions: torch.Tensor | None
    rewards: torch.Tensor | None
    returns_to_go: torch.Tensor | None
    timesteps: torch.Tensor
    terminals: torch.Tensor | None
    mask: torch.Tensor
    starts: torch.Tensor
    indices: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


class SegmentSampler:
    """Windows of up to `segment_length` (K) steps that never cross an episode boundary.

    A window starts at a uniformly drawn transition and runs to K steps or
    its episode's end; shorter windows are padded with zeros (`mask` False)
    on the right (`padding="right"`) or on the left (`"left"`, Decision
    Transformer's layout: the newest step is always last).  `columns` hold
    per-transition tensors on one device, with at least `observations`;
    `returns_to_go` is computed from `rewards` with `gamma` unless given as a
    column.  `episode_starts` are the Dataset's episode offsets.
    """

    def __init__(self, columns: Mapping[str, torch.Tensor], episode_starts: Any, batch_size: int,
                 segment_length: int, *, gamma: float = 1.0, padding: str = "right") -> None:
        if "observations" not in columns:
            raise ValueError("SegmentSampler columns need 'observations'")
        if padding not in ("right", "left"):
            raise ValueError(f"padding must be 'right' or 'left', got {padding!r}")
        self.batch_size = _positive_int(batch_size, "SegmentSampler batch_size")
        self.segment_length = _positive_int(segment_length, "SegmentSampler segment_length")
        gamma = float(gamma)
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"gamma must lie in [0, 1], got {gamma}")
        self.gamma, self.padding = gamma, padding
        n = next(iter(columns.values())).shape[0]
        starts = _as_episode_starts(episode_starts.cpu().numpy() if isinstance(episode_starts, torch.Tensor)
                                    else episode_starts).reshape(-1)
        if len(starts) < 2 or starts[0] != 0 or starts[-1] != n or np.any(np.diff(starts) <= 0):
            raise ValueError(f"episode_starts must increase strictly from 0 to the number of rows ({n}); "
                             f"got {starts[:5].tolist()}...{starts[-3:].tolist()}")
        columns = dict(columns)
        if "returns_to_go" not in columns and "rewards" in columns:
            rewards = columns["rewards"].detach().float().cpu().numpy().reshape(-1)
            rtg = episode_returns_to_go(rewards, starts, gamma)
            columns["returns_to_go"] = torch.from_numpy(rtg).to(columns["rewards"].device)
        self._packed = _Packed(columns, "SegmentSampler")
        device = self._packed.device
        # One zero row after the data (and a zero timestep): padding gathers it, so nothing is zeroed afterwards.
        packed = self._packed.packed
        self._packed.packed = torch.cat([packed, packed.new_zeros(1, packed.shape[1])])
        del packed
        self._end = torch.from_numpy(np.repeat(starts[1:], np.diff(starts))).to(device)
        self._step = torch.from_numpy(np.append(episode_timesteps(starts), 0)).to(device)
        self._offsets = torch.arange(self.segment_length, device=device)
        self.episode_starts = starts
        self.n = self._packed.n

    @classmethod
    def from_dataset(cls, dataset: Dataset, batch_size: int, segment_length: int, *, gamma: float = 1.0,
                     padding: str = "right", device: str | torch.device = "cpu",
                     extras: Mapping[str, Any] | None = None) -> "SegmentSampler":
        """Windows of a Dataset's observations, actions, rewards, returns to go (`Dataset.returns_to_go(gamma)`)
        and terminals, plus per-transition `extras`; a label missing wholly is None in the batch."""
        arrays = _dataset_columns(dataset, ["observations", "actions", "rewards", "terminals"], "SegmentSampler")
        if "rewards" in arrays:
            arrays["returns_to_go"] = dataset.returns_to_go(gamma)
        arrays.update(extras or {})
        return cls(_to_device(arrays, device), dataset.episode_starts, batch_size, segment_length,
                   gamma=gamma, padding=padding)

    @property
    def device(self) -> torch.device:
        return self._packed.device

    def sample(self, generator: torch.Generator | None = None) -> SegmentBatch:
        """`batch_size` windows whose first rows are `torch.randint(n, (batch_size,), generator=generator)`."""
        return self.gather(_draw(self.n, self.batch_size, generator, self.device, "SegmentSampler"))

    def gather(self, starts: torch.Tensor) -> SegmentBatch:
        """The windows that begin at rows `starts` (B,), gathered with (B, K) index tensors."""
        starts = starts.to(self.device)
        b, k = starts.shape[0], self.segment_length
        length = torch.clamp(self._end.index_select(0, starts) - starts, max=k)  # real steps per window
        offset = self._offsets.expand(b, k)
        if self.padding == "left":
            offset = offset - (k - length).unsqueeze(1)  # negative at the padding
        mask = (offset >= 0) & (offset < length.unsqueeze(1))
        rows = torch.where(mask, starts.unsqueeze(1) + offset, self.n).reshape(-1)  # padding: the zero row n
        data = self._packed.packed.index_select(0, rows).view(b, k, -1)
        timesteps = self._step.index_select(0, rows).view(b, k)
        fields: dict[str, torch.Tensor | None] = dict.fromkeys(_SEGMENT_FIELDS)
        extras: dict[str, torch.Tensor] = {}
        for name, value in self._packed.split(data).items():
            (fields if name in _SEGMENT_FIELDS else extras)[name] = value
        return SegmentBatch(**fields, timesteps=timesteps, mask=mask, starts=starts,
                            indices=rows.view(b, k).masked_fill(~mask, -1), extras=extras)
