"""The plan against an independent oracle: Megatron params in, SGLang params out, exactly.

For random layout pairs of every family: full random HF tensors are sliced into each Megatron
rank's parameters and into each SGLang rank's parameters by ``oracle`` (written from the two
frameworks' loaders, not from ``reshard``). Applying the plan's transfers (numpy slice copies
from the Megatron params into zeroed buffers shaped as the destination layout says) must give
exactly the SGLang params, padding rows included (zero).
"""

import numpy as np
import pytest

from reshard import Topology, canonical_tensors, plan_reshard
from reshard.hf import hf_layout
from tests.reshard.cases import TINY_MODELS, random_cases
from tests.reshard.oracle import hf_checkpoint, hf_shapes, megatron_params, sglang_params

CASES = random_cases(seed=20261130, count=120)


def _box(region):
    return tuple(slice(a, b) for a, b in region)


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_registry_names_and_shapes_match_hf_checkpoint(name):
    model = TINY_MODELS[name]
    ours = {t.name: t.shape for t in canonical_tensors(model)}
    assert ours == hf_shapes(model)


@pytest.mark.parametrize("case", CASES, ids=[f"{i}-{c.name}" for i, c in enumerate(CASES)])
def test_plan_reproduces_sglang_parameters(case):
    source, destination = case.build()
    plan = plan_reshard(source, destination, case.topology)
    hf = hf_checkpoint(case.model, seed=1)
    first = case.split.num_layers_in_first_pipeline_stage
    last = case.split.num_layers_in_last_pipeline_stage
    held = {r: megatron_params(case.model, case.layout, hf, r, first, last) for r in range(source.num_ranks)}
    for r, params in held.items():
        assert {k: v.shape for k, v in params.items()} == source.param_shapes(r), r

    buffers = {
        r: {k: np.zeros(s, np.float32) for k, s in destination.param_shapes(r).items()}
        for r in range(destination.num_ranks)
    }
    for t in plan.transfers():  # in plan order: a relay's box reached it on an earlier route
        sender = buffers if t.relay else held
        box = sender[t.src_rank][t.src_param][_box(t.src_region)]
        for param, region in ((t.dst_param, t.dst_region), *t.also):
            buffers[t.dst_rank][param][_box(region)] = box

    for r in range(destination.num_ranks):
        expected = sglang_params(case.model, case.settings, hf, r)
        assert {k: v.shape for k, v in expected.items()} == {k: v.shape for k, v in buffers[r].items()}, r
        for name, want in expected.items():
            np.testing.assert_array_equal(buffers[r][name], want, err_msg=f"rank {r} {name}")


@pytest.mark.parametrize("case", CASES[:24], ids=[f"{i}-{c.name}" for i, c in enumerate(CASES[:24])])
def test_plan_to_the_hf_layout_reassembles_the_checkpoint(case):
    """The full-tensor route's plan: every Megatron layout gathers back to the HF tensors, exactly."""
    source, _ = case.build()
    destination = hf_layout(case.model, dtype=source.dtype)
    plan = plan_reshard(source, destination, Topology.colocated(source.num_ranks, gpus_per_node=8, num_destination=1))
    hf = hf_checkpoint(case.model, seed=2)
    first = case.split.num_layers_in_first_pipeline_stage
    last = case.split.num_layers_in_last_pipeline_stage
    held = {r: megatron_params(case.model, case.layout, hf, r, first, last) for r in range(source.num_ranks)}
    out = {k: np.full(s, np.nan, np.float32) for k, s in destination.param_shapes(0).items()}
    for t in plan.transfers():
        out[t.dst_param][_box(t.dst_region)] = held[t.src_rank][t.src_param][_box(t.src_region)]
    assert set(out) == set(hf)
    for name, want in hf.items():
        np.testing.assert_array_equal(out[name], want, err_msg=name)
