"""pytest plugin for ``scripts/claims.py``: writes every collected test's claims and tier as JSON.

    pytest --collect-only -m "" -p tests.claims_plugin --claims-json PATH

Loaded as a plugin only by that command (``-p``), so ordinary runs never see its hooks;
tests/conftest.py keeps ``rows_of`` a whole-suite session's tests, so tests/test_claims.py need
not collect the suite again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

WHOLE_SUITE = pytest.StashKey[list]()
"""``rows_of`` every test, where a test session collected every test file (tests/conftest.py)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--claims-json", default=None, help="write each collected test's claims and tier here")


def tier_of(item: pytest.Item) -> str:
    """``gpu`` (needs CUDA), ``slow`` (``pytest -m slow``) or ``default`` (``pytest -q``, CI)."""
    if item.get_closest_marker("gpu") is not None:
        return "gpu"
    if item.get_closest_marker("slow") is not None:
        return "slow"
    return "default"


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    path = session.config.getoption("--claims-json")
    if not path:
        return
    Path(path).write_text(json.dumps(rows_of(session.items)))


def rows_of(items: list[pytest.Item]) -> list[dict]:
    """Each test's node id, tier and claims."""
    return [
        {
            "nodeid": item.nodeid,
            "tier": tier_of(item),
            "claims": [name for mark in item.iter_markers("claim") for name in mark.args],
        }
        for item in items
    ]
