"""Names that become paths, and locks that wait.

Every user-given name that ends up as a file or folder name (a sweep's
dataset label or algorithm key, a D4RL dataset name, a Minari id's parts,
a built dataset's name) goes through `check_path_name`, so no name can reach
outside the folder it is meant for.  `wait_for_lock` is the one way two
processes share a folder: the second waits (with a timeout and a message)
instead of failing.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

__all__ = ["check_path_name", "check_inside", "wait_for_lock", "LockTimeoutError"]

_SAFE_NAME = re.compile(r"[A-Za-z0-9_.+-]+")


def check_path_name(value: object, field: str) -> str:
    """`value` as a single safe path component, or a ValueError naming `field`.

    Refused: non-strings, the empty string, `.` and `..`, path separators,
    absolute paths, leading dots (hidden files) and anything outside letters,
    digits and `_ . + -`.
    """
    if not isinstance(value, str):
        raise TypeError(f"{field} must be a string, got {type(value).__name__} ({value!r})")
    problem = None
    if value == "":
        problem = "is empty"
    elif value in (".", ".."):
        problem = "is a relative folder reference"
    elif "/" in value or "\\" in value or os.sep in value or (os.altsep and os.altsep in value):
        problem = "contains a path separator"
    elif value.startswith("."):
        problem = "starts with a dot"
    elif not _SAFE_NAME.fullmatch(value):
        bad = sorted({c for c in value if not _SAFE_NAME.fullmatch(c)})
        problem = f"contains {''.join(bad)!r}"
    if problem is not None:
        raise ValueError(f"{field} {value!r} {problem}: it becomes a file or folder name, so use only letters, digits "
                         "and _ . + - (no '..', '/', '\\' or leading dot)")
    return value


def check_inside(path: str | os.PathLike, root: str | os.PathLike, field: str) -> Path:
    """`path` resolved, or a ValueError when it lies outside `root` (after following `..` and links)."""
    resolved, base = Path(path).resolve(), Path(root).resolve()
    if resolved != base and base not in resolved.parents:
        raise ValueError(f"{field} resolves to {resolved}, outside {base}; use a name without '..' or separators")
    return resolved


class LockTimeoutError(TimeoutError):
    """Another process held a lock for longer than the caller would wait."""


@contextlib.contextmanager
def wait_for_lock(lock_path: str | os.PathLike, what: str, timeout: float | None = 3600.0,
                  poll: float = 1.0, say: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold an exclusive `flock` on `lock_path`, waiting up to `timeout` seconds for another holder.

    `what` names the work in the messages; `say` (default: stderr) gets one
    line when the wait starts.  The lock dies with its process, so a killed
    holder never blocks anyone.  `timeout=None` waits forever; 0 fails at once.
    """
    import fcntl

    path = Path(lock_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    with open(path, "a") as handle:
        start, told = time.monotonic(), False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                if timeout is not None and waited >= timeout:
                    raise LockTimeoutError(
                        f"another process has been busy with {what} for {waited:.0f} s (lock {path}); it may still be "
                        "running: wait for it, or raise the timeout") from None
                if not told:
                    say(f"offrl: waiting for another process busy with {what} (lock {path})")
                    told = True
                time.sleep(poll if timeout is None else max(0.0, min(poll, timeout - waited)))
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
