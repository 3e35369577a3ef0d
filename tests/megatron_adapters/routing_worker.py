"""torchrun worker (2 processes): routing replay, router statistics and router freezing.

One set of random HF weights (the reshard oracle's) goes into a megatron-core Qwen3-MoE actor
(fp32) and into transformers' own Qwen3-MoE, which serves as the rollout engine (the project's HF
engine, bf16, sampling with a KV cache, returning the experts it routed to):

``replay`` (EP=2 x DP=2): the actor scores the engine's samples without replay (recording its own
routes) and with the engine's routes replayed; the engine-vs-trainer log-prob mismatch of both,
the share of tokens whose experts the trainer dispatched equal to the replayed ones, and the
actor's recorded routes against transformers' fp32 router (an independent implementation of the
same routing). Then R2: two training steps replay the recorded routes; the second runs on
updated weights, and every token of every layer must still go to its recorded experts. The
distributed statistics are checked against the pure functions applied to the gathered table.
``tp2`` (TP=2, sequence parallel, odd length so the policy pads) and ``pp2`` (PP=2: each stage
holds two of the four MoE layers): recorded routes equal transformers' and replay is exact, which
checks the per-rank sequence slice and the layer numbering.
``frozen`` (EP=2 x DP=2): a frozen router keeps its weight (Qwen3-MoE) and its weight and expert
bias (DeepSeek-V3) bit-identical through an RL step, while an unfrozen one moves both; the
expert bias travels through the reshard plan into SGLang's ``e_score_correction_bias``; aux and
z losses train.

Rank 0 writes the numbers to ``argv[1]`` (JSON); each rank prints ``OK <scenario> rank <r>``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from functools import partial

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..", "..")))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import megatron_adapters  # noqa: E402,F401
from families import tiny  # noqa: E402
from hfschema.layout import ParallelLayout  # noqa: E402
from hfschema.train import MoEConfig, TrainConfig  # noqa: E402
from hybridflow.rollout.base import SamplingParams  # noqa: E402
from hybridflow.rollout.hf_engine import HFEngine  # noqa: E402
from hybridflow.rollout.tokens import pack_batch  # noqa: E402
from megatron_adapters import parallel  # noqa: E402
from megatron_adapters.export import global_named_parameters  # noqa: E402
from megatron_adapters.policy import MegatronPolicy  # noqa: E402
from moe.stats import load_imbalance, tokens_per_expert  # noqa: E402
from tests.reshard import oracle  # noqa: E402

EP2 = ParallelLayout(ep=2, dp=2)
TP2 = ParallelLayout(tp=2)
PP2 = ParallelLayout(pp=2)
PROMPTS = int(os.environ.get("ROUTING_PROMPTS", "8"))
SAMPLES = 2


# ----------------------------------------------------------------------------- weights and engine


def hf_weights(model) -> dict[str, np.ndarray]:
    """The oracle's random HF tensors, scaled like a trained model's (norms near 1)."""
    hf = oracle.hf_checkpoint(model, seed=3)
    return {k: (1.0 + 0.1 * v if "norm" in k else 0.05 * v).astype(np.float32) for k, v in hf.items()}


def load(policy: MegatronPolicy, model, layout, hf) -> None:
    wanted = oracle.megatron_params(model, layout, hf, dist.get_rank())
    params = global_named_parameters(policy)  # the oracle names layers globally, as the export does
    with torch.no_grad():
        for name, value in wanted.items():
            params[name].copy_(torch.from_numpy(value))


def transformers_model(model, hf, dtype: torch.dtype):
    """transformers' Qwen3-MoE with the same weights (through a checkpoint: its loader fuses the
    per-expert tensors into its in-memory layout)."""
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
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=None,
    )
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        save_file({k: torch.from_numpy(v).contiguous() for k, v in hf.items()}, os.path.join(tmp, "model.safetensors"))
        return AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).eval()


def rollout_batch(model, hf, *, odd_length: bool = False) -> dict[str, torch.Tensor]:
    """The bf16 HF engine's samples (rank 0), packed with its routes and log-probs, on every rank."""
    box = [None]
    if dist.get_rank() == 0:
        engine = HFEngine(
            transformers_model(model, hf, torch.bfloat16),
            max_context=model.max_position_embeddings,
            seed=7,
            return_routed_experts=True,
        )
        generator = torch.Generator().manual_seed(11)
        prompts = [
            torch.randint(1, model.vocab_size, (int(n),), generator=generator).tolist()
            for n in torch.randint(4, 9, (PROMPTS,), generator=generator)
        ]
        out = engine.generate(prompts, SamplingParams(n=SAMPLES, temperature=1.0, max_new_tokens=12))
        length = max(len(s.prompt_ids) + len(s.response_ids) for s in out.samples)
        box = [pack_batch(out.samples, pad_id=0, max_length=length + (odd_length and length % 2 == 0))]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def transformers_routes(model, hf, ids_BT: torch.Tensor) -> torch.Tensor:
    """``[B, T, L, k]`` experts of transformers' fp32 router on the same tokens (teacher forced)."""
    net = transformers_model(model, hf, torch.float32)
    with torch.no_grad():
        out = net.model(input_ids=ids_BT, output_router_logits=True)
    k = model.moe_top_k
    return torch.stack(
        [torch.topk(layer, k, dim=-1).indices.reshape(*ids_BT.shape, k) for layer in out.router_logits], dim=2
    )


