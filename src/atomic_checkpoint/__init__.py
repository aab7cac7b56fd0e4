"""atomic-checkpoint: atomic, race-free, verifiable checkpoints for distributed training.

Importing this package imports no framework (no torch, no fsspec): they are imported
only when a feature that needs them is used.
"""

from typing import TYPE_CHECKING

# ``_early`` first (it sorts first): in ``python -m atomic_checkpoint.launch`` it keeps a
# preemption signal that comes while the rest is imported (about half a second).
from . import _early, errors, storage  # noqa: F401  (_early acts on import)
from ._version import __version__
from .adopt import AdoptResult, adopt, register_framework
from .async_save import SaveHandle
from .coordination import Coordinator, SingleProcessCoordinator, TorchDistributedCoordinator
from .errors import *  # noqa: F403  (every public error: errors.__all__)
from .manager import CheckpointManager
from .manifest import CheckpointInfo
from .preemption import REQUEUE_EXIT_CODE, PreemptionGuard
from .retention import AnyOf, KeepAll, KeepBest, KeepEvery, KeepLast, Pin, RetentionPolicy
from .storage import LocalStorage, MemoryStorage, Storage, StorageCapabilities, open_storage
from .tiered import Tier, TieredCheckpointInfo, TieredCheckpointManager

__all__ = [
    "REQUEUE_EXIT_CODE",
    "AdoptResult",
    "AnyOf",
    "CheckpointInfo",
    "CheckpointManager",
    "Coordinator",
    "FsspecStorage",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "LocalStorage",
    "MemoryStorage",
    "Pin",
    "PreemptionGuard",
    "RetentionPolicy",
    "SaveHandle",
    "SingleProcessCoordinator",
    "Storage",
    "StorageCapabilities",
    "Tier",
    "TieredCheckpointInfo",
    "TieredCheckpointManager",
    "TorchDistributedCoordinator",
    "__version__",
    "adopt",
    "open_storage",
    "register_framework",
]
__all__ += errors.__all__


if TYPE_CHECKING:
    from .storage.fsspec import FsspecStorage
else:

    def __getattr__(name: str) -> object:
        # FsspecStorage imports fsspec: loaded when first asked for. Hidden from type
        # checkers, which would take any name for an attribute of the package.
        return storage.lazy_attribute(__name__, name)
