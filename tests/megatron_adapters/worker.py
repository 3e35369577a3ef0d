"""torchrun worker for the megatron-core equivalence tests.

Run as ``torchrun --standalone --nproc-per-node N worker.py TASKS.json``. Each task in the
JSON list names a ``kind`` (a function below) and its arguments; every rank runs every task
and rank 0 writes each task's result to ``<out>``.pt. One process pool serves many tasks so
the ~5 s of imports is paid once per world size.

The data, loss and steps are the same in every process: a fixed batch of 4 sequences of 16
tokens and a next-token (SFT) loss over all positions but the first, token-averaged over the
global batch, so every layout computes the same gradient as one process.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from families import tiny  # noqa: E402

from hfschema.layout import ParallelLayout  # noqa: E402
from hfschema.train import TrainConfig  # noqa: E402
from hybridflow.selftest import next_token_loss  # noqa: E402
from megatron_adapters import checkpoint, parallel  # noqa: E402
from megatron_adapters.policy import MegatronPolicy  # noqa: E402
from task_pool import run_tasks  # noqa: E402

SEED = 1234
TRAIN = TrainConfig(lr=1e-3, micro_batch_size=1, global_batch_size=4, clip_grad=1.0)


def batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (4, 16), generator=g)
    mask = torch.ones(4, 16)
    mask[:, 0] = 0
    mask[3, 12:] = 0  # a shorter last sequence
    return {"input_ids": ids, "loss_mask": mask}


def layout_for(spec: dict) -> ParallelLayout:
    """The layout ``spec`` asks for, with dp filling the world."""
    world = dist.get_world_size()
    fields = {k: v for k, v in spec.items()}
    per_replica = fields.get("tp", 1) * fields.get("pp", 1) * fields.get("cp", 1)
    fields["dp"] = world // per_replica
    return ParallelLayout(**fields)


def make_policy(family: str, spec: dict) -> MegatronPolicy:
    model = tiny(family)
    layout = layout_for(spec)
    layout.check_model(model)
    pg = parallel.initialize(layout, seed=SEED)
    return MegatronPolicy(model, layout, TRAIN, pg_collection=pg)


def score(policy: MegatronPolicy) -> torch.Tensor:
    logp, _ = policy.forward_logprobs(batch(policy.model_config.vocab_size))
    return logp


def step(policy: MegatronPolicy) -> dict:
    result = policy.train_step(batch(policy.model_config.vocab_size), next_token_loss)
    return {"loss": result.loss, "grad_norm": result.grad_norm, "entropy": result.metrics["entropy"]}


# ------------------------------------------------------------------------------------- tasks


def direct_scores(policy: MegatronPolicy) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy from the full logits with plain torch ops (one process only)."""
    ids = batch(policy.model_config.vocab_size)["input_ids"]
    model = policy.chunks[0].module
    model.eval()
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
    logits = logits[..., : policy.model_config.vocab_size].float()
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)[:, :-1]
    pad = torch.zeros(ids.shape[0], 1)
    return torch.cat([pad, logp], 1), torch.cat([pad, entropy], 1)


def reference(family: str, init_dir: str) -> dict:
    """One process: save the initial weights, score, step, score."""
    policy = make_policy(family, {})
    checkpoint.save(policy, init_dir)
    direct_logp, direct_entropy = direct_scores(policy)
    logp, entropy = policy.forward_logprobs(batch(policy.model_config.vocab_size), with_entropy=True)
    stats = step(policy)
    return {
        "before": logp,
        "entropy_before": entropy,
        "after": score(policy),
        "direct_logp": direct_logp,
        "direct_entropy": direct_entropy,
        **stats,
    }


def equivalence(family: str, spec: dict, init_dir: str) -> dict:
    """Load the reference's initial weights under ``spec``: score, step, score."""
    policy = make_policy(family, spec)
    checkpoint.load(policy, init_dir)
    before, entropy = policy.forward_logprobs(batch(policy.model_config.vocab_size), with_entropy=True)
    stats = step(policy)
    return {"before": before, "entropy_before": entropy, "after": score(policy), **stats}


def train_and_save(family: str, spec: dict, init_dir: str, save_dir: str, steps: int, more: int) -> dict:
    """Train ``steps`` steps, save with optimizer state, train ``more`` steps (uninterrupted)."""
    policy = make_policy(family, spec)
    checkpoint.load(policy, init_dir)
    for _ in range(steps):
        step(policy)
    at_save = score(policy)
    checkpoint.save(policy, save_dir, with_optimizer=True, step=steps)
    continued = [step(policy) for _ in range(more)]
    return {"at_save": at_save, "continued": continued, "final": score(policy)}


def resume(family: str, spec: dict, save_dir: str, more: int) -> dict:
    """A fresh policy resumes from ``save_dir`` with its optimizer state."""
    policy = make_policy(family, spec)
    meta = checkpoint.load(policy, save_dir, with_optimizer=True)
    resumed = [step(policy) for _ in range(more)]
    return {"meta_step": meta["step"], "continued": resumed, "final": score(policy)}


def load_weights(family: str, spec: dict, save_dir: str) -> dict:
    """Score a checkpoint's weights under another layout."""
    policy = make_policy(family, spec)
    checkpoint.load(policy, save_dir)
    return {"logp": score(policy)}


def load_optimizer_error(family: str, spec: dict, save_dir: str) -> dict:
    """Loading optimizer state across an EP=1 / EP>1 boundary must raise a clear ValueError."""
    policy = make_policy(family, spec)
    try:
        checkpoint.load(policy, save_dir, with_optimizer=True)
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


def global_layers(family: str, spec: dict) -> dict:
    """Global layer numbers of rank 0's parameters under ``spec`` (export names)."""
    from megatron_adapters.export import global_named_parameters

    names = global_named_parameters(make_policy(family, spec))
    return {
        "layers": sorted({int(n.split(".")[2]) for n in names if n.startswith("decoder.layers.")}),
        "names": sorted(names),
    }


def fused_scores(seed: int) -> dict:
    """``token_scores`` with the vocabulary split over every rank (the TP group is the world):
    each rank's log-probs and entropy, and the gradient of a loss weighing both gathered over the
    vocabulary, beside the same computed in one piece (``tests/megatron_adapters/test_logprobs.py``)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from test_logprobs import case  # the single-process test's inputs and reference

    from megatron_adapters.logprobs import token_scores

    logits, labels, weight_logp, weight_entropy = (t.to(parallel.device()) for t in case(seed))
    rank, world = dist.get_rank(), dist.get_world_size()
    local = logits.shape[-1] // world
    mine = logits[..., rank * local : (rank + 1) * local].clone().requires_grad_(True)
    logp, entropy = token_scores(mine, labels, vocab_size=250, tp_group=dist.group.WORLD, with_entropy=True)
    (logp * weight_logp + entropy * weight_entropy).sum().backward()
    grads = [torch.empty_like(mine.grad) for _ in range(world)]
    dist.all_gather(grads, mine.grad)
    return {"logp": logp.detach(), "entropy": entropy.detach(), "grad": torch.cat(grads, dim=-1)}


TASKS = {
    f.__name__: f
    for f in (
        reference,
        equivalence,
        train_and_save,
        resume,
        load_weights,
        load_optimizer_error,
        global_layers,
        fused_scores,
    )
}


def main() -> None:
    run_tasks(lambda task: TASKS[task.pop("kind")](**task))


if __name__ == "__main__":
    main()
