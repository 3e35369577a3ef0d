"""The trainer backends' shared semantics (``hfschema.trainer``) are megatron-core's: the FSDP2
backend's learning rate and weight-decay rule equal what the megatron backend runs."""

from __future__ import annotations

import pytest
import torch

from hfschema.train import TrainConfig
from hfschema.trainer import decays, lr_at


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"lr_schedule": "linear", "lr_decay_steps": 5},
        {"lr_schedule": "cosine", "lr_warmup_steps": 3, "lr_decay_steps": 10, "min_lr": 1e-5},
        {"lr_schedule": "constant", "lr_warmup_steps": 4},
    ],
)
def test_the_learning_rate_of_every_step_is_megatron_cores(settings: dict) -> None:
    from megatron_adapters.policy import _scheduler

    train = TrainConfig(lr=1e-3, **settings)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    scheduler = _scheduler(optimizer, train)
    theirs = []
    for _ in range(14):
        theirs.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=1)
    assert [lr_at(train, step) for step in range(14)] == pytest.approx(theirs, abs=1e-15)


def test_weight_decay_skips_biases_and_one_dimensional_parameters() -> None:
    assert decays("model.layers.0.mlp.up_proj.weight", (64, 32))
    assert not decays("model.layers.0.self_attn.q_proj.bias", (32,))
    assert not decays("model.norm.weight", (32,))
