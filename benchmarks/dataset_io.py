"""Dataset I/O benchmark: batch sampling latency, D4RL-file load time, memory footprint.

    python benchmarks/dataset_io.py                 # 1M transitions, 17-d obs, 6-d actions (hopper-sized x1000)
    python benchmarks/dataset_io.py --n 100000      # quicker
    python benchmarks/dataset_io.py --device cuda   # sample on a GPU

Measures
  (a) median wall time of `Dataset.sample(batch_size, generator=g)` over `--calls`
      calls (after a warm-up), issue target < 100 us on CPU;
  (b) time of `offrl.datasets.load(path)` for two 1M-row files in D4RL's HDF5
      layout written to a temporary directory: float64 medium-replay style
      ((N, 1) rewards/terminals, no next_observations) and float32 with
      next_observations and infos/action_log_probs (the files were just
      written, so this is a warm page cache: decoding, not disk speed);
  (c) memory: the Dataset's array bytes against the raw float32 size of the
      file's columns (issue target: ratio <= 2), and the process RSS growth
      from loading it, read from /proc/self/statm: as is, and after glibc's
      malloc_trim (which returns the freed temporaries glibc otherwise keeps
      cached), plus the peak during the load from VmHWM in /proc/self/status
      (reset through /proc/self/clear_refs where the kernel allows it).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from offrl.datasets import Dataset, load

_PAGE = os.sysconf("SC_PAGE_SIZE")
_MB = 1024.0**2


# ------------------------------------------------------------------ memory probes (Linux /proc, no psutil)
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def malloc_trim() -> bool:
    """Ask glibc to return freed heap pages to the OS (they stay cached in the process otherwise)."""
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0)) or True
    except (OSError, AttributeError):
        return False


def dataset_nbytes(ds: Dataset) -> int:
    arrays = [ds.observations, ds.actions, ds.rewards, ds.terminals, ds.timeouts, ds.next_observations, ds.episode_starts]
    if ds.behavior_log_probs is not None:
        arrays.append(ds.behavior_log_probs)
    return sum(a.nbytes for a in arrays)


# ------------------------------------------------------------------ data
def episode_flags(n: int, rng: np.random.Generator, max_len: int = 1000) -> tuple[np.ndarray, np.ndarray]:
    """Terminals/timeouts for a replay-buffer-like mix: early terminations and 1000-step timeouts."""
    terminals = np.zeros(n, bool)
    timeouts = np.zeros(n, bool)
    t = 0
    while t < n:
        length = int(rng.integers(20, max_len + 1)) if rng.random() < 0.6 else max_len
        end = min(t + length, n) - 1
        if length == max_len:
            timeouts[end] = True
        else:
            terminals[end] = True
        t = end + 1
    return terminals, timeouts


def write_d4rl_file(path: Path, n: int, obs_dim: int, act_dim: int, *, float64: bool, next_obs: bool, seed: int) -> int:
    """Write a D4RL-layout HDF5 file; returns the raw float32 bytes of its transition columns."""
    import h5py

    rng = np.random.default_rng(seed)
    dtype = np.float64 if float64 else np.float32
    terminals, timeouts = episode_flags(n, rng)
    raw = 0
    with h5py.File(path, "w") as f:
        def put(key: str, value: np.ndarray) -> None:
            nonlocal raw
            f.create_dataset(key, data=value)
            raw += value.size * 4  # counted as float32

        put("observations", rng.standard_normal((n, obs_dim)).astype(dtype))
        put("actions", rng.uniform(-1, 1, (n, act_dim)).astype(dtype))
        rewards = rng.normal(3.0, 1.0, n).astype(dtype)
        put("rewards", rewards[:, None] if float64 else rewards)
        put("terminals", terminals[:, None] if float64 else terminals)
        put("timeouts", timeouts)
        if next_obs:
            put("next_observations", rng.standard_normal((n, obs_dim)).astype(dtype))
        put("infos/action_log_probs", rng.normal(-2.0, 1.0, n).astype(dtype))
    return raw


def synthetic_dataset(n: int, obs_dim: int, act_dim: int, seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    terminals, timeouts = episode_flags(n, rng)
    return Dataset.from_arrays(
        observations=rng.standard_normal((n, obs_dim), dtype=np.float32),
        actions=rng.uniform(-1, 1, (n, act_dim)).astype(np.float32),
        rewards=rng.standard_normal(n, dtype=np.float32),
        terminals=terminals,
        timeouts=timeouts,
        next_observations=rng.standard_normal((n, obs_dim), dtype=np.float32),
        behavior_log_probs=rng.standard_normal(n, dtype=np.float32),
    )


# ------------------------------------------------------------------ measurements
def time_sample(ds: Dataset, batch_size: int, calls: int, device: str, seed: int = 0) -> list[float]:
    generator = torch.Generator(device=device).manual_seed(seed)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(max(50, calls // 20)):  # warm-up: builds the tensor cache, warms allocator and caches
        ds.sample(batch_size, generator=generator)
    sync()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        ds.sample(batch_size, generator=generator)
        sync()
        times.append(time.perf_counter() - start)
    return times


def measure_load(path: Path, raw_bytes: int, repeats: int) -> dict[str, float | None]:
    load_times, rss_deltas, peaks, trimmed = [], [], [], []
    nbytes = 0
    for _ in range(repeats):
        malloc_trim()  # so that memory cached from an earlier repeat does not hide this load's growth
        can_reset = reset_peak_rss()
        before = rss_bytes()
        start = time.perf_counter()
        ds = load(str(path))
        load_times.append(time.perf_counter() - start)
        ds.tensors("cpu")  # sampling's tensor views must not add a copy
        rss_deltas.append(rss_bytes() - before)
        peak = peak_rss_bytes()
        peaks.append(peak - before if (peak is not None and can_reset) else None)
        trimmed.append(rss_bytes() - before if malloc_trim() else None)
        nbytes = dataset_nbytes(ds)
        n_transitions = ds.n_transitions
        del ds
    return {
        "load_s": statistics.median(load_times),
        "n_transitions": n_transitions,
        "nbytes": nbytes,
        "raw": raw_bytes,
        "rss_delta": statistics.median(rss_deltas),
        "peak_delta": None if any(p is None for p in peaks) else statistics.median(peaks),
        "trimmed_delta": None if any(t is None for t in trimmed) else statistics.median(trimmed),
    }


# ------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="transitions (default 1M)")
    parser.add_argument("--obs-dim", type=int, default=17)
    parser.add_argument("--act-dim", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--calls", type=int, default=2000, help="timed sample() calls")
    parser.add_argument("--device", default="cpu", help="device for sample() (cpu, cuda)")
    parser.add_argument("--load-repeats", type=int, default=3, help="loads per file (median reported)")
    parser.add_argument("--skip-load", action="store_true", help="only (a): no HDF5 files")
    parser.add_argument("--tmpdir", default=None, help="where to write the temporary HDF5 files")
    parser.add_argument("--sample-target-us", type=float, default=100.0)
    parser.add_argument("--memory-target", type=float, default=2.0)
    args = parser.parse_args(argv)

    print(
        f"offrl dataset I/O benchmark: n={args.n:,} obs_dim={args.obs_dim} act_dim={args.act_dim} "
        f"batch={args.batch_size} device={args.device}\n"
        f"python {platform.python_version()}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"numpy {np.__version__}, {os.cpu_count()} CPUs, {platform.machine()}"
    )
    rows: list[tuple[str, str, str, str]] = []

    def row(name: str, value: str, target: str = "", ok: bool | None = None) -> None:
        rows.append((name, value, target, "" if ok is None else ("ok" if ok else "MISS")))

    # (a) sampling
    ds = synthetic_dataset(args.n, args.obs_dim, args.act_dim)
    times = time_sample(ds, args.batch_size, args.calls, args.device)
    median_us = statistics.median(times) * 1e6
    p90_us = float(np.percentile(times, 90)) * 1e6
    row(f"sample({args.batch_size}) median", f"{median_us:.1f} us", f"< {args.sample_target_us:g} us",
        median_us < args.sample_target_us if args.device == "cpu" else None)
    row(f"sample({args.batch_size}) p90", f"{p90_us:.1f} us")
    row("sample throughput", f"{args.batch_size / statistics.median(times) / 1e6:.2f} M transitions/s")
    del ds

    # (b) + (c) loading D4RL-layout files
    if not args.skip_load:
        with tempfile.TemporaryDirectory(dir=args.tmpdir, prefix="offrl-bench-") as tmp:
            files = [
                ("float64 medium-replay (no next_obs)", Path(tmp) / "hopper_medium_replay-v2.hdf5", True, False),
                ("float32 with next_obs", Path(tmp) / "hopper_medium-v2.hdf5", False, True),
            ]
            for label, path, float64, next_obs in files:
                raw = write_d4rl_file(path, args.n, args.obs_dim, args.act_dim, float64=float64, next_obs=next_obs, seed=1)
                result = measure_load(path, raw, args.load_repeats)
                size_mb = path.stat().st_size / _MB
                row(f"load {label}", f"{result['load_s']:.3f} s", f"file {size_mb:.0f} MB, {result['n_transitions']:,} transitions kept")
                ratio = result["nbytes"] / result["raw"]
                row("  Dataset arrays / raw float32", f"{result['nbytes'] / _MB:.0f} / {result['raw'] / _MB:.0f} MB = {ratio:.2f}x",
                    f"<= {args.memory_target:g}x", ratio <= args.memory_target)
                row("  RSS growth / raw float32", f"{result['rss_delta'] / _MB:.0f} MB = {result['rss_delta'] / result['raw']:.2f}x",
                    "info: includes freed temporaries glibc keeps")
                if result["trimmed_delta"] is not None:
                    trimmed_ratio = result["trimmed_delta"] / result["raw"]
                    row("  RSS growth after malloc_trim / raw", f"{result['trimmed_delta'] / _MB:.0f} MB = {trimmed_ratio:.2f}x",
                        f"<= {args.memory_target:g}x", trimmed_ratio <= args.memory_target)
                if result["peak_delta"] is not None:
                    row("  peak RSS during load / raw", f"{result['peak_delta'] / _MB:.0f} MB = {result['peak_delta'] / result['raw']:.2f}x")
                else:
                    row("  peak RSS during load / raw", "n/a (cannot reset VmHWM here)")

    widths = [max(len(r[i]) for r in rows + [("metric", "value", "target", "")]) for i in range(4)]
    header = ("metric", "value", "target", "")
    for r in [header] + rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    return 0 if all(r[3] != "MISS" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
