"""Partial rollouts (``async_rl.partial_rollout``): a batch started ahead generates a segment per
request, and after each weight push its unfinished requests continue with the new weights.

A scripted engine stands in for SGLang: its "weights" are a version number that shows up in
every token, log-prob and routed-expert row it produces, so each test can read off which
version produced what. The distributed run is ``tests/test_train_async.py``.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.preflight import check_async
from hybridflow.rollout.base import FINISH_LENGTH, FINISH_STOP, RolloutBatch, RolloutSample, SamplingParams
from hybridflow.rollout.tokens import pack_batch
from hybridflow.runtime import replicas
from hybridflow.runtime.engine_client import EngineClient
from hybridflow.runtime.exchange import meta_of, pack, unpack

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart_cpu.yaml")
SEPARATE = ["rollout.placement=separate", "rollout.tp=1"]
EOS = 1


class ScriptedEngine:
    """Prompt tokens < 100 set how long the answer is (1 + sum % 7 tokens, EOS last); response
    tokens are 100 + 10 * version + a seeded draw, log-probs -0.1 * version, routed-expert rows
    the version. A continuation's prompt carries its earlier response tokens (>= 100)."""

    def __init__(self, version: int) -> None:
        self.version, self.calls, self.rng = version, [], random.Random(0)

    def reseed(self, seed: int) -> None:
        self.rng, self.seed = random.Random(seed), seed

    def generate(self, prompts, params: SamplingParams) -> RolloutBatch:
        self.calls.append((self.seed, [tuple(p) for p in prompts], params.max_new_tokens))
        out = []
        for i, prompt in enumerate(prompts):
            question = [t for t in prompt if t < 100]
            done = len(prompt) - len(question)
            for j in range(params.n):
                left = 1 + sum(question) % 7 - done
                count = min(left, params.max_new_tokens)
                ids = [100 + 10 * self.version + self.rng.randrange(5) for _ in range(count)]
                stop = count == left
                if stop:
                    ids[-1] = EOS
                out.append(
                    RolloutSample(
                        prompt_index=i,
                        sample_index=j,
                        prompt_ids=tuple(prompt),
                        response_ids=tuple(ids),
                        logprobs=(-0.1 * self.version,) * count,
                        finish_reason=FINISH_STOP if stop else FINISH_LENGTH,
                        routed_experts=torch.full((len(prompt) + count - 1, 1, 1), self.version),
                    )
                )
        return RolloutBatch(samples=tuple(out), seconds=0.0)


class Store:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, key: str, amount: int) -> int:
        self.counts[key] = self.counts.get(key, 0) + amount
        return self.counts[key]


@dataclasses.dataclass
class Channel:
    store: Store = dataclasses.field(default_factory=Store)


PROMPTS = [[3, 4], [6], [2, 2, 2], [5, 1]]  # answers of 1 + sum % 7 = 1, 7, 7, 7 tokens
PARAMS = SamplingParams(n=2, max_new_tokens=6, stop_token_ids=(EOS,))


def _cfg(replicas_: int = 1):
    return load_config(QUICKSTART, [*SEPARATE, f"rollout.num_replicas={replicas_}", "rollout.dispatch_chunks=1"])


def _started(engine, cfg=None, segment=2, version=5):
    return replicas.start(
        cfg or _cfg(),
        engine,
        PROMPTS,
        PARAMS,
        11,
        call="async/3",
        channel=Channel(),
        replica=0,
        segment=segment,
        version=version,
    )


