"""Public twins take one parameter list: ``save_async`` takes ``save``'s,
``async_save_dcp`` ``save_dcp``'s, ``AtomicCheckpointCallback`` ``make_atomic``'s (and
``catalog.validate_consistent`` ``validate``'s). The list is stated once
(``_params.parameters_of``); these tests hold what users see of it: ``help()`` and
``inspect.signature`` show every parameter with its default, a misspelt or missing
argument raises the ``TypeError`` a plain function raises (before anything runs), and
a twin called with only some options gets the documented defaults for the rest."""

from __future__ import annotations

import inspect
import pydoc

import numpy as np
import pytest

from atomic_checkpoint import CheckpointManager, KeepLast
from atomic_checkpoint._params import parameters_of
from atomic_checkpoint.catalog import validate, validate_consistent


def _params(fn, skip_first: bool = False) -> list[tuple[str, object, object]]:
    ps = list(inspect.signature(fn).parameters.values())
    if skip_first:
        ps = ps[1:]
    return [(p.name, p.kind, p.default) for p in ps]


def test_save_async_shows_the_parameters_of_save_in_help_and_signature():
    assert _params(CheckpointManager.save_async) == _params(CheckpointManager.save)
    assert inspect.signature(CheckpointManager.save_async).return_annotation == "SaveHandle"
    text = pydoc.render_doc(CheckpointManager.save_async, renderer=pydoc.plaintext)
    assert "metrics: 'Mapping[str, SupportsFloat] | None' = None" in text
    assert "replicated: 'bool' = False, overwrite: 'bool' = False) -> 'SaveHandle'" in text


def test_the_integrations_twins_show_their_originals_parameters():
    dcp = pytest.importorskip("atomic_checkpoint.integrations.dcp")
    assert _params(dcp.async_save_dcp) == _params(dcp.save_dcp)
    assert "thread_count: 'int' = 1" in str(inspect.signature(dcp.async_save_dcp))
    hf = pytest.importorskip("atomic_checkpoint.integrations.hf")
    # The callback takes every option of make_atomic, the Trainer aside.
    assert _params(hf.AtomicCheckpointCallback) == _params(hf.make_atomic, skip_first=True)
    assert _params(validate_consistent) == _params(validate)


def test_a_misspelt_option_of_save_async_raises_before_anything_is_saved(tmp_path):
    with CheckpointManager(str(tmp_path / "root"), retention=KeepLast(2)) as mgr:
        with pytest.raises(TypeError, match=r"save_async\(\) got an unexpected keyword .*overwrit"):
            mgr.save_async(1, {"w": np.zeros(3)}, overwrit=True)  # type: ignore[call-arg]
        with pytest.raises(TypeError, match=r"save_async\(\) missing a required argument: .state."):
            mgr.save_async(1)  # type: ignore[call-arg]
        assert mgr.checkpoints() == []
        # The manager is not left holding a save: the next one goes ahead.
        info = mgr.save_async(1, {"w": np.ones(3)}, metrics={"loss": 0.5}).result()
        assert info.step == 1 and info.metrics == {"loss": 0.5}
        np.testing.assert_array_equal(mgr.restore(1)["w"], np.ones(3))


def test_the_twin_is_called_with_every_argument_defaults_filled_in():
    def original(a: int, b: str = "b", *, c: float = 1.5, d: object = None) -> int:
        return 0

    seen = []

    @parameters_of(original)
    def twin(a, b, *, c, d) -> list:
        seen.append((a, b, c, d))
        return seen

    assert twin(1) == [(1, "b", 1.5, None)]
    twin(2, "x", d=3)
    assert seen[-1] == (2, "x", 1.5, 3)
    assert str(inspect.signature(twin)) == (
        "(a: 'int', b: 'str' = 'b', *, c: 'float' = 1.5, d: 'object' = None) -> 'list'"
    )
    with pytest.raises(TypeError, match=r"twin\(\) got an unexpected keyword argument 'e'"):
        twin(1, e=2)
    with pytest.raises(TypeError, match="too many positional"):
        twin(1, "b", 3)


def test_first_renames_the_first_parameter_for_a_method_twin():
    def make(target: object, *, level: int = 3) -> object:
        return target

    class Twin:
        @parameters_of(make, first="self")
        def __init__(self, *, level) -> None:
            self.level = level

    assert Twin().level == 3 and Twin(level=5).level == 5
    assert str(inspect.signature(Twin)) == "(*, level: 'int' = 3) -> 'None'"
    # The renamed parameter drops the original's annotation (self is no 'object').
    assert str(inspect.signature(Twin.__init__)).startswith("(self, *, level")
    with pytest.raises(TypeError, match=r"Twin.__init__\(\) too many positional"):
        Twin(4)  # type: ignore[misc]
