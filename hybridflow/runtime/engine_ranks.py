"""What an engine rank does in separate placement: follow actor rank 0's requests.

```
engine rank r (joint rank actors + r; rank r of the engines' own default group)
  wait for the model directory (actor rank 0 wrote it; None: the run ended before rollout)
  replica k's driver (r = k * tp) starts its SGLang engine on its GPUs (r .. r + tp - 1)
  loop on the joint channel:
     ("generate", prompts, params, seed, call)  drive the replica's share of the chunks; the
                                                samples go straight to the actor DP ranks
     ("push",)                                  receive rank r's share of the reshard plan from
                                                the actor ranks, hand it to the driver's engine
     ("stop",)                                  shut the engine down
   asynchronous RL (``pipeline``): the buffer of started batches lives here, on the drivers
     ("start", batch, prompts, params, seed, segment, version)
                                                generate the batch now, keep its samples
                                                (partial rollouts: its first segment, tagged)
     ("advance", version, segment)              partial rollouts, as the actor trains: the kept
                                                batches' unfinished requests go a segment on
     ("collect", batch)                         deliver them to the actor DP ranks
     ("intervals",)                             report when this rank generated since last asked
     ("save_buffer", dir) / ("load_buffer", dir)  the kept samples to / from a checkpoint
```

Requests run in the order announced: a push announced after a start lands after that batch is
generated, so every batch samples with the version it was started under.

A driver whose engine is lost in a generate call or a push is restarted inside that call, with
every actor and engine rank (``recovery``): the call's gather tells every process which engines
were lost, the driver starts a new engine, the actor ranks push it their weights (no
announcement: every process is already in the call) and the call runs again. A lost engine in a
``start`` is not restarted: ``collect`` stops the run naming why (``replicas.ASYNC_LOST``).

The engine ranks hold no model, data or optimizer: a restarted job rebuilds them from the
config, and the actor ranks' checkpoints are the run's whole state.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from hybridflow.config import HybridflowConfig
from hybridflow.runtime import replicas
from hybridflow.runtime.channel import Channel
from hybridflow.runtime.engine_client import EngineClient
from hybridflow.runtime.recovery import EngineRestarts
from hybridflow.runtime.session import start_engine
from hybridflow.runtime.sync import EngineSync
from hybridflow.runtime.trainers import trainer_of

__all__ = ["BUFFER_FILE", "serve"]

BUFFER_FILE = "async_buffer_replica"
"""A checkpoint's saved buffer: one file per replica driver, ``<BUFFER_FILE><replica>.pt``."""

logger = logging.getLogger(__name__)


def serve(cfg: HybridflowConfig, channel: Channel) -> None:
    """Run this engine rank until actor rank 0 says stop (every engine rank calls it)."""
    announced = channel.broadcast(None)
    if announced is None:  # the run ended before its rollout began (run.mode=sft, or a stop during SFT)
        channel.barrier()
        return
    model_dir = Path(announced)
    replica = replicas.replica_of(cfg, dist.get_rank())
    held = EngineClient(cfg, model_dir, replica, start_engine(cfg, model_dir) if replica is not None else None)
    try:
        held.sync = EngineSync(cfg, channel=channel, device=trainer_of(cfg).device(), engines=held)
        restarts = held.restarts = EngineRestarts(held)  # the actor ranks count the restarts in their metrics
        held.sync.restarts = restarts
        buffer = _Buffer(cfg, held, channel)
        while True:
            request = channel.broadcast(None)
            if request[0] == "generate":
                _, prompts, params, seed, call = request
                replicas.generate(
                    cfg,
                    held.engine,
                    prompts,
                    params,
                    seed,
                    call=call,
                    channel=channel,
                    replica=replica,
                    shard=None,
                    device=trainer_of(cfg).device(),
                    restarts=restarts,
                )
            elif request[0] == "push":
                held.sync.push()
            elif request[0] == "stop":
                break
            elif request[0] in _Buffer.REQUESTS:
                getattr(buffer, request[0])(*request[1:])
            else:
                raise AssertionError(f"engine rank {dist.get_rank()}: unknown request {request[0]!r}")
    finally:
        if held.engine is not None:
            held.engine.shutdown()
    channel.barrier()


class _Buffer:
    """The batches this driver generated ahead of the trainer (asynchronous RL), by batch index;
    every engine rank follows the requests, only a driver holds samples."""

    REQUESTS = ("start", "advance", "collect", "intervals", "save_buffer", "load_buffer")

    def __init__(self, cfg: HybridflowConfig, held: EngineClient, channel: Channel) -> None:
        self.cfg, self.held, self.replica, self.channel = cfg, held, held.replica, channel
        self.kept: dict[int, replicas.Started] = {}
        self.busy: list[tuple[float, float]] = []

    @property
    def engine(self):
        """The driver's engine as it is now (a restart replaces it), or None."""
        return self.held.engine

    def start(
        self, batch: int, prompts, params, seed: int, segment: int | None = None, version: int | None = None
    ) -> None:
        if self.engine is not None:
            started = replicas.start(
                self.cfg,
                self.engine,
                prompts,
                params,
                seed,
                call=f"async/{batch}",
                channel=self.channel,
                replica=self.replica,
                segment=segment,
                version=version,
            )
            self.kept[batch] = started
            if started.report.interval is not None:
                self.busy.append(started.report.interval)

    def advance(self, version: int, segment: int) -> None:
        """The engine holds policy ``version`` while the actor trains it: the batch collected at
        the next step runs to its end, and the unfinished requests of the later batches that an
        older version generated go ``segment`` tokens further."""
        for batch in sorted(self.kept) if self.engine is not None else ():
            if batch == version + 1:
                self._continue(batch, version, None)
            elif self.kept[batch].version != version:
                self._continue(batch, version, segment)

    def _continue(self, batch: int, version: int, segment: int | None) -> None:
        if self.kept[batch].unfinished():
            self.kept[batch], interval = replicas.advance(self.engine, self.kept[batch], version, segment=segment)
            self.busy.append(interval)

    def collect(self, batch: int, num_prompts: int) -> None:
        """Deliver batch ``batch``; a partial rollout's requests left unfinished (none after the
        previous step's advance) first run to their end with the weights held now (``batch``)."""
        if batch in self.kept:
            self._continue(batch, batch, None)
        replicas.collect(
            self.cfg,
            self.kept.pop(batch, None),
            num_prompts=num_prompts,
            channel=self.channel,
            shard=None,
            device=trainer_of(self.cfg).device(),
        )

    def intervals(self) -> None:
        self.channel.gather(self.busy)
        self.busy = []

    def save_buffer(self, directory: str) -> None:
        if self.engine is not None and self.kept:
            torch.save(self.kept, Path(directory) / f"{BUFFER_FILE}{self.replica}.pt")
        self.channel.barrier()  # written before actor rank 0 publishes the checkpoint

    def load_buffer(self, directory: str) -> None:
        """This driver's saved batches, and those of saved replicas past today's count (a resumed
        run with fewer replicas): replica j's file goes to driver j % num_replicas."""
        if self.engine is not None:
            count = self.cfg.rollout.num_replicas
            for path in sorted(Path(directory).glob(f"{BUFFER_FILE}*.pt")):
                if int(path.stem[len(BUFFER_FILE) :]) % count == self.replica:
                    for batch, started in torch.load(path, weights_only=False).items():
                        self.kept[batch] = self.kept[batch].merged(started) if batch in self.kept else started
        self.channel.barrier()
