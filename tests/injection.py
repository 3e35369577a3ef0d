"""Faults and probes the tests inject into a real run from outside the product.

A test starts the run with ``environment(...)`` merged into its environment: ``tests/inject``
first on ``PYTHONPATH`` (its ``sitecustomize`` calls ``install`` in every Python process of the
job) and the ``HYBRIDFLOW_INJECT_*`` variables that select what to inject:

``CRASH_AT_STEP=STEP``
    each rank exits abruptly (status 17) as that RL step starts: a node failure.
``RAISE_AT_STEP=STEP:RANK``
    that rank raises as that RL step starts: a bug in one rank.
``RAISE_IN_STAGE=OP:STEP:RANK``
    that rank's op raises in that RL step, inside its stage: a bug in an op.
``REPLICA_FAILURE=K@N``
    replica K's driver fails its share of the N-th generate call of the run (its first try).
``KILL_ENGINE=K@N``
    replica K's driver SIGKILLs a scheduler process of its SGLang engine while the N-th generate
    call generates (its first try).
``KILL_ENGINE_PUSH=K@N``
    the same while replica K's driver hands its engine the N-th counted weight push (the first
    fills the engines at start).
``DUMP_LOGPROBS=FOLDER``
    each rank writes ``step_<k>/rank<r>.pt`` there at every RL step: its rows' token ids and masks
    and the trainer's log-probs (``tests/dumped_logprobs.py`` reads them).
``DISK_FULL=TEXT``
    every write to a file whose path holds the text fails with ENOSPC, as on a full file system.
``PROTOCOL_ONLY=1``
    every engine ``make_engine`` starts is handed to the runtime behind a ``ProtocolOnly`` proxy
    that has the methods of the engine protocols the engine implements (``rollout.base``) and
    nothing else: the run then shows it asks nothing more of an engine.

Each hook wraps one product function when its module is first imported (``_AFTER_IMPORT``): a
faulty engine around the real one, a step that crashes before the real one runs. The product
carries none of this.
"""

from __future__ import annotations

import builtins
import errno
import importlib.abc
import importlib.machinery
import io
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "HYBRIDFLOW_INJECT_"
CRASH_AT_STEP = PREFIX + "CRASH_AT_STEP"
RAISE_AT_STEP = PREFIX + "RAISE_AT_STEP"
RAISE_IN_STAGE = PREFIX + "RAISE_IN_STAGE"
REPLICA_FAILURE = PREFIX + "REPLICA_FAILURE"
KILL_ENGINE = PREFIX + "KILL_ENGINE"
KILL_ENGINE_PUSH = PREFIX + "KILL_ENGINE_PUSH"
DUMP_LOGPROBS = PREFIX + "DUMP_LOGPROBS"
DISK_FULL = PREFIX + "DISK_FULL"
PROTOCOL_ONLY = PREFIX + "PROTOCOL_ONLY"
CRASH_STATUS = 17

logger = logging.getLogger("tests.injection")


