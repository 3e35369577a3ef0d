"""The runtime's single-process pieces: tensor plumbing, checkpoint bookkeeping, reports, NaN policy."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.lowering import Stage
from hybridflow.runtime import loop, report, state
from hybridflow.runtime.batch import from_response, pad_rows, to_response
from hybridflow.runtime.engine_client import EngineClient
from hybridflow.runtime.model_dir import _mismatches, hf_overrides, rollout_model_dir
from hybridflow.runtime.ops import NonFiniteStep, step_seed
from hybridflow.runtime.session import Models, RunContext, RunData, Session
from hybridflow.runtime.step import Inputs, Produced, Step, UndeclaredRead


def test_response_views_round_trip() -> None:
    # two rows: prompt lengths 2 and 3, responses of 3 and 1 tokens, T = 5
    x = torch.tensor([[0, 0, 1, 2, 3], [0, 0, 0, 7, 0]], dtype=torch.float32)
    lengths = torch.tensor([2, 3])
    r = to_response(x, lengths, 3)
    assert r.tolist() == [[1, 2, 3], [7, 0, 0]]
    assert from_response(r, lengths, 5).tolist() == x.tolist()


def test_pad_rows_adds_rows_without_tokens() -> None:
    batch = {"input_ids": torch.arange(6).view(3, 2), "response_mask": torch.ones(3, 2), "advantages": torch.ones(3, 2)}
    padded, rows = pad_rows(batch, 4)
    assert rows == 3 and padded["input_ids"].shape == (4, 2)
    assert padded["response_mask"][3].sum() == 0 and padded["advantages"][3].sum() == 0
    same, rows = pad_rows(batch, 3)
    assert same is batch and rows == 3


def test_step_seeds_differ_per_step_and_draw() -> None:
    seeds = {step_seed(1234, s, d) for s in range(50) for d in range(3)}
    assert len(seeds) == 150


def _checkpoint(root: Path, name: str, step: int) -> Path:
    path = root / "checkpoints" / name
    path.mkdir(parents=True)
    state.save_state(path, state.RunState(step=step))
    return path


def test_resume_takes_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    assert state.latest_checkpoint(tmp_path) is None
    _checkpoint(tmp_path, "sft", 0)
    assert state.latest_checkpoint(tmp_path).name == "sft"
    _checkpoint(tmp_path, "step_000002", 2)
    _checkpoint(tmp_path, "step_000010", 10)
    (tmp_path / "checkpoints" / "step_000012.partial").mkdir()  # a crash while writing
    assert state.latest_checkpoint(tmp_path).name == "step_000010"
    assert state.read_state(state.latest_checkpoint(tmp_path)).step == 10
    with pytest.raises(ValueError, match="run.resume=auto"):
        state.resume_point(tmp_path, "never")
    state.prune(tmp_path, keep=1)
    assert [p.name for p in state.checkpoint_dirs(tmp_path)] == ["step_000010"]


def test_a_reward_model_run_resumes_from_its_newest_checkpoint_after_the_sft(tmp_path: Path) -> None:
    """``run.mode=rm`` writes ``rm_<step>`` after the SFT: newer than ``sft``, older than any RL step."""
    _checkpoint(tmp_path, "sft", 0)
    for step in (50, 100, 150):
        _checkpoint(tmp_path, f"rm_{step:06d}", 0)
    assert [p.name for p in state.rm_progress_dirs(tmp_path)] == ["rm_000050", "rm_000100", "rm_000150"]
    assert state.latest_checkpoint(tmp_path).name == "rm_000150"
    state.prune(tmp_path, keep=2)
    assert [p.name for p in state.rm_progress_dirs(tmp_path)] == ["rm_000100", "rm_000150"]
    assert (tmp_path / "checkpoints" / "sft").is_dir()
    _checkpoint(tmp_path, "step_000001", 1)
    assert state.latest_checkpoint(tmp_path).name == "step_000001"


def test_an_unreadable_run_state_names_the_file(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, "step_000001", 1)
    (path / "state.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"step_000001/state.json"):
        state.read_state(path)


def test_summary_and_plot(tmp_path: Path) -> None:
    cfg = load_config("configs/quickstart_cpu.yaml")
    run = state.RunState(
        step=2,
        heldout_after_sft=0.25,
        sft_losses=[3.0, 1.0],
        heldout=[(0, 0.25), (2, 0.5)],
        history=[{"step": 1, "reward/mean": 0.2}, {"step": 2, "reward/mean": 0.4}],
    )
    summary = report.summarise(
        cfg,
        run,
        heldout_after_rl=0.5,
        wall_seconds=12.0,
        data_rows_skipped={"train": 0, "heldout": 0},
        reward_errors=0,
        extra={},
    )
    for key, value in (
        ("heldout_reward_after_sft", 0.25),
        ("heldout_reward_after_rl", 0.5),
        ("steps", 2),
        ("wall_seconds", 12.0),
        ("train_reward_last", 0.4),
    ):
        assert summary[key] == value
    path = report.write_summary(tmp_path, summary)
    assert json.loads(path.read_text())["steps"] == 2
    assert report.plot_rewards(tmp_path, run).read_bytes()[:4] == b"\x89PNG"
    screen = report.format_summary(summary, tmp_path)
    assert "after RL 0.500" in screen
    assert "left out     0 bad data rows, 0 reward errors\n" in screen  # a clean run says it is clean


@pytest.mark.claim("bad-rows-and-reward-errors")
def test_skipped_rows_and_reward_errors_reach_the_screen_and_summary_json(tmp_path: Path) -> None:
    cfg = load_config("configs/quickstart_cpu.yaml")
    summary = report.summarise(
        cfg,
        state.RunState(),
        heldout_after_rl=None,
        wall_seconds=1.0,
        data_rows_skipped={"train": 3, "heldout": 1},
        reward_errors=2,
        extra={},
    )
    saved = json.loads(report.write_summary(tmp_path, summary).read_text())
    assert saved["data_rows_skipped"] == {"train": 3, "heldout": 1} and saved["reward_errors"] == 2
    (line,) = [x for x in report.format_summary(saved, tmp_path).splitlines() if "left out" in x]
    assert "4 bad data rows (train 3, heldout 1; see data.on_bad_row)" in line
    assert "2 reward errors (scored 0; see reward.on_error)" in line


def test_the_rollout_model_directory_matches_the_config() -> None:
    cfg = load_config("configs/quickstart_cpu.yaml")
    overrides = hf_overrides(cfg.model)
    assert overrides["num_experts"] == cfg.model.num_experts
    other = load_config("configs/quickstart_cpu.yaml", ["model.num_experts=8"]).model
    assert _mismatches(cfg.model, other) == ["model.num_experts: config 4, directory 8"]


@pytest.mark.claim("engine-starts-without-weights")
@pytest.mark.parametrize("config", ["quickstart_cpu.yaml", "grpo_qwen3_235b.yaml"])
def test_the_rollout_model_directory_holds_configs_and_tokenizer_but_no_weights(config, tmp_path) -> None:
    """The engine starts without weights (load_format="dummy"), so even a 235B model's directory
    is written at once: nothing is built or saved but configs and the tokenizer."""
    from hybridflow.rollout.tiny import to_hybridflow_model_config

    cfg = load_config(f"configs/{config}")
    path = rollout_model_dir(cfg.model, tmp_path / "model", seed=0)
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= names
    assert not [n for n in names if n.endswith((".safetensors", ".bin"))], names
    assert to_hybridflow_model_config(path) == cfg.model.architecture
    assert json.loads((path / "config.json").read_text())["architectures"]  # SGLang picks its model class by it
    stamp = (path / "config.json").stat().st_mtime_ns
    assert rollout_model_dir(cfg.model, path, seed=0) == path  # a resumed run reuses it
    assert (path / "config.json").stat().st_mtime_ns == stamp


class _Tracker:
    def __init__(self) -> None:
        self.logged = []

    def log_metrics(self, metrics, step):
        self.logged.append((step, metrics))


def _fake_session(on_nan: str, steps: int = 3):
    cfg = load_config(
        "configs/quickstart_cpu.yaml",
        [f"run.on_nan={on_nan}", f"run.steps={steps}", "run.heldout_every=0", "run.samples_per_step=0"],
    )  # the fake stages' responses carry no samples
    run = RunContext(
        cfg=cfg, out_dir=Path("unused"), rank=1, state=state.RunState(), tracker=_Tracker(), shard=_NoRanks()
    )
    data = RunData(tokenizer=None, train_prompts=[], heldout_prompts=[], sampler=SimpleNamespace(batch=lambda step: []))
    models = Models(spec=None, algo=cfg.algorithm, kl_reward=None)
    return Session(run=run, data=data, models=models, engines=EngineClient(cfg, Path("unused")))


class _NoRanks:
    group = None


def _done(**extra) -> Produced:
    """What the fake stages return: a step's responses and scores (the loop's metrics read them)."""
    responses = SimpleNamespace(lengths=torch.ones(2), truncated=torch.zeros(2), seconds=1.0)
    return Produced({"responses": responses, "scores": torch.ones(2), **extra})


def _graph_raising_at(bad_step: int):
    calls = []

    def update(s, node, f, step):
        calls.append(step.index)
        if step.index == bad_step:
            raise NonFiniteStep(f"step {step.index}: not finite")
        return _done()

    node = SimpleNamespace(
        name="update_actor", op="fake_update", role="actor", inputs=(), outputs=("responses", "scores")
    )
    stage = Stage(node=node, pool="colocated", ranks=range(1), layout="megatron")
    return SimpleNamespace(stages=(stage,), start_mode=None), update, calls


@pytest.mark.claim("non-finite-never-applied")
def test_a_nan_step_stops_the_run_before_any_checkpoint(monkeypatch) -> None:
    graph, update, calls = _graph_raising_at(1)
    monkeypatch.setitem(loop.OPS, "fake_update", update)
    monkeypatch.setattr(loop.dist, "barrier", lambda: None)
    saved = []
    s = _fake_session("stop")
    with pytest.raises(NonFiniteStep):
        loop.train_rl(s, graph, save=saved.append)
    assert calls == [0, 1] and s.run.state.step == 1 and saved == []


@pytest.mark.claim("non-finite-never-applied")
def test_a_nan_step_is_skipped_when_configured(monkeypatch) -> None:
    graph, update, calls = _graph_raising_at(1)
    monkeypatch.setitem(loop.OPS, "fake_update", update)
    monkeypatch.setattr(loop.dist, "barrier", lambda: None)
    saved = []
    s = _fake_session("skip")
    loop.train_rl(s, graph, save=saved.append)
    assert calls == [0, 1, 2] and s.run.state.step == 3 and saved == [3]
    skipped = {"step": 2, "actor/skipped_step": 1.0, "actor/rolled_back": 0.0, "checks/failed": 0.0}
    assert s.run.state.history[1] == skipped


class _Role:
    """A trained role that counts its updates and can snapshot / roll back that count."""

    def __init__(self) -> None:
        self.updates = 0

    def snapshot(self):
        return self.updates

    def rollback(self, updates):
        self.updates = updates


@pytest.mark.claim("skipped-step-rolled-back")
def test_a_skipped_step_rolls_back_every_update_it_made(monkeypatch) -> None:
    """The critic's update and the actor's first mini-batch went through when the actor's second
    one is not finite: with run.on_nan=skip both are undone, and later steps train normally."""

    def critic_update(s, node, f, step):
        step.undo.before_update(s.models.critic)
        s.models.critic.updates += 1
        return Produced({"critic_done": True})

    def actor_update(s, node, f, step):
        step.undo.before_update(s.models.actor)
        s.models.actor.updates += 1
        if step.index == 1:
            raise NonFiniteStep(f"step {step.index}: mini-batch 2 not finite")
        s.models.actor.updates += 1
        return _done()

    monkeypatch.setitem(loop.OPS, "fake_critic", critic_update)
    monkeypatch.setitem(loop.OPS, "fake_actor", actor_update)
    monkeypatch.setattr(loop.dist, "barrier", lambda: None)
    stages = tuple(
        Stage(
            node=SimpleNamespace(name=name, op=op, role=role, inputs=(), outputs=outputs),
            pool="colocated",
            ranks=range(1),
            layout="megatron",
        )
        for name, op, role, outputs in (
            ("update_critic", "fake_critic", "critic", ("critic_done",)),
            ("update_actor", "fake_actor", "actor", ("responses", "scores")),
        )
    )
    s = _fake_session("skip")
    s.models.actor, s.models.critic = _Role(), _Role()
    loop.train_rl(s, SimpleNamespace(stages=stages, start_mode=None), save=lambda step: None)
    assert (s.models.actor.updates, s.models.critic.updates) == (4, 2)  # steps 0 and 2 only
    assert s.run.state.history[1]["actor/rolled_back"] == 1.0


class _Recorder:
    """A policy or engine stand-in that records the calls a switch makes."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def offload_training_state(self):
        self.calls.append(f"{self.name} offload")

    def restore_training_state(self):
        self.calls.append(f"{self.name} restore")

    def release_memory(self, tags):
        self.calls.append(f"engine release {'+'.join(tags)}")

    def resume_memory(self, tags):
        self.calls.append(f"engine resume {'+'.join(tags)}")


