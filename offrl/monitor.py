"""What every training loop reports and keeps: one `TrainingMonitor` for offline `fit` and the online loop.

A loop calls `monitor.after_step(step, metrics)` after each gradient (or
environment) step.  The monitor decides which steps are log steps
(`log_every`) and evaluation steps (`eval_every`) and, on those only, moves
the metrics to the host, checks them for NaN/inf, writes `train.csv`,
TensorBoard and the progress bar, evaluates the estimator in `eval_env`
(`eval.csv`, `estimator.history_`) and calls the callbacks.  Between those
steps nothing leaves the device.  Checkpoints are written through
`write_checkpoint`, which stores the estimator's model payload (optimisers
included), the RNG states and the monitor's history atomically, and never
a state holding NaN or inf (it raises instead and keeps the previous
checkpoint, so "the last good checkpoint" is one); `read_checkpoint`
restores them, refusing damaged or non-finite ones with a message.  What to checkpoint beyond that (a replay
buffer, episode counters) is the loop's `extra` dict.

This module sits below the algorithms: it knows estimators only through
their public methods (`evaluate`, `history_`) and `offrl.serialization`.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch

from offrl.datasets.core import atomic_write_path

__all__ = ["TrainingMonitor", "TrainingDivergedError", "write_checkpoint", "read_checkpoint", "nonfinite_tensors",
           "checkpoint_note"]


class TrainingDivergedError(FloatingPointError):
    """A loss, or a weight about to be checkpointed, became NaN or inf during training."""


def nonfinite_tensors(state: Any, prefix: str = "") -> list[str]:
    """Dotted names of the floating-point tensors in `state` (nested dicts / lists) holding a NaN or inf.

    One device round trip per device, not one per tensor.
    """
    found: list[tuple[str, torch.Tensor]] = []

    def walk(value: Any, name: str) -> None:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() or value.is_complex():
                found.append((name, value))
        elif isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, f"{name}.{key}" if name else str(key))
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{name}[{i}]")

    walk(state, prefix)
    bad: set[str] = set()
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in found:
        by_device.setdefault(tensor.device, []).append((name, tensor))
    for group in by_device.values():
        flags = torch.stack([torch.isfinite(t.detach()).all() for _, t in group]).tolist()
        bad.update(name for (name, _), ok in zip(group, flags) if not ok)
    return [name for name, _ in found if name in bad]


def _names(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def checkpoint_note(path: Path | None) -> str:
    """What the checkpoint at `path` offers after a divergence: its step when its weights are finite."""
    if path is None:
        return ""
    path = Path(path)
    if not path.exists():
        return "; no checkpoint has been written yet"
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        ckpt = next(v for k, v in payload.items() if k.endswith("checkpoint") and isinstance(v, dict))
        step, bad = ckpt["step"], nonfinite_tensors(payload.get("state", {}))
    except Exception as err:  # an error message must not fail on a damaged file
        return f"; the checkpoint {path} cannot be read ({type(err).__name__}: {err})"
    if bad:
        return (f"; the checkpoint {path} (step {step}) holds NaN or inf too ({_names(bad)}; written by an older "
                "offrl): do not resume from it")
    return f"; the last good checkpoint is {path} (step {step})"


class _CSVLog:
    """Append-only CSV with a fixed header; on resume, rows after the checkpoint step are dropped."""

    def __init__(self, path: Path, keep_until: int | None) -> None:
        self.path = path
        self.fields: list[str] | None = None
        if keep_until is not None and path.exists():
            with open(path, newline="") as f:
                rows = [r for r in csv.DictReader(f) if int(float(r["step"])) <= keep_until]
            with atomic_write_path(path) as tmp, open(tmp, "w", newline="") as f:
                if rows:
                    writer = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
                    writer.writeheader()
                    writer.writerows(rows)
            self.fields = list(rows[0].keys()) if rows else None
        elif path.exists():
            path.unlink()

    def write(self, row: Mapping[str, Any]) -> None:
        new = self.fields is None
        if new:
            self.fields = list(row.keys())
        with open(self.path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.fields, extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerow(row)


def _tensorboard_writer(log_path: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:  # tensorboard not installed
        return None
    return SummaryWriter(str(log_path / "tensorboard"))


class TrainingMonitor:
    """Logging, NaN checks, evaluation, history and callbacks of one training run.

    `callbacks_on` says when callbacks run: "log" (every `log_every` steps,
    offline `fit`) or "eval" (at each evaluation step, the online loop,
    whose callbacks snapshot policies).  A callback returning False stops
    the run (`after_step` returns False).  `row_extras()` (optional) adds
    loop-specific columns (e.g. the last training episode's return) to each
    evaluation row.
    """

    def __init__(
        self,
        estimator: Any,
        n_steps: int,
        *,
        start: int = 0,
        log_every: int = 100,
        eval_env: Any = None,
        eval_every: int | None = None,
        eval_episodes: int = 10,
        callbacks: Iterable[Callable[[Any, int, dict[str, float]], Any]] = (),
        callbacks_on: str = "log",
        log_dir: str | Path | None = None,
        resume: bool = False,
        progress: bool = True,
        desc: str | None = None,
        unit: str = "step",
        row_extras: Callable[[], dict[str, float]] | None = None,
        checkpoint_path: Path | None = None,
        history: list | None = None,
    ) -> None:
        from tqdm.auto import tqdm

        if int(log_every) < 1:
            raise ValueError(f"log_every must be at least 1, got {log_every}")
        if callbacks_on not in ("log", "eval"):
            raise ValueError(f"callbacks_on must be 'log' or 'eval', got {callbacks_on!r}")
        self.estimator = estimator
        self.n_steps = int(n_steps)
        self.log_every = int(log_every)
        self.eval_env = eval_env
        self.eval_every = int(eval_every or max(self.n_steps // 10, 1))
        self.eval_episodes = int(eval_episodes)
        self.callbacks = list(callbacks)
        self.callbacks_on = callbacks_on
        self.row_extras = row_extras
        self.checkpoint_path = checkpoint_path
        self.progress = progress
        self.history = estimator.history_ if history is None else history
        self.last_checked = start
        self.values: dict[str, float] = {}
        self.train_log = self.eval_log = self.writer = None
        if log_dir is not None:
            log_path = Path(log_dir)
            log_path.mkdir(parents=True, exist_ok=True)
            keep = start if resume else None
            self.train_log = _CSVLog(log_path / "train.csv", keep)
            self.eval_log = _CSVLog(log_path / "eval.csv", keep)
            self.writer = _tensorboard_writer(log_path)
        self.bar = tqdm(total=self.n_steps, initial=start, desc=desc or type(estimator).__name__, unit=unit,
                        disable=not progress, dynamic_ncols=True)
        self.shown = start

    # ------------------------------------------------------------------ schedule
    def is_log_step(self, done: int, prev: int | None = None) -> bool:
        """Whether a multiple of `log_every` lies in (prev, done] (prev = done - 1 unless a step took k > 1 env steps)."""
        prev = done - 1 if prev is None else prev
        return done // self.log_every > prev // self.log_every or done == self.n_steps

    def is_eval_step(self, done: int, prev: int | None = None) -> bool:
        prev = done - 1 if prev is None else prev
        return done // self.eval_every > prev // self.eval_every or done == self.n_steps

    def needs_host(self, done: int) -> bool:
        """Whether `after_step(done, ...)` does anything beyond counting (so the loop may skip it)."""
        return self.is_log_step(done) or (self.is_eval_step(done) and (self.eval_env is not None or self.callbacks_on == "eval"))

    # ------------------------------------------------------------------ per step
    def finite(self, metrics: Mapping[str, torch.Tensor], step: int) -> dict[str, float]:
        """Host floats of `metrics`; a NaN or inf raises `TrainingDivergedError` naming the loss and step."""
        values = {k: float(v) for k, v in metrics.items()}
        for key, value in values.items():
            if not math.isfinite(value):
                where = checkpoint_note(self.checkpoint_path)
                since = (f" (losses are checked every log_every steps; all were finite at step {self.last_checked})"
                         if self.last_checked < step - 1 else "")
                raise TrainingDivergedError(
                    f"{type(self.estimator).__name__}: loss {key!r} became {value} at step {step}{since}{where}. "
                    "Lower the learning rate, check the rewards' scale, or enable observation normalisation"
                )
        self.last_checked = step
        return values

    def after_step(self, done: int, metrics: Mapping[str, torch.Tensor], *, prev: int | None = None,
                   before_callbacks: Callable[[], None] | None = None) -> bool:
        """Log / evaluate / call back at step `done` as scheduled; False when a callback asked to stop.

        `before_callbacks` runs after logging and evaluation and before the
        callbacks (the offline loop writes its checkpoint there, so a run a
        callback stops has the checkpoint of that step).
        """
        is_log, is_eval = self.is_log_step(done, prev), self.is_eval_step(done, prev)
        if done > self.shown:
            self.bar.update(done - self.shown)
            self.shown = done
        if is_log and metrics:
            self.values = self.finite(metrics, done)
            self.bar.set_postfix({k: f"{v:.3g}" for k, v in list(self.values.items())[:4]}, refresh=False)
            if self.train_log is not None:
                self.train_log.write({"step": done, **self.values})
            if self.writer is not None:
                for key, value in self.values.items():
                    self.writer.add_scalar(f"train/{key}", value, done)
        row = None
        if is_eval and (self.eval_env is not None or self.callbacks_on == "eval"):
            row = self._evaluation_row(done, metrics)
        if before_callbacks is not None:
            before_callbacks()
        if self.callbacks_on == "log" and is_log:
            return not any(cb(self.estimator, done, self.values) is False for cb in self.callbacks)
        if self.callbacks_on == "eval" and row is not None:
            return not any(cb(self.estimator, done, row) is False for cb in self.callbacks)
        return True

    def _evaluation_row(self, done: int, metrics: Mapping[str, torch.Tensor]) -> dict[str, float]:
        row: dict[str, float] = {"step": done}
        if self.callbacks_on == "eval" and metrics:  # online rows carry the losses too
            row.update(self.values if self.last_checked == done else self.finite(metrics, done))
        if self.row_extras is not None:
            row.update(self.row_extras())
        if self.eval_env is not None:
            result = self.estimator.evaluate(self.eval_env, n_episodes=self.eval_episodes, seed=0)
            row.update({"return_mean": result["return_mean"], "return_std": result["return_std"],
                        "normalized_score_mean": result.get("normalized_score_mean", float("nan")),
                        "normalized_score_std": result.get("normalized_score_std", float("nan"))})
            if self.progress:
                score = row["normalized_score_mean"]
                self.bar.write(f"step {done}: return {row['return_mean']:.2f} ± {row['return_std']:.2f}"
                               + (f", normalised score {score:.1f}" if math.isfinite(score) else ""))
            if self.eval_log is not None:
                self.eval_log.write(row)
            if self.writer is not None:
                self.writer.add_scalar("eval/return_mean", row["return_mean"], done)
                if math.isfinite(row["normalized_score_mean"]):
                    self.writer.add_scalar("eval/normalized_score", row["normalized_score_mean"], done)
        self.history.append(row)
        return row

    def set_postfix(self, values: Mapping[str, str]) -> None:
        self.bar.set_postfix(dict(values), refresh=False)

    def close(self) -> None:
        self.bar.close()
        if self.writer is not None:
            self.writer.close()


# ---------------------------------------------------------------------- checkpoints
def write_checkpoint(path: Path, estimator: Any, generator: torch.Generator, step: int,
                     extra: Mapping[str, Any] | None = None, key: str = "checkpoint", history: list | None = None) -> None:
    """Model payload with optimisers + RNG states + history (+ `extra`), written atomically to `path`.

    A state with a NaN or inf in any float tensor (weights, optimiser moments)
    raises `TrainingDivergedError` naming the tensors and the step, and the
    previous checkpoint at `path` is kept as it was.
    """
    from offrl.serialization import model_payload

    payload = model_payload(estimator, include_optimizers=True)
    bad = nonfinite_tensors(payload["state"]) if "state" in payload else []
    if bad:
        raise TrainingDivergedError(
            f"{type(estimator).__name__}: {len(bad)} tensor{'s' if len(bad) > 1 else ''} of the state became NaN or "
            f"inf at step {step} ({_names(bad)}), so no checkpoint was written for it{checkpoint_note(Path(path))}. "
            "Lower the learning rate, check the rewards' scale, or enable observation normalisation"
        )
    payload[key] = {
        "step": int(step),
        "torch_rng": torch.get_rng_state(),
        "generator": generator.get_state(),
        "history": [dict(r) for r in (estimator.history_ if history is None else history)],
        **dict(extra or {}),
    }
    if torch.cuda.is_available():
        payload[key]["cuda_rng"] = torch.cuda.get_rng_state_all()
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write_path(path) as tmp:
        torch.save(payload, tmp)


_CHECKPOINT_FIX = "delete it (or use a new log_dir) to start afresh"


def read_checkpoint(path: Path, estimator: Any, generator: torch.Generator, key: str = "checkpoint",
                    required: Iterable[str] = ()) -> dict[str, Any]:
    """Restore `estimator` (networks, optimisers, fitted attributes) and the RNGs from `path`.

    Returns the checkpoint's dict (its `step`, `history` and the loop's `extra`
    entries, of which `required` must be present).  A damaged checkpoint
    (missing or mistyped entries, tensors of the wrong shape) or one holding
    NaN or inf weights raises ValueError naming the file and the entry.
    """
    from offrl.serialization import restore_state

    source = f"checkpoint {path}"
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(f"{source} could not be read ({err}); {_CHECKPOINT_FIX}") from err
    if not isinstance(payload, dict) or not isinstance(payload.get(key), dict):
        raise ValueError(f"{path} is not an offrl {key.replace('_', ' ')} file; {_CHECKPOINT_FIX}")
    if str(payload.get("class", "")).split(":")[-1] != type(estimator).__qualname__:
        raise ValueError(f"{source} belongs to {payload.get('class')}, not {type(estimator).__name__}; "
                         f"{_CHECKPOINT_FIX}")
    where = type(estimator).__name__
    if isinstance(payload.get("state"), dict):
        bad = nonfinite_tensors(payload["state"])
        if bad:
            raise ValueError(f"{source}: {where}: the state holds NaN or inf ({_names(bad)}), so training cannot "
                             f"resume from it; {_CHECKPOINT_FIX}")
    ckpt = payload[key]
    problems = []
    step = ckpt.get("step")
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        problems.append(f"{key}.step is {repr(step) if 'step' in ckpt else 'missing'}, not a non-negative integer")
    history = ckpt.get("history")
    if not (isinstance(history, list) and all(isinstance(row, dict) for row in history)):
        problems.append(f"{key}.history is not a list of evaluation rows")
    for name in ("torch_rng", "generator"):
        state = ckpt.get(name)
        if not (isinstance(state, torch.Tensor) and state.dtype == torch.uint8):
            problems.append(f"{key}.{name} is {'a ' + type(state).__name__ if name in ckpt else 'missing'}, not an "
                            "RNG state")
    problems += [f"{key} has no {name!r}" for name in required if name not in ckpt]
    if problems:
        raise ValueError(f"{source}: {where}: {'; '.join(problems)}; {_CHECKPOINT_FIX}")
    restore_state(estimator, payload, source, where, fix=_CHECKPOINT_FIX)
    try:
        torch.set_rng_state(ckpt["torch_rng"])
        generator.set_state(ckpt["generator"])
        if "cuda_rng" in ckpt and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(ckpt["cuda_rng"])
    except (RuntimeError, TypeError, ValueError) as err:
        raise ValueError(f"{source}: {where}: its RNG states do not fit this machine ({err}); {_CHECKPOINT_FIX}") from err
    return ckpt
