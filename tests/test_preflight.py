"""What ``hybridflow train`` checks before any rank starts (``hybridflow.preflight``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hybridflow.config import load_config
from hybridflow.preflight import check_runtime_support, preflight

QUICKSTART = str(Path(__file__).resolve().parents[1] / "configs" / "quickstart_cpu.yaml")


@pytest.mark.parametrize(
    "overrides, key",
    [
        (
            ["rollout.num_replicas=2", "rollout.sync_route=full", "rollout.placement=separate"],
            "rollout.num_replicas=2 with rollout.sync_route=full and rollout.tp=2",
        ),
        (
            ["rollout.placement=separate", "rollout.engine=hf", "rollout.sync_route=full", "rollout.tp=1"],
            "rollout.placement=separate with rollout.engine=hf",
        ),
        (["rollout.placement=separate", "rollout.gpus_per_node=1"], "separate engines spanning nodes"),
        (["rollout.gpus_per_node=3", "rollout.tp=4", "actor.parallel.dp=4"], "rollout.tp=4 does not fill whole nodes"),
        (["critic.enabled=true", "algorithm.name=ppo", "critic.parallel.ep=1"], "critic.parallel differs"),
        (["actor.backend=fsdp2"], "actor.parallel.ep=2 with actor.backend=fsdp2: FSDP2 shards every parameter"),
        (["reference.backend=fsdp2"], "reference.backend=fsdp2 with actor.backend=megatron: a run trains every"),
    ],
)
@pytest.mark.claim("preflight-one-line")
def test_what_the_runtime_cannot_run_is_refused_with_the_key_and_the_fix(overrides, key):
    cfg = load_config(QUICKSTART, overrides)
    with pytest.raises(ValueError, match=key) as error:
        check_runtime_support(cfg)
    assert "set " in str(error.value)


@pytest.mark.claim("fsdp2-quickstart")
@pytest.mark.parametrize(
    "overrides, key",
    [
        (["actor.parallel.ep=1"], "model.family=qwen3_moe (MoE) with actor.backend=fsdp2"),
        (
            ["actor.parallel.ep=1", "model.family=qwen3", "model.num_experts=0", "run.mode=rm"],
            "run.mode=rm is not built",
        ),
        (
            [
                "actor.parallel.ep=1",
                "model.family=qwen3",
                "model.num_experts=0",
                "actor.parallel.cp=4",
                "actor.parallel.dp=1",
            ],
            "actor.parallel.cp=4 does not divide model.num_kv_heads=2",
        ),
        (
            ["actor.parallel.ep=1", "model.family=qwen3", "model.num_experts=0", "lora.enabled=true"],
            "lora.enabled=true",
        ),
        (
            ["actor.parallel.ep=1", "model.family=qwen3", "model.num_experts=0", "distillation.teacher_path=/x"],
            "distillation.teacher_path is not built",
        ),
    ],
)
def test_what_the_fsdp2_backend_does_not_train_is_refused_by_name(overrides, key):
    cfg = load_config(QUICKSTART, ["actor.backend=fsdp2", *overrides])
    with pytest.raises(ValueError, match=re.escape(key)) as error:
        check_runtime_support(cfg)
    (line,) = str(error.value).splitlines()
    assert "actor.backend=megatron" in line or "set actor.parallel.cp to a divisor" in line  # the fix, named


def test_the_quickstart_passes_preflight(tmp_path):
    preflight(load_config(QUICKSTART, [f"run.output_dir={tmp_path}"]))


@pytest.mark.claim("output-dir-checked")
def test_an_output_dir_that_cannot_hold_the_run_is_refused_in_one_line(tmp_path, monkeypatch):
    """A file, a place this user cannot write (/sys), and a file system without room for one
    checkpoint (its free space reported small): each named with the key and the fix, before any
    rank starts; nothing is created."""
    import shutil
    from collections import namedtuple

    (tmp_path / "a_file").write_text("keep me\n")
    for where, says in (
        (tmp_path / "a_file", "is a file, not a directory"),
        (tmp_path / "a_file" / "run", "lies under"),
        (Path("/sys/hybridflow_run"), "cannot be written"),
    ):
        with pytest.raises(ValueError, match=rf"^run.output_dir={where} {says}.*; set run.output_dir to"):
            preflight(load_config(QUICKSTART, [f"run.output_dir={where}"]))
    assert (tmp_path / "a_file").read_text() == "keep me\n"
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 << 30, 10 << 30, 1 << 20))
    out = tmp_path / "new" / "run"
    with pytest.raises(
        ValueError,
        match=rf"^run.output_dir={out}: its file system has 1.05 MB free, less than one "
        r"checkpoint of this run \(about 1.62 MB.*set run.output_dir to a larger",
    ):
        preflight(load_config(QUICKSTART, [f"run.output_dir={out}"]))
    assert not (tmp_path / "new").exists()


@pytest.mark.claim("gpu-count-refused")
def test_a_layout_that_needs_more_gpus_than_the_node_has_is_refused(tmp_path, monkeypatch):
    import torch

    cfg = load_config(QUICKSTART, [f"run.output_dir={tmp_path}"])  # 2 ranks
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr("moe.routes.check_replay_device", lambda *a, **k: None)
    with pytest.raises(ValueError) as error:
        preflight(cfg)
    message = str(error.value)
    assert "actor.parallel needs 2 GPUs" in message and "this node has 1" in message
    assert "lower actor.parallel.dp" in message and "\n" not in message


@pytest.mark.claim("separate-refused-shapes")
def test_separate_placement_passes_for_train_and_counts_the_engine_ranks(tmp_path, monkeypatch):
    import torch

    from hybridflow.preflight import check_separate_nodes, process_count

    cfg = load_config(QUICKSTART, [f"run.output_dir={tmp_path}", "rollout.placement=separate"])
    preflight(cfg)  # 2 actor ranks + 2 engine ranks (tp=2)
    assert process_count(cfg) == 4
    preflight(cfg, command="launch")
    check_separate_nodes(cfg, 2)  # actor ranks on one node, the tp=2 engine on the next
    with pytest.raises(ValueError, match="engine replica 0 \\(ranks 2..3\\) would span two nodes of 3"):
        check_separate_nodes(cfg, 3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr("moe.routes.check_replay_device", lambda *a, **k: None)
    with pytest.raises(ValueError, match="actor.parallel \\+ the ranks of their own needs 4 GPUs"):
        preflight(cfg)


# --------------------------------------------------------------------------- reward, data, engine, resume


def _refusal(tmp_path, *overrides: str, capsys=None) -> str:
    """The one line ``hybridflow train`` prints before exiting 2 (no rank is started)."""
    from hybridflow.cli import main

    assert main(["train", QUICKSTART, f"run.output_dir={tmp_path / 'run'}", *overrides]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    return line


def _jsonl(path: Path, *rows: dict) -> str:
    import json

    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _parquet(path: Path, *rows: dict) -> str:
    from hybridflow.data import write_parquet

    return str(write_parquet(path, rows))


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


ROW = {"prompt": "1+1=", "reward_model": {"ground_truth": 2}, "data_source": "arithmetic", "sft_response": "2"}


@pytest.mark.claim("preflight-one-line")
def test_a_misspelled_reward_function_stops_train_before_any_rank_starts(tmp_path, capsys):
    line = _refusal(tmp_path, "reward.function=mxa", capsys=capsys)
    assert line.startswith("hybridflow train: error: reward.function='mxa' is not a registered reward")
    assert "did you mean 'max'?" in line


def test_plan_resolves_the_reward_function_too(capsys):
    from hybridflow.cli import main

    assert main(["plan", QUICKSTART, "reward.function=my_rewards.score", "--no-reshard"]) == 2
    assert "cannot import module 'my_rewards'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "make, overrides, expected",
    [
        (lambda d: str(d / "missing.jsonl"), (), "data.train_files[0]={}: no such file (relative paths are read from"),
        (
            lambda d: _jsonl(d / "empty.jsonl"),
            (),
            "data.train_files[0]={}: the file holds no rows; fill it or remove it from data.train_files",
        ),
        (
            lambda d: _jsonl(d / "q.jsonl", {"question": "1+1=", "answer": 2}),
            (),
            "data.train_files[0]={}: none of its first 1 rows is usable (line 1 (1-based): no prompt column 'prompt' "
            "(data.prompt_key)); its columns: question, answer; set data.prompt_key",
        ),
        (
            lambda d: _jsonl(d / "noans.jsonl", {"prompt": "1+1=", "sft_response": "2"}),
            (),
            "no value under 'reward_model' (reading 'reward_model.ground_truth')",
        ),
        (
            lambda d: _jsonl(d / "nosft.jsonl", {k: v for k, v in ROW.items() if k != "sft_response"}),
            (),
            "no SFT response in 'sft_response' (sft.response_key)",
        ),
        (
            lambda d: _jsonl(d / "bad.jsonl", ROW, {"prompt": ""}),
            ("data.on_bad_row=fail",),
            "data.train_files[0]={}: line 2 (1-based): empty prompt in 'prompt'; fix the row, or set "
            "data.on_bad_row=skip",
        ),
        (
            lambda d: str(d / "rows.csv"),
            (),
            "data.train_files[0]={}: unsupported data file extension '.csv'; convert it to one of: .jsonl, .parquet",
        ),
        (
            lambda d: _parquet(d / "q.parquet", {"question": "1+1=", "answer": 2}),
            (),
            "data.train_files[0]={}: none of its first 1 rows is usable (row 0 (0-based): no prompt column 'prompt'",
        ),
        (lambda d: _write(d / "text.parquet", b"not parquet"), (), "data.train_files[0]={}: cannot be read ("),
        (
            lambda d: _write(d / "binary.jsonl", b"\xff\xfe\x00"),
            (),
            "data.train_files[0]={}: none of its first 1 rows is usable (line 1 (1-based): not UTF-8 text "
            "(byte 0xff at byte 1 of the line); re-encode the file as UTF-8)",
        ),
    ],
)
@pytest.mark.claim("preflight-one-line")
def test_data_files_are_checked_before_any_rank_starts(tmp_path, capsys, make, overrides, expected):
    path = make(tmp_path)
    line = _refusal(tmp_path, f"data.train_files=[{path}]", *overrides, capsys=capsys)
    assert expected.format(path) in line


def test_a_heldout_file_is_checked_too(tmp_path, capsys):
    good = _jsonl(tmp_path / "train.jsonl", ROW)
    line = _refusal(
        tmp_path, f"data.train_files=[{good}]", f"data.heldout_files=[{good},{tmp_path}/h.jsonl]", capsys=capsys
    )
    assert f"data.heldout_files[1]={tmp_path}/h.jsonl: no such file" in line


@pytest.mark.claim("reward-routing-line")
def test_preflight_states_which_reward_scores_which_data_source_and_warns_when_one_is_bypassed(tmp_path, capsys):
    rows = _jsonl(tmp_path / "train.jsonl", ROW, ROW, {**ROW, "data_source": "my/math_set"})
    preflight(
        load_config(
            QUICKSTART,
            [f"run.output_dir={tmp_path / 'run'}", f"data.train_files=[{rows}]", "reward.function=auto"]
            + ["run.prompts_per_step=2"],
        )
    )
    out = capsys.readouterr()
    assert (
        "hybridflow train: reward (auto): 'arithmetic' (2 rows) -> arithmetic; 'my/math_set' (1 rows) -> math "
        "(the first rows of each file)"
    ) in out.out.splitlines()
    assert out.err == ""
    preflight(
        load_config(
            QUICKSTART, [f"run.output_dir={tmp_path / 'run'}", f"data.train_files=[{rows}]", "run.prompts_per_step=2"]
        )
    )
    out = capsys.readouterr()  # the quickstart's explicit reward.function=max scores every row
    assert "hybridflow train: reward (max): 'arithmetic' (2 rows), 'my/math_set' (1 rows) -> max" in out.out
    assert out.err == (
        "hybridflow train: warning: reward.function='max' scores the rows whose data_source is "
        "'arithmetic', not the registered 'arithmetic' verifier; set reward.function=auto to score "
        "each row by its data_source\n"
    )


def test_the_synthetic_task_routes_by_its_name(tmp_path, capsys):
    preflight(load_config(QUICKSTART, [f"run.output_dir={tmp_path}", "task.name=countdown"]))
    out = capsys.readouterr()
    assert "reward (max): 'countdown' (" in out.out and "not the registered 'countdown' verifier" in out.err


@pytest.mark.claim("preflight-one-line")
def test_sglang_expert_parallelism_is_refused_on_a_cpu_machine(tmp_path, capsys):
    line = _refusal(tmp_path, "rollout.ep=2", capsys=capsys)
    assert line == (
        "hybridflow train: error: rollout.ep=2 on a machine without a GPU: SGLang's CPU engine runs "
        "only ep=1 (its torch-native MoE does not handle non-local experts); set rollout.ep=1 or run "
        "on GPUs"
    )


def _run_dir(root: Path) -> Path:
    """A quickstart run directory with a complete step 2 and step 4."""
    from hybridflow.config import to_yaml
    from tests.runtime.run_dirs import checkpoint

    root.mkdir()
    (root / "config.yaml").write_text(to_yaml(load_config(QUICKSTART, [f"run.output_dir={root}"])))
    for name, step in (("step_000002", 2), ("step_000004", 4)):
        checkpoint(root, name, step)
    return root


@pytest.mark.claim("preflight-one-line")
def test_a_damaged_newest_checkpoint_is_named_and_passed_over_or_refused(tmp_path, capsys):
    from tests.runtime.run_dirs import shard

    run = _run_dir(tmp_path / "run")
    missing = shard(run / "checkpoints" / "step_000004")
    missing.unlink()
    preflight(load_config(QUICKSTART, [f"run.output_dir={run}"]))
    out = capsys.readouterr()
    assert f"hybridflow train: resuming from {run / 'checkpoints' / 'step_000002'}\n" in out.out
    assert out.err.endswith(
        f"hybridflow train: warning: checkpoint step_000004 is damaged: {missing} is missing "
        "(listed in .metadata); the run sets it aside as step_000004.damaged and resumes from "
        "an earlier one (run.resume_fallback=previous)\n"
    )
    assert (run / "checkpoints" / "step_000004").is_dir()  # preflight only looks
    line = _refusal(tmp_path, "run.resume_fallback=stop", capsys=capsys)
    assert line == (
        f"hybridflow train: error: checkpoint step_000004 is damaged: {missing} is missing (listed in "
        f".metadata); set run.resume_fallback=previous to resume from the newest complete checkpoint, "
        f"or move {run / 'checkpoints' / 'step_000004'} away"
    )


@pytest.mark.claim("model-change-refused")
def test_a_model_the_checkpoint_cannot_load_into_is_named_key_by_key(tmp_path, capsys):
    run = _run_dir(tmp_path / "run")
    line = _refusal(tmp_path, "model.num_layers=3", "model.moe_ffn_hidden_size=16", capsys=capsys)
    assert line == (
        "hybridflow train: error: checkpoint step_000004 holds a different model than this config "
        "(model.moe_ffn_hidden_size: 32 -> 16; model.num_layers: 2 -> 3; saved under "
        f"{run / 'config.yaml'}): restore those model keys to resume, or set a new run.output_dir "
        "for a new run"
    )
    preflight(load_config(QUICKSTART, [f"run.output_dir={run}", "run.steps=40"]))
    assert "hybridflow train: changed since step_000004 was saved: run.steps: 30 -> 40\n" in capsys.readouterr().out


@pytest.mark.parametrize("source", ["sft", "initial"])  # the SFT warm-up's, or a random model's initial weights
def test_a_damaged_checkpoint_the_reference_loads_from_is_refused(tmp_path, capsys, source):
    from tests.runtime.run_dirs import checkpoint, shard

    run = _run_dir(tmp_path / "run")
    missing = shard(checkpoint(run, source, 0))
    missing.unlink()
    preflight(load_config(QUICKSTART, [f"run.output_dir={run}"]))  # no KL term: the checkpoint is not read
    line = _refusal(tmp_path, "reference.enabled=true", "algorithm.kl_loss_coef=0.01", capsys=capsys)
    assert line == (
        f"hybridflow train: error: checkpoint {source} is damaged: {missing} is missing (listed in .metadata); "
        "the reference policy loads from it (algorithm.kl_loss_coef / kl_reward_coef > 0): restore its "
        "files, or set a new run.output_dir"
    )


@pytest.mark.claim("data-size-and-overlap-said")
def test_a_data_set_smaller_than_a_step_and_a_held_out_set_that_is_the_training_set_are_said(tmp_path, capsys):
    from hybridflow.data import write_jsonl

    rows = [{"prompt": f"{i}+1=", "reward_model": {"ground_truth": i + 1}} for i in range(6)]
    train, copy = tmp_path / "train.jsonl", tmp_path / "copy.jsonl"
    write_jsonl(train, rows)
    write_jsonl(copy, rows[:3])
    base = [
        f"run.output_dir={tmp_path / 'run'}",
        f"data.train_files=[{train}]",
        "run.prompts_per_step=8",
        "sft.steps=0",
    ]
    preflight(load_config(QUICKSTART, [*base, f"data.heldout_files=[{train}]"]))
    err = capsys.readouterr().err
    assert "warning: data.train_files hold 6 usable rows, fewer than run.prompts_per_step=8: every step" in err
    assert "warning: data.heldout_files[0] is data.train_files[0]: the held-out reward will measure" in err
    preflight(load_config(QUICKSTART, [*base, f"data.heldout_files=[{copy}]", "run.prompts_per_step=4"]))
    err = capsys.readouterr().err
    assert "3 of the first 3 held-out prompts are also among the first training rows" in err
    assert "fewer than run.prompts_per_step" not in err


@pytest.mark.claim("tracking-wandb")
def test_a_tracker_whose_package_is_missing_is_refused_in_one_line(monkeypatch) -> None:
    import importlib.util

    from hybridflow.preflight import check_trackers

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else found(name, *a))
    check_trackers(load_config(QUICKSTART, ["run.tracking.trackers=[mlflow,tensorboard]"]))
    with pytest.raises(ValueError) as refused:
        check_trackers(load_config(QUICKSTART, ["run.tracking.trackers=[mlflow,wandb]"]))
    assert str(refused.value) == (
        "run.tracking.trackers lists wandb, but the wandb package is not installed here: pip install wandb "
        "(requirements/runtime.txt pins it), or drop wandb from the list"
    )


@pytest.mark.claim("trainer-seam")
def test_a_trainer_backend_that_does_not_exist_is_named_with_the_choices():
    from hfschema.checks import ConfigError

    with pytest.raises(ConfigError, match="actor.backend") as error:
        load_config(QUICKSTART, ["actor.backend=deepspeed"])
    assert "megatron" in str(error.value) and "fsdp2" in str(error.value)
    cfg = load_config(QUICKSTART, [])
    assert (cfg.actor.backend, cfg.reference.backend, cfg.critic.backend) == ("megatron", None, None)


@pytest.mark.claim("fsdp2-quickstart")
def test_a_model_transformers_cannot_build_or_a_megatron_checkpoint_is_refused_for_fsdp2(tmp_path):
    import json

    from hfschema.model_source import ModelSource
    from hybridflow.preflight import check_transformers_builds

    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "brand_new_arch", "hidden_size": 8}))
    with pytest.raises(ValueError) as error:
        check_transformers_builds(ModelSource(kind="hf", weights=unknown, files=unknown))
    (line,) = str(error.value).splitlines()
    assert line.startswith(f"model.path={unknown}: transformers ") and "cannot build it as a causal LM" in line
    with pytest.raises(ValueError, match="is a megatron-core checkpoint; actor.backend=fsdp2 reads Hugging Face"):
        check_transformers_builds(ModelSource(kind="mcore", weights=tmp_path, files=tmp_path))


@pytest.mark.claim("fsdp2-ulysses")
def test_megatron_context_parallel_on_a_cpu_is_refused_pointing_to_ulysses():
    from hybridflow.preflight import check_trainer_device

    cfg = load_config(QUICKSTART, ["actor.parallel.cp=2", "actor.parallel.ep=1", "actor.parallel.dp=1"])
    with pytest.raises(ValueError, match="on a CPU use actor.backend=fsdp2 \\(Ulysses sequence parallel"):
        check_trainer_device(cfg, on_gpu=False)
    check_trainer_device(cfg, on_gpu=True)  # TransformerEngine's, on GPUs
