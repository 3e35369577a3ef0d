"""``hybridflow train`` with two colocated SGLang replicas (tp=1 each) on the quickstart's EP=2 actor,
starting from a Hugging Face model directory (``model.path``: the shared SFT warm-up exported as a
user's SFT model would be).

Each actor rank drives one replica; the step's prompts are pulled in chunks by whichever replica
is free, every push reaches both replicas, and the run learns. A run killed mid-way and resumed
reproduces the uninterrupted one exactly: each chunk is sampled with its own seed, so no sample
depends on which replica served it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.injection import environment
from tests.test_train import LOGPROB_TOL, _deterministic, _history, _ok, _train

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1500)]

REPLICAS = [
    "rollout.tp=1",
    "rollout.num_replicas=2",
    "sft.steps=0",
    "model.init=pretrained",
    "run.steps=8",
    "run.checkpoint_every=4",
    "run.heldout_prompts=20",
    "run.prompts_per_step=16",
    "rollout.n=8",
]
SAMPLES = 16 * 8


@pytest.fixture(scope="module")
def replicas(pretrained_dir) -> list[str]:
    """The replica runs' overrides: RL from the exported warm-up (no SFT)."""
    return [*REPLICAS, f"model.path={pretrained_dir}"]


@pytest.fixture(scope="module")
def replica_run(tmp_path_factory, replicas) -> Path:
    out = tmp_path_factory.mktemp("replicas") / "full"
    _ok(_train(out, *replicas))
    return out


@pytest.mark.claim("model-path-e2e")
def test_the_run_starts_from_the_model_directory(replica_run: Path, pretrained_dir: Path) -> None:
    """No SFT ran, yet the held-out reward before RL is the warm-up's (a random model scores 0): the
    actor started from the directory's weights, the engines from its files, and the engines'
    log-probs equal the trainer's at the first step."""
    summary = json.loads((replica_run / "summary.json").read_text())
    assert summary["heldout_reward_after_sft"] >= 0.1, summary
    assert summary["first_step_logprob_diff_max"] < LOGPROB_TOL
    assert not (replica_run / "checkpoints" / "sft").exists()
    config = (replica_run / "model" / "config.json").read_bytes()
    assert config == (pretrained_dir / "config.json").read_bytes()
    assert not list((replica_run / "model").glob("*.safetensors"))


@pytest.mark.claim("model-path-e2e")
def test_the_exported_model_carries_the_starting_models_tokenizer(
    replica_run: Path, pretrained_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_adapters.convert import mcore_to_hf

    out = tmp_path / "rl_hf"
    mcore_to_hf(replica_run / "checkpoints" / "step_000008" / "actor", out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (pretrained_dir / name).read_bytes(), name
    assert AutoTokenizer.from_pretrained(str(out)).chat_template
    AutoModelForCausalLM.from_pretrained(str(out))


@pytest.mark.claim("replicas-share-the-work")
@pytest.mark.features("replicas")
def test_two_colocated_replicas_share_the_work_receive_every_push_and_learn(replica_run: Path) -> None:
    summary = json.loads((replica_run / "summary.json").read_text())
    assert summary["heldout_reward_after_rl"] > summary["heldout_reward_after_sft"], summary
    history = _history(replica_run, "step_000008")
    for h in history:
        counts = [h["rollout/replica0/samples"], h["rollout/replica1/samples"]]
        assert sum(counts) == SAMPLES, h
        # samples from both replicas score like the trainer: both hold the pushed weights
        assert h["rollout/logprob_diff_max"] < LOGPROB_TOL, h
        if "sync/engine_bytes" in h:
            assert h["sync/replica0/engine_bytes"] == h["sync/replica1/engine_bytes"] > 0, h
    assert sum(h["rollout/replica1/samples"] for h in history) > 0  # the second replica generated
    assert sum(h["rollout/replica0/samples"] for h in history) > 0


@pytest.mark.claim("restart-reproduces", "replica-failure-named")
def test_a_replica_failing_mid_generation_stops_the_step_by_name_and_the_run_resumes(
    replica_run: Path, tmp_path: Path, replicas
) -> None:
    """The uninterrupted run's step-4 checkpoint in a fresh directory (the run as it stood when it
    saved step 4): its restart fails in step 5's generation, saves nothing more, and the next
    restart reproduces the uninterrupted run's steps 5-8."""
    import shutil

    out = tmp_path / "failed"
    shutil.copytree(replica_run / "checkpoints" / "step_000004", out / "checkpoints" / "step_000004")
    # generate call 1 of the restarted process is step 5's
    failed = _train(out, *replicas, env=environment(REPLICA_FAILURE="1@1"))
    assert failed.returncode != 0
    assert "ReplicaFailed: rollout replica 1 (driven by rank 1) failed mid-generation" in failed.stderr
    assert f"resuming from {out / 'checkpoints' / 'step_000004'}" in failed.stdout, failed.stdout[-2000:]
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved == ["step_000004"], saved
    _ok(_train(out, *replicas))
    assert _deterministic(_history(out, "step_000008")) == _deterministic(_history(replica_run, "step_000008"))
