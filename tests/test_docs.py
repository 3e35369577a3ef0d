"""What the docs point at exists: every relative link (file and heading), every repository path
they name, every ``hybridflow`` subcommand they show (its ``--help`` parses), and the generated
configuration reference is current."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
TOP = "scripts|configs|benchmarks|tests|launch|hybridflow|megatron_adapters|reshard|moe|hfschema|docs|\\.ci"
PATH = re.compile(rf"`((?:{TOP})/[^`\s]*)`")
"""A backticked path in the repository (a metric name such as ``moe/train/*`` is not one)."""
COMMAND = re.compile(r"(?:^|[\s`(])(?:\.venv/bin/)?hybridflow ((?:convert )?[a-z][a-z0-9-]+)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # a "# comment" in a code block is no heading
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_heading(doc: Path) -> None:
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target}: no {file}")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_the_docs_name_exists(doc: Path) -> None:
    named = {re.split(r"::|\[|:", p)[0] for p in PATH.findall(doc.read_text())}  # less a test id or a line
    missing = sorted(p for p in named if not (ROOT / p).exists() and not re.search(r"[*<>{}…]|\.\.\.", p))
    assert not missing, missing


def test_every_hybridflow_subcommand_the_docs_show_parses_its_help(capsys) -> None:
    from hybridflow.cli import main

    shown = {cmd for doc in DOCS for cmd in COMMAND.findall(doc.read_text())}
    subcommands = {
        cmd for cmd in shown if cmd.split()[0] in {"plan", "selftest", "train", "launch", "slurm", "convert"}
    }
    assert {"train", "plan", "launch", "slurm", "convert hf-to-mcore", "convert mcore-to-hf"} <= subcommands, shown
    for cmd in sorted(subcommands):
        with pytest.raises(SystemExit) as done:
            main([*cmd.split(), "--help"])
        assert done.value.code == 0, cmd
        assert "usage: hybridflow" in capsys.readouterr().out, cmd


def test_the_configuration_reference_is_generated_from_the_current_config() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import config_reference
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert (ROOT / "docs" / "configuration.md").read_text() == config_reference.render(), (
        "docs/configuration.md is stale: run python scripts/config_reference.py"
    )


@pytest.mark.claim("template-shown-whole")
def test_getting_started_shows_the_template_whole_as_it_is_shipped() -> None:
    shown = (ROOT / "docs" / "getting-started.md").read_text()
    template = (ROOT / "configs" / "my_model.yaml").read_text()
    assert f"```yaml\n{template}```" in shown, "docs/getting-started.md: paste configs/my_model.yaml again"