@pytest.mark.claim("plan-is-what-runs")
def test_switches_execute_the_plans_values_in_order():
    from hybridflow.lowering import lower
    from hybridflow.runtime import switches

    cfg = load_config("configs/quickstart_cpu.yaml", ["algorithm.name=ppo", "critic.enabled=true"])
    calls = []
    s = _switched(cfg, calls, critic=True)
    plan = lower(cfg, with_reshard=False)
    switches.enter(s, plan.start_mode)  # from everything resident to the step's start (sync)
    for stage in plan.stages:
        if stage.switch is not None:
            switches.apply(s, stage.switch)
    assert calls == [
        "actor offload",
        "critic offload",
        "engine release kv_cache+cuda_graph",  # -> sync
        "engine resume kv_cache+cuda_graph",  # -> generate
        "engine release weights+kv_cache+cuda_graph",
        "actor restore",
        "critic restore",  # -> train
        "actor offload",
        "critic offload",
        "engine resume weights",
    ]  # -> sync
    assert s.mode == "sync"
    calls.clear()
    switches.enter(s, "generate")
    switches.enter(s, "sync")  # generating GPUs already hold what a sync needs
    assert calls == ["engine resume kv_cache+cuda_graph"]
    separate = _switched(load_config("configs/quickstart_cpu.yaml", ["rollout.placement=separate"]), [])
    switches.enter(separate, "train")  # engines on their own GPUs: nothing moves
    assert separate.mode is None


