"""Every claim the README and docs/ make has a test in some tier, and docs/claims.md says which
(``scripts/claims.py``: the docs' ``<!-- claim: NAME -->`` markers against the tests'
``@pytest.mark.claim(NAME)`` marks, as pytest collects them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.claims import TABLE, parse_doc, problems, read_docs, render, slug

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def collected(request) -> dict[str, list[tuple[str, str]]]:
    """Every test's claims: from this session where it collected the whole suite, else from
    ``pytest --collect-only`` as ``scripts/claims.py`` runs it."""
    from scripts.claims import collect_tests, index_claims
    from tests.claims_plugin import WHOLE_SUITE

    rows = request.config.stash.get(WHOLE_SUITE, None)
    return index_claims(rows) if rows is not None else collect_tests(ROOT)


@pytest.mark.claim("every-claim-has-a-test")
def test_every_claim_of_the_docs_has_a_test_and_the_table_is_current(collected) -> None:
    claims, bare = read_docs(ROOT)
    assert len(claims) > 100  # the README's claims are marked, not a handful
    assert problems(claims, bare, collected) == []
    assert (ROOT / TABLE).read_text() == render(claims, collected), (
        f"{TABLE} is stale: python scripts/claims.py --write"
    )


PLANTED = """\
# A page

## A feature

It works, and a test says so. <!-- claim: quickstart-resumes -->

## Another feature

It also streams checkpoints of any size to the moon. <!-- claim: planted-moon-streaming -->

## A section that claims something unmarked

Everything here is fast.

## A table of contents

<!-- claims: none, it only points at the sections above -->
"""


@pytest.mark.claim("every-claim-has-a-test", "claims-check-names-each-problem")
def test_a_planted_claim_without_a_test_fails_the_check(collected) -> None:
    claims, bare = parse_doc("docs/planted.md", PLANTED)
    assert [c.name for c in claims] == ["quickstart-resumes", "planted-moon-streaming"]
    assert claims[1].says == "It also streams checkpoints of any size to the moon." and claims[1].line == 9
    found = problems(claims, bare, collected)
    moon = [line for line in found if "planted-moon-streaming" in line]
    assert moon == [
        "docs/planted.md:9: claim 'planted-moon-streaming' ('It also streams checkpoints of any size to "
        "the moon.') has no test in any tier; mark the test that proves it with "
        '@pytest.mark.claim("planted-moon-streaming")'
    ]
    assert any(
        line.startswith("docs/planted.md: A section that claims something unmarked: a section with no claim marker")
        for line in found
    ), found
    assert not any("A table of contents" in line or "A feature:" in line for line in found), found
    # the README's claims are not made on this page: their tests are named as claiming nothing here
    assert any("claims 'learning-matrix', which no doc makes" in line for line in found), found


@pytest.mark.claim("claims-check-names-each-problem")
def test_a_claim_made_twice_and_a_test_of_no_claim_are_named() -> None:
    text = "# P\n\nA. <!-- claim: same -->\n\n## Q\n\nB. <!-- claim: same -->\n"
    claims, bare = parse_doc("p.md", text)
    found = problems(
        claims, bare, {"same": [("tests/t.py::test_a", "default")], "gone": [("tests/t.py::test_b", "slow")]}
    )
    assert found == [
        "p.md:7: claim 'same' is made again (first at p.md:3); give it a name of its own",
        "tests/t.py::test_b: claims 'gone', which no doc makes; mark the sentence it proves with "
        "<!-- claim: gone --> or drop the marker",
    ]


@pytest.mark.claim("claims-check-names-each-problem")
def test_markers_in_code_blocks_are_text_and_tiers_are_listed() -> None:
    assert slug("Training on megatron-core (what exists today)") == "training-on-megatron-core-what-exists-today"
    text = "# P\n\n```\n<!-- claim: in-code -->\n## not a heading\n```\n\nReal. <!-- claim: real -->\n"
    claims, bare = parse_doc("p.md", text)
    assert [c.name for c in claims] == ["real"] and bare == []
    table = render(claims, {"real": [("tests/t.py::test_a", "default"), ("tests/t.py::test_b", "slow")]})
    assert (
        "| `real` | [p.md:8](../p.md#p) | Real. | default, slow | `tests/t.py::test_a`<br>"
        "`tests/t.py::test_b` (slow) |" in table
    )
