"""torchrun worker for the LoRA tests (``test_lora.py``): tasks as in ``worker.py``.

One process trains LoRA adapters two steps from a saved initial state (base weights and
adapters) and records log-probs, losses, the adapters' gradients and values; the other layouts
load the same state and must record the same. The batch and loss are ``worker.py``'s.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from families import tiny  # noqa: E402
from worker import TRAIN, batch, layout_for  # noqa: E402

from hfschema.lora import LoRAConfig  # noqa: E402
from hybridflow.selftest import next_token_loss  # noqa: E402
from megatron_adapters import checkpoint, parallel  # noqa: E402
from megatron.core.tensor_parallel.layers import ColumnParallelLinear  # noqa: E402

from megatron_adapters.lora import adapted_modules, adapter_state, is_adapter, local_slice, merged_weights  # noqa: E402
from megatron_adapters.policy import MegatronPolicy, _torch_optimizers  # noqa: E402
from task_pool import run_tasks  # noqa: E402

SEED = 1234
# whole gradients in main_grad (no reduce-scatter) so that they can be compared
LORA_TRAIN = dataclasses.replace(TRAIN, use_distributed_optimizer=False)


def make_policy(family: str, spec: dict, targets: list[str] | None, dropout: float = 0.0) -> MegatronPolicy:
    model = tiny(family)
    layout = layout_for(spec)
    pg = parallel.initialize(layout, seed=SEED)
    lora = LoRAConfig(enabled=True, rank=4, alpha=8.0, target_modules=targets, dropout=dropout) if targets else None
    return MegatronPolicy(model, layout, LORA_TRAIN, pg_collection=pg, lora=lora)


def _base(policy: MegatronPolicy) -> dict[str, torch.Tensor]:
    """The base's parameters and its routers' expert bias (base state megatron moves itself)."""
    params = {
        f"{i}.{n}": p.detach().clone()
        for i, c in enumerate(policy.chunks)
        for n, p in c.named_parameters()
        if not is_adapter(n)
    }
    return params | {
        f"{i}.{n}": b.clone()
        for i, c in enumerate(policy.chunks)
        for n, b in c.named_buffers()
        if n.endswith("expert_bias")
    }


def train_two_steps(policy: MegatronPolicy) -> dict:
    data = batch(policy.model_config.vocab_size)
    out = {"logp_before": policy.forward_logprobs(data)[0], "steps": []}
    base = _base(policy)
    for _ in range(2):
        result = policy.train_step(data, next_token_loss)
        out["steps"].append(
            {"loss": result.loss, "grad_norm": result.grad_norm, "grads": adapter_state(policy, grads=True)}
        )
    out["logp_after"] = policy.forward_logprobs(data)[0]
    out["adapters"] = adapter_state(policy)
    out["merge_error"] = _merge_error(policy, out["adapters"])
    after = _base(policy)
    out["base_identical"] = all(torch.equal(base[k], after[k]) for k in base)
    out["base_requires_grad"] = any(
        p.requires_grad for c in policy.chunks for n, p in c.named_parameters() if not is_adapter(n)
    )
    optimized = [p for o in _torch_optimizers(policy.optimizer) for g in o.param_groups for p in g["params"]]
    adapters = [p for c in policy.chunks for n, p in c.named_parameters() if is_adapter(n)]
    out["optimizer_numel"] = sum(p.numel() for p in optimized)
    out["adapter_numel"] = sum(p.numel() for p in adapters)
    out["grad_buffer_numel"] = sum(
        b.grad_data.numel() for c in policy.chunks for b in c.buffers + c.expert_parallel_buffers
    )
    return out


def _merge_error(policy: MegatronPolicy, whole: dict[str, torch.Tensor]) -> float:
    """Largest distance of the merged weights the engine is pushed (local shards, collective under
    etp) from this rank's part of W + s * B A computed from the whole adapters."""
    worst = 0.0
    for chunk in policy.chunks:
        merged = merged_weights(getattr(chunk, "module", chunk))
        for name, module in adapted_modules(chunk):
            delta = module.lora_scale * whole[f"{module.lora_name}.lora_b"] @ whole[f"{module.lora_name}.lora_a"]
            column = isinstance(module, ColumnParallelLinear)  # rows split like B's, columns like A's
            expected = local_slice(module, "lora_b" if column else "lora_a", delta)
            got = merged[f"{name}.weight"] - module.weight
            worst = max(worst, (got.float() - expected).abs().max().item())
    return worst