def _switched(cfg, calls: list, *, critic: bool = False, mode: str | None = None) -> SimpleNamespace:
    """What a switch touches of a session (the models and the engine), recording its calls."""
    return SimpleNamespace(
        cfg=cfg,
        mode=mode,
        models=SimpleNamespace(actor=_Recorder("actor", calls), critic=_Recorder("critic", calls) if critic else None),
        engines=SimpleNamespace(engine=_Recorder("engine", calls)),
    )


def test_an_op_returning_undeclared_fields_stops_the_step(monkeypatch) -> None:
    graph, update, calls = _graph_raising_at(99)
    graph.stages[0].node.outputs = ("responses",)  # the op also returns scores
    monkeypatch.setitem(loop.OPS, "fake_update", update)
    with pytest.raises(AssertionError, match=r"returned fields \['responses', 'scores'\]; the node declares"):
        loop.run_step(_fake_session("stop"), graph.stages, Step(0))


@pytest.mark.claim("ops-read-only-edges")
def test_an_op_reading_a_field_its_node_does_not_declare_stops_the_step(monkeypatch) -> None:
    """Every value that passes between ops is an edge `hybridflow plan` prints: an op that reads
    (or asks for) anything else fails at once, naming the field and the node."""

    def peeking(s, node, f, step):
        assert "prompts" in f and len(f["prompts"]) == 0  # declared: readable
        return _done(weights=f["scores_of_another_op"])

    node = SimpleNamespace(
        name="peek", op="fake_peek", role="driver", inputs=("prompts",), outputs=("responses", "scores", "weights")
    )
    monkeypatch.setitem(loop.OPS, "fake_peek", peeking)
    stages = (Stage(node=node, pool="colocated", ranks=range(1), layout="megatron"),)
    with pytest.raises(UndeclaredRead, match=r"node 'peek' read field 'scores_of_another_op', which the node does not"):
        loop.run_step(_fake_session("stop"), stages, Step(0))
    view = Inputs(node, {"prompts": [], "answers": []})
    assert list(view) == ["prompts"] and len(view) == 1
    with pytest.raises(UndeclaredRead):
        _ = "answers" in view  # asking is reading: an op cannot branch on a field it was not given
    with pytest.raises(UndeclaredRead):
        view.get("answers")


