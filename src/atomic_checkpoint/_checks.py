"""Checks of user arguments shared by the public entry points (pure, no package
imports): a flag is a bool, a bound is a positive number of seconds. Each raises the
error that says what was passed and what to pass instead."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["flag", "positive_seconds", "retention_policy", "wait_seconds"]


def flag(name: str, value: Any) -> bool:
    """``value`` as a bool, else ``TypeError``: a string from a config file or the
    command line ("no", "false") is truthy, and ``overwrite="no"`` replaced a committed
    checkpoint. numpy's bool is accepted."""
    kind = type(value)
    if isinstance(value, bool) or (
        kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")
    ):
        return bool(value)
    raise TypeError(
        f"{name} must be True or False, got {value!r} ({type(value).__name__}); convert "
        "a setting read as text first (e.g. value.lower() in ('1', 'true', 'yes'))"
    )


def positive_seconds(name: str, value: Any) -> float:
    """``value`` as a positive, finite number of seconds, else ``ValueError`` (a number
    out of range) or ``TypeError`` (not a number: text from a config file, and a bool,
    which ``float()`` takes as 1 second)."""
    if isinstance(value, (str, bytes, bytearray, bool)):
        raise TypeError(
            f"{name} must be a number of seconds, got {value!r} ({type(value).__name__}); "
            "convert a setting read as text first (float(value))"
        )
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number of seconds, got {value!r}") from None
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(
            f"{name} must be a positive, finite number of seconds, got {value!r} (for a "
            "bound that never matters in practice, pass e.g. 86400: a day)"
        )
    return seconds


def wait_seconds(name: str, value: Any) -> float | None:
    """A bound on a wait: None (no bound), 0 (do not wait: poll) or a positive number
    of seconds, checked as :func:`positive_seconds` does."""
    if value is None:
        return None
    if not isinstance(value, bool) and isinstance(value, (int, float)) and value == 0:
        return 0.0
    return positive_seconds(name, value)


def retention_policy(policy: Any) -> None:
    """Raise ``TypeError`` unless ``policy`` is None or a retention policy object (a
    class such as ``KeepLast`` itself, or a number, is a mistake to say at once: as
    a policy it would fail at every rotation, and the disk would fill)."""
    if policy is None or (not isinstance(policy, type) and callable(getattr(policy, "keep", None))):
        return
    if isinstance(policy, type):
        raise TypeError(
            f"retention must be a policy object such as {policy.__name__}(3), not the class "
            f"{policy.__name__} itself"
        )
    hint = f" (KeepLast({policy}) keeps the {policy} newest)" if isinstance(policy, int) else ""
    raise TypeError(
        f"retention must be a policy such as KeepLast(3), got {type(policy).__name__}{hint}"
    )
