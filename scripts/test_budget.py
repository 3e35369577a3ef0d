"""Where a test run's time went, from pytest's JUnit XML: the slowest modules, then the total.

    python scripts/test_budget.py JUNIT.xml [--top 15] [--json PATH]

``.ci/run`` prints it at the end of every CI log, so each log shows the suite's budget by module.
A test's time in the XML is its setup, call and teardown together, so a module-scoped (or
session-scoped) fixture counts against the module of the first test that asked for it.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class ModuleTime:
    """One test module's share of the run."""

    path: str
    seconds: float = 0.0
    tests: int = 0
    outcomes: dict[str, int] = field(default_factory=lambda: defaultdict(int))


def module_of(classname: str, root: Path = ROOT) -> str:
    """``tests.test_train`` or ``tests.launch.test_slurm.TestX`` -> the module's file path (the
    longest dotted prefix that names a file under ``root``; the class name otherwise)."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        candidate = Path(*parts[:end]).with_suffix(".py")
        if (root / candidate).is_file():
            return candidate.as_posix()
    return classname


def _outcome(case: ET.Element) -> str:
    for tag in ("failure", "error", "skipped"):
        if case.find(tag) is not None:
            return tag
    return "passed"


def module_times(junit: Path, root: Path = ROOT) -> list[ModuleTime]:
    """Every module's seconds and test count, slowest first."""
    modules: dict[str, ModuleTime] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = module_of(case.get("classname", ""), root)
        entry = modules.setdefault(path, ModuleTime(path))
        entry.seconds += float(case.get("time") or 0.0)
        entry.tests += 1
        entry.outcomes[_outcome(case)] += 1
    return sorted(modules.values(), key=lambda m: m.seconds, reverse=True)


def render(modules: list[ModuleTime], top: int) -> str:
    total = sum(m.seconds for m in modules)
    lines = [f"slowest {min(top, len(modules))} of {len(modules)} test modules (setup + call + teardown):"]
    for m in modules[:top]:
        share = 100 * m.seconds / total if total else 0.0
        lines.append(f"  {m.seconds:8.1f}s {share:5.1f}%  {m.tests:4d} tests  {m.path}")
    tests = sum(m.tests for m in modules)
    lines.append(f"  {total:8.1f}s 100.0%  {tests:4d} tests  all modules")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path, help="pytest --junitxml output")
    parser.add_argument("--top", type=int, default=15, help="modules to list (default 15)")
    parser.add_argument("--json", type=Path, help="also write every module's figures here")
    args = parser.parse_args(argv)
    if not args.junit.is_file():
        print(f"test_budget: error: {args.junit} does not exist (pytest did not write its --junitxml)", file=sys.stderr)
        return 2
    modules = module_times(args.junit)
    print(render(modules, args.top))
    if args.json:
        from hfschema.files import write_atomic

        rows = [
            {"path": m.path, "seconds": round(m.seconds, 2), "tests": m.tests, "outcomes": dict(m.outcomes)}
            for m in modules
        ]
        write_atomic(args.json, json.dumps({"modules": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
