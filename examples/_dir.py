"""The one argument of the examples: ``[DIR]``, where the example's run writes."""

from __future__ import annotations

import os
import sys
import tempfile


def example_dir(doc: str, prefix: str) -> str:
    """``DIR`` from the command line, else a new temporary directory. ``-h``/``--help``
    prints the example's docstring. Each example starts a new run, so a ``DIR`` that
    already holds files (an earlier run of it) is refused, by rank 0 under torchrun."""
    args = sys.argv[1:]
    if any(a in ("-h", "--help") for a in args) or len(args) > 1:
        print(doc.strip())
        sys.exit(0 if len(args) == 1 else 2)
    if not args:
        return tempfile.mkdtemp(prefix=prefix)
    path = args[0]
    first = os.environ.get("RANK", "0") == "0"
    if first and os.path.isdir(path) and os.listdir(path):
        sys.exit(
            f"{sys.argv[0]}: {path} is not empty (an earlier run of this example?): each "
            "run starts a new one, so pass a new or empty directory"
        )
    return path
