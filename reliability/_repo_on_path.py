"""Puts the repository root first on ``sys.path``, so that ``reliability`` (and the
``tests`` it imports) can be imported by a campaign module run by its path
(``python reliability/run.py``): Python then puts only this directory on the path,
where this module is found as ``_repo_on_path``. Run with ``-m``, nothing needs it."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