@pytest.mark.claim("partial-rollout-versions")
def test_a_request_spanning_two_updates_keeps_each_tokens_version_log_prob_and_routes():
    engine = ScriptedEngine(5)
    started = _started(engine)
    assert all(len(x.response_ids) <= 2 for x in started.samples)
    assert len(started.unfinished()) == 6  # the 1-token answers ended; the others hold 2 tokens
    engine.version = 6
    started, (began, ended) = replicas.advance(engine, started, 6, segment=2)
    assert began <= ended and len(started.unfinished()) == 6
    engine.version = 7
    started, _ = replicas.advance(engine, started, 7, segment=None)  # the batch trained next: to its end
    assert not started.unfinished()
    for x in started.samples:
        if x.prompt_ids == (3, 4):  # ended in its first segment
            assert x.segments == ((0, 5),) and x.response_ids == (EOS,)
            continue
        # the cap is 6 tokens; answers of 7 are cut there
        assert len(x.response_ids) == 6 and x.finish_reason == FINISH_LENGTH
        assert x.segments == ((0, 5), (2, 6), (4, 7))
        assert [t // 10 - 10 for t in x.response_ids] == [5, 5, 6, 6, 7, 7]
        assert x.logprobs == pytest.approx((-0.5, -0.5, -0.6, -0.6, -0.7, -0.7))
        # routes: the prompt and the first response token fed under version 5, the next two under 6
        p = len(x.prompt_ids)
        assert x.routed_experts.flatten().tolist() == [5] * (p + 1) + [6, 6] + [7, 7]
    assert [meta_of(x) for x in started.samples] == started.report.metas


def test_continuations_take_their_chunks_seeds_whatever_replica_holds_them():
    cfg = _cfg(replicas_=2)  # two chunks of two prompts each
    engine = ScriptedEngine(0)
    started = _started(engine, cfg, segment=1, version=0)
    assert started.chunk_of == (0, 0, 0, 0, 1, 1, 1, 1) and started.seed == 11
    engine.calls.clear()
    replicas.advance(engine, started, 1, segment=1)
    seeds = [seed for seed, _, _ in engine.calls]
    assert seeds == [replicas.chunk_seed(11 + replicas._SEGMENT_SEED, c) for c in (0, 1)]
    # each call holds its chunk's unfinished requests only, with the tokens so far as the prompt
    assert [len(prompts) for _, prompts, _ in engine.calls] == [2, 4]
    assert all(len(p) == len(q) + 1 for p, q in zip(engine.calls[0][1], [(6,), (6,)]))


def test_a_failed_continuation_is_kept_for_collect_to_raise():
    engine = ScriptedEngine(0)
    started = _started(engine)

    def broken(prompts, params):
        raise RuntimeError("scheduler died")

    engine.generate = broken
    after, _ = replicas.advance(engine, started, 1, segment=2)
    assert after.report.error == "RuntimeError: scheduler died" and not after.unfinished()
    with pytest.raises(replicas.ReplicaFailed, match="scheduler died"):
        replicas._raise_failures([after.report])


def test_a_batch_generated_whole_is_tagged_with_one_version_and_an_untagged_start_is_unchanged():
    whole = _started(ScriptedEngine(4), segment=None, version=4)
    assert not whole.unfinished() and {x.segments for x in whole.samples} == {((0, 4),)}
    plain = _started(ScriptedEngine(4), segment=None, version=None)
    assert plain.params is None and all(x.segments == () for x in plain.samples)


@pytest.mark.claim("partial-rollout-versions")
def test_token_versions_follow_the_segments_and_travel_with_the_samples():
    x = RolloutSample(
        prompt_index=0,
        sample_index=0,
        prompt_ids=(7, 8),
        response_ids=(101, 102, 103, EOS),
        logprobs=(-1.0,) * 4,
        finish_reason=FINISH_STOP,
        segments=((0, 3), (1, 4), (3, 5)),
    )
    y = dataclasses.replace(x, prompt_index=1, response_ids=(101,), logprobs=(-1.0,), segments=((0, 3),))
    right = pack_batch([x, y], pad_id=0)["token_versions"]
    assert right.tolist() == [[-1, -1, 3, 4, 4, 5], [-1, -1, 3, -1, -1, -1]]
    left = pack_batch([x, y], pad_id=0, padding_side="left")["token_versions"]
    assert left.tolist() == [[-1, -1, 3, 4, 4, 5], [-1, -1, -1, -1, -1, 3]]
    assert "token_versions" not in pack_batch([dataclasses.replace(x, segments=())], pad_id=0)
    with pytest.raises(ValueError, match="sample 1 has no segments"):
        pack_batch([x, dataclasses.replace(y, segments=())], pad_id=0)
    ints, floats = pack([x, y])
    assert unpack([meta_of(x), meta_of(y)], ints, floats) == [x, y]


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["async_rl.partial_rollout=true"], "async_rl.partial_rollout=true with async_rl.mode=sync"),
        (
            [
                "async_rl.mode=async",
                *SEPARATE,
                "async_rl.max_staleness=2",
                "async_rl.partial_rollout=true",
                "async_rl.segment_tokens=4",
            ],
            "async_rl.segment_tokens=4 >= data.max_response_length=4",
        ),
        (
            ["async_rl.mode=one_step_off", *SEPARATE, "async_rl.partial_rollout=true", "async_rl.segment_tokens=1"],
            "async_rl.partial_rollout=true with async_rl.mode=one_step_off",
        ),
    ],
)
@pytest.mark.claim("partial-rollout-refusals")
def test_bad_partial_rollout_settings_are_one_line_errors_naming_the_keys(overrides, key):
    cfg = load_config(QUICKSTART, overrides)
    with pytest.raises(ValueError, match=key) as error:
        check_async(cfg)
    assert "\n" not in str(error.value) and "set " in str(error.value)
    with pytest.raises(ValueError, match="async_rl.segment_tokens=0"):
        load_config(QUICKSTART, ["async_rl.segment_tokens=0"])


