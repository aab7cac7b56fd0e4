"""Storage backends. ``LocalStorage`` for mounted filesystems, ``MemoryStorage`` for
unit tests of pure logic; ``FsspecStorage`` (object stores) lives in ``fsspec.py`` and
imports fsspec only when used: it is exported lazily, so ``import atomic_checkpoint``
never imports fsspec. ``posix.py`` holds the calls by OS path that the rest of the
package makes on a mounted filesystem, with their OSError mapped here too."""

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .base import (
    RenamingStorage,
    Storage,
    StorageCapabilities,
    Writer,
    check_storage,
    looks_like_storage,
)
from .detect import local_capabilities
from .local import LocalStorage, local_root
from .memory import MemoryStorage
from .project import open_project

if TYPE_CHECKING:
    from .fsspec import FsspecStorage

__all__ = [
    "FsspecStorage",
    "LocalStorage",
    "MemoryStorage",
    "RenamingStorage",
    "Storage",
    "StorageCapabilities",
    "Writer",
    "local_root",
    "open_storage",
]


def is_url(root: str | os.PathLike[str]) -> bool:
    """Whether ``root`` names an object store (``s3://bucket/run``, any fsspec URL) rather
    than a path on a mounted filesystem; ``file://`` URLs are paths. The one test every
    caller that must tell the two apart uses (frameworks that write by OS path refuse
    URLs with it)."""
    text = os.fspath(root)
    return "://" in text and not text.startswith("file://")


def lazy_attribute(module: str, name: str) -> Any:
    """The attributes exported lazily (``FsspecStorage``, which imports fsspec), for
    the ``__getattr__`` of ``module``: this package, and the top-level one."""
    if name == "FsspecStorage":
        from .fsspec import FsspecStorage

        return FsspecStorage
    raise AttributeError(f"module {module!r} has no attribute {name!r}")


if not TYPE_CHECKING:  # type checkers see FsspecStorage's import above, and no other name

    def __getattr__(name: str) -> Any:
        return lazy_attribute(__name__, name)


def storage_for(
    root: str | os.PathLike[str] | Storage, storage_options: Mapping[str, Any] | None = None
) -> Storage:
    """The storage a user's ``root`` names: ``open_storage`` of a path or URL, or the
    ``Storage`` object itself, checked against the protocol (``check_storage``); anything
    else, or an empty path, is refused before anything is created."""
    if isinstance(root, (str, os.PathLike)):
        if not os.fspath(root).strip():
            raise ValueError(
                "root is an empty path: pass the checkpoint directory or URL (an unset "
                "environment variable? use '.' for the current directory)"
            )
        return open_storage(root, storage_options)
    if looks_like_storage(root):
        if storage_options:
            raise ValueError(
                "storage_options apply to URL roots; this root is a Storage object, which "
                "was made with its own options"
            )
        return check_storage(root)
    raise TypeError(
        "root must be a path (str or os.PathLike), a URL such as 's3://bucket/run', "
        f"or a Storage, got {type(root).__name__}"
    )


def open_storage(
    root: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> Storage:
    """A storage for a path or URL: ``FsspecStorage`` for ``s3://``, ``gs://``, ... (any
    fsspec URL but ``file://``), else ``LocalStorage`` with capabilities read from the
    mount table (a ``fuse.s3fs`` mount has no atomic directory rename).

    Object-store URLs name keys literally: no pattern (``[``, ``*``, ``?``) and no
    ``%`` escape in them is interpreted (as in the AWS CLI and s3fs). Local roots are
    normalised by ``local_root``; one that records the Accelerate layout (or its
    ``checkpoints/`` folder) opens as a ``project.ProjectStorage``."""
    text = os.fspath(root)
    if is_url(text):
        from .fsspec import FsspecStorage  # imports fsspec: only for URL roots

        return FsspecStorage(text, storage_options)
    if storage_options:
        raise ValueError(
            f"storage_options apply to URL roots (s3://, gs://, ...), not to the local "
            f"path {text!r}"
        )
    path = local_root(text)
    # An Accelerate project directory (or its checkpoints/ folder) keeps Accelerate's
    # names on disk: opened through the view that its layout record asks for.
    view = open_project(path, lambda p: LocalStorage(p, capabilities=local_capabilities(p)))
    if view is not None:
        return view
    return LocalStorage(path, capabilities=local_capabilities(path))
