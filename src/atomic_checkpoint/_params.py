"""One parameter list for a public function and its twin (pure, no package imports).

``save`` and ``save_async``, ``save_dcp`` and ``async_save_dcp``, ``make_atomic`` and
``AtomicCheckpointCallback``: each pair takes the same options, and a list written
twice drifts (a default changed in one place, a new option added to one twin only).
:func:`parameters_of` states the list once. The twin is written with the names only::

    @parameters_of(save)
    def save_async(self, step, state, *, metrics, metadata, replicated, overwrite) -> ...:

and gets the original's parameters (kinds, defaults, annotations) as its own:

- ``help()``, ``inspect.signature`` and the API docs show them (``__signature__``);
- a type checker checks its calls against them (``ParamSpec``);
- a call is bound against them before the twin runs: a misspelt or missing argument
  raises the ``TypeError`` a plain function raises, and every default is filled in, so
  the twin is always called with every argument.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

__all__ = ["parameters_of"]

P = ParamSpec("P")
R = TypeVar("R")


def parameters_of(
    original: Callable[P, object], *, first: str | None = None
) -> Callable[[Callable[..., R]], Callable[P, R]]:
    """Give the decorated function ``original``'s parameters; its own return type stays.

    ``first`` renames the first parameter, for a method whose twin is a function
    (``make_atomic(trainer, ...)`` and ``AtomicCheckpointCallback.__init__(self, ...)``).
    """
    shared = inspect.signature(original)
    if first is not None:
        head, *rest = shared.parameters.values()
        head = head.replace(name=first, annotation=inspect.Parameter.empty)
        shared = shared.replace(parameters=[head, *rest])

    def declare(twin: Callable[..., R]) -> Callable[P, R]:
        signature = shared.replace(return_annotation=inspect.signature(twin).return_annotation)
        name = getattr(twin, "__qualname__", repr(twin))

        @functools.wraps(twin)
        def call(*args: Any, **kwargs: Any) -> R:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError as exc:
                raise TypeError(f"{name}() {exc}") from None
            bound.apply_defaults()
            return twin(*bound.args, **bound.kwargs)

        # inspect.signature reads __signature__ before it follows __wrapped__ to the twin.
        call.__signature__ = signature  # type: ignore[attr-defined]
        return call

    return declare
