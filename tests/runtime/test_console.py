"""``runtime.console``: the terminal keeps the run's own lines, the log files keep everything."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from hybridflow.runtime import console


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(False)
    console._Settings.args = None


def _emit() -> None:
    logging.getLogger("hybridflow.train").info("own note")
    logging.getLogger("megatron_adapters.checkpoint").info("adapter note")
    logging.getLogger("megatron_adapters.checkpoint").warning("adapter warning")
    logging.getLogger("megatron.core.optimizer").info("Params for bucket 1")
    logging.getLogger("sglang.srt.entrypoints.engine").error("engine error")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("full scope is deprecated", UserWarning, stacklevel=1)


@pytest.mark.claim("quiet-terminal")
@pytest.mark.parametrize("verbose", [False, True])
def test_the_terminal_shows_the_runs_own_lines_and_the_file_keeps_every_record(
    tmp_path: Path, capsys, restore_logging, verbose: bool
) -> None:
    path = console.configure(tmp_path, rank=0, driver=True, verbose=verbose)
    _emit()
    for handler in logging.getLogger().handlers:
        handler.flush()
    terminal, kept = capsys.readouterr().err, path.read_text()
    assert path == tmp_path / "logs" / "rank0.log"
    for line in ("own note", "adapter warning", "engine error"):
        assert line in terminal, terminal
    assert ("adapter note" in terminal) == ("Params for bucket" in terminal) == verbose, terminal
    for line in ("own note", "adapter note", "Params for bucket 1", "engine error"):
        assert line in kept
    assert ("full scope is deprecated" in kept) != verbose  # quiet: the warning is a record in the file


def test_another_rank_shows_warnings_only(tmp_path: Path, capsys, restore_logging) -> None:
    console.configure(tmp_path, rank=1, driver=False, verbose=False)
    _emit()
    terminal = capsys.readouterr().err
    assert "own note" not in terminal and "adapter warning" in terminal and "engine error" in terminal


def test_an_engines_processes_write_to_the_engine_log_and_the_terminal_comes_back(tmp_path: Path) -> None:
    """A child started inside ``engine_output`` keeps writing to the engine log after the block."""
    child = "import time; time.sleep(0.5); print('from the engine', flush=True)"
    script = f"""
CHILD = {child!r}
import subprocess, sys, time
from hybridflow.runtime import console
with console.engine_output({str(tmp_path)!r}, 3, verbose=False):
    child = subprocess.Popen([sys.executable, "-c", CHILD])
    print("started", flush=True)
print("back on the terminal", flush=True)
child.wait()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "back on the terminal\n"
    assert (tmp_path / "logs" / "engine_rank3.log").read_text() == "started\nfrom the engine\n"
