"""A griffe extension for the API reference: a function decorated with
``@parameters_of(original)`` (``atomic_checkpoint._params``: ``save_async`` takes
``save``'s parameters) is shown with ``original``'s parameters, annotations and defaults,
as ``help()`` and ``inspect.signature`` show it at run time. griffe reads the source
without running it, so without this the reference showed the twin's bare names, and its
``Args:`` entries failed the strict build for want of a type.

``original`` is looked up by name beside the twin (the class or module that holds it),
then in the twin's module; ``first="self"`` renames the first parameter, as at run time.
An ``original`` that cannot be found fails the build: a reference that silently lost a
signature is worse than none."""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Function, Object, Parameter, Parameters

_DECORATOR = re.compile(r"^(?:\w+\.)*parameters_of\((\w+)(?:,\s*first=['\"](\w+)['\"])?\)$")


def _find(func: Function, name: str) -> Function:
    holder: Object | None = func.parent
    while holder is not None:
        found = holder.members.get(name)
        if isinstance(found, Function):
            return found
        holder = holder.parent if not holder.is_module else None
    raise LookupError(
        f"{func.path}: @parameters_of({name}) names no function beside it or in its module"
    )


def shared_parameters(func: Function) -> Parameters | None:
    """The parameters ``func`` takes at run time if it is a ``parameters_of`` twin."""
    for decorator in func.decorators:
        m = _DECORATOR.match(str(decorator.value))
        if m is None:
            continue
        original, first = _find(func, m.group(1)), m.group(2)
        params = [
            Parameter(p.name, annotation=p.annotation, kind=p.kind, default=p.default)
            for p in original.parameters
        ]
        if first and params:  # the method's own first parameter, unannotated
            params[0] = Parameter(first, kind=params[0].kind)
        return Parameters(*params)
    return None


class SharedParameters(Extension):
    def on_function_instance(self, *, func: Function, **kwargs: Any) -> None:
        params = shared_parameters(func)
        if params is not None:
            func.parameters = params
