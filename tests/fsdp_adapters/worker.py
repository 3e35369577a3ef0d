"""One torchrun rank of tests/fsdp_adapters/test_policy.py: an FSDP2 policy over all ranks against
transformers in one process (rank 0 computes the reference), written as JSON.

    torchrun --nproc-per-node 2 tests/fsdp_adapters/worker.py OUT compare MODEL_DIR [MODEL_DIR ...]
    torchrun --nproc-per-node 2 tests/fsdp_adapters/worker.py OUT fsdp2_only MODEL_DIR [...]
    torchrun --nproc-per-node 1 tests/fsdp_adapters/worker.py OUT resume_alone MODEL_DIR [...]

(``<out>/<model dir name>*.json``: one start of the ranks serves every model.)
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_adapters.policy import FSDP2Policy
from hfschema.train import TrainConfig
from hfschema.trainer import decays, lr_at

LIFECYCLE_MODEL = "qwen3"
"""The model whose checkpoint, resume, stream and export are checked (tied embeddings: the harder one)."""
SEQUENCE_PARALLEL_MODELS = ("llama", "qwen3")
"""The dense models also compared under Ulysses sequence parallel (sp=2, dp=1), and packed."""
TRAIN = TrainConfig(lr=1e-4, weight_decay=0.1, clip_grad=0.5, micro_batch_size=2, global_batch_size=4)


def batch(vocab: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (4, 11), generator=generator)
    mask = torch.ones(4, 11)
    mask[1, 7:] = 0  # a shorter row, right-padded
    mask[3, 4:] = 0
    mask[:, 0] = 0
    ids[mask == 0] = 0
    return {"input_ids": ids, "loss_mask": mask}


def loss_fn(logp, entropy, micro):
    mask = micro["loss_mask"]
    return -(logp * mask).sum(), mask.sum(), {"entropy": (entropy * mask).sum() / mask.sum().clamp(min=1)}


def reference(
    model_dir: Path, rows: dict[str, torch.Tensor]
) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """Log-probs of the batch and the parameters after one step, as a user would write it in
    one process: transformers' model, AdamW, the loss per token over the batch, clipping."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = rows["input_ids"]

    def scores():
        logits = model(input_ids=ids).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return torch.cat([logp.new_zeros(ids.shape[0], 1), logp], dim=1)

    model.eval()
    with torch.no_grad():
        before = scores()
        logits = model(input_ids=ids).logits[:, :-1].float()
        entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
        entropy = torch.cat([entropy.new_zeros(ids.shape[0], 1), entropy], dim=1)
    model.train()
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if decays(n, tuple(p.shape))], "weight_decay": TRAIN.weight_decay},
        {"params": [p for n, p in named if not decays(n, tuple(p.shape))], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=lr_at(TRAIN, 0), betas=(TRAIN.adam_beta1, TRAIN.adam_beta2))
    loss = -(scores() * rows["loss_mask"]).sum() / rows["loss_mask"].sum()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN.clip_grad)
    optimizer.step()
    return (before, entropy), {"grad_norm": norm, **{n: p.detach().clone() for n, p in model.named_parameters()}}


