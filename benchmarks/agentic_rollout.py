"""Multi-turn rollouts with a long-tail tool latency: independent scheduling against turn-synchronous.

    trajectories T, each `turns` tool turns then an answer, on one engine (transformers on a tiny
    Qwen3 model, CPU; real batched generation of `turn_tokens` per turn)
    each tool call sleeps a latency drawn per (trajectory, turn): `base_s`, or `tail_s` with
    probability `tail_p` (the same draws for both schedules)
    independent:       hybridflow.agentic.rollout (a trajectory's next turn is sampled as soon as
                       its tool answered; the engine takes whatever is ready)
    turn_synchronous:  every trajectory waits for the batch's slowest tool each turn (a loop over
                       the batch, turn by turn: the competitor's shape)
    -> trajectories per second of each, their ratio (goal >= 1.5), tokens each sampled

A tiny random model never writes its end-of-turn token, so each sampled turn is closed with it
(no log-prob needed here) and the environment answers every turn with its tool's result; the
engine's time is real, the tool's is the drawn latency.

.venv/bin/python benchmarks/agentic_rollout.py [--trajectories 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
from hfschema.files import write_atomic  # noqa: E402
from hybridflow.agentic.env import Reply, ToolOutcome  # noqa: E402
from hybridflow.agentic.rollout import TurnLimits, run_trajectories  # noqa: E402
from hybridflow.agentic.trajectory import ObservationRenderer, Trajectory  # noqa: E402
from hybridflow.rollout import make_engine  # noqa: E402
from hybridflow.rollout.base import FINISH_STOP, RolloutBatch, SamplingParams  # noqa: E402
from hybridflow.rollout.tiny import TOOL_CHAT_TEMPLATE, make_tiny_model_dir  # noqa: E402


class _ClosedTurns:
    """The engine, each sample ending in the end-of-turn token (see the module doc)."""

    def __init__(self, engine, end_id: int) -> None:
        self.engine, self.end_id = engine, end_id

    def generate(self, prompts, params) -> RolloutBatch:
        batch = self.engine.generate(prompts, params)
        closed = [
            dataclasses.replace(
                s,
                response_ids=(*s.response_ids[:-1], self.end_id),
                logprobs=s.logprobs,
                finish_reason=FINISH_STOP,
            )
            for s in batch.samples
        ]
        return dataclasses.replace(batch, samples=tuple(closed))


class _SlowTool:
    """``turns`` tool answers with the drawn latencies, then the trajectory ends."""

    def __init__(self, latencies: list[float]) -> None:
        self.latencies, self.turn = latencies, 0

    def step(self, text: str) -> Reply:
        if self.turn == len(self.latencies):
            return Reply(done=True, reward=1.0)
        time.sleep(self.latencies[self.turn])
        self.turn += 1
        return Reply(messages=[{"role": "tool", "content": "ok"}], outcome=ToolOutcome(calls=1))


def _latencies(args) -> list[list[float]]:
    rng = random.Random(args.seed)
    return [
        [args.tail_s if rng.random() < args.tail_p else args.base_s for _ in range(args.turns)]
        for _ in range(args.trajectories)
    ]


def _measure(engine, tokenizer, prompts, latencies, args, schedule: str) -> dict:
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    renderer = ObservationRenderer(tokenizer, end)
    limits = TurnLimits(max_turns=args.turns + 1, max_tokens=10_000, turn_tokens=args.turn_tokens)
    # the call's budget is the whole trajectory (a smaller one would pause them: partial rollouts)
    params = SamplingParams(max_new_tokens=limits.max_tokens, temperature=1.0, seed=args.seed)
    starts = [Trajectory(tuple(p), i, 0) for i, p in enumerate(prompts)]
    envs = {i: _SlowTool(lat) for i, lat in enumerate(latencies)}
    began = time.perf_counter()
    done = run_trajectories(
        _ClosedTurns(engine, end),
        starts,
        lambda t: envs[t.prompt_index],
        params,
        renderer=renderer,
        tokenizer=tokenizer,
        limits=limits,
        schedule=schedule,
    )
    seconds = time.perf_counter() - began
    assert all(t.stats.turns == args.turns + 1 for t in done), [t.stats for t in done]
    return {"seconds": seconds, "sampled_tokens": sum(sum(t.loss_mask) for t in done)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3, help="tool turns per trajectory (then one answer)")
    parser.add_argument("--turn-tokens", type=int, default=8)
    parser.add_argument("--base-s", type=float, default=0.02)
    parser.add_argument("--tail-s", type=float, default=1.0)
    parser.add_argument("--tail-p", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model_dir(Path(tmp) / "model", "qwen3")
        tokenizer = AutoTokenizer.from_pretrained(str(model))
        tokenizer.chat_template = TOOL_CHAT_TEMPLATE
        engine = make_engine("hf", model_path=str(model), seed=args.seed)
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"task {i}"}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            for i in range(args.trajectories)
        ]
        latencies = _latencies(args)
        _measure(engine, tokenizer, prompts[:2], latencies[:2], args, "independent")  # warm the engine
        runs = {
            s: _measure(engine, tokenizer, prompts, latencies, args, s) for s in ("independent", "turn_synchronous")
        }
        engine.shutdown()
    result = {
        "independent_trajectories_per_second": args.trajectories / runs["independent"]["seconds"],
        "turn_synchronous_trajectories_per_second": args.trajectories / runs["turn_synchronous"]["seconds"],
        "speedup": runs["turn_synchronous"]["seconds"] / runs["independent"]["seconds"],
        "tool_seconds_total": sum(map(sum, latencies)),
        "runs": runs,
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        write_atomic(args.json, text + "\n")
    return result


if __name__ == "__main__":
    main()
