"""Samplers: transitions (bit-identical to the fit loop's packed sampler), mixtures with exact per-source
counts, and K-step segments checked against a naive loop over episodes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_episodes
from offrl.datasets import Dataset
from offrl.datasets.core import Batch
from offrl.datasets.samplers import MixtureSampler, SegmentBatch, SegmentSampler, TransitionSampler, allocate_counts

FIELDS = ("observations", "actions", "rewards", "terminals", "timeouts", "next_observations", "behavior_log_probs")


def columns_of(ds: Dataset, **extras) -> dict[str, torch.Tensor]:
    cols = {k: torch.from_numpy(getattr(ds, k)) for k in
            ("observations", "next_observations", "actions", "rewards", "terminals", "timeouts", "behavior_log_probs")
            if getattr(ds, k) is not None}
    cols.update({k: torch.as_tensor(v) for k, v in extras.items()})
    return cols


class FrozenPackedSampler:
    """The fit loop's `_PackedSampler` as it was when the samplers were split out (offrl/algos/base.py)."""

    def __init__(self, columns):
        self.names = list(columns)
        n = next(iter(columns.values())).shape[0]
        self.vector = {k: v.dim() == 1 for k, v in columns.items()}
        parts = [v.reshape(n, -1).float() for v in columns.values()]
        self.widths = [p.shape[1] for p in parts]
        self.packed = torch.cat(parts, dim=1).contiguous()
        self.n = n

    def __call__(self, index):
        rows = self.packed.index_select(0, index).split(self.widths, dim=1)
        fields, extras = {}, {}
        for name, value in zip(self.names, rows):
            value = value.squeeze(1) if self.vector[name] else value
            (fields if name in FIELDS else extras)[name] = value
        return Batch(indices=index, extras=extras, **fields)


def assert_same_batch(a: Batch, b: Batch) -> None:
    for key in FIELDS + ("indices",):
        x, y = getattr(a, key), getattr(b, key)
        assert (x is None) == (y is None), key
        if x is not None:
            assert torch.equal(x, y) and x.dtype == y.dtype and x.shape == y.shape, key
    assert a.extras.keys() == b.extras.keys()
    for key in a.extras:
        assert torch.equal(a.extras[key], b.extras[key]), key


@pytest.fixture
def big():
    eps = make_episodes(tuple(np.random.default_rng(0).integers(1, 30, size=25)), obs_dim=4, act_dim=2, seed=3)
    return Dataset.from_episodes(eps)


# ------------------------------------------------------------------ transitions


def test_transition_sampler_reproduces_the_fit_loop_sampler(big):
    cols = columns_of(big, mc_returns=big.returns_to_go(0.99))
    old = FrozenPackedSampler(cols)
    new = TransitionSampler(cols, 64)
    assert new.n == old.n == big.n_transitions
    g_old, g_new = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(5):  # the fit loop's draw, step after step
        index = torch.randint(big.n_transitions, (64,), generator=g_old, device=g_old.device)
        assert_same_batch(old(index), new.sample(g_new))
    index = torch.arange(10)
    assert_same_batch(old(index), new.gather(index))


def test_transition_batch_rows_and_fields(big):
    sampler = TransitionSampler.from_dataset(big, 128, extras={"step": big.timesteps()})
    batch = sampler.sample(torch.Generator().manual_seed(0))
    rows = batch.indices.numpy()
    for key in FIELDS:
        np.testing.assert_array_equal(getattr(batch, key).numpy(), getattr(big, key)[rows], err_msg=key)
    np.testing.assert_array_equal(batch.extras["step"].numpy(), big.timesteps()[rows])
    assert batch.observations.shape == (128, 4) and batch.actions.shape == (128, 2) and batch.rewards.shape == (128,)
    # a stream repeats from the same seed, and consecutive batches differ
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    a, b = [sampler.sample(g1).indices for _ in range(2)], [sampler.sample(g2).indices for _ in range(2)]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not torch.equal(a[0], a[1])