def policy(model, layout, pg, moe: MoEConfig, *, lr: float = 1e-2, micro: int = 2) -> MegatronPolicy:
    torch.manual_seed(5)
    return MegatronPolicy(
        model,
        layout,
        TrainConfig(micro_batch_size=micro, global_batch_size=PROMPTS * SAMPLES, lr=lr),
        pg_collection=pg,
        moe=moe,
    )


def _loss(logp, entropy, micro):
    mask = micro["response_mask"]
    return -(logp * mask).sum(), mask.sum(), {}


def _mismatch(logp_BT, engine_BT, mask_BT) -> dict[str, float]:
    diff = (logp_BT - engine_BT).abs()[mask_BT.bool()]
    return {"mean": float(diff.mean()), "max": float(diff.max()), "tokens_over_0.05": int((diff > 0.05).sum())}


def _agreement(table_a, table_b, valid_BT) -> float:
    same_BTL = (table_a.sort(-1).values == table_b.sort(-1).values).all(-1)
    return float(same_BTL[valid_BT.bool()].float().mean())


# ----------------------------------------------------------------------------- scenarios


def replay(pg) -> dict:
    model = tiny("qwen3_moe")
    hf = hf_weights(model)
    batch = rollout_batch(model, hf)
    actor = policy(model, EP2, pg, MoEConfig(routing_replay="r2"))
    load(actor, model, EP2, hf)
    plain = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    logp_off, _ = actor.forward_logprobs(plain, record_routes=True)
    recorded = actor.routing.take_recorded()
    natural = actor.routing.pop_metrics()
    natural_counts = actor.routing.last_stats["logprob"].counts()
    logp_on, _ = actor.forward_logprobs({**plain, "routed_experts": batch["routed_experts"]})
    replayed = actor.routing.pop_metrics()
    valid = batch["attention_mask"]
    engine_routed = (batch["routed_experts"] >= 0).all(-1).all(-1) & valid.bool()
    result = {
        "rows": int(valid.shape[0]),
        "real_tokens": int(valid.sum()),
        "layers": int(recorded.shape[2]),
        "response_tokens": int(batch["response_mask"].sum()),
        "mismatch_without_replay": _mismatch(logp_off, batch["logprobs"], batch["response_mask"]),
        "mismatch_with_replay": _mismatch(logp_on, batch["logprobs"], batch["response_mask"]),
        "engine_vs_trainer_topk_mismatch": replayed["moe/logprob/topk_mismatch"],
        "engine_vs_trainer_topk_mismatch_any_layer": replayed["moe/logprob/topk_mismatch_any_layer"],
        "replay_match_engine_routes": replayed["moe/logprob/replay_match"],
        "recorded_vs_transformers_fp32": _agreement(
            recorded, transformers_routes(model, hf, batch["input_ids"]), valid
        ),
        "engine_routes_vs_recorded": _agreement(recorded, batch["routed_experts"], engine_routed),
    }
    result["stats_match_pure_functions"] = _check_stats(natural, natural_counts, recorded, valid, model.num_experts)
    result.update(_r2_training(actor, batch, recorded))
    return result


