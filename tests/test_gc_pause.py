"""``hfschema.gc_pause``: start-up imports with the cyclic collector paused, and frozen after."""

from __future__ import annotations

import gc
import subprocess
import sys
import types

import pytest

from hfschema import gc_pause


@pytest.fixture
def restored_gc():
    """The suite's own process keeps its collector as it was: on, nothing frozen by these tests."""
    frozen = gc.get_freeze_count()
    yield
    gc.enable()
    if gc.get_freeze_count() > frozen:
        gc.unfreeze()  # back into the oldest generation: collected as before


def test_the_collector_is_off_inside_and_on_after_and_nothing_is_frozen_without_an_import(restored_gc) -> None:
    gc.enable()
    frozen = gc.get_freeze_count()
    with gc_pause.paused():
        assert not gc.isenabled()
        with gc_pause.paused():  # nested: still off when the inner block ends
            pass
        assert not gc.isenabled()
        made = [[] for _ in range(1000)]
    assert gc.isenabled() and made
    assert gc.get_freeze_count() == frozen


def test_a_block_that_imports_freezes_what_was_made_and_a_disabled_collector_stays_off(restored_gc) -> None:
    gc.enable()
    name, frozen = "hybridflow_test_gc_pause_module", gc.get_freeze_count()
    with gc_pause.paused():
        sys.modules[name] = types.ModuleType(name)  # what an import does to sys.modules
        kept = {"made": "during the import"}
    try:
        assert gc.isenabled()
        assert gc.get_freeze_count() > frozen
        assert all(kept is not o for o in gc.get_objects())  # frozen: out of every generation
        gc.disable()
        with gc_pause.paused():
            pass
        assert not gc.isenabled()  # it restores, it does not turn on
    finally:
        del sys.modules[name]


def test_importing_the_worker_as_a_module_leaves_the_collector_on() -> None:
    """Only a rank's main (``python -m hybridflow.runtime.worker``) starts with it off."""
    code = "import gc, hybridflow.runtime.worker; assert gc.isenabled() and gc.get_freeze_count() == 0"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
