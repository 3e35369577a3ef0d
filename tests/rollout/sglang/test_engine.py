"""SGLang engine adapter against transformers, on tiny Qwen3-MoE and Qwen2 models (CPU engine here).

One engine per (family, tp) is shared by the tests of that case (module-scoped, parametrized:
pytest finishes one case, and shuts its engine down, before starting the next). Tests run in file
order within a case: those that assume the original weights come first; each push test pushes
its own weights and checks against transformers loaded with them; the last test shuts down.
"""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from hybridflow.rollout import FINISH_LENGTH, FINISH_STOP, RolloutEngine, SamplingParams, make_engine
from hybridflow.rollout.sglang.cpu import STUB_LOG_ENV
from tests.rollout.sglang.reference import (
    checkpoint_tensors,
    child_processes,
    hf_greedy,
    hf_logprobs,
    load_hf,
    rank_tensors,
    tiny_model_dir,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

CASES = [("qwen3_moe", 2), ("qwen2", 1), ("qwen3_moe", 1), ("qwen2", 2)]
SLOW_TP = 1
"""The tp=1 cases are the slow tier's: the same adapter with the TP split left out (the default
tier keeps both families at tp=2, where the shapes, slices and pushes are split; tp=1 engines
serve the default tier's replica, separate and LoRA runs end to end, scored against the trainer)."""
MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)
VOCAB_SIZE = 320
"""hybridflow.rollout.tiny's default vocabulary (ids 0-5 are special tokens)."""
LOGPROB_ATOL = 1e-4
"""SGLang (fp32, CPU, torch-native kernels) vs a transformers teacher-forced forward: the largest
difference seen over all cases was 3.1e-6; 1e-4 leaves margin without hiding a real mismatch
(a wrong token or weight moves log-probs by far more)."""


def _prompts(seed: int = 0, count: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, VOCAB_SIZE) for _ in range(rng.randrange(3, 11))] for _ in range(count)]


PROMPTS = _prompts()


@dataclasses.dataclass
class Case:
    family: str
    tp: int
    engine: RolloutEngine
    model_dir: object
    model: torch.nn.Module
    root: object
    stub_log: object
    start_seconds: float


@pytest.fixture(
    scope="module",
    params=[pytest.param(c, marks=pytest.mark.slow) if c[1] == SLOW_TP else c for c in CASES],
    ids=[f"{f}-tp{tp}" for f, tp in CASES],
)
def case(request, tmp_path_factory, monkeypatch_module):
    family, tp = request.param
    root = tmp_path_factory.mktemp(f"{family}-tp{tp}")
    model_dir = tiny_model_dir(root, family, seed=0)
    stub_log = root / "sgl_kernel_calls.log"
    monkeypatch_module.setenv(STUB_LOG_ENV, str(stub_log))
    started = time.perf_counter()
    engine = make_engine("sglang", model_path=str(model_dir), tp=tp, max_total_tokens=2048)
    start_seconds = time.perf_counter() - started
    print(f"\n[{family} tp={tp}] engine start {start_seconds:.1f} s")
    yield Case(family, tp, engine, model_dir, load_hf(model_dir), root, stub_log, start_seconds)
    engine.shutdown()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def _response_ids(batch) -> list[list[int]]:
    return [list(s.response_ids) for s in batch.samples]


def test_greedy_matches_transformers_and_the_hf_engine(case):
    batch = case.engine.generate(PROMPTS, GREEDY)
    assert _response_ids(batch) == hf_greedy(case.model, PROMPTS, MAX_NEW)
    reference = make_engine("hf", model_path=str(case.model_dir))
    assert _response_ids(reference.generate(PROMPTS, GREEDY)) == _response_ids(batch)
    reference.shutdown()
    assert [s.prompt_index for s in batch.samples] == list(range(len(PROMPTS)))
    assert all(s.finish_reason in (FINISH_STOP, FINISH_LENGTH) for s in batch.samples)
    assert all(s.routed_experts is None for s in batch.samples)  # SGLang cannot on CPU


@pytest.mark.claim("judge-overlaps-the-step")
def test_a_submitted_batch_is_generated_while_the_caller_does_other_work(case):
    """``submit`` returns once the schedulers have the requests; they generate while this process
    sleeps (as the trainer computes log-probs while a judge generates), so collecting takes a
    fraction of a whole ``generate``, and the batch is the same. The work lasts three generates: on
    a loaded machine the second generation took twice the first (CI: 1.1 s, then collected 0.48 s
    after a 1.65 s sleep)."""
    prompts, params = _prompts(seed=3, count=8), dataclasses.replace(GREEDY, max_new_tokens=24)
    started = time.perf_counter()
    whole = case.engine.generate(prompts, params)
    generate_s = time.perf_counter() - started
    pending = case.engine.submit(prompts, params)
    time.sleep(3 * generate_s)
    started = time.perf_counter()
    collected = pending.result()
    collect_s = time.perf_counter() - started
    print(f"\n[{case.family} tp={case.tp}] generate {generate_s:.2f} s; collect after the work {collect_s:.3f} s")
    assert _response_ids(collected) == _response_ids(whole)
    got, expected = ([lp for s in batch.samples for lp in s.logprobs] for batch in (collected, whole))
    assert got == pytest.approx(expected, abs=1e-6)
    assert collect_s < 0.25 * generate_s


