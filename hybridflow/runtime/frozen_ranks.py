"""What a rank of a frozen model on GPUs of its own does (``reward_model.gpus``,
``distillation.gpus``, ``judge.gpus``): build the model, then answer actor rank 0's requests.

```
frozen rank r (rank r of the model's own default group; joint rank A + r of its channel with the
               A actor ranks, runtime.channel.join)
  megatron-core's groups for <section>.parallel over its own ranks; the model built, each rank
  reading its own slices of the weights (while the actor ranks start, warm up and generate)
  loop on the joint channel:
     ("score", whole, {pad_id})   every sample's score [N]: the model's DP ranks score shares of
                                  the whole batch; its rank 0 answers
     ("logprobs", whole, {})      the teacher's log-probs [N, T] of every sample's tokens
     ("generate", ids, {})        a judge's reply text to each request (token ids): the first
                                  rank of each replica's judge.tp ranks drives an engine, the
                                  replicas take consecutive shares, the judge's rank 0 answers
     ("stop", ...)                leave (the run ended; actor rank 0 sends it in every ending
                                  but a failure, after which torchrun stops every process)
```

The actor ranks start a request (``frozen.Remote.start``: the whole batch's token ids, small
beside the model) and collect its answer later (``Remote.result``), so a reward model scores
while the actor ranks compute their log-probs (``recipes.with_reward_model``).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from hybridflow.config import HybridflowConfig, frozen_layout, frozen_layout_key
from hybridflow.runtime.channel import Channel

__all__ = ["answer", "serve", "share"]

logger = logging.getLogger(__name__)


def serve(cfg: HybridflowConfig, role: str, channel: Channel) -> None:
    """Build frozen model ``role`` on this process's world and answer until told to stop (every
    rank of the model's own GPUs calls it)."""
    from hybridflow.runtime.frozen import load_frozen
    from hybridflow.runtime.trainers import trainer_of

    if role == "judge":
        return _serve_judge(cfg, channel)
    layout = frozen_layout(cfg, role)
    pg = trainer_of(cfg).initialize(layout, seed=cfg.run.seed, prefix=frozen_layout_key(role))
    model = load_frozen(cfg, role, layout, pg)
    logger.info("rank %d: %s built under %s on GPUs of its own", dist.get_rank(), role, layout.describe())
    while True:
        kind, whole, options = channel.broadcast(None)
        if kind == "stop":
            break
        result = answer(model, kind, whole, micro_rows=cfg.train.micro_batch_size, **options)
        channel.broadcast(result if dist.get_rank() == 0 else None, src=channel.actors)
    channel.barrier()


def answer(model, kind: str, whole: dict[str, torch.Tensor], *, micro_rows: int, pad_id: int | None = None):
    """``model``'s answer to one request on the whole batch ``whole`` (every rank of the model
    computes it; the DP ranks take shares): scores [N] or log-probs [N, T], on the host."""
    from hybridflow.runtime.frozen import in_micro_batches

    rows = whole["input_ids"].shape[0]
    device = model.device
    inputs = {k: v.to(device) for k, v in in_micro_batches(whole, model, micro_rows).items()}
    if kind == "score":
        return model.forward_scores(inputs, pad_id)[:rows].float().cpu()
    if kind == "logprobs":
        logp, _ = model.forward_logprobs(inputs, with_entropy=False)
        return logp[:rows].cpu()
    raise ValueError(f"a frozen model's rank got an unknown request {kind!r}")


def _serve_judge(cfg: HybridflowConfig, channel: Channel) -> None:
    """A judge on GPUs of its own: ``judge.gpus / judge.tp`` replicas, each driven by its first
    rank (its engine's schedulers take the replica's other GPUs; those ranks only wait)."""
    from hybridflow.runtime.frozen import start_judge

    tp, rank, size = cfg.judge.tp, dist.get_rank(), dist.get_world_size()
    replica, replicas = rank // tp, size // tp
    judge = start_judge(cfg) if rank % tp == 0 else None
    if judge is not None:
        logger.info("rank %d: judge replica %d of %d started on GPUs of its own", rank, replica, replicas)
    try:
        while True:
            kind, ids, _ = channel.broadcast(None)
            if kind == "stop":
                break
            if kind != "generate":
                raise ValueError(f"a judge's rank got an unknown request {kind!r}")
            mine = share(ids, replica, replicas)
            texts = judge.submit(cfg, mine).texts() if judge is not None and mine else []
            parts: list = [None] * size
            dist.all_gather_object(parts, texts)
            whole = [text for part in parts[::tp] for text in part]
            channel.broadcast(whole if rank == 0 else None, src=channel.actors)
    finally:
        if judge is not None:
            judge.engine.shutdown()
    channel.barrier()


def share(items: list, replica: int, replicas: int) -> list:
    """Replica ``replica``'s consecutive share of ``items`` (sizes differ by at most one)."""
    return items[replica * len(items) // replicas : (replica + 1) * len(items) // replicas]