def test_transition_sampler_without_labels_and_errors(big):
    unlabelled = big.without_rewards()
    batch = TransitionSampler.from_dataset(unlabelled, 8).sample(torch.Generator().manual_seed(0))
    assert batch.rewards is None and batch.actions is not None
    keep = np.arange(big.n_transitions) % 3 > 0
    with pytest.raises(ValueError, match=r"TransitionSampler needs rewards, but rewards are missing for 130 of 388 .*with_rewards\("):
        TransitionSampler.from_dataset(big.without_rewards(keep=keep), 8)
    cols = columns_of(big)
    with pytest.raises(ValueError, match=r"lack \['terminals'\]"):
        TransitionSampler({k: v for k, v in cols.items() if k != "terminals"}, 8)
    with pytest.raises(ValueError, match="column 'rewards' has 3 rows but 'observations' has"):
        TransitionSampler({**cols, "rewards": cols["rewards"][:3]}, 8)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        TransitionSampler(cols, 0)


def test_transition_sampler_grows_like_a_replay_buffer(big):
    cols = columns_of(big)
    capacity = {k: torch.zeros((100,) + v.shape[1:]) for k, v in cols.items()}
    sampler = TransitionSampler(capacity, 16)
    sampler.n = 0
    with pytest.raises(ValueError, match="no rows to draw from"):
        sampler.sample(torch.Generator().manual_seed(0))
    sampler.write(torch.arange(10), {k: v[:10] for k, v in cols.items()})
    sampler.n = 10
    batch = sampler.sample(torch.Generator().manual_seed(0))
    assert int(batch.indices.max()) < 10
    assert torch.equal(batch.observations, cols["observations"][batch.indices])
    with pytest.raises(ValueError, match="capacity"):
        sampler.n = 101
    with pytest.raises(ValueError, match="exactly the sampler's columns"):
        sampler.write(torch.arange(2), {"observations": cols["observations"][:2]})


# ------------------------------------------------------------------ mixtures


def test_allocate_counts_largest_remainder():
    assert allocate_counts([0.5, 0.5], 256) == [128, 128]
    assert allocate_counts([1 / 3, 1 / 3, 1 / 3], 10) == [4, 3, 3]  # ties go to the earlier source
    assert allocate_counts([0.25, 0.75], 7) == [2, 5]  # quotas 1.75 and 5.25
    assert allocate_counts([0.1, 0.2, 0.7], 9) == [1, 2, 6]  # quotas 0.9, 1.8, 6.3
    for fractions in ([0.15, 0.35, 0.5], [0.01, 0.99], [0.6, 0.4]):
        for total in (1, 7, 64, 255):
            counts = allocate_counts(fractions, total)
            assert sum(counts) == total
            assert all(abs(c - f * total) < 1 for c, f in zip(counts, fractions))


def tagged(ds: Dataset, tag: float) -> dict[str, torch.Tensor]:
    """Columns whose extra 'tag' says which source a row came from."""
    return columns_of(ds, tag=np.full(ds.n_transitions, tag, np.float32))


@pytest.mark.parametrize("fractions, batch_size, counts", [
    ([0.5, 0.5], 256, [128, 128]),
    ([0.25, 0.75], 7, [2, 5]),
    ([0.2, 0.3, 0.5], 50, [10, 15, 25]),
    ([1 / 3, 1 / 3, 1 / 3], 10, [4, 3, 3]),
])
def test_mixture_draws_exact_counts_from_each_source(big, fractions, batch_size, counts):
    sources = [big.subset(range(0, 5)), big, big.subset(range(10, 12))][: len(fractions)]  # different sizes
    samplers = [TransitionSampler(tagged(ds, i), 32) for i, ds in enumerate(sources)]
    mixture = MixtureSampler(samplers, fractions, batch_size)
    assert mixture.counts == counts
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        batch = mixture.sample(generator)
        source = batch.extras["source"]
        assert source.dtype == torch.int64 and source.shape == (batch_size,)
        assert torch.equal(torch.bincount(source, minlength=len(counts)), torch.tensor(counts))
        assert torch.equal(source, torch.sort(source).values)  # in source order
        assert torch.equal(batch.extras["tag"], source.float())
        for i, ds in enumerate(sources):
            rows = batch.indices[source == i].numpy()
            assert rows.max() < ds.n_transitions
            for key in FIELDS:
                np.testing.assert_array_equal(getattr(batch, key)[source == i].numpy(), getattr(ds, key)[rows], key)