def test_greedy_logprobs_match_teacher_forced_forward(case):
    batch = case.engine.generate(PROMPTS, GREEDY)
    worst = 0.0
    for sample in batch.samples:
        expected = hf_logprobs(case.model, list(sample.prompt_ids), list(sample.response_ids))
        got = torch.tensor(sample.logprobs, dtype=torch.float64)
        worst = max(worst, (got - expected).abs().max().item())
    print(f"\n[{case.family} tp={case.tp}] greedy log-prob max |diff| {worst:.2e}")
    assert worst < LOGPROB_ATOL


def test_sampled_logprobs_are_unscaled_and_n_samples_come_prompt_major(case):
    params = SamplingParams(n=3, temperature=0.7, max_new_tokens=6)
    batch = case.engine.generate(PROMPTS[:2], params)
    assert [(s.prompt_index, s.sample_index) for s in batch.samples] == [(p, i) for p in range(2) for i in range(3)]
    for sample in batch.samples:
        assert list(sample.prompt_ids) == PROMPTS[sample.prompt_index]
        expected = hf_logprobs(case.model, list(sample.prompt_ids), list(sample.response_ids))
        assert torch.allclose(torch.tensor(sample.logprobs, dtype=torch.float64), expected, atol=LOGPROB_ATOL)


def test_stop_token_ends_the_response(case):
    reference = hf_greedy(case.model, PROMPTS[:1], MAX_NEW)[0]
    stop = reference[2]
    first = reference.index(stop)
    batch = case.engine.generate(PROMPTS[:1], dataclasses.replace(GREEDY, stop_token_ids=(stop,)))
    sample = batch.samples[0]
    assert list(sample.response_ids) == reference[: first + 1]  # the stop token is kept
    assert sample.finish_reason == FINISH_STOP


def test_pause_holds_requests_until_resume_and_flush_cache_works(case):
    import asyncio

    engine = case.engine
    sgl = engine.sglang_engine
    expected = hf_greedy(case.model, PROMPTS[:1], 4)
    engine.pause()
    request = sgl.async_generate(input_ids=PROMPTS[0], sampling_params={"temperature": 0, "max_new_tokens": 4})
    task = sgl.loop.create_task(request)
    _done, pending = sgl.loop.run_until_complete(asyncio.wait([task], timeout=2.0))
    assert pending, "a request finished while the engine was paused"
    engine.resume()
    assert sgl.loop.run_until_complete(task)["output_ids"] == expected[0]
    engine.flush_cache()
    assert _response_ids(engine.generate(PROMPTS[:1], dataclasses.replace(GREEDY, max_new_tokens=4))) == expected


