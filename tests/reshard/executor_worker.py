"""torchrun worker (4 processes): a real megatron-core actor resharded into SGLang layouts.

1. Random full Hugging Face weights of a tiny Qwen3-MoE (the oracle's, scaled to sane sizes)
   are sliced into each Megatron rank's parameters by the test oracle and copied into a real
   ``megatron_adapters`` policy built under TP2 x EP2 (names and shapes must match exactly).
2. The policy's log-probs on a batch are recorded, and rank 0 records transformers' own
   Qwen3-MoE log-probs on the same full weights: equal log-probs show the Megatron-side layout
   (qkv interleave, [gate; up], expert ownership) is the one megatron-core really uses.
3. For SGLang tp=2 and tp=2 ep=2, with the SGLang ranks on processes 0-1 (colocated with
   Megatron ranks 0-1) and on processes 2-3, the executor moves the plan from the policy's
   live parameters into zeroed SGLang-layout buffers, with checksum verification. Each process
   records its buffers' differences from the oracle's SGLang slices and the bytes it received.

Each process writes ``<out>/rank<r>.pt``.
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..", "..")))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "megatron_adapters"))

import oracle  # noqa: E402
from families import tiny  # noqa: E402

from hfschema.layout import ParallelLayout  # noqa: E402
from hfschema.train import TrainConfig  # noqa: E402
from megatron_adapters import parallel  # noqa: E402
from megatron_adapters.export import global_named_parameters  # noqa: E402
from megatron_adapters.policy import MegatronPolicy  # noqa: E402
from reshard.executor import ProcessMap, execute  # noqa: E402
from reshard.megatron import megatron_layout  # noqa: E402
from reshard.planner import plan_reshard  # noqa: E402
from hfschema.sglang import SGLangSettings  # noqa: E402
from reshard.sglang import sglang_layout  # noqa: E402
from reshard.topology import Device, Topology  # noqa: E402

LAYOUT = ParallelLayout(tp=2, ep=2, dp=2)
CASES = {
    "tp2_colocated": (SGLangSettings(tp=2), (0, 1)),
    "tp2_other_ranks": (SGLangSettings(tp=2), (2, 3)),
    "tp2ep2_colocated": (SGLangSettings(tp=2, ep=2), (0, 1)),
    "tp2ep2_other_ranks": (SGLangSettings(tp=2, ep=2), (2, 3)),
}


def full_weights(model) -> dict[str, np.ndarray]:
    """The oracle's random HF tensors, scaled like a trained model's (norms near 1)."""
    hf = oracle.hf_checkpoint(model, seed=3)
    return {k: (1.0 + 0.1 * v if "norm" in k else 0.05 * v).astype(np.float32) for k, v in hf.items()}


def load_into_policy(policy: MegatronPolicy, model, hf) -> None:
    wanted = oracle.megatron_params(model, LAYOUT, hf, dist.get_rank())
    params = dict(policy.chunks[0].module.named_parameters())
    if set(wanted) != set(params):
        raise AssertionError(
            f"name mismatch: oracle-only {sorted(set(wanted) - set(params))[:5]}, "
            f"megatron-only {sorted(set(params) - set(wanted))[:5]}"
        )
    with torch.no_grad():
        for name, value in wanted.items():
            if tuple(params[name].shape) != value.shape:
                raise AssertionError(f"{name}: megatron {tuple(params[name].shape)} vs oracle {value.shape}")
            params[name].copy_(torch.from_numpy(value))


def hf_logprobs(model, hf, ids: torch.Tensor) -> torch.Tensor:
    """transformers' own Qwen3-MoE on the full weights (saved and loaded as a checkpoint)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=model.vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_kv_heads,
        head_dim=model.kv_channels,
        moe_intermediate_size=model.moe_ffn_hidden_size,
        num_experts=model.num_experts,
        num_experts_per_tok=model.moe_top_k,
        norm_topk_prob=True,
        rms_norm_eps=model.norm_eps,
        rope_theta=model.rope_theta,
        max_position_embeddings=model.max_position_embeddings,
        tie_word_embeddings=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        save_file({k: torch.from_numpy(v).contiguous() for k, v in hf.items()}, os.path.join(tmp, "model.safetensors"))
        net = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(net(ids).logits.float(), dim=-1)
    return torch.cat([torch.zeros(ids.shape[0], 1), logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)], 1)


def reshard_case(policy, model, hf, settings: SGLangSettings, dst_processes: tuple[int, ...]) -> dict:
    source = megatron_layout(model, LAYOUT, dtype="float32")
    destination = sglang_layout(model, settings, dtype="float32")
    topology = Topology(
        source=tuple(Device(node=0, gpu=p) for p in range(LAYOUT.world_size)),
        destination=tuple(Device(node=0, gpu=p) for p in dst_processes),
    )
    plan = plan_reshard(source, destination, topology)
    processes = ProcessMap(source=tuple(range(LAYOUT.world_size)), destination=dst_processes)
    _, dst_rank = processes.roles(dist.get_rank())
    buffers = {}
    if dst_rank is not None:
        buffers = {n: torch.zeros(s) for n, s in destination.param_shapes(dst_rank).items()}
    report = execute(
        plan,
        processes,
        sources=global_named_parameters(policy),
        destinations=buffers,
        bucket_bytes=16 << 10,
        verify=True,
    )
    result = {"report": report.as_dict(), "dst_rank": dst_rank}
    if dst_rank is not None:
        expected = oracle.sglang_params(model, settings, hf, dst_rank)
        result["names_match"] = set(expected) == set(buffers)
        result["max_diff"] = max(
            float((buffers[n] - torch.from_numpy(np.ascontiguousarray(v))).abs().max()) for n, v in expected.items()
        )
        remote = (plan.route_dst == dst_rank) & (plan.route_kind != 0)
        result["plan_bytes_received"] = int(plan.route_nbytes()[remote].sum())
        result["needed_bytes"] = sum(
            destination.shard_nbytes(s) for shards in destination.shards.values() for s in shards if dst_rank in s.ranks
        )
        result["full_model_bytes"] = sum(v.nbytes for v in hf.values())
    return result


def main() -> None:
    out = sys.argv[1]
    parallel.init_default_group()
    model = tiny("qwen3_moe")
    hf = full_weights(model)
    pg = parallel.initialize(LAYOUT, seed=5)
    policy = MegatronPolicy(model, LAYOUT, TrainConfig(micro_batch_size=1, global_batch_size=4), pg_collection=pg)
    load_into_policy(policy, model, hf)
    ids = torch.randint(0, model.vocab_size, (4, 16), generator=torch.Generator().manual_seed(11))
    result = {"megatron_logp": policy.forward_logprobs({"input_ids": ids})[0]}
    if dist.get_rank() == 0:
        result["hf_logp"] = hf_logprobs(model, hf, ids)
    for name, (settings, dst) in CASES.items():
        result[name] = reshard_case(policy, model, hf, settings, dst)
    torch.save(result, os.path.join(out, f"rank{dist.get_rank()}.pt"))
    parallel.teardown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
