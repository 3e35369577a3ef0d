"""The learning signal watched from step 1: a run whose groups all score alike says so, and why."""

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hybridflow.config import RewardConfig, load_config
from hybridflow.lowering import Stage
from hybridflow.rewards import score_rows
from hybridflow.runtime import loop, state
from hybridflow.runtime.learning_signal import GROUPS_EQUAL, NO_ANSWER, clip_warning, no_signal_warning, signal_metrics
from hybridflow.runtime.ops import Rollout
from hybridflow.runtime.report import format_summary, summarise
from hybridflow.runtime.session import EngineClient, Models, RunContext, RunData, Session
from hybridflow.runtime.shares import single_process

QUICKSTART = "configs/quickstart_cpu.yaml"


def test_signal_metrics_count_groups_whose_rewards_are_all_equal():
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])  # groups 0 and 2 alike, group 1 differs
    no_answer = torch.tensor([False, False, False, False, True, True])
    m = signal_metrics(scores, groups, no_answer)
    assert m[GROUPS_EQUAL] == pytest.approx(2 / 3)
    assert m[NO_ANSWER] == pytest.approx(2 / 6)
    assert m["signal/groups_no_answer"] == pytest.approx(1 / 3)
    # rollout.n=1: no group has peers, so the batch counts as one group
    alone = torch.arange(3)
    assert signal_metrics(torch.zeros(3), alone, torch.zeros(3, dtype=torch.bool))[GROUPS_EQUAL] == 1.0
    assert signal_metrics(torch.tensor([0.0, 1.0, 0.0]), alone, torch.zeros(3, dtype=torch.bool))[GROUPS_EQUAL] == 0.0


def test_scorers_tell_no_answer_in_their_format_from_a_wrong_answer():
    responses = ["So, the answer is 7.", "#### 8", "#### 7", "The answer is \\boxed{7}"]
    sources = ["openai/gsm8k"] * 3 + ["lighteval/MATH"]
    scored = score_rows(responses, ["7"] * 4, sources, RewardConfig())
    assert scored.scores == [0.0, 0.0, 1.0, 1.0]
    assert scored.no_answer == [True, False, False, False]  # the first never wrote "#### <n>"
    # a user's scorer may say so itself, verl style
    mine = score_rows(["x"], ["7"], [None], RewardConfig(function=f"{__name__}.says_no_answer"))
    assert mine.scores == [0.0] and mine.no_answer == [True]


def says_no_answer(response, answer):
    return {"score": 0.0, "reason": "no_answer"}


def _rollout(texts: list[str], n: int) -> Rollout:
    count = len(texts)
    return Rollout(
        batch={},
        texts=texts,
        answers=["7"] * count,
        prompts=["Natalia sold clips ..."] * count,
        sources=["openai/gsm8k"] * count,
        extra_infos=[None] * count,
        rows=torch.arange(count),
        groups=torch.arange(count) // n,
        lengths=torch.full((count,), 6),
        truncated=torch.zeros(count, dtype=torch.bool),
        seconds=1.0,
    )


class _Tracker:
    def __init__(self) -> None:
        self.logged = []

    def log_metrics(self, metrics, step):
        self.logged.append((step, metrics))


def _session(steps: int, texts: list[str], out_dir: Path):
    overrides = [f"run.steps={steps}", "run.heldout_every=0", "checks.no_signal_steps=2", "reward.function=auto"]
    overrides.append("run.samples_per_step=0")  # the fake rollout has texts, not token tensors
    cfg = load_config(QUICKSTART, overrides)
    run = RunContext(
        cfg=cfg,
        out_dir=out_dir,  # the driver writes progress.json and the start-up clock there
        rank=0,
        state=state.RunState(),
        tracker=_Tracker(),
        shard=single_process(),
    )
    data = RunData(tokenizer=None, train_prompts=[], heldout_prompts=[], sampler=SimpleNamespace(batch=lambda step: []))
    s = Session(run=run, data=data, models=Models(spec=None, algo=cfg.algorithm, kl_reward=None), engines=None)
    s.engines = EngineClient(cfg, out_dir)
    generate = SimpleNamespace(name="generate", op="fake_generate", role="rollout", inputs=(), outputs=("responses",))
    reward = SimpleNamespace(
        name="reward",
        op="reward",
        role="reward",
        inputs=("responses", "answers"),
        outputs=("scores",),
        option=lambda key, *default: {"responses_field": "responses", "scores_field": "scores"}.get(key, *default),
    )
    stages = tuple(Stage(node=node, pool="colocated", ranks=range(1), layout="cpu") for node in (generate, reward))
    return s, SimpleNamespace(stages=stages, start_mode=None), _rollout(texts, n=2)


