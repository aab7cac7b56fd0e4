"""Real multi-process jobs whose ranks the campaign can kill, stop and watch.

The launcher lives in :mod:`tests.dist.launcher` (one for the tests, the campaigns and
the benchmarks); this module keeps the names the campaigns import: :class:`ForkJob`
(ranks forked from the torch-preloaded forkserver, joined in a real gloo process group
through a TCPStore hosted by the parent, with their pids and a progress slot per rank)
and, inside a rank, :func:`mark`, :func:`set_epoch` and :func:`install_fault_hook`.
"""

from __future__ import annotations

from tests.dist.launcher import ForkJob, RankResult, install_fault_hook, mark, set_epoch

__all__ = ["ForkJob", "RankResult", "install_fault_hook", "mark", "set_epoch"]