def environment(**selected: str) -> dict[str, str]:
    """The variables that inject ``selected`` (names without the prefix, as keyword arguments:
    ``environment(RAISE_AT_STEP="1:1")``) into every process of a job started with them."""
    path = os.pathsep.join(p for p in (str(ROOT / "tests" / "inject"), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, **{PREFIX + name: value for name, value in selected.items()}}


# --------------------------------------------------------------------------- the run's steps


def _steps(loop) -> None:
    run_step = loop.run_step

    def faulty_run_step(s, stages, step):
        index, rank = step.index, s.run.rank
        if os.environ.get(CRASH_AT_STEP) == str(index):
            logger.error("%s=%d: simulating a crash", CRASH_AT_STEP, index)
            os._exit(CRASH_STATUS)
        if os.environ.get(RAISE_AT_STEP) == f"{index}:{rank}":
            raise RuntimeError(f"{RAISE_AT_STEP}={index}:{rank}: simulated failure in rank {rank}")
        return run_step(s, stages, step)

    loop.run_step = faulty_run_step


def _ops(ops) -> None:
    if os.environ.get(DUMP_LOGPROBS):
        _dump(ops)
    if os.environ.get(RAISE_IN_STAGE):
        _raise_in_stage(ops)


def _raise_in_stage(ops) -> None:
    """Wrap the op ``RAISE_IN_STAGE`` names: at that step, on that rank, it raises inside it."""
    name, index, rank = os.environ[RAISE_IN_STAGE].split(":")
    real = ops.OPS[name]

    def raising(s, node, f, step):
        if step.index == int(index) and s.run.rank == int(rank):
            raise IndexError(f"{RAISE_IN_STAGE}={name}:{index}:{rank}: simulated bug in {name}")
        return real(s, node, f, step)

    ops.OPS[name] = raising


def _dump(ops) -> None:
    """Wrap the ``old_logprob`` op: after it, each rank saves its rows and their log-probs."""
    import torch

    old_logprob = ops.OPS["old_logprob"]

    def dumping(s, node, f, step):
        out = old_logprob(s, node, f, step)
        target = Path(os.environ[DUMP_LOGPROBS]) / f"step_{step.index:06d}" / f"rank{s.run.rank}.pt"
        if not target.exists():
            ro = f["responses"]
            rows = {key: ro.batch[key].cpu() for key in ("input_ids", "attention_mask", "response_mask", "logprobs")}
            target.parent.mkdir(parents=True, exist_ok=True)
            logprobs = out.fields["old_logprobs"].detach().cpu()
            torch.save({**rows, "trainer_logprobs": logprobs, "step": step.index}, target)
        return out

    ops.OPS["old_logprob"] = dumping


# --------------------------------------------------------------------------- engines


def kill_a_scheduler_soon(engine) -> None:
    """SIGKILL the SGLang engine's first scheduler process from a thread once the caller waits in
    the engine's next call, the one about to start; a vLLM engine's server process at once (its
    next call finds it gone)."""
    if hasattr(engine, "server_pid"):
        os.kill(engine.server_pid, signal.SIGKILL)
        return
    pid, watch = engine.watch.schedulers()[0], engine.watch

    def kill() -> None:
        while not watch.active:
            time.sleep(0.001)
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=kill, daemon=True, name="injected-engine-kill").start()


class FaultyEngine:
    """The real engine, whose next ``generate`` loses a scheduler process while it runs;
    everything else goes to the real one."""

    def __init__(self, engine) -> None:
        self._engine, self._kill = engine, True

    def generate(self, prompts, params):
        if self._kill:
            self._kill = False
            kill_a_scheduler_soon(self._engine)
        return self._engine.generate(prompts, params)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


def _replicas(replicas) -> None:
    real_attempt, real_drive = replicas._attempt, replicas._drive

    def faulty_attempt(engine, *args, replica: int, call, attempt: int, **kwargs):
        here = f"{replica}@{call}"
        if attempt == 0 and os.environ.get(KILL_ENGINE) == here:
            engine = FaultyEngine(engine)
        if attempt == 0 and os.environ.get(REPLICA_FAILURE) == here:
            # the try itself fails, before any chunk is taken: a replica that would have taken none
            # (the chunks go to whichever driver asks first) fails all the same
            replicas._drive = _failing(f"{REPLICA_FAILURE}={here}: simulated engine failure")
        try:
            return real_attempt(engine, *args, replica=replica, call=call, attempt=attempt, **kwargs)
        finally:
            replicas._drive = real_drive

    replicas._attempt = faulty_attempt


def _failing(message: str) -> Callable:
    def drive(*args, **kwargs):
        raise RuntimeError(message)

    return drive