def test_the_plan_line_and_the_summary_state_partial_rollouts():
    from hybridflow.runtime.report import summarise_async

    cfg = load_config(
        QUICKSTART,
        [
            "async_rl.mode=async",
            *SEPARATE,
            "async_rl.max_staleness=2",
            "async_rl.partial_rollout=true",
            "async_rl.segment_tokens=1",
        ],
    )
    check_async(cfg)
    assert "partial rollouts: 1 token(s) per request per version" in cfg.async_rl.describe()
    history = [
        {"async/token_staleness_mean": 0.5, "async/partial_samples": 10.0},
        {"async/token_staleness_mean": 1.5, "async/partial_samples": 20.0},
    ]
    got = summarise_async(cfg.async_rl, history)
    assert (got["partial_rollout"], got["token_staleness_mean"], got["partial_samples"]) == (True, 1.0, 30.0)


def test_the_engine_ranks_buffer_advances_as_the_actor_trains_and_finishes_the_next_batch(monkeypatch):
    from hybridflow.runtime import engine_ranks

    engine = ScriptedEngine(0)
    buffer = engine_ranks._Buffer(_cfg(), EngineClient(_cfg(), Path("."), 0, engine), Channel())
    buffer.start(2, PROMPTS, PARAMS, 11, 1, 0)  # step 0 of K=3: batches 2 and 3 started by version 0
    buffer.start(3, PROMPTS, PARAMS, 12, 1, 0)
    buffer.advance(0, 1)  # started by this very version: nothing to continue yet
    assert {x.segments for b in (2, 3) for x in buffer.kept[b].samples} == {((0, 0),)}
    engine.version = 1
    buffer.start(4, PROMPTS, PARAMS, 13, 1, 1)
    buffer.advance(1, 1)  # batch 2 (trained at step 2) to its end, batch 3 a token on, batch 4 waits
    two = {x.segments for x in buffer.kept[2].samples if x.prompt_ids != (3, 4)}
    assert two == {((0, 0), (1, 1))} and not buffer.kept[2].unfinished()
    assert {x.segments for x in buffer.kept[3].samples if x.prompt_ids != (3, 4)} == {((0, 0), (1, 1))}
    assert {x.segments for x in buffer.kept[4].samples} == {((0, 1),)}
    engine.version = 2
    delivered = []
    monkeypatch.setattr(engine_ranks.replicas, "collect", lambda cfg, started, **kw: delivered.append(started))
    buffer.collect(2, len(PROMPTS))  # nothing left to generate: delivered as it is
    assert delivered[0] is not None and 2 not in buffer.kept and delivered[0].version == 1
    for x in delivered[0].samples:
        if x.prompt_ids != (3, 4):
            assert x.logprobs == pytest.approx((0.0,) + (-0.1,) * 5)
    assert len(buffer.busy) == 5  # each generation's interval, for the overlap metric
