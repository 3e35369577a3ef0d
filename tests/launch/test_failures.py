"""The first failing rank's error: records written by ranks, chosen and reported by the launcher."""

from __future__ import annotations

import json

import pytest

from launch.failures import ERROR_DIR_ENV, ERROR_FILE, first_failure, record_failure, report_failure


def _record(directory, rank: int, restart: int, when: float, error: str) -> None:
    payload = {"rank": rank, "restart": restart, "time": when, "error": error}
    (directory / f"rank{rank}.json").write_text(json.dumps(payload))


def test_a_rank_writes_its_error_only_when_a_launcher_asked(tmp_path) -> None:
    assert record_failure(ValueError("x"), env={}) is None
    env = {ERROR_DIR_ENV: str(tmp_path), "RANK": "3", "TORCHELASTIC_RESTART_COUNT": "1"}
    path = record_failure(ValueError("train.lr=-1 must be > 0"), env=env)
    saved = json.loads(path.read_text())
    assert path.name == "rank3.json" and saved["rank"] == 3 and saved["restart"] == 1
    assert saved["error"] == "ValueError: train.lr=-1 must be > 0"


@pytest.mark.claim("first-failure-named")
def test_the_earliest_error_of_the_newest_restart_is_the_first_failure(tmp_path) -> None:
    _record(tmp_path, 0, 1, 20.0, "RuntimeError: Connection reset by peer")
    _record(tmp_path, 1, 1, 19.5, "ValueError: the cause")
    _record(tmp_path, 2, 0, 5.0, "KeyError: an earlier start's failure")
    (tmp_path / "rank3.json").write_text('{"rank": 3, "ti')  # cut short by a kill: ignored
    first = first_failure(tmp_path)
    assert (first.rank, first.error) == (1, "ValueError: the cause")
    assert first_failure(tmp_path / "nothing") is None


def test_the_report_names_the_rank_and_lands_in_the_run_directory(tmp_path) -> None:
    errors, run = tmp_path / "errors", tmp_path / "run"
    errors.mkdir()
    run.mkdir()
    _record(errors, 1, 0, 1.0, "ValueError: the cause")
    line = report_failure(errors, run, command="hybridflow launch", returncode=1)
    assert line == "hybridflow launch: rank 1 failed: ValueError: the cause"
    assert (run / ERROR_FILE).read_text() == line + "\n"


def test_a_failure_without_a_record_still_says_so(tmp_path) -> None:
    line = report_failure(tmp_path, None, command="hybridflow train", returncode=17)
    assert "exit status 17" in line and "no rank reported an error" in line


@pytest.mark.claim("first-failure-across-nodes")
def test_every_node_names_the_first_failure_of_the_whole_job(tmp_path) -> None:
    """Two nodes' launchers: node 1's rank 3 failed first; each node sees its own ranks' records
    and the run directory's, where every rank writes too, so both name rank 3."""
    from launch.failures import RUN_ERROR_DIR_ENV, RUN_ERRORS

    run = tmp_path / "run"
    shared = run / RUN_ERRORS
    shared.mkdir(parents=True)
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    _record(shared, 3, 0, 1.0, "KeyError: from a job before this launch")  # older than the launch: passed over
    env = {RUN_ERROR_DIR_ENV: str(shared), "TORCHELASTIC_RESTART_COUNT": "0"}
    record_failure(ValueError("the cause"), env={**env, ERROR_DIR_ENV: str(nodes[1]), "RANK": "3"})
    record_failure(RuntimeError("Connection closed by peer"), env={**env, ERROR_DIR_ENV: str(nodes[0]), "RANK": "0"})
    lines = [report_failure(node, run, command="hybridflow launch", returncode=1, since=2.0) for node in nodes]
    assert lines == ["hybridflow launch: rank 3 failed: ValueError: the cause"] * 2
    assert first_failure(nodes[0]).rank == 0  # without the run directory, node 0 knew only its own rank
    assert (run / ERROR_FILE).read_text() == lines[0] + "\n"


def _parse(text: str):
    return json.loads(text)  # raises in the standard library, called from here


@pytest.mark.claim("failure-traceback-kept")
def test_a_raised_error_is_recorded_with_where_it_was_raised_its_stage_and_its_traceback(tmp_path) -> None:
    """The innermost frame in the project's files (not the standard library's json), the stage and
    step, the whole traceback; the line says all but the traceback and where that is kept."""
    try:
        _parse("{")
    except ValueError as error:
        raised = error
    env = {ERROR_DIR_ENV: str(tmp_path), "RANK": "1"}
    saved = json.loads(record_failure(raised, env=env, context="advantages, step 2").read_text())
    line_no = next(
        i for i, text in enumerate(open(__file__).read().splitlines(), 1) if "raises in the standard" in text
    )
    where = f"tests/launch/test_failures.py:{line_no}"
    assert saved["where"] == where and saved["context"] == "advantages, step 2"
    assert (
        saved["traceback"].startswith("Traceback (most recent call last)") and "json/decoder.py" in saved["traceback"]
    )
    line = report_failure(tmp_path, None, command="hybridflow train", returncode=1)
    assert line == (
        f"hybridflow train: rank 1 failed: JSONDecodeError in advantages, step 2 ({where}): {raised}; "
        "traceback in logs/errors/rank1.json"
    )
    told = json.loads(record_failure(raised, env=env, context="advantages, step 2", detail=False).read_text())
    assert (told["where"], told["context"], told["traceback"]) == ("", "", "")  # a message that says it all
