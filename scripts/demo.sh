#!/usr/bin/env bash
# The main demo: a 4-process torchrun job is killed in the middle of a save, restarted,
# and resumes from the newest complete checkpoint; then the checkpoints are listed.
# Sets itself up (virtualenv, pinned dependencies) on the first run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/bootstrap.sh >&2
exec "$ROOT/.venv/bin/python" examples/demo/run.py "$@"