@pytest.mark.claim("no-signal-said")
def test_a_run_whose_scorer_never_finds_an_answer_says_so_in_the_step_line_log_and_summary(
    monkeypatch, caplog, tmp_path
):
    """An instruct model answering "So, the answer is 7." under verl's strict GSM8K check: every
    reward 0, every group alike. The run names the scorer, the reason and an example, and the
    summary says how many steps had no signal."""
    texts = ["So, the answer is 7."] * 4
    s, plan, ro = _session(3, texts, tmp_path)
    monkeypatch.setitem(loop.OPS, "fake_generate", lambda *a: loop.Produced({"responses": ro}))
    monkeypatch.setattr(loop.dist, "barrier", lambda: None)
    with caplog.at_level(logging.WARNING, logger="hybridflow.runtime.loop"):
        loop.train_rl(s, plan, save=lambda step: None)
    history = s.run.state.history
    assert [h[GROUPS_EQUAL] for h in history] == [1.0, 1.0, 1.0] and history[0][NO_ANSWER] == 1.0
    assert loop._step_line(history[0]) == {"reward": "0.000", "signal": "0%"}
    assert all(GROUPS_EQUAL in metrics for _, metrics in s.run.tracker.logged)
    (warning,) = [r.getMessage() for r in caplog.records if "no learning signal" in r.getMessage()]  # once
    assert warning.startswith("step 2: no learning signal for 2 steps in a row: 100% of the responses hold no answer ")
    assert "reward function 'openai/gsm8k'" in warning and "'So, the answer is 7.' (expected '7')" in warning
    assert "sft.response_key" in warning and "reward.function=math_verify" in warning
    summary = summarise(
        s.cfg, s.run.state, heldout_after_rl=None, wall_seconds=1.0, data_rows_skipped={}, reward_errors=0, extra={}
    )
    assert summary["learning_signal"] == {
        "groups_with_signal_mean": 0.0,
        "steps_without_signal": 3,
        "no_answer_mean": 1.0,
    }
    text = format_summary(summary, Path("out"))
    assert "  signal       0% of groups had rewards that differed (mean); 3 steps had none; 100% of responses" in text
    assert "held-out     before RL" in text  # no SFT ran


def test_groups_that_differ_carry_signal_and_no_warning(monkeypatch, caplog, tmp_path):
    s, plan, ro = _session(3, ["#### 7", "#### 8", "#### 8", "#### 7"], tmp_path)
    monkeypatch.setitem(loop.OPS, "fake_generate", lambda *a: loop.Produced({"responses": ro}))
    monkeypatch.setattr(loop.dist, "barrier", lambda: None)
    with caplog.at_level(logging.WARNING):
        loop.train_rl(s, plan, save=lambda step: None)
    assert [h[GROUPS_EQUAL] for h in s.run.state.history] == [0.0] * 3
    assert not [r for r in caplog.records if "no learning signal" in r.getMessage()]


def test_every_answer_alike_names_difficulty_not_format():
    cfg = load_config(QUICKSTART, ["checks.no_signal_steps=1", "reward.function=auto"])
    ro = _rollout(["#### 8", "#### 8"], n=2)
    warning = no_signal_warning(cfg, [], {GROUPS_EQUAL: 1.0, NO_ANSWER: 0.0}, ro)
    assert "every response of a group gets the same score from the reward function 'openai/gsm8k'" in warning
    assert "raise rollout.n or rollout.temperature" in warning
    off = load_config(QUICKSTART, ["checks.no_signal_steps=0"])
    assert no_signal_warning(off, [], {GROUPS_EQUAL: 1.0}, ro) is None


@pytest.mark.claim("response-clip-warned")
def test_responses_that_hit_their_limit_are_warned_about_once_a_run():
    cfg = load_config(QUICKSTART, ["data.max_response_length=16"])
    assert clip_warning(cfg, [], {"response_length/clip_ratio": 0.2}) is None  # under the 0.25 default
    warning = clip_warning(cfg, [], {"response_length/clip_ratio": 0.8})
    assert warning.startswith("80% of this step's responses hit data.max_response_length=16 tokens before they ")
    assert "raise data.max_response_length" in warning
    assert clip_warning(cfg, [{"response_length/clip_ratio": 0.5}], {"response_length/clip_ratio": 0.9}) is None
    off = load_config(QUICKSTART, ["checks.response_clip_ratio=0"])
    assert clip_warning(off, [], {"response_length/clip_ratio": 1.0}) is None


@pytest.mark.claim("wall-time-per-start")
def test_the_summary_gives_the_wall_time_of_each_start():
    cfg = load_config(QUICKSTART, [])
    run_state = state.RunState(step=4, history=[{"step": 4, "reward/mean": 0.5}])
    summary = summarise(
        cfg, run_state, heldout_after_rl=None, wall_seconds=70.0, data_rows_skipped={}, reward_errors=0,
        extra={"wall_seconds_per_start": [50.0, 20.0]},
    )  # fmt: skip
    assert "  wall time    70 s over 2 starts (50, 20 s; this one last)" in format_summary(summary, Path("o"))
    one = dict(summary, wall_seconds_per_start=[70.0])
    assert "  wall time    70 s\n" in format_summary(one, Path("o"))


def test_after_a_warm_up_that_did_not_teach_the_format_the_fix_names_the_warm_up():
    cfg = load_config(QUICKSTART, ["checks.no_signal_steps=1", "reward.function=auto", "sft.steps=50"])
    ro = _rollout(["So, the answer is 8."] * 2, n=2)
    warning = no_signal_warning(cfg, [], {GROUPS_EQUAL: 1.0, NO_ANSWER: 1.0}, ro, [6.5, 4.7])
    assert "the warm-up ran (2 steps, loss 6.500 -> 4.700) without teaching it the format: give it more" in warning