def test_a_skipped_sync_still_brings_the_engine_in_for_the_next_generation():
    from hybridflow.runtime import switches

    calls = []
    s = _switched(load_config("configs/quickstart_cpu.yaml"), calls, mode="train")  # the step stopped mid-way
    switches.enter(s, "generate")  # what the loop does before the next step's generate stage
    assert calls == ["actor offload", "engine resume weights+kv_cache+cuda_graph"] and s.mode == "generate"


def _protocol_members(protocol: type) -> set[str]:
    """The attributes and methods a Protocol class declares (not those of ``Protocol`` itself)."""
    methods = {name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")}
    return set(getattr(protocol, "__annotations__", {})) | methods


def test_an_inactive_tracker_has_everything_the_runtime_calls_on_its_metric_sink(tmp_path: Path) -> None:
    from hybridflow.runtime.session import MetricSink
    from hybridflow.runtime.tracking import Tracker

    tracker = Tracker(load_config("configs/quickstart_cpu.yaml", [f"run.output_dir={tmp_path}"]), active=False)
    members = {"run_id", "uri", "wandb_run_id", "log_params", "log_metrics", "log_table", "log_artifact", "close"}
    assert _protocol_members(MetricSink) == members
    assert all(hasattr(tracker, name) for name in _protocol_members(MetricSink))
    assert tracker.run_id is None and tracker.uri is None


def test_load_prompts_counts_the_bad_rows_it_skips_by_data_set(tmp_path: Path) -> None:
    from hybridflow.rollout.tiny import make_tiny_tokenizer
    from hybridflow.runtime.session import load_prompts

    good = json.dumps({"prompt": "1+2=", "reward_model": {"ground_truth": 3}, "sft_response": "3"})
    too_long = json.dumps({"prompt": "1+2=" * 40, "reward_model": {"ground_truth": 3}, "sft_response": "3"})
    train, heldout = tmp_path / "train.jsonl", tmp_path / "heldout.jsonl"
    train.write_text("\n".join([good, "{not json", too_long, good]) + "\n")
    heldout.write_text("\n".join([good, json.dumps({"reward_model": {"ground_truth": 1}})]) + "\n")
    overrides = ["data.on_bad_row=skip", "data.max_prompt_length=32"]
    cfg = load_config("configs/quickstart_cpu.yaml", [*overrides, "data.max_dropped_share=1.0"])
    prompts, held, skipped = load_prompts(cfg, make_tiny_tokenizer(), [str(train)], [str(heldout)])
    assert (len(prompts), len(held)) == (2, 1)
    assert skipped == {"train": 2, "heldout": 1}  # unreadable and too long both count
    # by default a run that would drop half its data refuses, naming the setting that keeps it
    with pytest.raises(ValueError) as refused:
        load_prompts(load_config("configs/quickstart_cpu.yaml", overrides), make_tiny_tokenizer(), [str(train)], [])
    assert str(refused.value) == (
        "data.train_files: 2 of 4 training rows (50%) would be dropped (1 malformed (see the warnings above), "
        "1 too long), more than data.max_dropped_share=0.05; data.max_prompt_length=173 keeps the 1 too long "
        "(the longest has 173 tokens); fix or remove the malformed rows (or raise data.max_dropped_share)"
    )


def test_reward_errors_survive_a_resume_and_old_states_still_load(tmp_path: Path) -> None:
    (tmp_path / "new").mkdir()
    state.save_state(tmp_path / "new", state.RunState(step=2, reward_errors=3))
    assert state.read_state(tmp_path / "new").reward_errors == 3
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "state.json").write_text(json.dumps({"step": 2}))  # written before the field
    assert state.read_state(tmp_path / "old").reward_errors == 0
