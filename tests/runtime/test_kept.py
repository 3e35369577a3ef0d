"""A filter's kept batch (``step.Kept``): every per-sample field the filter read follows the samples
it keeps and the ones it draws, and the stages after it read those under their own names.

``algorithm.name=remax algorithm.dynamic_sampling=true`` crashed at its first RL step (an index
past the batch in ``advantages``): ReMax's greedy baselines were indexed with the kept batch's
rows, and the extra rounds had none. The run itself: ``tests/test_train.py``'s ReMax run draws
with dynamic sampling.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.runtime.shares import single_process
from hybridflow.runtime.step import Inputs, Kept, UndeclaredRead
from tests.reward.test_frozen_models import _groups_rollout

QUICKSTART = "configs/quickstart_cpu.yaml"


def test_a_node_that_reads_kept_reads_the_kept_fields_under_their_own_names():
    whole, kept = _groups_rollout(4), _groups_rollout(2)
    fields = {
        "responses": whole,
        "scores": torch.arange(4.0),
        "baseline_scores": torch.arange(4.0),
        "kept": Kept({"responses": kept, "scores": torch.tensor([7.0, 8.0]), "baseline_scores": torch.ones(2)}),
    }
    after = Inputs(SimpleNamespace(inputs=("responses", "kept", "baseline_scores"), op="advantages", name="a"), fields)
    assert after["responses"] is kept and after["baseline_scores"].tolist() == [1.0, 1.0]
    with pytest.raises(UndeclaredRead, match="'scores'"):  # kept or not, a read is declared
        after["scores"]
    before = Inputs(SimpleNamespace(inputs=("responses", "scores"), op="filter_groups", name="f"), fields)
    assert before["responses"] is whole and before["scores"].tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.claim("dynamic-sampling-remax")
def test_remax_baselines_follow_the_kept_samples_and_every_extra_round_gets_its_own(tmp_path, monkeypatch):
    """Round 1 keeps group 1 of two; round 2 draws two groups and keeps group 0: the kept
    baselines are round 1's of group 1, then round 2's own greedy baselines of its group 0."""
    from hybridflow.runtime import ops, switches

    cfg = load_config(
        QUICKSTART,
        [
            f"run.output_dir={tmp_path}",
            "algorithm.name=remax",
            "algorithm.dynamic_sampling=true",
            "algorithm.max_sampling_rounds=2",
            "run.prompts_per_step=2",
            "rollout.n=2",
        ],
    )
    session = SimpleNamespace(
        cfg=cfg,
        mode="train",
        run=SimpleNamespace(shard=single_process()),
        data=SimpleNamespace(prompt_batch=lambda step, offset: ["p0", "p1"], stop_ids=(0,)),
        engines=SimpleNamespace(sync=SimpleNamespace(engine_drops_weights=False)),
    )
    monkeypatch.setattr(switches, "enter", lambda s, mode: setattr(s, "mode", mode))
    greedy = []

    def rollout(s, prompts, params, seed, **kwargs):
        greedy.append(params.temperature == 0.0)
        return (_groups_rollout(2) if greedy[-1] else _groups_rollout(4)), {}

    # round 2: the samples' scores (group 0 differs), then the baselines of its two prompts
    extra = iter([torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0.25, 0.25, 0.75, 0.75])])
    monkeypatch.setattr(ops, "rollout", rollout)
    monkeypatch.setattr(ops, "_extra_round_scores", lambda s, ro: (next(extra), 0, {}))
    node = SimpleNamespace(
        inputs=("responses", "scores", "baseline_scores"), option=lambda name: {"max_rounds": 2}[name]
    )
    fields = {
        "responses": _groups_rollout(4),
        "scores": torch.tensor([1.0, 1.0, 0.0, 1.0]),  # group 0 all equal: dropped
        "baseline_scores": torch.tensor([0.5, 0.5, 0.1, 0.1]),
    }
    produced = ops.filter_groups_op(session, node, fields, SimpleNamespace(index=0))
    kept = produced.fields["kept"].fields
    assert greedy == [False, True]  # round 2 sampled, then generated its greedy baselines
    assert kept["responses"].total == 4 and kept["scores"].tolist() == [0.0, 1.0, 1.0, 0.0]
    assert kept["baseline_scores"].tolist() == pytest.approx([0.1, 0.1, 0.25, 0.25])
