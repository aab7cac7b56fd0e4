"""``python -m atomic_checkpoint``: the same command line as ``atomic-checkpoint``."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