def test_bad_prompts_are_refused(case):
    with pytest.raises(ValueError, match="context length"):
        case.engine.generate([[5] * 600], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        case.engine.generate([[5, VOCAB_SIZE + 3]], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        case.engine.generate([[]], GREEDY)


def test_param_shapes_are_read_from_the_engine(case):
    shapes = case.engine.param_shapes()
    assert len(shapes) == case.tp
    assert shapes[0]["model.norm.weight"] == (64,)
    assert shapes[0]["lm_head.weight"] == (VOCAB_SIZE // case.tp, 64)
    if case.family == "qwen3_moe":
        # CPU pads moe_intermediate_size 32 to a multiple of 32 * tp: per rank 32 rows, 32/tp real
        assert shapes[0]["model.layers.0.mlp.experts.w13_weight"] == (4, 64, 64)
        assert shapes[0]["model.layers.0.mlp.experts.w2_weight"] == (4, 64, 32)


@pytest.mark.claim("sliced-push")
def test_bad_pushes_raise_and_keep_the_old_weights(case):
    engine = case.engine
    before = _response_ids(engine.generate(PROMPTS, GREEDY))
    other = tiny_model_dir(case.root, case.family, seed=1)
    per_rank = rank_tensors(other, case.tp)
    name = next(n for n in per_rank[-1] if n.endswith("o_proj.weight"))
    bad = [dict(r) for r in per_rank]
    bad[-1][name] = bad[-1][name][:, :-1]
    with pytest.raises(ValueError, match=rf"rank {case.tp - 1}.*{name}|{name}.*rank {case.tp - 1}"):
        engine.push_weights(bad, route="sliced")
    renamed = [dict(r) for r in per_rank]
    for r in renamed:
        r["model.layers.0.mlp.no_such.weight"] = r.pop(name)
    with pytest.raises(ValueError, match="no_such"):
        engine.push_weights(renamed, route="sliced")
    with pytest.raises(ValueError, match=f"tp={case.tp}"):
        engine.push_weights(per_rank + per_rank, route="sliced")
    full = checkpoint_tensors(other)
    hf_name = next(n for n in full if n.endswith("down_proj.weight"))
    with pytest.raises(ValueError, match="shape"):
        engine.push_weights({hf_name: full[hf_name][:-1]}, route="full")
    with pytest.raises(ValueError, match="not a tensor of the model's checkpoint"):
        engine.push_weights({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(1)}, route="full")
    with pytest.raises(ValueError, match="route"):
        engine.push_weights(per_rank, route="broadcast")
    assert _response_ids(engine.generate(PROMPTS, GREEDY)) == before


@pytest.mark.claim("sliced-push")
def test_sliced_push_matches_transformers_with_those_weights(case):
    engine = case.engine
    other = tiny_model_dir(case.root, case.family, seed=1)
    expected = hf_greedy(load_hf(other), PROMPTS, MAX_NEW)
    assert expected != hf_greedy(case.model, PROMPTS, MAX_NEW)  # the push must change something
    report = engine.push_weights(rank_tensors(other, case.tp), route="sliced")
    assert _response_ids(engine.generate(PROMPTS, GREEDY)) == expected
    assert report.route == "sliced" and len(report.bytes_per_rank) == case.tp
    print(f"\n[{case.family} tp={case.tp}] sliced push {report.seconds:.2f} s, bytes/rank {report.bytes_per_rank}")


@pytest.mark.claim("sliced-push")
def test_full_push_matches_transformers_and_moves_more_bytes_per_rank(case):
    engine = case.engine
    other = tiny_model_dir(case.root, case.family, seed=2)
    expected = hf_greedy(load_hf(other), PROMPTS, MAX_NEW)
    full = engine.push_weights(checkpoint_tensors(other), route="full")
    assert _response_ids(engine.generate(PROMPTS, GREEDY)) == expected
    sliced = engine.push_weights(rank_tensors(other, case.tp), route="sliced")
    assert _response_ids(engine.generate(PROMPTS, GREEDY)) == expected
    print(
        f"\n[{case.family} tp={case.tp}] full push {full.seconds:.2f} s, bytes/rank {full.bytes_per_rank}; "
        f"sliced {sliced.seconds:.2f} s, {sliced.bytes_per_rank}"
    )
    assert full.bytes_per_rank == (sum(t.nbytes for t in checkpoint_tensors(other).values()),) * case.tp
    if case.tp > 1:
        assert all(s < f for s, f in zip(sliced.bytes_per_rank, full.bytes_per_rank))


def test_memory_calls_are_no_ops_on_cpu(case):
    if not case.engine.on_cpu:
        pytest.skip("GPU: release / resume free memory for real")
    case.engine.release_memory()
    case.engine.resume_memory()


@pytest.mark.claim("idle-engine-sleeps")
def test_an_idle_engine_leaves_the_cores_to_the_trainer(case):
    """Between generations (the colocated actor trains) the schedulers wait on their sockets: a
    busy-polling one takes a whole core each (about 5 CPU s per 10 s here, per TP rank)."""
    case.engine.generate(PROMPTS[:1], GREEDY)
    schedulers = [psutil.Process(pid) for pid in case.engine.watch.schedulers()]
    assert len(schedulers) == case.tp
    before = [sum(p.cpu_times()[:2]) for p in schedulers]
    time.sleep(3.0)
    used = [sum(p.cpu_times()[:2]) - b for p, b in zip(schedulers, before)]
    assert max(used) < 0.5, f"idle schedulers used {used} CPU s in 3 s"


@pytest.mark.claim("stub-never-called", "engine-shutdown-own-processes")
def test_shutdown_leaves_no_process_and_no_stub_kernel_was_called(case):
    engine_children = child_processes()
    assert engine_children, "the engine should have started scheduler processes"
    # the /dev/shm files SGLang's processes made (message queues named with their pid, the load
    # snapshot named after the instance): SGLang removes them at a clean exit only
    shm = [path for c in engine_children for path in Path("/dev/shm").glob(f"sgl_shm_*_{c.pid}_*")]
    assert shm or case.tp == 1, "the tp>1 engine's schedulers should have made their shared-memory queues"
    from sglang.srt.managers.load_snapshot import shm_path_for

    snapshot = Path(shm_path_for(case.engine.sglang_engine.port_args.instance_id))
    assert snapshot.exists()
    # SGLang's own shutdown kills every child of the caller; the adapter's kills only the engine's
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        case.engine.shutdown()
        assert bystander.poll() is None, "the engine's shutdown killed a process the engine did not start"
    finally:
        bystander.kill()
        bystander.wait()
    left = [p for p in child_processes() if p.pid in {c.pid for c in engine_children}]
    assert not left, f"processes left after shutdown: {left}"
    assert not [path for path in shm if path.exists()], "the engine's shared-memory files outlived it"
    assert not snapshot.exists(), f"the engine's load snapshot {snapshot} outlived it"
    assert not case.stub_log.exists(), f"sgl_kernel stand-in functions were called:\n{case.stub_log.read_text()}"
    with pytest.raises(RuntimeError, match="shut down"):
        case.engine.generate(PROMPTS[:1], GREEDY)
