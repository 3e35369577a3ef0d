"""The start-up clock: phases in the order they ended, the first end of each kept, written atomically."""

import json

from hybridflow.runtime import startup_clock


def test_marks_keep_their_order_and_first_end_and_are_written_into_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(startup_clock, "_marks", [("process", 100.0)])
    startup_clock.mark("imports")
    startup_clock.mark("rendezvous")
    startup_clock.mark("imports")  # a second end of a phase (a restarted step) is not its end
    startup_clock.write(tmp_path)
    marks = json.loads((tmp_path / startup_clock.STARTUP_FILE).read_text())["marks"]
    assert [name for name, _ in marks] == ["process", "imports", "rendezvous"]
    assert marks[0][1] == 100.0 and 100.0 < marks[1][1] <= marks[2][1]
    assert not list((tmp_path / "logs").glob("*.tmp*"))
