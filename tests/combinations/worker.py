"""Many matrix cells in one torchrun job: ``python -m launch.torchrun_entry --standalone
--nproc-per-node=N -m tests.combinations.worker JOBS_FILE``, the cells of one shape (the worlds
``hybridflow.config.job_worlds`` gives: the actor's ranks, and the engines' when separate).

Each rank does per cell what ``hybridflow train``'s ranks do in processes of their own
(``hybridflow.runtime.worker.main``: an actor rank ``run``s, an engine rank ``serve``s), but the
imports, the rendezvous and the default group are paid once: a cell costs its own run (a few
seconds) instead of a process start (about ten). Megatron's groups are built again for each cell
(``trainer.initialize`` tears the last ones down), and each cell's channel keys the job's store
under the cell's name: the runtime counts its calls from 1 in every run and keys the store by
them (``replicas._Counter``), so a second run on one store would find its first calls' chunks
taken already.

A cell that raises on any rank ends the job: that rank writes ``<name>.crash`` (the traceback)
and exits at once, and torchrun stops the others, which may be waiting in a collective for it.
The caller (``tests.combinations.matrix``) starts a new job at the next cell. A cell that
finishes leaves ``<name>.done``; ``<name>.started`` tells which cell a job died in.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import traceback
from pathlib import Path

import torch.distributed as dist

from hfschema.files import write_atomic
from hybridflow.config import load_config
from hybridflow.runtime import console, determinism
from hybridflow.runtime.channel import Channel, GroupLink, join
from hybridflow.runtime.engine_ranks import serve
from hybridflow.runtime.trainers import trainer_of
from hybridflow.runtime.worker import run


def main(jobs_file: str) -> int:
    jobs = json.loads(Path(jobs_file).read_text())
    marks, worlds = Path(jobs["marks"]), jobs["worlds"]
    first = load_config(jobs["config"], jobs["cells"][0]["overrides"])
    trainer = trainer_of(first)
    minutes = first.run.collective_timeout_minutes
    joined = None
    if len(worlds) > 1:  # as the worker's main joins them
        joined = join(worlds, timeout_minutes=minutes)
        store = dist.PrefixStore(f"{joined.world}/", joined.store)
        trainer.init_default_group(minutes, store=store, rank=joined.rank, world_size=joined.size)
    else:
        trainer.init_default_group(timeout_minutes=minutes)
    rank = int(os.environ["RANK"])
    for cell in jobs["cells"]:
        cfg = load_config(jobs["config"], cell["overrides"])
        if rank == 0:
            write_atomic(marks / f"{cell['name']}.started", "")
        determinism.apply(cfg.run.deterministic)
        console.configure(cfg.run.output_dir, rank=rank, driver=rank == 0, verbose=False)
        try:
            if joined is not None and joined.world == "engine":
                serve(cfg, _own(joined.engines, cell["name"]))
            else:
                run(cfg, _own(joined.engines, cell["name"]) if joined else _colocated(cell["name"]))
        except BaseException:
            write_atomic(marks / f"{cell['name']}.crash", f"rank {rank}:\n{traceback.format_exc()}")
            sys.stderr.flush()
            os._exit(1)  # the peers may wait in a collective: torchrun stops them
        if rank == 0:
            write_atomic(marks / f"{cell['name']}.done", "")
        _release()
    trainer.teardown()
    dist.destroy_process_group()
    return 0


def _release() -> None:
    """What a run leaves that a process of its own would free on exit: its process groups (each
    gloo group keeps its threads: 60 more a cell slowed the tenth cell of a job fivefold) and the
    objects ``worker._freeze_startup_objects`` put out of the collector's reach, collected."""
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)
    gc.unfreeze()
    # now, in this process: left to a forked engine process, a finalizer of this garbage hung
    # SGLang's scheduler in its own gc.collect() (a replica's engine that never became ready)
    gc.collect()


def _own(channel: Channel, name: str) -> Channel:
    """``channel`` with the store keyed under the cell's name."""
    return dataclasses.replace(channel, store=dist.PrefixStore(f"{name}/", channel.store))


def _colocated(name: str) -> Channel:
    """``channel.colocated()``'s channel (every process an actor rank), keyed under the cell's name."""
    store = dist.PrefixStore(f"{name}/", dist.distributed_c10d._get_default_store())
    return Channel(link=GroupLink(), store=store, actors=dist.get_world_size())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
