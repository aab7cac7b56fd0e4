"""A griffe extension for the API reference: Google-style ``Args:`` entries that document
several parameters at once (``root, retention, timeout_s: as for save_state``, the
description on the same line or indented below) become one entry per parameter, so that
each name is still checked against the signature: a name that is not a parameter still
fails the strict build."""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

_SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Keyword Args|Keyword Arguments):\s*$")
_GROUPED = re.compile(r"^(\s+)([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)+)\s*:\s*(.*)$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def split_grouped_args(text: str) -> str:
    lines = text.splitlines()
    out: list[str] = []
    section: int | None = None  # indent of the current Args: heading
    entry: int | None = None  # indent of its entries
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        m = _SECTION.match(line)
        if m:
            section, entry = len(m.group(1)), None
            out.append(line)
            continue
        if section is not None and line.strip():
            if _indent(line) <= section:
                section = None  # the section ended
            elif entry is None:
                entry = _indent(line)
        g = _GROUPED.match(line) if section is not None else None
        if g is None or len(g.group(1)) != entry:
            out.append(line)
            continue
        # The description: the rest of the line, then the lines indented below the entry.
        more = []
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > len(g.group(1))):
            more.append(lines[i])
            i += 1
        while more and not more[-1].strip():
            more.pop()
            i -= 1
        for name in re.split(r"\s*,\s*", g.group(2)):
            out.append(f"{g.group(1)}{name}: {g.group(3)}".rstrip())
            out.extend(more)
    return "\n".join(out)


class GroupedArgs(Extension):
    def on_instance(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = split_grouped_args(obj.docstring.value)
