"""What the docs claim, and the test that proves each claim: the table in docs/claims.md, and its check.

A claim is marked where the README (or a page under docs/) makes it, with an HTML comment that
does not render:

    ... a killed run resumes and reproduces the metrics. <!-- claim: resume-reproduces -->

and a test proves it by carrying the same name:

    @pytest.mark.claim("resume-reproduces")
    def test_a_killed_run_resumes_and_reproduces(...): ...

The test's tier follows from its markers: ``default`` (what ``pytest -q`` and CI run), ``slow``
(``pytest -m slow``) or ``gpu`` (skipped without CUDA). Every section of a doc carries a claim
or says why it makes none (``<!-- claims: none, <why> -->``), so a new section cannot slip by.

    python scripts/claims.py            # check; exit 1 listing every problem
    python scripts/claims.py --write    # regenerate docs/claims.md from the docs and the tests

The check fails when a claim has no test in any tier, a test names a claim no doc makes, a claim
is made twice, a section has neither a claim nor a reason, or docs/claims.md is stale.
Test tiers come from pytest's own collection (``tests/claims_plugin.py``), so parametrized
cases and module-level marks count as pytest counts them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = Path("docs/claims.md")
CLAIM = re.compile(r"<!--\s*claim:\s*([a-z0-9][a-z0-9-]*)\s*-->")
NO_CLAIMS = re.compile(r"<!--\s*claims:\s*none\b[^>]*-->")
HEADING = re.compile(r"^(#{1,6})\s+(.*\S)\s*$")
TIERS = ("default", "slow", "gpu")
SAYS_CHARS = 150


@dataclass(frozen=True)
class Claim:
    """One marked claim: its name, where it is made, and the sentence that makes it."""

    name: str
    path: str
    line: int
    section: str
    says: str


@dataclass
class Proof:
    """The collected tests that carry one claim's name, with their tiers."""

    tests: list[tuple[str, str]] = field(default_factory=list)

    def tiers(self) -> list[str]:
        return sorted({tier for _, tier in self.tests}, key=TIERS.index)


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every docs/ page but the generated table, relative to ``root``."""
    pages = sorted(p.relative_to(root) for p in (root / "docs").rglob("*.md")) if (root / "docs").is_dir() else []
    return [Path("README.md"), *(p for p in pages if p != TABLE)]


def _sentence_before(text: str) -> str:
    """The last sentence of ``text`` (the one a marker closes), on one line, shortened."""
    flat = " ".join(text.split())
    starts = [m.end() for m in re.finditer(r"[.!?:;]\s+(?=[A-Z`(\"*])", flat)]
    sentence = flat[starts[-1] :] if starts else flat
    sentence = sentence.lstrip("-*> ").strip()
    return sentence if len(sentence) <= SAYS_CHARS else sentence[: SAYS_CHARS - 3].rstrip() + "..."


def _in_fence(lines: list[str]) -> list[bool]:
    inside, flags = False, []
    for line in lines:
        if line.lstrip().startswith("```"):
            inside = not inside
            flags.append(True)
        else:
            flags.append(inside)
    return flags


def parse_doc(path: str, text: str) -> tuple[list[Claim], list[str]]:
    """The claims a doc makes, and its sections (``path: heading``) with neither a claim nor a
    reason for none. A section is the text from one heading to the next of any level."""
    lines = text.splitlines()
    fenced = _in_fence(lines)
    claims, bare, section, marked, paragraph = [], [], "(top)", False, []

    def close() -> None:
        if not marked and section != "(top)":
            bare.append(f"{path}: {section}")

    for number, (line, in_code) in enumerate(zip(lines, fenced), start=1):
        heading = None if in_code else HEADING.match(line)
        if heading:
            close()
            section, marked, paragraph = heading.group(2), False, []
            continue
        if not line.strip():
            paragraph = []
            continue
        if in_code:  # a marker in a code block is an example, not a claim
            continue
        if NO_CLAIMS.search(line):
            marked = True
        position = 0
        for match in CLAIM.finditer(line):
            before = " ".join(paragraph + [line[position : match.start()]])
            claims.append(Claim(match.group(1), path, number, section, _sentence_before(CLAIM.sub("", before))))
            marked, position = True, match.end()
        paragraph.append(CLAIM.sub("", line))
    close()
    return claims, bare


def collect_tests(root: Path = ROOT) -> dict[str, list[tuple[str, str]]]:
    """claim name -> [(test node id, tier)], from pytest's collection of every tier."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "claims.json"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-m",
            "",
            "-p",
            "tests.claims_plugin",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            f"--claims-json={out}",
        ]
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        result = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
        if result.returncode != 0 or not out.is_file():
            raise RuntimeError(
                f"pytest --collect-only failed (exit {result.returncode}):\n"
                f"{result.stdout[-3000:]}{result.stderr[-3000:]}"
            )
        items = json.loads(out.read_text())
    return index_claims(items)


