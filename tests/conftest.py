"""Session-wide test settings.

Every process the tests start (torchrun ranks, ``hybridflow train`` jobs) runs under the device
guard (``megatron_adapters/device_guard.py``): a tensor a GPU run would leave on the host that
reaches a collective or the trainer fails the test, although on this CPU it is on the right device.
"""

import gc
import os
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

DEVICE_GUARD_ENV = "HYBRIDFLOW_DEVICE_GUARD"
"""``megatron_adapters.device_guard.ENV`` (tests/test_device_guard.py checks they agree); spelled
out because importing ``megatron_adapters`` loads megatron-core (seconds) into every test session."""

os.environ.setdefault(DEVICE_GUARD_ENV, "1")

REQUIRE_SLURM_ENV = "HYBRIDFLOW_REQUIRE_SLURM"
"""Set to 1 by ``.ci/run`` once it has started the one-node Slurm cluster: from then on a test
marked ``slurm`` that skips (Slurm missing, or any later skip condition) is reported as failed,
so CI cannot go green without having submitted a job."""


REQUIRE_VLLM_ENV = "HYBRIDFLOW_REQUIRE_VLLM"
"""Set to 1 by ``.ci/run``, which installs vLLM's venv (``scripts/install.sh --vllm``): a test marked
``vllm`` that skips (vLLM missing) is then reported as failed."""

REQUIRED = {"slurm": (REQUIRE_SLURM_ENV, "a Slurm cluster is up"), "vllm": (REQUIRE_VLLM_ENV, "vLLM is installed")}
"""The markers whose skips fail the test where their variable is 1, and what the variable says."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """Where this session collected every test file (the README's test command, CI), every test's
    claims and tier, before ``-m`` deselects the slow tier: tests/test_claims.py reads them here
    instead of collecting the whole suite again in a subprocess (15 s)."""
    from tests.claims_plugin import WHOLE_SUITE, rows_of

    if {Path(str(item.path)) for item in items} >= set(TESTS.rglob("test_*.py")):
        config.stash[WHOLE_SUITE] = rows_of(items)


def pytest_collection_finish(session):
    """Freeze what collection made (torch, megatron-core, SGLang, every test module): it lives as
    long as the session, and the in-process tests' collections need not scan it again (as the
    ranks do after their imports, hfschema/gc_pause.py)."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped:
        return
    for marker, (variable, says) in REQUIRED.items():
        if item.get_closest_marker(marker) and os.environ.get(variable) == "1":
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            report.outcome = "failed"
            report.longrepr = f"{variable}=1 says {says}, but this test skipped: {reason}"


@pytest.fixture(scope="session")
def full_run(tmp_path_factory):
    """The uninterrupted short quickstart run (``tests.test_train.uninterrupted_run``), made once
    for every module whose faulted runs must reproduce it."""
    from tests.test_train import uninterrupted_run

    return uninterrupted_run(tmp_path_factory)


@pytest.fixture(scope="session")
def sft_warm_up(tmp_path_factory):
    """The learning runs' SFT warm-up (``tests.test_train.warm_up_run``), trained once a session."""
    from tests.test_train import warm_up_run

    return warm_up_run(tmp_path_factory)


@pytest.fixture(scope="session")
def seeded(sft_warm_up):
    """``seeded(out)``: ``out`` holds the shared warm-up's SFT checkpoint, so the run started there
    skips the 150 SFT steps every learning run would repeat (``tests.test_train.seed_from_warm_up``)."""
    from tests.test_train import seed_from_warm_up

    return lambda out: seed_from_warm_up(sft_warm_up, out)


@pytest.fixture(scope="session")
def pretrained_dir(sft_warm_up, tmp_path_factory):
    """The shared warm-up exported as a Hugging Face model directory (``convert mcore-to-hf``: its
    safetensors in several shards with their index, the tokenizer and chat template, configs): what
    a user's own SFT model looks like, for runs that start from it with ``model.path``."""
    from megatron_adapters.convert import mcore_to_hf

    out = tmp_path_factory.mktemp("pretrained") / "warm_up_hf"
    mcore_to_hf(sft_warm_up / "checkpoints" / "sft" / "actor", out, shard_bytes=256 << 10)
    return out


@pytest.fixture(scope="session")
def separate_run(tmp_path_factory, seeded):
    """The uninterrupted separate-placement run (``tests.test_train_separate``, two tp=1 engine
    ranks) and its stdout: checked there, and reproduced by the killed engines of
    ``tests/test_engine_restart.py``."""
    from tests.test_train_separate import uninterrupted_separate_run

    return uninterrupted_separate_run(tmp_path_factory, seeded)


@pytest.fixture(scope="session")
def rm_run(tmp_path_factory):
    """``run.mode=rm``'s 150-step run and its export (``tests.test_train_rm``)."""
    from tests.test_train_rm import rm_mode_run

    return rm_mode_run(tmp_path_factory)


@pytest.fixture(scope="session")
def rl_run(rm_run, tmp_path_factory, seeded):
    """GRPO against ``rm_run``'s export, the reward model on the actor's ranks under TP=2."""
    from tests.test_train_rm import rl_against_rm_run

    return rl_against_rm_run(rm_run, tmp_path_factory, seeded)


@pytest.fixture(scope="session")
def judge_run(tmp_path_factory, seeded, sft_warm_up):
    """Two GRPO steps judged by the shared warm-up's export on rank 0's engine (``tests.test_train_judge``)."""
    from tests.test_train_judge import judge_quickstart_run

    return judge_quickstart_run(tmp_path_factory, seeded, sft_warm_up)


@pytest.fixture(scope="session")
def distill_teacher(tmp_path_factory):
    """The distillation teacher, exported (``tests.test_train_distill``)."""
    from tests.test_train_distill import teacher_export

    return teacher_export(tmp_path_factory)


@pytest.fixture(scope="session")
def distill_student(distill_teacher, tmp_path_factory, seeded):
    """Six steps of distillation from ``distill_teacher``, the teacher under PP=2 on the actor's ranks."""
    from tests.test_train_distill import student_run

    return student_run(distill_teacher, tmp_path_factory, seeded)
