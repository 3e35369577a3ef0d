"""scripts/test_budget.py: a JUnit file's test times summed per module, slowest first."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.test_budget import module_of, module_times, render

ROOT = Path(__file__).resolve().parents[2]

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_train" name="test_a" time="30.5"/>
<testcase classname="tests.test_train" name="test_b" time="10.0"><skipped message="x"/></testcase>
<testcase classname="tests.launch.test_slurm.TestRender" name="test_c" time="2.0"/>
<testcase classname="tests.launch.test_slurm" name="test_d" time="1.0"><failure message="y"/></testcase>
<testcase classname="tests.test_config" name="test_e" time="0.25"/>
</testsuite></testsuites>"""


def test_test_classes_count_against_their_module_file():
    assert module_of("tests.launch.test_slurm.TestRender", ROOT) == "tests/launch/test_slurm.py"
    assert module_of("tests.test_train", ROOT) == "tests/test_train.py"
    assert module_of("not.a.module", ROOT) == "not.a.module"


@pytest.mark.claim("ci-prints-its-budget")
def test_modules_are_summed_and_ordered_with_their_outcomes(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    modules = module_times(junit, ROOT)
    assert [(m.path, m.seconds, m.tests) for m in modules] == [
        ("tests/test_train.py", 40.5, 2),
        ("tests/launch/test_slurm.py", 3.0, 2),
        ("tests/test_config.py", 0.25, 1),
    ]
    assert dict(modules[1].outcomes) == {"passed": 1, "failure": 1}
    text = render(modules, top=2)
    assert text.splitlines()[0] == "slowest 2 of 3 test modules (setup + call + teardown):"
    assert "40.5s  92.6%     2 tests  tests/test_train.py" in text
    assert text.splitlines()[-1].strip().startswith("43.8s 100.0%     5 tests  all modules")


@pytest.mark.claim("ci-prints-its-budget")
def test_the_command_prints_the_table_writes_json_and_names_a_missing_file(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    done = subprocess.run(
        [sys.executable, "scripts/test_budget.py", str(junit), "--json", str(tmp_path / "b.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "tests/test_train.py" in done.stdout
    assert json.loads((tmp_path / "b.json").read_text())["modules"][0]["seconds"] == 40.5
    missing = subprocess.run(
        [sys.executable, "scripts/test_budget.py", str(tmp_path / "none.xml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "none.xml does not exist" in missing.stderr