def _check_stats(metrics: dict, counts_LE, recorded_BTLk, valid_BT, num_experts: int) -> bool:
    """The all-reduced statistics (both ranks' tokens) equal the pure functions on the gathered table."""
    for layer in range(recorded_BTLk.shape[2]):
        counts = tokens_per_expert(recorded_BTLk[:, :, layer][valid_BT.bool()], num_experts)
        peak, cv = load_imbalance(counts)
        got = metrics[f"moe/logprob/layer{layer}/load_max_mean"], metrics[f"moe/logprob/layer{layer}/load_cv"]
        if not torch.equal(counts.double(), counts_LE[layer]) or got != (peak, cv):
            return False
    return True


def _r2_training(actor: MegatronPolicy, batch, recorded) -> dict:
    """R2: replay the recorded routes in two training steps; the second runs on updated weights."""
    rows = {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "response_mask": batch["response_mask"],
        "routed_experts": recorded,
    }
    first = actor.train_step(rows, _loss)
    actor.routing.pop_metrics()
    second = actor.train_step(rows, _loss)
    stats = actor.routing.pop_metrics()
    totals = actor.routing.last_stats["train"].totals()
    return {
        "r2_train_replay_match": stats["moe/train/replay_match"],
        "r2_train_pairs_compared": totals["replayed"],
        "r2_train_pairs_matched": totals["matched"],
        "r2_train_natural_vs_recorded_mismatch": stats["moe/train/topk_mismatch"],
        "r2_losses": [first.loss, second.loss],
    }


def model_parallel(layout: ParallelLayout, pg) -> dict:
    """Recording and self-replay under TP=2 (sequence parallel) or PP=2 (layers split in stages)."""
    model = tiny("qwen3_moe")
    hf = hf_weights(model)
    batch = rollout_batch(model, hf, odd_length=True)
    actor = policy(model, layout, pg, MoEConfig(routing_replay="r3"))
    load(actor, model, layout, hf)
    plain = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    logp_off, _ = actor.forward_logprobs(plain, record_routes=True)
    recorded = actor.routing.take_recorded()
    logp_self, _ = actor.forward_logprobs({**plain, "routed_experts": recorded})
    metrics = actor.routing.pop_metrics()
    return {
        "length": int(batch["input_ids"].shape[1]),
        "recorded_vs_transformers_fp32": _agreement(
            recorded, transformers_routes(model, hf, batch["input_ids"]), batch["attention_mask"]
        ),
        "self_replay_max_logp_diff": float((logp_self - logp_off).abs().max()),
        "self_replay_match": metrics["moe/logprob/replay_match"],
    }


def _router_state(p: MegatronPolicy) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in global_named_parameters(p).items() if ".router." in k}


def _step_changes(p: MegatronPolicy, batch) -> dict[str, bool]:
    """Which router tensors an RL step changed (name -> changed), and whether anything else did."""
    before = {k: v.clone() for k, v in global_named_parameters(p).items()}
    assert p.train_step(batch, _loss).applied
    after = global_named_parameters(p)
    routers = {k: not torch.equal(before[k], after[k]) for k in before if ".router." in k}
    others = any(not torch.equal(before[k], after[k]) for k in before if ".router." not in k)
    return {"router": routers, "others_changed": others}