def lora_reference(family: str, targets: list[str], init_dir: str, resume_dir: str, dropout: float = 0.0) -> dict:
    """One process: save the initial state; base log-probs; LoRA training; save and resume."""
    policy = make_policy(family, {}, targets, dropout)
    checkpoint.save(policy, init_dir)
    out = train_two_steps(policy)
    base = make_policy(family, {}, None)  # (re-initialising the groups retires ``policy``)
    checkpoint.load(base, init_dir, base_of_lora=True)  # a LoRA checkpoint's base weights
    base_logp = base.forward_logprobs(batch(base.model_config.vocab_size))[0]
    # resume: train one step, save with optimizer state, a fresh policy resumes and steps again
    again = make_policy(family, {}, targets, dropout)
    checkpoint.load(again, init_dir)
    data = batch(again.model_config.vocab_size)
    again.train_step(data, next_token_loss)
    checkpoint.save(again, resume_dir, with_optimizer=True, step=1)
    resumed = make_policy(family, {}, targets, dropout)
    checkpoint.load(resumed, resume_dir, with_optimizer=True)
    resumed.train_step(data, next_token_loss)
    try:  # without base_of_lora: refused, it would drop the adapters' training
        checkpoint.load(base, resume_dir)
        refused = None
    except ValueError as error:
        refused = str(error)
    return {**out, "base_logp": base_logp, "resumed_adapters": adapter_state(resumed), "refused": refused}


def lora_equivalence(
    family: str, spec: dict, targets: list[str], init_dir: str, save_dir: str, dropout: float = 0.0
) -> dict:
    """Load the reference's initial state under ``spec`` and train as it did; save, and read the
    adapters back from the files as the offline PEFT export does (global, layout-free)."""
    from megatron_adapters.dist_io import DistReader
    from megatron_adapters.peft_io import checkpoint_adapters

    policy = make_policy(family, spec, targets, dropout)
    checkpoint.load(policy, init_dir)
    out = train_two_steps(policy)
    checkpoint.save(policy, save_dir)
    out["saved_adapters"] = checkpoint_adapters(DistReader(save_dir), policy.model_config)
    return out


def peft_roundtrip(hf_dir: str, mcore_dir: str, spec: dict, targets: list[str], peft_dir: str, lora_dir: str) -> dict:
    """A converted HF model's base under fresh adapters, two steps, exported as PEFT files and
    saved as a LoRA checkpoint (``lora_dir``, for the offline converters); a fresh policy imports
    the PEFT files and must score the same."""
    from hfschema.hf_config import read_model_config
    from megatron_adapters.peft_io import export_peft, import_peft

    model = read_model_config(hf_dir)
    lora = LoRAConfig(enabled=True, rank=4, alpha=8.0, target_modules=targets)
    pg = parallel.initialize(layout_for(spec), seed=SEED)
    policy = MegatronPolicy(model, layout_for(spec), LORA_TRAIN, pg_collection=pg, lora=lora)
    checkpoint.load(policy, mcore_dir)  # a checkpoint without adapters: B = 0
    data = batch(model.vocab_size)
    base = _base(policy)
    for _ in range(2):
        policy.train_step(data, next_token_loss)
    after = _base(policy)
    base_identical = all(torch.equal(base[k], after[k]) for k in base)
    expert_biases = sum(k.endswith("expert_bias") for k in base)
    logp = policy.forward_logprobs(data)[0]
    export_peft(policy, peft_dir)
    checkpoint.save(policy, lora_dir)
    pg = parallel.initialize(layout_for(spec), seed=SEED + 1)
    fresh = MegatronPolicy(model, layout_for(spec), LORA_TRAIN, pg_collection=pg, lora=lora)
    checkpoint.load(fresh, mcore_dir)
    import_peft(fresh, peft_dir)
    return {
        "logp": logp,
        "imported_logp": fresh.forward_logprobs(data)[0],
        "input_ids": data["input_ids"],
        "base_identical": base_identical,
        "expert_biases": expert_biases,
    }


TASKS = {f.__name__: f for f in (lora_reference, lora_equivalence, peft_roundtrip)}


def main() -> None:
    run_tasks(lambda task: TASKS[task.pop("kind")](**task))


if __name__ == "__main__":
    main()