def test_mixture_draws_each_source_like_its_own_sampler(big):
    a, b = TransitionSampler(columns_of(big.subset([0, 1])), 3), TransitionSampler(columns_of(big), 5)
    batch = MixtureSampler([a, b], [0.375, 0.625], 8).sample(torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(4)
    assert_same_batch(Batch(**{k: getattr(batch, k)[:3] for k in FIELDS}, indices=batch.indices[:3]), a.sample(g))
    assert_same_batch(Batch(**{k: getattr(batch, k)[3:] for k in FIELDS}, indices=batch.indices[3:]), b.sample(g))


def test_mixture_errors_name_the_problem(big):
    s = TransitionSampler(columns_of(big), 8)
    with pytest.raises(ValueError, match="sum to 1"):
        MixtureSampler([s, s], [0.5, 0.6], 8)
    with pytest.raises(ValueError, match="positive"):
        MixtureSampler([s, s], [1.5, -0.5], 8)
    with pytest.raises(ValueError, match="2 fractions for 1 sources"):
        MixtureSampler([s], [0.5, 0.5], 8)
    with pytest.raises(ValueError, match="source 1 .* gets no row of a batch of 8"):
        MixtureSampler([s, s], [0.95, 0.05], 8)
    no_logp = TransitionSampler(columns_of(big.without_behavior_log_probs()), 8)
    with pytest.raises(ValueError, match=r"source 1 has columns \[.*\] but source 0 has \[.*behavior_log_probs:1"):
        MixtureSampler([s, no_logp], [0.5, 0.5], 8)
    with pytest.raises(ValueError, match="at least one source"):
        MixtureSampler([], [], 8)


def test_mixture_of_labelled_and_unlabelled_sources(big):
    """ReCOIL's case: expert data and reward-free data, as sources without rewards."""
    expert = TransitionSampler.from_dataset(big.subset([0, 1]).without_rewards(), 4)
    mixed = TransitionSampler.from_dataset(big.without_rewards(), 4)
    batch = MixtureSampler([expert, mixed], [0.5, 0.5], 16).sample(torch.Generator().manual_seed(0))
    assert batch.rewards is None and batch.observations.shape == (16, 4)
    assert batch.extras["source"].tolist() == [0] * 8 + [1] * 8


# ------------------------------------------------------------------ segments


def naive_segments(ds: Dataset, starts, k: int, gamma: float, padding: str) -> dict[str, np.ndarray]:
    """Windows built step by step from the episodes, with returns to go summed directly."""
    b = len(starts)
    out = {
        "observations": np.zeros((b, k, ds.observation_dim), np.float32),
        "actions": np.zeros((b, k, ds.action_dim), np.float32),
        "rewards": np.zeros((b, k), np.float32),
        "returns_to_go": np.zeros((b, k), np.float32),
        "terminals": np.zeros((b, k), np.float32),
        "timesteps": np.zeros((b, k), np.int64),
        "mask": np.zeros((b, k), bool),
        "indices": np.full((b, k), -1, np.int64),
    }
    for i, start in enumerate(starts):
        episode = int(np.searchsorted(ds.episode_starts, start, side="right") - 1)
        first, end = ds.episode_starts[episode], ds.episode_starts[episode + 1]
        steps = list(range(start, min(start + k, end)))
        shift = k - len(steps) if padding == "left" else 0
        for j, row in enumerate(steps):
            p = j + shift
            out["observations"][i, p] = ds.observations[row]
            out["actions"][i, p] = ds.actions[row]
            out["rewards"][i, p] = ds.rewards[row]
            out["terminals"][i, p] = ds.terminals[row]
            out["timesteps"][i, p] = row - first
            out["mask"][i, p] = True
            out["indices"][i, p] = row
            out["returns_to_go"][i, p] = sum(gamma ** (t - row) * float(ds.rewards[t]) for t in range(row, end))
    return out


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_segments_match_a_naive_loop_over_episodes(big, padding, gamma):
    k = 8
    sampler = SegmentSampler.from_dataset(big, 64, k, gamma=gamma, padding=padding)
    batch = sampler.sample(torch.Generator().manual_seed(0))
    assert isinstance(batch, SegmentBatch)
    assert torch.equal(batch.starts, torch.randint(big.n_transitions, (64,), generator=torch.Generator().manual_seed(0)))
    # every episode's first and last rows too: full windows, one-step windows, windows cut by the episode end
    starts = np.concatenate([batch.starts.numpy(), big.episode_starts[:-1], big.episode_starts[1:] - 1])
    batch = sampler.gather(torch.as_tensor(starts))
    want = naive_segments(big, starts, k, gamma, padding)
    assert not want["mask"].all() and want["mask"].any(1).all()  # some padding in this data, never a blank window
    for key, value in want.items():
        got = getattr(batch, key).numpy()
        assert got.dtype == value.dtype and got.shape == value.shape, key
        if key == "returns_to_go":
            np.testing.assert_allclose(got, value, rtol=1e-5, atol=1e-5, err_msg=key)
        else:
            np.testing.assert_array_equal(got, value, err_msg=key)
    np.testing.assert_array_equal(batch.starts.numpy(), starts)
    # the stored returns to go are Dataset.returns_to_go's, exactly
    rtg = big.returns_to_go(gamma)
    mask = want["mask"]
    np.testing.assert_array_equal(batch.returns_to_go.numpy()[mask], rtg[want["indices"][mask]])


@pytest.mark.parametrize("padding", ["right", "left"])
def test_segment_sampler_from_columns_equals_from_dataset(big, padding):
    cols = {k: torch.from_numpy(getattr(big, k)) for k in ("observations", "actions", "rewards", "terminals")}
    cols["timeouts"] = torch.from_numpy(big.timeouts)
    a = SegmentSampler(cols, big.episode_starts, 16, 5, gamma=0.95, padding=padding)
    b = SegmentSampler.from_dataset(big, 16, 5, gamma=0.95, padding=padding, extras={"timeouts": big.timeouts})
    x, y = a.sample(torch.Generator().manual_seed(2)), b.sample(torch.Generator().manual_seed(2))
    for key in ("observations", "actions", "rewards", "returns_to_go", "terminals", "timesteps", "mask", "starts", "indices"):
        assert torch.equal(getattr(x, key), getattr(y, key)), key
    assert torch.equal(x.extras["timeouts"], y.extras["timeouts"]) and x.extras["timeouts"].shape == (16, 5)


def test_segments_longer_than_every_episode_and_unlabelled_rewards(big):
    k = 40  # longer than any episode: every window is cut by its episode's end
    sampler = SegmentSampler.from_dataset(big.without_rewards(), 32, k, padding="left")
    batch = sampler.sample(torch.Generator().manual_seed(1))
    assert batch.rewards is None and batch.returns_to_go is None
    lengths = batch.mask.sum(1)
    ends = torch.from_numpy(np.repeat(big.episode_starts[1:], big.episode_lengths()))[batch.starts]
    assert torch.equal(lengths, ends - batch.starts)
    assert not batch.mask[:, -1].logical_not().any()  # left padding: the newest step is always last
    assert (batch.observations[~batch.mask] == 0).all() and (batch.timesteps[~batch.mask] == 0).all()


def test_segment_sampler_errors(big):
    cols = {"observations": torch.from_numpy(big.observations)}
    with pytest.raises(ValueError, match="padding must be 'right' or 'left'"):
        SegmentSampler(cols, big.episode_starts, 4, 3, padding="middle")
    with pytest.raises(ValueError, match="gamma must lie in"):
        SegmentSampler(cols, big.episode_starts, 4, 3, gamma=1.5)
    with pytest.raises(ValueError, match="episode_starts must increase strictly"):
        SegmentSampler(cols, [0, 5], 4, 3)
    with pytest.raises(ValueError, match="segment_length must be a positive integer"):
        SegmentSampler(cols, big.episode_starts, 4, 0)
    with pytest.raises(ValueError, match="need 'observations'"):
        SegmentSampler({"rewards": torch.from_numpy(big.rewards)}, big.episode_starts, 4, 3)
    partial = big.without_actions(keep=np.arange(big.n_transitions) % 2 == 0)
    with pytest.raises(ValueError, match="actions are missing for"):
        SegmentSampler.from_dataset(partial, 4, 3)
