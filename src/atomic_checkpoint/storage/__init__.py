"""Storage backends. ``LocalStorage`` for mounted filesystems, ``MemoryStorage`` for
unit tests of pure logic; ``FsspecStorage`` (object stores) lives in ``fsspec.py`` and
imports fsspec only when used: it is exported lazily, so ``import atomic_checkpoint``
never imports fsspec."""

from typing import TYPE_CHECKING, Any

from .base import Storage, StorageCapabilities, Writer
from .local import LocalStorage
from .memory import MemoryStorage

if TYPE_CHECKING:
    from .fsspec import FsspecStorage

__all__ = [
    "FsspecStorage",
    "LocalStorage",
    "MemoryStorage",
    "Storage",
    "StorageCapabilities",
    "Writer",
]


def __getattr__(name: str) -> Any:
    if name == "FsspecStorage":
        from .fsspec import FsspecStorage

        return FsspecStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
