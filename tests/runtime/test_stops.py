"""A rank's stop: signals become ``Stopped`` (after a checkpoint being written), and a
checkpoint request ends the RL loop at the next step boundary, after saving it."""

from __future__ import annotations

import os
import signal

import pytest

from hybridflow.runtime import loop, stops
from launch.reaper import REQUEST_FILE
from tests.runtime.test_pieces import _fake_session, _graph_raising_at


@pytest.fixture
def handlers():
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    stops.install()
    yield
    stops._State.pending = None
    for sig, handler in previous.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_raises_stopped(handlers, sig) -> None:
    with pytest.raises(stops.Stopped) as stopped:
        os.kill(os.getpid(), sig)
    assert stopped.value.signum == sig and signal.Signals(sig).name in str(stopped.value)


@pytest.mark.claim("stop-mid-checkpoint")
def test_a_signal_during_a_checkpoint_waits_for_its_end(handlers) -> None:
    written = []
    with pytest.raises(stops.Stopped):
        with stops.deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            written.append("state.json")  # the save goes on to its end
    assert written == ["state.json"]


def test_a_save_that_fails_under_a_pending_stop_is_a_stop(handlers) -> None:
    with pytest.raises(stops.Stopped):
        with stops.deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            raise EOFError("the save's helper process was signalled too")
    with pytest.raises(EOFError):  # without a stop, an error is an error
        with stops.deferred():
            raise EOFError


def _loop_without_ranks(monkeypatch, tmp_path, steps: int):
    """(graph, session, the steps its update ran) of a loop with no process group or GPUs."""
    graph, update, calls = _graph_raising_at(-1)
    monkeypatch.setitem(loop.OPS, "fake_update", update)
    monkeypatch.setattr(loop.dist, "barrier", lambda: None)
    monkeypatch.setattr(loop.switches, "enter", lambda s, mode: None)
    s = _fake_session("stop", steps=steps)
    s.run.rank, s.run.out_dir = 0, tmp_path
    return graph, s, calls


@pytest.mark.claim("checkpoint-on-demand")
def test_a_checkpoint_request_saves_the_step_and_leaves_the_loop(monkeypatch, tmp_path) -> None:
    graph, s, calls = _loop_without_ranks(monkeypatch, tmp_path, steps=5)
    saved = []

    def save(step):
        saved.append(step)
        if step == 2:  # asked while step 3 runs (the Slurm script before the time limit)
            stops.request_checkpoint(tmp_path)

    s.cfg.run.checkpoint_every = 2
    assert loop.train_rl(s, graph, save=save) is False
    assert calls == [0, 1, 2] and saved == [2, 3] and s.run.state.step == 3
    assert not (tmp_path / REQUEST_FILE).exists()  # a resumed start must not stop again


def test_without_a_request_the_loop_runs_to_the_end(monkeypatch, tmp_path) -> None:
    graph, s, calls = _loop_without_ranks(monkeypatch, tmp_path, steps=3)
    assert loop.train_rl(s, graph, save=lambda step: None) is True
    assert calls == [0, 1, 2]


def test_the_schedule_saves_every_n_and_the_last_step_and_a_request_never_at_the_last(tmp_path) -> None:
    due = [stops.checkpoint_due(tmp_path, done=d, total=5, every=2, is_driver=True, group=None) for d in range(1, 6)]
    assert due == [(False, False), (True, False), (False, False), (True, False), (True, False)]
    assert stops.checkpoint_due(tmp_path, done=3, total=5, every=0, is_driver=True, group=None) == (False, False)
    stops.request_checkpoint(tmp_path)
    assert stops.checkpoint_due(tmp_path, done=3, total=5, every=0, is_driver=True, group=None) == (False, True)
    assert stops.checkpoint_due(tmp_path, done=5, total=5, every=0, is_driver=True, group=None) == (True, False)
    assert stops.checkpoint_due(tmp_path, done=3, total=5, every=0, is_driver=False, group=None) == (False, False)