def _sync(sync) -> None:
    push = sync.EngineSync.push

    def faulty_push(self, *, counted: bool = True, announce: bool = True):
        if self.engine is not None and counted:
            import torch.distributed as dist

            here = f"{sync.replica_of(self.cfg, dist.get_rank())}@{self.pushes + 1}"
            if os.environ.get(KILL_ENGINE_PUSH) == here:
                kill_a_scheduler_soon(self.engine)
        return push(self, counted=counted, announce=announce)

    sync.EngineSync.push = faulty_push


class ProtocolOnly:
    """An engine reduced to the protocols it implements: ``rollout.base.ENGINE_PROTOCOLS``'
    methods it has, bound to it; any other attribute is missing, as on an engine built to the
    protocols alone."""

    def __init__(self, engine) -> None:
        from hybridflow.rollout.base import ENGINE_PROTOCOLS, protocol_methods

        self.implements = [p.__name__ for p in ENGINE_PROTOCOLS if isinstance(engine, p)]
        for protocol in ENGINE_PROTOCOLS:
            if isinstance(engine, protocol):
                for name in protocol_methods(protocol):
                    setattr(self, name, getattr(engine, name))


def _protocol_only(rollout) -> None:
    make_engine = rollout.make_engine

    def reduced(name: str, **kwargs):
        engine = ProtocolOnly(make_engine(name, **kwargs))
        logger.warning("%s: the %s engine reduced to %s", PROTOCOL_ONLY, name, ", ".join(engine.implements))
        return engine

    rollout.make_engine = reduced


# --------------------------------------------------------------------------- files


class _FullDiskFile:
    """A real open file whose writes fail as a full disk's do."""

    def __init__(self, stream, name: str) -> None:
        self._stream, self._name = stream, name

    def write(self, data) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._name)

    def writelines(self, lines) -> None:
        self.write(b"")

    def __getattr__(self, attribute: str):
        return getattr(self._stream, attribute)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._stream.close()


def _fill_disk_for(text: str) -> None:
    real_open = builtins.open

    def open_(file, mode="r", *args, **kwargs):
        stream = real_open(file, mode, *args, **kwargs)
        writing = any(flag in mode for flag in "wax+")
        if writing and isinstance(file, (str, bytes, os.PathLike)) and text in os.fsdecode(file):
            return _FullDiskFile(stream, os.fsdecode(file))
        return stream

    builtins.open = io.open = open_


# --------------------------------------------------------------------------- installing


_AFTER_IMPORT: dict[str, tuple[tuple[str, ...], Callable]] = {
    "hybridflow.runtime.loop": ((CRASH_AT_STEP, RAISE_AT_STEP), _steps),
    "hybridflow.runtime.ops": ((DUMP_LOGPROBS, RAISE_IN_STAGE), _ops),
    "hybridflow.runtime.replicas": ((REPLICA_FAILURE, KILL_ENGINE), _replicas),
    "hybridflow.runtime.sync": ((KILL_ENGINE_PUSH,), _sync),
    "hybridflow.rollout": ((PROTOCOL_ONLY,), _protocol_only),
}
"""module -> (the variables that select its hook, the hook run on the module once it is loaded)."""


class _PatchedLoader(importlib.abc.Loader):
    def __init__(self, loader, hook: Callable) -> None:
        self._loader, self._hook = loader, hook

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        self._hook(module)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a hook on a module right after it is first executed."""

    def __init__(self, hooks: dict[str, Callable]) -> None:
        self._hooks = hooks

    def find_spec(self, name, path, target=None):
        hook = self._hooks.get(name)
        if hook is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchedLoader(spec.loader, hook)
        return spec


def install() -> None:
    """Install what this process's environment selects (``sitecustomize`` calls it)."""
    if os.environ.get(DISK_FULL):
        _fill_disk_for(os.environ[DISK_FULL])
    hooks = {
        module: hook for module, (names, hook) in _AFTER_IMPORT.items() if any(os.environ.get(name) for name in names)
    }
    if hooks:
        sys.meta_path.insert(0, _AfterImport(hooks))