def megatron_scores(model_dir: Path, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """The megatron backend's log-probs of the batch on the same weights (dp over the same ranks)."""
    from hfschema.hf_config import read_model_config
    from hfschema.layout import ParallelLayout
    from megatron_adapters import parallel
    from megatron_adapters.policy import MegatronPolicy
    from megatron_adapters.pretrained import load_hf_weights

    model = read_model_config(model_dir)
    layout = ParallelLayout(dp=dist.get_world_size())
    pg = parallel.initialize(layout, seed=0)
    policy = MegatronPolicy(model, layout, TRAIN, pg_collection=pg, trainable=False, initialize=False)
    load_hf_weights(policy, model_dir)
    return policy.forward_logprobs(rows)[0]


def _storage_bytes(policy: FSDP2Policy) -> dict[str, float]:
    """This rank's parameter and optimizer-state bytes (the storage its tensors hold) as a share of
    the whole model's parameters (x1) and Adam moments (x2)."""
    whole = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    params = sum(p.to_local().untyped_storage().nbytes() for p in policy.model.parameters())
    moments = sum(
        v.to_local().untyped_storage().nbytes()
        for state in policy.optimizer.state.values()
        for v in state.values()
        if hasattr(v, "to_local")
    )
    return {"params": params / whole, "optimizer": moments / (2 * whole)}


class _Said(logging.Handler):
    """What the loader logs (which path read the checkpoint)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _layout_matches(policy: FSDP2Policy, model_dir: Path) -> bool | None:
    """Whether every rank's local parameter shapes are those the weight sync's planner assumes
    (``reshard.fsdp.fsdp_layout``); None for MoE families, whose layout it refuses."""
    from hfschema.hf_config import read_model_config
    from hfschema.layout import ParallelLayout
    from reshard.fsdp import fsdp_layout

    mine = {n: tuple(p.to_local().shape) for n, p in policy.model.named_parameters()}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    model = read_model_config(model_dir)
    if model.is_moe:
        return None
    layout = fsdp_layout(model, ParallelLayout(dp=dist.get_world_size()), dtype="float32")
    return all(shapes == layout.param_shapes(rank) for rank, shapes in enumerate(every))


def _against_reference(model_dir: Path, rows, scores, result, after) -> dict:
    """The policy's log-probs, entropy, step and parameters after it against ``reference``'s."""
    (expected, expected_entropy), stepped = reference(model_dir, rows)
    grad_norm = float(stepped.pop("grad_norm"))
    relative = {n: float((after[n] - p).norm() / p.norm().clamp(min=1e-12)) for n, p in stepped.items() if n in after}
    differences = {
        "logprobs": float((scores[0] - expected).abs().max()),
        "entropy": float((scores[1] - expected_entropy).abs().max()),
        "grad_norm": abs(result.grad_norm - grad_norm),
        "params_relative": max(relative.values()),
        "worst": max(relative, key=relative.get),
        "names": sorted(after) == sorted(stepped),
        "tokens": result.num_tokens,
    }
    return differences


def compare(model_dir: Path, out: Path) -> None:
    said, loader = _Said(), logging.getLogger("fsdp_adapters.model")
    loader.addHandler(said)
    loader.setLevel(logging.INFO)
    policy = FSDP2Policy(model_dir, TRAIN, chunk_tokens=7)  # several chunks a micro-batch: 2 rows x 10 scored
    loader.removeHandler(said)
    said = said.lines
    rows = batch(policy.model.config.vocab_size)
    shards = _layout_matches(policy, model_dir)
    logp, entropy = policy.forward_logprobs(rows, with_entropy=True)
    megatron_logp = megatron_scores(model_dir, rows)
    result = policy.train_step(rows, loss_fn)
    held = _storage_bytes(policy)
    after = {n: p.full_tensor() for n, p in policy.model.named_parameters()}
    if dist.get_rank() == 0:
        differences = _against_reference(model_dir, rows, (logp, entropy), result, after)
        differences |= {
            "megatron_logprobs": float((logp - megatron_logp).abs().max()),
            "loss": result.loss,
            "tied": policy.model.get_output_embeddings().weight is policy.model.get_input_embeddings().weight,
            "held_share": held,
            "layout_shapes": shards,
            "read_by_rank0": any("rank 0 loads it with transformers" in line for line in said),
        }
        (out / f"{model_dir.name}.json").write_text(json.dumps(differences))


def compare_sequence_parallel(model_dir: Path, out: Path) -> None:
    """The same batch at dp=1 with Ulysses over the two ranks (sp=2): the rows' tokens split over
    the ranks (11 tokens, padded to 12), attention over the whole sequence through the all-to-alls."""
    policy = FSDP2Policy(model_dir, TRAIN, sp=2)
    rows = batch(policy.model.config.vocab_size)
    logp, entropy = policy.forward_logprobs(rows, with_entropy=True)
    result = policy.train_step(rows, loss_fn)
    after = {n: p.full_tensor() for n, p in policy.model.named_parameters()}
    if dist.get_rank() == 0:
        differences = _against_reference(model_dir, rows, (logp, entropy), result, after)
        differences["attention"] = policy.model.config._attn_implementation
        (out / f"{model_dir.name}_sp2.json").write_text(json.dumps(differences))


def compare_packed(model_dir: Path, out: Path) -> None:
    """The same rows at dp=2 unpacked, packed (a micro-batch's samples in one row) and packed to a
    token budget: the same log-probs, entropy, step and parameters after it."""
    from hfschema.packing import PackingConfig

    seen = {}
    for name, config in {
        "unpacked": None,
        "packed": PackingConfig(enabled=True),
        "budget": PackingConfig(enabled=True, max_tokens_per_micro_batch=12),
    }.items():
        policy = FSDP2Policy(model_dir, TRAIN, packing=config)
        rows = batch(policy.model.config.vocab_size)
        logp, entropy = policy.forward_logprobs(rows, with_entropy=True)
        result = policy.train_step(rows, loss_fn)
        seen[name] = (logp, entropy, result, {n: p.full_tensor() for n, p in policy.model.named_parameters()})
    if dist.get_rank() == 0:
        base = seen.pop("unpacked")
        marked = rows["loss_mask"].bool()  # packing scores a row up to its last marked token (0 after it)
        report = {
            name: {
                "logprobs": float((logp - base[0])[marked].abs().max()),
                "entropy": float((entropy - base[1])[marked].abs().max()),
                "loss": abs(result.loss - base[2].loss),
                "tokens": [result.num_tokens, base[2].num_tokens],
                "params": max(float((after[n] - base[3][n]).abs().max()) for n in after),
            }
            for name, (logp, entropy, result, after) in seen.items()
        }
        report["moved"] = max(float((base[3][n] - p).abs().max()) for n, p in _initial(model_dir).items())
        (out / f"{model_dir.name}_packed.json").write_text(json.dumps(report))


def _initial(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())


def lifecycle(model_dir: Path, out: Path) -> None:
    """Checkpoint after a step, resume at dp=2 and at dp=1, stream the weights in buckets, export
    a Hugging Face directory: each against the run that was not interrupted."""
    from fsdp_adapters import checkpoint
    from fsdp_adapters.export import hf_buckets, save_hf_directory

    first = FSDP2Policy(model_dir, TRAIN)
    rows = batch(first.model.config.vocab_size)
    later = {**rows, "input_ids": rows["input_ids"].roll(1, dims=1)}
    first.train_step(rows, loss_fn)
    saved = checkpoint.save(first, out / f"{model_dir.name}_step1", with_optimizer=True, step=1)
    after_one = {n: p.full_tensor() for n, p in first.model.named_parameters()}
    first.train_step(later, loss_fn)
    after_two = {n: p.full_tensor() for n, p in first.model.named_parameters()}
    resumed = FSDP2Policy(model_dir, TRAIN)
    checkpoint.load(resumed, saved, with_optimizer=True)
    resumed.train_step(later, loss_fn)
    again = {n: p.full_tensor() for n, p in resumed.model.named_parameters()}
    buckets = list(hf_buckets(resumed, bucket_bytes=4096))
    exported = save_hf_directory(resumed, out / f"{model_dir.name}_hf", source=model_dir)
    steps = [first.steps, resumed.steps]
    undone = _rolled_back(resumed, later)  # last: it steps the policy on
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        torch.save(after_one, out / f"{model_dir.name}_after_one.pt")  # for the dp=1 resume
        loaded = dict(AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).named_parameters())
        streamed = [(n, t) for bucket in buckets for n, t in bucket]
        report = {
            "resume_max_abs": max(float((again[n] - after_two[n]).abs().max()) for n in after_two),
            "steps": steps,
            "stream_names": [n for n, _ in streamed] == list(again),
            "stream_max_abs": max(float((t - again[n]).abs().max()) for n, t in streamed),
            "stream_buckets": len(buckets),
            "stream_bucket_bytes": max(sum(t.numel() * t.element_size() for _, t in b) for b in buckets if len(b) > 1),
            "export_max_abs": max(float((loaded[n] - again[n]).abs().max()) for n in again),
            "export_files": sorted(p.name for p in exported.iterdir()),
            "moved": max(float((after_two[n] - after_one[n]).abs().max()) for n in after_one),
            **undone,
        }
        (out / f"{model_dir.name}_lifecycle.json").write_text(json.dumps(report))
    dist.barrier()


def _rolled_back(policy: FSDP2Policy, rows) -> dict:
    """A step undone (``snapshot`` / ``rollback``, a failed RL step's undo) leaves the weights,
    the Adam moments and the schedule as they were: the same step taken again lands where the
    undone one did. Also from a fresh optimizer (no moments yet)."""
    seen = {}
    for name, target in (("trained", policy), ("fresh", FSDP2Policy(policy.source, TRAIN))):
        before = {n: p.full_tensor() for n, p in target.model.named_parameters()}
        steps, snap = target.steps, target.snapshot()
        target.train_step(rows, loss_fn)
        undone = {n: p.full_tensor() for n, p in target.model.named_parameters()}
        target.rollback(snap)
        back = {n: p.full_tensor() for n, p in target.model.named_parameters()}
        back_steps = target.steps
        target.train_step(rows, loss_fn)
        again = {n: p.full_tensor() for n, p in target.model.named_parameters()}
        seen[f"rollback_{name}"] = {
            "back_max_abs": max(float((back[n] - before[n]).abs().max()) for n in before),
            "again_max_abs": max(float((again[n] - undone[n]).abs().max()) for n in undone),
            "moved": max(float((undone[n] - before[n]).abs().max()) for n in before),
            "steps": [steps, back_steps],
        }
    return seen


def resume_alone(model_dir: Path, out: Path) -> None:
    """One rank loads the checkpoint two ranks wrote (DCP reshards): the weights after step 1."""
    from fsdp_adapters import checkpoint

    single = FSDP2Policy(model_dir, TRAIN)
    checkpoint.load(single, out / f"{model_dir.name}_step1", with_optimizer=True)
    expected = torch.load(out / f"{model_dir.name}_after_one.pt")
    got = {n: p.full_tensor() for n, p in single.model.named_parameters()}
    report = {"max_abs": max(float((got[n] - t).abs().max()) for n, t in expected.items()), "steps": single.steps}
    (out / f"{model_dir.name}_dp1.json").write_text(json.dumps(report))


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    for model_dir in map(Path, sys.argv[3:]):
        if mode == "resume_alone":
            resume_alone(model_dir, out)
        elif mode == "fsdp2_only":  # no megatron-core in this process: its CPU modes stay out of the way
            if model_dir.name in SEQUENCE_PARALLEL_MODELS:
                compare_sequence_parallel(model_dir, out)
                compare_packed(model_dir, out)
            if model_dir.name == LIFECYCLE_MODEL:
                lifecycle(model_dir, out)
        else:
            compare(model_dir, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
