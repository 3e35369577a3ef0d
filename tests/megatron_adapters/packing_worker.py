"""torchrun worker for the packing tests: packed and token-budget passes against unpacked ones.

Run as ``torchrun --standalone --nproc-per-node N packing_worker.py TASKS.json`` (``task_pool``).
Each ``packed`` task builds, under one layout and from the same seed, an unpacked policy, a
packed one (the same micro-batches of ``train.micro_batch_size`` rows, each packed into one
row) and a packed one with a token budget, and records how far apart their log-probs, entropy,
losses, grad norms and log-probs after one Adam step are, over the tokens the loss counts; the
same for a critic's values and value loss; for MoE families also the routes each records and
the log-probs replaying one's routes in the other.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from families import tiny  # noqa: E402
from task_pool import run_tasks  # noqa: E402
from worker import layout_for  # noqa: E402

from hfschema.packing import PackingConfig  # noqa: E402
from hfschema.train import MoEConfig, TrainConfig  # noqa: E402
from hybridflow.selftest import next_token_loss  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron_adapters import parallel  # noqa: E402
from megatron_adapters.critic import MegatronCritic  # noqa: E402
from megatron_adapters.policy import MegatronPolicy  # noqa: E402

SEED = 4321
TRAIN = TrainConfig(lr=1e-3, micro_batch_size=2, global_batch_size=8, clip_grad=1.0)
LENGTHS = [24, 5, 9, 3, 17, 12, 2, 20]  # a long tail over 8 rows of 24 columns
BUDGET = 32
PACKINGS = {
    "unpacked": PackingConfig(),
    "packed": PackingConfig(enabled=True),
    "budget": PackingConfig(enabled=True, max_tokens_per_micro_batch=BUDGET),
}


def batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, vocab, (len(LENGTHS), max(LENGTHS)), generator=g)
    mask = (torch.arange(ids.shape[1])[None, :] < torch.tensor(LENGTHS)[:, None]).float()
    mask[:, 0] = 0
    returns = torch.randn(ids.shape, generator=g)
    return {"input_ids": ids, "loss_mask": mask, "returns": returns}


def _value_loss(values, _unused, micro):
    mask = micro["loss_mask"]
    return ((values - micro["returns"]) ** 2 * mask).sum(), mask.sum(), {}


def _build(cls, family: str, layout, pg, packing: PackingConfig, moe: MoEConfig | None):
    torch.manual_seed(SEED)  # CPU initialisation: the same weights for every packing setting
    model_parallel_cuda_manual_seed(SEED)
    return cls(tiny(family), layout, TRAIN, pg_collection=pg, moe=moe, packing_config=packing)


def _masked_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).max())


def _actor_pass(policy: MegatronPolicy, data: dict) -> dict:
    logp, entropy = policy.forward_logprobs(data, with_entropy=True)
    result = policy.train_step(data, next_token_loss)
    after, _ = policy.forward_logprobs(data)
    return {
        "logp": logp,
        "entropy": entropy,
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "tokens": result.num_tokens,
        "after": after,
    }


def _critic_pass(critic: MegatronCritic, data: dict) -> dict:
    values = critic.forward_values(data)
    result = critic.train_step(data, _value_loss)
    return {"values": values, "loss": result.loss, "grad_norm": result.grad_norm, "after": critic.forward_values(data)}


def _routes(policy: MegatronPolicy, data: dict) -> torch.Tensor:
    policy.forward_logprobs(data, record_routes=True)
    return policy.routing.take_recorded()


def packed(family: str, spec: dict) -> dict:
    """Differences of packed and token-budget passes from unpacked ones (see the module doc)."""
    layout = layout_for(spec)
    layout.check_model(tiny(family))
    pg = parallel.initialize(layout, seed=SEED)
    data = batch(tiny(family).vocab_size)
    mask = data["loss_mask"]
    # No expert-bias update (deepseek_v3): unpacked rows route their padding too, which the
    # aux-loss-free bias counts, so the weights after a step would differ by design.
    is_moe = tiny(family).is_moe
    moe = MoEConfig(routing_replay="r2", expert_bias_update_rate=0.0) if is_moe else None
    critic_moe = MoEConfig(expert_bias_update_rate=0.0) if is_moe else None
    out: dict = {}
    actors = {name: _build(MegatronPolicy, family, layout, pg, p, moe) for name, p in PACKINGS.items()}
    if moe is not None:  # before training: every policy still has the same weights
        routes = {name: _routes(policy, data) for name, policy in actors.items()}
        valid = mask.bool()[..., None, None].expand_as(routes["unpacked"])
        replayed = {
            name: actors[name].forward_logprobs({**data, "routed_experts": routes["unpacked"]})[0]
            for name in ("unpacked", "packed")
        }
        out["routes_equal"] = {n: bool(torch.equal(r[valid], routes["unpacked"][valid])) for n, r in routes.items()}
        out["replay_logp"] = _masked_diff(replayed["packed"], replayed["unpacked"], mask)
    runs = {name: _actor_pass(policy, data) for name, policy in actors.items()}
    del actors
    out["moved"] = _masked_diff(runs["unpacked"]["after"], runs["unpacked"]["logp"], mask)
    ref = runs["unpacked"]
    for name in ("packed", "budget"):
        got = runs[name]
        out[name] = {
            "logp": _masked_diff(got["logp"], ref["logp"], mask),
            "entropy": _masked_diff(got["entropy"], ref["entropy"], mask),
            "loss": abs(got["loss"] - ref["loss"]),
            "grad_norm": abs(got["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"],
            "tokens": (got["tokens"], ref["tokens"]),
            "after": _masked_diff(got["after"], ref["after"], mask),
        }
    critics = {
        name: _critic_pass(_build(MegatronCritic, family, layout, pg, PACKINGS[name], critic_moe), data)
        for name in ("unpacked", "packed", "budget")
    }
    vref = critics["unpacked"]
    for name in ("packed", "budget"):
        vgot = critics[name]
        out[name].update(
            {
                "values": _masked_diff(vgot["values"], vref["values"], mask),
                "value_loss": abs(vgot["loss"] - vref["loss"]),
                "value_grad_norm": abs(vgot["grad_norm"] - vref["grad_norm"]) / vref["grad_norm"],
                "value_after": _masked_diff(vgot["after"], vref["after"], mask),
            }
        )
    return out


if __name__ == "__main__":
    run_tasks(lambda task: {"packed": packed}[task.pop("kind")](**task))