def frozen(pg) -> dict:
    out = {}
    ids = torch.randint(1, 250, (PROMPTS * SAMPLES, 12), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "response_mask": torch.ones(ids.shape)}
    for family in ("qwen3_moe", "deepseek_v3"):
        for freeze in (True, False):
            p = policy(tiny(family), EP2, pg, MoEConfig(freeze_router=freeze, expert_bias_update_rate=1e-2))
            with torch.no_grad():  # a non-zero bias, so "unchanged" is not "still zero"
                for name, value in global_named_parameters(p).items():
                    if name.endswith("expert_bias"):
                        value.copy_(torch.randn(value.shape, generator=torch.Generator().manual_seed(1)))
            out[f"{family}_{'frozen' if freeze else 'trained'}"] = _step_changes(p, batch)
    out["expert_bias_through_reshard"] = _bias_reshard(pg)
    out["aux_z_loss_changes_router_update"] = _aux_losses(pg, batch)
    return out


def _bias_reshard(pg) -> bool:
    """DeepSeek-V3's expert bias reaches SGLang's e_score_correction_bias through the plan."""
    from reshard.executor import ProcessMap, execute
    from reshard.megatron import megatron_layout
    from reshard.planner import plan_reshard
    from hfschema.sglang import SGLangSettings
    from reshard.sglang import sglang_layout
    from reshard.topology import Device, Topology

    model = tiny("deepseek_v3")
    p = policy(model, EP2, pg, MoEConfig())
    named = global_named_parameters(p)
    with torch.no_grad():
        for name, value in named.items():
            if name.endswith("expert_bias"):
                value.copy_(torch.arange(value.numel(), dtype=value.dtype) + int(name.split(".")[2]) * 10)
    named = global_named_parameters(p)
    destination = sglang_layout(model, SGLangSettings(tp=1), dtype="float32")
    topology = Topology(source=(Device(node=0, gpu=0), Device(node=0, gpu=1)), destination=(Device(node=0, gpu=0),))
    plan = plan_reshard(megatron_layout(model, EP2, dtype="float32"), destination, topology)
    buffers = {}
    if dist.get_rank() == 0:
        buffers = {n: torch.zeros(s) for n, s in destination.param_shapes(0).items()}
    execute(
        plan,
        ProcessMap(source=(0, 1), destination=(0,)),
        sources=named,
        destinations=buffers,
        bucket_bytes=1 << 20,
        verify=True,
    )
    if dist.get_rank() != 0:
        return True
    biases = {n: t for n, t in buffers.items() if n.endswith("e_score_correction_bias")}
    layers = range(model.first_k_dense_layers, model.num_layers)
    expected = {
        f"model.layers.{i}.mlp.gate.e_score_correction_bias": named[f"decoder.layers.{i}.mlp.router.expert_bias"]
        for i in layers
    }
    return set(biases) == set(expected) and all(torch.equal(biases[n], expected[n]) for n in expected)


def _aux_losses(pg, batch) -> bool:
    """Aux and z losses add router gradients: one step moves the router differently."""
    model = tiny("qwen3_moe")
    moved = []
    for moe in (MoEConfig(), MoEConfig(aux_loss_coef=1.0, z_loss_coef=1.0)):
        p = policy(model, EP2, pg, moe)
        assert p.train_step(batch, _loss).applied
        moved.append(_router_state(p))
    return any(not torch.equal(moved[0][k], moved[1][k]) for k in moved[0])


SCENARIOS = {
    "replay": (EP2, replay),
    "tp2": (TP2, partial(model_parallel, TP2)),
    "pp2": (PP2, partial(model_parallel, PP2)),
    "frozen": (EP2, frozen),
}

if __name__ == "__main__":
    parallel.init_default_group()
    results = {}
    for name in sys.argv[2:]:
        layout, run = SCENARIOS[name]
        group = parallel.initialize(layout, seed=1)
        results[name] = run(group)
        parallel.teardown()
        os.write(1, f"OK {name} rank {dist.get_rank()}\n".encode())
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()