def index_claims(items: list[dict]) -> dict[str, list[tuple[str, str]]]:
    """claim name -> [(test node id, tier)], from ``tests/claims_plugin.py``'s rows, in node id
    order (pytest's run order groups tests by fixture, which a whole-suite session has already
    done and a bare collection has not)."""
    found: dict[str, list[tuple[str, str]]] = {}
    for item in sorted(items, key=lambda item: item["nodeid"]):
        for name in item["claims"]:
            found.setdefault(name, []).append((item["nodeid"], item["tier"]))
    return found


def problems(claims: list[Claim], bare_sections: list[str], tests: dict[str, list[tuple[str, str]]]) -> list[str]:
    """Every reason the docs and the tests disagree, one line each (empty: they agree)."""
    found, seen = [], {}
    for claim in claims:
        if claim.name in seen:
            first = seen[claim.name]
            found.append(
                f"{claim.path}:{claim.line}: claim '{claim.name}' is made again "
                f"(first at {first.path}:{first.line}); give it a name of its own"
            )
            continue
        seen[claim.name] = claim
        if not tests.get(claim.name):
            found.append(
                f"{claim.path}:{claim.line}: claim '{claim.name}' ({claim.says!r}) has no test in any "
                f'tier; mark the test that proves it with @pytest.mark.claim("{claim.name}")'
            )
    for name in sorted(set(tests) - set(seen)):
        nodes = ", ".join(node for node, _ in tests[name][:3])
        found.append(
            f"{nodes}: claims '{name}', which no doc makes; mark the sentence it proves with "
            f"<!-- claim: {name} --> or drop the marker"
        )
    for section in bare_sections:
        found.append(
            f"{section}: a section with no claim marker; mark what it claims with "
            f"<!-- claim: NAME --> or say why it claims nothing with <!-- claims: none, REASON -->"
        )
    return found


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    kept = "".join(ch for ch in heading.lower() if ch.isalnum() or ch in " -_")
    return kept.replace(" ", "-")


def render(claims: list[Claim], tests: dict[str, list[tuple[str, str]]]) -> str:
    """docs/claims.md: every claim, where it is made, and the tests that prove it with their tiers."""
    lines = [
        "# Claims and the tests that prove them",
        "",
        "Generated by `python scripts/claims.py --write` from the `<!-- claim: NAME -->` markers in the",
        "docs and the `@pytest.mark.claim(NAME)` marks on the tests; `tests/test_claims.py` fails when it",
        "is stale or when a claim has no test. Tiers: `default` runs in `pytest -q` (CI), `slow` in",
        "`pytest -m slow` (before resolving an issue that touches it), `gpu` only on a CUDA machine.",
        "See [testing](testing.md) for the tiers.",
        "",
        "| claim | made in | what it says | tier | tests |",
        "| --- | --- | --- | --- | --- |",
    ]
    for claim in claims:
        proof = Proof(tests.get(claim.name, []))
        where = f"[{claim.path}:{claim.line}](../{claim.path}#{slug(claim.section)})"
        says = claim.says.replace("|", "\\|")
        nodes = "<br>".join(f"`{node}`" + (f" ({tier})" if tier != "default" else "") for node, tier in proof.tests)
        lines.append(
            f"| `{claim.name}` | {where} | {says} | {', '.join(proof.tiers()) or 'NONE'} | {nodes or 'NONE'} |"
        )
    return "\n".join(lines) + "\n"


def read_docs(root: Path = ROOT) -> tuple[list[Claim], list[str]]:
    claims, bare = [], []
    for path in doc_files(root):
        found, sections = parse_doc(path.as_posix(), (root / path).read_text())
        claims += found
        bare += sections
    return claims, bare


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"regenerate {TABLE} instead of checking it")
    args = parser.parse_args(argv)
    claims, bare = read_docs()
    tests = collect_tests()
    table = render(claims, tests)
    found = problems(claims, bare, tests)
    if args.write:
        from hfschema.files import write_atomic

        write_atomic(ROOT / TABLE, table)
        print(f"wrote {TABLE}: {len(claims)} claims")
    elif not (ROOT / TABLE).is_file() or (ROOT / TABLE).read_text() != table:
        found.append(f"{TABLE} is stale; regenerate it with: python scripts/claims.py --write")
    for line in found:
        print(f"claims: {line}", file=sys.stderr)
    if not found:
        tiers = {tier: sum(tier in Proof(tests.get(c.name, [])).tiers() for c in claims) for tier in TIERS}
        print(
            f"claims: {len(claims)} claims, each with a test ({tiers['default']} proven in the default tier, "
            f"{tiers['slow']} with slow-tier tests, {tiers['gpu']} with GPU tests)"
        )
    return 1 if found else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
