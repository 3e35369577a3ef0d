"""Each model family is registered once (``hfschema.families``) and every other table derives from it.

The diff that added qwen3 (dense) is the example: one ``Family(...)`` record, and the tests'
tables that enumerate the registry picked it up. These tests keep it so: every derived table
holds exactly the registered families, and no product module names a family in a literal (a
table of its own or a branch on the name) outside the registry.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hfschema.families import FAMILIES, family
from tests.test_boundaries import PACKAGES, python_files

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = ROOT / "hfschema" / "families.py"
ALLOWED_LITERALS = {
    ("hfschema/model.py", "qwen3_moe"): "ModelConfig's default family (the quickstart's)",
}
"""(file, family) literals outside the registry that are not tables or branches, and why."""


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    for node in ast.walk(tree):  # attribute docstrings: a string statement after an assignment
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            ids.add(id(node.value))
    return ids


def family_literals(root: Path = ROOT) -> list[str]:
    """``file:line: 'name'`` for each string literal equal to a registered family in the
    project's packages, outside the registry, docstrings and ``ALLOWED_LITERALS``."""
    found = []
    for package in PACKAGES:
        for path in python_files(root / package):
            if path == REGISTRY:
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            skip = _docstrings(tree)
            rel = path.relative_to(root).as_posix()
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Constant)
                    and node.value in FAMILIES
                    and id(node) not in skip
                    and (rel, node.value) not in ALLOWED_LITERALS
                ):
                    found.append(f"{rel}:{node.lineno}: {node.value!r}")
    return found


@pytest.mark.claim("family-one-registration")
def test_no_product_module_names_a_family_outside_the_registry() -> None:
    assert family_literals() == []


def test_the_literal_check_finds_a_planted_table(tmp_path: Path) -> None:
    planted = tmp_path / "hybridflow" / "planted.py"
    planted.parent.mkdir()
    planted.write_text('"""A module."""\nEXTRA = {"qwen3": 1}\n')
    assert family_literals(tmp_path) == ["hybridflow/planted.py:2: 'qwen3'"]


@pytest.mark.claim("family-one-registration")
def test_every_derived_table_holds_exactly_the_registered_families() -> None:
    from hfschema import hf_config, model
    from hybridflow.rollout import tiny
    from hybridflow.runtime import model_dir
    from reshard import families as reshard_families

    names = list(FAMILIES)
    # and the one family no record maps: an architecture transformers' own class builds (FSDP2)
    assert list(model.MODEL_FAMILIES) == [*names, model.UNMAPPED_FAMILY]
    assert list(model.FAMILY_FIXED) == [*names, model.UNMAPPED_FAMILY] and list(model.ROUTER_RULES) == names
    assert list(hf_config.HF_CONFIG_READERS) == names and list(hf_config.HF_FIXED) == names
    assert list(reshard_families.FAMILIES) == names
    assert set(model.MOE_FAMILIES) == {n for n, f in FAMILIES.items() if f.is_moe}
    # every family that can be made tiny can also start a random run, and the reverse
    assert set(tiny.TINY_FAMILIES) == set(model_dir.GENERATED_FAMILIES)


@pytest.mark.distributed  # imports megatron-core
def test_megatron_builds_every_registered_family() -> None:
    from megatron_adapters import model as megatron_model

    assert list(megatron_model.FAMILIES) == list(FAMILIES)
    assert [n for n, t in megatron_model.FAMILIES.items() if t.mla] == ["deepseek_v3"]


def test_an_unknown_family_names_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="'gpt2' is not supported; supported: llama, qwen2, qwen3, qwen3_moe"):
        family("gpt2")


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.tiny])
def test_a_tiny_directory_reads_back_as_the_model_it_was_written_for(tmp_path: Path, name: str) -> None:
    """The run's generated directory (``Family.write`` on the tiny dims) reads back, through the
    one config.json reader, as the ModelConfig it was written for."""
    from hfschema.hf_config import read_model_config
    from hybridflow.runtime.model_dir import rollout_model_dir

    first = read_model_config(rollout_model_dir(_tiny_model(name, tmp_path), tmp_path / "a", seed=0))
    again = read_model_config(rollout_model_dir(first, tmp_path / "b", seed=0))
    assert again == first and first.family == name


def _tiny_model(name: str, tmp_path: Path):
    from hybridflow.rollout.tiny import make_tiny_model_dir, to_hybridflow_model_config

    return to_hybridflow_model_config(make_tiny_model_dir(tmp_path / "tiny", name, weights=False))
