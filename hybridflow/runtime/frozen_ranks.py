"""What a rank of a frozen model on GPUs of its own does (``reward_model.gpus``,
``distillation.gpus``): build the model, then answer actor rank 0's requests.

```
frozen rank r (rank r of the model's own default group; joint rank A + r of its channel with the
               A actor ranks, runtime.channel.join)
  megatron-core's groups for <section>.parallel over its own ranks; the model built, each rank
  reading its own slices of the weights (while the actor ranks start, warm up and generate)
  loop on the joint channel:
     ("score", whole, {pad_id})   every sample's score [N]: the model's DP ranks score shares of
                                  the whole batch; its rank 0 answers
     ("logprobs", whole, {})      the teacher's log-probs [N, T] of every sample's tokens
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

__all__ = ["answer", "serve"]

logger = logging.getLogger(__name__)


def serve(cfg: HybridflowConfig, role: str, channel: Channel) -> None:
    """Build frozen model ``role`` on this process's world and answer until told to stop (every
    rank of the model's own GPUs calls it)."""
    from hybridflow.runtime.frozen import load_frozen
    from megatron_adapters import parallel

    layout = frozen_layout(cfg, role)
    pg = parallel.initialize(layout, seed=cfg.run.seed, prefix=frozen_layout_key(role))
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
