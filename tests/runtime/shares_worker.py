"""torchrun worker for test_shares.py: the sample exchange and the batch-wide statistics.

Every rank builds the same synthetic batch (seeded), so it can check its own share against the
whole. Writes ``rank{r}.json`` into the output directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hybridflow.algorithms.estimators import get_estimator
from hybridflow.algorithms.losses import masked_whiten
from hybridflow.config import AlgorithmConfig
from hybridflow.rollout.base import RolloutSample
from hybridflow.runtime.exchange import deliver, meta_of
from hybridflow.runtime.shares import Shard, owner

PROMPTS, N = 7, 3
"""7 prompts x 3 samples: 7 does not split evenly over 2 or 4 DP ranks."""


def batch(routes: bool) -> list[RolloutSample]:
    g = torch.Generator().manual_seed(5)
    out = []
    for p in range(PROMPTS):
        prompt = tuple(torch.randint(0, 1000, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist())
        for k in range(N):
            length = int(torch.randint(1, 9, (1,), generator=g))
            response = tuple(torch.randint(0, 1000, (length,), generator=g).tolist())
            logprobs = tuple(torch.rand(length, generator=g).neg().tolist())
            experts = torch.randint(0, 8, (len(prompt) + length - 1, 2, 2), generator=g) if routes else None
            out.append(
                RolloutSample(
                    prompt_index=p,
                    sample_index=k,
                    prompt_ids=prompt,
                    response_ids=response,
                    logprobs=logprobs,
                    finish_reason="stop" if k else "length",
                    routed_experts=experts,
                )
            )
    return out


def main() -> None:
    out_dir, tp = Path(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank, dp_size = rank // tp, world // tp
    everything = batch(routes=True)
    # two drivers: rank 0 generated the even prompts, the last rank the odd ones
    drivers = {
        0: [x for x in everything if x.prompt_index % 2 == 0],
        world - 1: [x for x in everything if x.prompt_index % 2 == 1],
    }
    metas = [[meta_of(x) for x in drivers.get(r, [])] for r in range(world)]
    got = deliver(
        drivers.get(rank, []),
        metas,
        [r // tp for r in range(world)],
        lambda m: owner(m.prompt_index, PROMPTS, dp_size),
        device=torch.device("cpu"),
    )
    mine = [i for i, x in enumerate(everything) if owner(x.prompt_index, PROMPTS, dp_size) == dp_rank]
    same = [
        a.prompt_ids == b.prompt_ids
        and a.response_ids == b.response_ids
        and a.logprobs == tuple(torch.tensor(b.logprobs, dtype=torch.float32).tolist())
        and a.finish_reason == b.finish_reason
        and torch.equal(a.routed_experts, b.routed_experts)
        for a, b in zip(got.samples, [everything[i] for i in mine])
    ]

    shard = Shard(dp_rank=dp_rank, dp_size=dp_size, leader=rank % tp == 0, group=dist.new_group(backend="gloo"))
    g = torch.Generator().manual_seed(9)
    x, mask = torch.randn(len(everything), 6, generator=g), torch.rand(len(everything), 6, generator=g) > 0.3
    rows = torch.tensor(mine, dtype=torch.long)
    whole = masked_whiten(x, mask)
    split = masked_whiten(x[rows], mask[rows], split=shard)
    scores = (torch.rand(len(everything), generator=g) > 0.5).float()
    groups = torch.tensor([s.prompt_index for s in everything])
    rewards = torch.zeros(len(everything), 6)
    rewards[:, -1] = scores
    cfg = AlgorithmConfig()
    estimates = {}
    for name in ("grpo", "gpg", "reinforce_plus_plus_baseline"):
        full, _ = get_estimator(name)(rewards, torch.ones_like(mask), index=groups, cfg=cfg)
        part, _ = get_estimator(name)(
            rewards[rows], torch.ones_like(mask[rows]), index=groups[rows], cfg=cfg, split=shard
        )
        estimates[name] = float((full[rows] - part).abs().max())
    gathered = shard.gather(rows, scores[rows], len(everything))
    result = {
        "positions": list(got.positions),
        "expected": mine,
        "same": same,
        "received_bytes": got.received_bytes,
        "metas": len(got.metas),
        "whiten_diff": float((whole[rows] - split).abs().max()),
        "estimator_diff": estimates,
        "gather_equal": bool(torch.equal(gathered, scores)),
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
