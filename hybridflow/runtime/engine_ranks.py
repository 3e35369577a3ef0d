"""What an engine rank does in separate placement: follow actor rank 0's requests.

```
engine rank r (joint rank actors + r; rank r of the engines' own default group)
  wait for the model directory (actor rank 0 wrote it)
  replica k's driver (r = k * tp) starts its SGLang engine on its GPUs (r .. r + tp - 1)
  loop on the joint channel:
     ("generate", prompts, params, seed, call)  drive the replica's share of the chunks; the
                                                samples go straight to the actor DP ranks
     ("push",)                                  receive rank r's share of the reshard plan from
                                                the actor ranks, hand it to the driver's engine
     ("stop",)                                  shut the engine down
```

The engine ranks hold no model, data or optimizer: a restarted job rebuilds them from the
config, and the actor ranks' checkpoints are the run's whole state.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

from hybridflow.config import HybridflowConfig
from hybridflow.runtime import replicas
from hybridflow.runtime.channel import Channel
from hybridflow.runtime.session import start_engine
from hybridflow.runtime.sync import EngineSync

__all__ = ["serve"]

logger = logging.getLogger(__name__)


def serve(cfg: HybridflowConfig, channel: Channel) -> None:
    """Run this engine rank until actor rank 0 says stop (every engine rank calls it)."""
    from megatron_adapters.parallel import device

    model_dir = Path(channel.broadcast(None))
    replica = replicas.replica_of(cfg, dist.get_rank())
    engine = start_engine(cfg, model_dir) if replica is not None else None
    try:
        sync = EngineSync(cfg, channel=channel, device=device(), engine=engine)
        while True:
            request = channel.broadcast(None)
            if request[0] == "generate":
                _, prompts, params, seed, call = request
                replicas.generate(cfg, engine, prompts, params, seed, call=call, channel=channel, replica=replica,
                                  shard=None, device=device())
            elif request[0] == "push":
                sync.push()
            elif request[0] == "stop":
                break
            else:
                raise AssertionError(f"engine rank {dist.get_rank()}: unknown request {request[0]!r}")
    finally:
        if engine is not None:
            engine.shutdown()
    channel.barrier()
