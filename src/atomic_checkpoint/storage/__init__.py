"""Storage backends. ``LocalStorage`` for mounted filesystems, ``MemoryStorage`` for
unit tests of pure logic; ``FsspecStorage`` (object stores) lives in ``fsspec.py`` and
imports fsspec only when used: it is exported lazily, so ``import atomic_checkpoint``
never imports fsspec."""

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .base import Storage, StorageCapabilities, Writer
from .detect import local_capabilities
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
    "open_storage",
]


def __getattr__(name: str) -> Any:
    if name == "FsspecStorage":
        from .fsspec import FsspecStorage

        return FsspecStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_storage(
    root: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> Storage:
    """A storage for a path or URL: ``FsspecStorage`` for ``s3://``, ``gs://``, ... (any
    fsspec URL but ``file://``), else ``LocalStorage`` with capabilities read from the
    mount table (a ``fuse.s3fs`` mount has no atomic directory rename)."""
    text = os.fspath(root)
    if "://" in text and not text.startswith("file://"):
        from .fsspec import FsspecStorage  # imports fsspec: only for URL roots

        return FsspecStorage(text, storage_options)
    if storage_options:
        raise ValueError(
            f"storage_options apply to URL roots (s3://, gs://, ...), not to the local "
            f"path {text!r}"
        )
    if text.startswith("file://"):
        text = text[len("file://") :]
    return LocalStorage(text, capabilities=local_capabilities(text))
