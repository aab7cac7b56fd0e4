"""Storage backends. ``LocalStorage`` for mounted filesystems, ``MemoryStorage`` for
unit tests of pure logic; ``FsspecStorage`` (object stores) lives in ``fsspec.py`` and
imports fsspec only when used."""

from .base import Storage, StorageCapabilities, Writer
from .local import LocalStorage
from .memory import MemoryStorage

__all__ = ["LocalStorage", "MemoryStorage", "Storage", "StorageCapabilities", "Writer"]
