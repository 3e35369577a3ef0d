"""torchrun worker (2 processes): a megatron-core EP=2 actor, its weights resharded for SGLang.

``export MODEL_DIR OUT``: the actor takes the model directory's weights (sliced per Megatron
rank by the reshard test oracle and copied into a real ``megatron_adapters`` policy), then the
reshard executor moves them from the live parameters into SGLang tp=2 per-rank tensors
(SGLang rank r on process r). Each process saves ``OUT/rank<r>.pt`` with its tensors and the
bytes the plan assigns to it.

``score MODEL_DIR OUT SEQS``: the same actor recomputes per-token log-probs of the sequences in
``SEQS`` (a torch file with ``input_ids [B, T]``); rank 0 saves ``OUT/actor_logp.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from hfschema.layout import ParallelLayout  # noqa: E402
from hfschema.train import TrainConfig  # noqa: E402
from hybridflow.rollout.tiny import to_hybridflow_model_config  # noqa: E402
from megatron_adapters import parallel  # noqa: E402
from megatron_adapters.export import global_named_parameters  # noqa: E402
from megatron_adapters.policy import MegatronPolicy  # noqa: E402
from reshard.executor import ProcessMap, execute  # noqa: E402
from reshard.megatron import megatron_layout  # noqa: E402
from reshard.planner import plan_reshard  # noqa: E402
from hfschema.sglang import SGLangSettings  # noqa: E402
from reshard.sglang import sglang_layout  # noqa: E402
from reshard.topology import Device, Topology  # noqa: E402
from tests.reshard import oracle  # noqa: E402

LAYOUT = ParallelLayout(ep=2, dp=2)
SETTINGS = SGLangSettings(tp=2)


def actor(model_dir: str):
    model = to_hybridflow_model_config(model_dir)
    hf = load_file(str(Path(model_dir) / "model.safetensors"))
    pg = parallel.initialize(LAYOUT, seed=0)
    policy = MegatronPolicy(model, LAYOUT, TrainConfig(micro_batch_size=1, global_batch_size=2), pg_collection=pg)
    wanted = oracle.megatron_params(model, LAYOUT, hf, dist.get_rank())
    params = global_named_parameters(policy)
    assert set(wanted) == set(params), sorted(set(wanted) ^ set(params))[:5]
    with torch.no_grad():
        for name, value in wanted.items():
            params[name].copy_(torch.from_numpy(value))
    return model, policy


def export(model_dir: str, out: str) -> None:
    model, policy = actor(model_dir)
    source = megatron_layout(model, LAYOUT, dtype="float32")
    destination = sglang_layout(model, SETTINGS, dtype="float32")
    topology = Topology(
        source=(Device(node=0, gpu=0), Device(node=0, gpu=1)),
        destination=(Device(node=0, gpu=0), Device(node=0, gpu=1)),
    )
    plan = plan_reshard(source, destination, topology)
    me = dist.get_rank()
    buffers = {n: torch.zeros(s) for n, s in destination.param_shapes(me).items()}
    report = execute(
        plan,
        ProcessMap(source=(0, 1), destination=(0, 1)),
        sources=global_named_parameters(policy),
        destinations=buffers,
        bucket_bytes=1 << 20,
        verify=True,
    )
    share = sum(destination.shard_nbytes(s) for shards in destination.shards.values() for s in shards if me in s.ranks)
    torch.save(
        {"tensors": buffers, "plan_share_bytes": share, "report": report.as_dict()}, os.path.join(out, f"rank{me}.pt")
    )


def score(model_dir: str, out: str, seqs: str) -> None:
    _, policy = actor(model_dir)
    ids = torch.load(seqs)["input_ids"]
    logp, _ = policy.forward_logprobs({"input_ids": ids}, micro_batch_size=1)
    if dist.get_rank() == 0:
        torch.save(logp, os.path.join(out, "actor_logp.pt"))


if __name__ == "__main__":
    parallel.init_default_group()
    {"export": export, "score": score}[sys.argv[1]](*sys.argv[2:])
    parallel.teardown()
    dist.destroy_process_group()
