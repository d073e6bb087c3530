"""Declared hyper-parameter rules: one check serves `fit`, a sweep's config check and the CLI.

Each estimator declares `_param_rules = {"expectile": real(0, 1, closed="neither"), ...}`;
`check_params(estimator)` applies the rules of the class and its bases to
`get_params(deep=False)`, so a sweep can refuse `expectile: 1.5` or
`batch_size: 2.5` before any run starts, with the same message `fit` gives.
A bool is never accepted where a number is expected (`expectile: true`).
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

__all__ = ["InvalidParameterError", "Rule", "real", "integer", "boolean", "choice", "layer_sizes", "device_name",
           "seed", "compile_option", "any_of", "interval_pair", "check_params", "param_rules"]


class InvalidParameterError(ValueError, TypeError):
    """A hyper-parameter of the wrong type or outside its range (a ValueError and a TypeError, as in scikit-learn)."""


@dataclass(frozen=True)
class Rule:
    """A named test: `accepts(value)` and the phrase that says what is allowed."""

    accepts: Callable[[Any], bool]
    allowed: str

    def ok(self, value: Any) -> bool:
        """Whether `value` is allowed (a value the test cannot even examine, e.g. a huge int, is not)."""
        try:
            return bool(self.accepts(value))
        except (TypeError, ValueError, OverflowError):
            return False

    def check(self, owner: str, name: str, value: Any) -> None:
        if not self.ok(value):
            raise InvalidParameterError(f"{owner}: {name} must be {self.allowed}, got {value!r}; fix it in the "
                                        "constructor call or the sweep config")


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _bounds_text(low: float | None, high: float | None, closed: str) -> str:
    left = "[" if closed in ("both", "left") else "("
    right = "]" if closed in ("both", "right") else ")"
    if low is not None and high is not None:
        return f"in {left}{low:g}, {high:g}{right}"
    if low is not None:
        return (">= " if left == "[" else "> ") + f"{low:g}"
    if high is not None:
        return ("<= " if right == "]" else "< ") + f"{high:g}"
    return "finite"


def _in_bounds(value: float, low: float | None, high: float | None, closed: str) -> bool:
    if low is not None and not (value >= low if closed in ("both", "left") else value > low):
        return False
    return high is None or (value <= high if closed in ("both", "right") else value < high)


def real(low: float | None = None, high: float | None = None, *, closed: str = "both", none: bool = False,
         infinite: bool = False) -> Rule:
    """A real number (not a bool) in the interval; `closed` is "both", "left", "right" or "neither"."""
    def accepts(value: Any) -> bool:
        if value is None:
            return none
        if not _is_real(value) or math.isnan(value) or (math.isinf(value) and not infinite):
            return False
        return _in_bounds(float(value), low, high, closed)

    text = f"a real number {_bounds_text(low, high, closed)}" + (" or None" if none else "")
    return Rule(accepts, text)


def integer(low: int | None = None, high: int | None = None, *, none: bool = False) -> Rule:
    """An integer (not a bool, not 2.0) in [low, high]."""
    def accepts(value: Any) -> bool:
        if value is None:
            return none
        return _is_int(value) and _in_bounds(int(value), low, high, "both")

    return Rule(accepts, f"an integer {_bounds_text(low, high, 'both')}" + (" or None" if none else ""))


def boolean() -> Rule:
    return Rule(lambda value: isinstance(value, (bool, np.bool_)), "True or False")


def choice(*options: Any) -> Rule:
    """One of `options` (compared with ==, types must match: 1 is not True)."""
    def accepts(value: Any) -> bool:
        return any(type(value) is type(option) and value == option for option in options)

    return Rule(accepts, "one of " + ", ".join(repr(o) for o in options))


def interval_pair(*, none: bool = True) -> Rule:
    """A (low, high) pair of finite reals with low <= high, e.g. a reward range."""
    def accepts(value: Any) -> bool:
        if value is None:
            return none
        if isinstance(value, (str, bytes)) or len(value) != 2:
            return False
        low, high = value
        return _is_real(low) and _is_real(high) and math.isfinite(low) and math.isfinite(high) and low <= high

    return Rule(accepts, "a (low, high) pair of finite numbers with low <= high" + (" or None" if none else ""))


def any_of(*rules: Rule) -> Rule:
    return Rule(lambda value: any(rule.accepts(value) for rule in rules), " or ".join(r.allowed for r in rules))


def layer_sizes(*, allow_empty: bool = False) -> Rule:
    """A list or tuple of positive integers (hidden layer widths)."""
    def accepts(value: Any) -> bool:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            return False
        return (allow_empty or len(value) > 0) and all(_is_int(v) and v >= 1 for v in value)

    return Rule(accepts, "a list of positive integer layer widths, e.g. [256, 256]")


_DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def device_name() -> Rule:
    """A device name ('auto', 'cpu', 'cuda', 'cuda:N', 'mps') or a torch.device."""
    import torch

    return Rule(lambda value: isinstance(value, torch.device)
                or (isinstance(value, str) and _DEVICE.fullmatch(value) is not None),
                "'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'")


def seed() -> Rule:
    """What `random_state` may be: None, a non-negative int, or a numpy Generator / RandomState."""
    def accepts(value: Any) -> bool:
        if value is None or isinstance(value, (np.random.Generator, np.random.RandomState)):
            return True
        return _is_int(value) and 0 <= int(value) < 2**63

    return Rule(accepts, "None, a non-negative integer or a numpy Generator")


_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_option() -> Rule:
    return any_of(boolean(), choice(*_COMPILE_MODES))


def param_rules(cls: type) -> dict[str, Rule]:
    """The rules `cls` declares, merged over its bases (a subclass's rule wins)."""
    rules: dict[str, Rule] = {}
    for klass in reversed(cls.__mro__):
        rules.update(vars(klass).get("_param_rules", {}))
    return rules


def check_params(estimator: Any, params: dict[str, Any] | None = None) -> None:
    """Raise InvalidParameterError for the first hyper-parameter that breaks its declared rule.

    `params` defaults to `estimator.get_params(deep=False)`; parameters
    without a rule (e.g. a nested estimator) are left to the estimator.
    """
    rules = param_rules(type(estimator))
    values = estimator.get_params(deep=False) if params is None else params
    owner = type(estimator).__name__
    for name, value in values.items():
        rule = rules.get(name)
        if rule is not None:
            rule.check(owner, name, value)
