"""The public API is stable: ``atomic_checkpoint.__all__`` changes only on purpose.

Removing or renaming a public name breaks users' imports: this list must be edited in
the same change, with a note in the README (and a deprecation path for a removal).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import atomic_checkpoint
from atomic_checkpoint.errors import CheckpointError

PUBLIC = {
    # managers and their records
    "CheckpointManager", "CheckpointInfo", "Tier", "TieredCheckpointInfo",
    "TieredCheckpointManager", "adopt", "AdoptResult", "register_framework",
    "SaveHandle",  # what save_async returns: a type users annotate with
    # retention
    "RetentionPolicy", "KeepAll", "KeepBest", "KeepEvery", "KeepLast", "AnyOf", "Pin",
    # storage and coordination
    "Storage", "StorageCapabilities", "LocalStorage", "FsspecStorage", "MemoryStorage",
    "open_storage", "Coordinator", "SingleProcessCoordinator",
    "TorchDistributedCoordinator",
    # preemption
    "PreemptionGuard", "REQUEUE_EXIT_CODE",
    # errors
    "CheckpointError", "CheckpointNotFoundError", "CheckpointExistsError", "StepOrderError",
    "CorruptCheckpointError", "UnsafeCheckpointError", "UnsupportedSchemaError",
    "SerializationError", "StorageError", "StorageFullError", "StoragePermissionError",
    "CommitError", "CoordinationTimeoutError", "CollectiveMismatchError", "RankFailure",
    "DistributedCheckpointError", "DistributedStorageFullError",
    "DistributedStateMismatchError",
    "LockError", "LockHeldError", "FencedError", "ResumeError", "ReadOnlyError",
    "SaveAbandonedError", "StateMismatchError",
    "__version__",
}  # fmt: skip


def test_all_is_the_documented_public_api():
    assert set(atomic_checkpoint.__all__) == PUBLIC
    assert len(atomic_checkpoint.__all__) == len(set(atomic_checkpoint.__all__))
    for name in PUBLIC:
        assert getattr(atomic_checkpoint, name) is not None, name


def test_every_error_the_package_raises_is_exported_from_the_top_level():
    # An exception users may need to catch must be importable from atomic_checkpoint
    # and be a CheckpointError, so `except CheckpointError` catches everything we raise.
    errors = {}
    for mod in pkgutil.walk_packages(atomic_checkpoint.__path__, "atomic_checkpoint."):
        if mod.name.startswith("atomic_checkpoint.integrations") or mod.name.endswith("__main__"):
            continue  # framework imports; their errors are the package's own
        module = importlib.import_module(mod.name)
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == module.__name__
                and not name.startswith("_")
            ):
                errors[name] = obj
    errors.pop("CliError", None)  # the command line's own exit path, never raised to users
    missing = sorted(n for n in errors if n not in atomic_checkpoint.__all__)
    assert missing == [], f"public exceptions not exported from atomic_checkpoint: {missing}"
    assert all(issubclass(e, CheckpointError) for e in errors.values())


def test_a_type_checker_sees_the_lazy_exports_and_no_other_name(tmp_path):
    # The package's module __getattr__ made mypy accept any name (a typo such as
    # KeepLastt passed, then failed at import) and typed FsspecStorage as `object`.
    from mypy import api  # requirements/dev.txt

    user = tmp_path / "user.py"
    user.write_text(
        "from atomic_checkpoint import FsspecStorage, SaveHandle, KeepLastt\n"
        "from atomic_checkpoint.storage import LocalStorag\n"
        "reveal_type(FsspecStorage)\n"
        "def done(h: SaveHandle) -> None: ...\n"
    )
    out, _, _ = api.run([str(user), "--ignore-missing-imports", "--no-incremental"])
    assert 'Module "atomic_checkpoint" has no attribute "KeepLastt"' in out, out
    assert 'has no attribute "LocalStorag"' in out, out
    assert "-> atomic_checkpoint.storage.fsspec.FsspecStorage" in out, out
    assert "SaveHandle" not in out, out  # a valid type
