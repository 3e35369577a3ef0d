"""pytest plugin for ``scripts/claims.py``: writes every collected test's claims and tier as JSON.

    pytest --collect-only -m "" -p tests.claims_plugin --claims-json PATH

Loaded only by that command (``-p``), so ordinary runs never see it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


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
    rows = [
        {
            "nodeid": item.nodeid,
            "tier": tier_of(item),
            "claims": [name for mark in item.iter_markers("claim") for name in mark.args],
        }
        for item in session.items
    ]
    Path(path).write_text(json.dumps(rows))
