"""``python -m atomic_checkpoint``: the same command line as ``atomic-checkpoint``.

Ctrl-C while the command line is being imported exits 130 with one line, as it does
later (``cli.main``). Python has imported the package itself before this module runs
(about 0.25 s): a Ctrl-C in that time still ends with Python's own traceback."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    try:
        from .cli import main
    except KeyboardInterrupt:
        sys.stderr.write("atomic-checkpoint: error: interrupted\n")
        raise SystemExit(130) from None
    raise SystemExit(main())
