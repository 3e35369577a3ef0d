"""Import boundaries: only ``megatron_adapters`` imports megatron; only the rollout adapter imports sglang.

Every ``.py`` file in the repository is parsed with ``ast`` (nothing is imported) except those
under ``tests/``, hidden folders (``.venv``, ``.git``) and build output. Caught: ``import x``,
``from x import y`` and ``importlib.import_module("x")`` / ``__import__("x")`` with a literal
name, where ``x`` is the package or one of its submodules (``megatron_adapters`` is not
``megatron``).
"""

import ast
import os
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# folders never scanned: tests may compare against megatron directly; the rest is not our source
SKIPPED_DIRS = {"tests", "build", "dist", "runs", "mlruns", "__pycache__"}
MEGATRON_ALLOWED = ("megatron_adapters/",)
SGLANG_ALLOWED = ("rollout/sglang",)


def _skipped(name: str) -> bool:
    return name.startswith(".") or name in SKIPPED_DIRS or name.endswith(".egg-info")


def python_files(root: Path) -> Iterator[Path]:
    """Every .py file under root, outside hidden, build and test folders (pruned, not walked)."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not _skipped(d))
        yield from (Path(folder) / f for f in sorted(files) if f.endswith(".py"))


def _is_package(module: str | None, package: str) -> bool:
    return module is not None and (module == package or module.startswith(package + "."))


def _literal_import_call(node: ast.Call) -> str | None:
    """The module name of ``importlib.import_module("m")`` or ``__import__("m")``, if literal."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in ("import_module", "__import__") or not node.args:
        return None
    first = node.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def imported_modules(source: str, filename: str) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) for every import in source; relative imports are ours."""
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.lineno, node.module
        elif isinstance(node, ast.Call) and (module := _literal_import_call(node)):
            yield node.lineno, module


def violations(root: Path, package: str, allowed: tuple[str, ...]) -> list[str]:
    """``path:line: import of package`` for each import of package outside the allowed paths."""
    found = []
    for path in python_files(root):
        relative = path.relative_to(root).as_posix()
        if any(fragment in relative for fragment in allowed):
            continue
        for line, module in sorted(imported_modules(path.read_text(), relative)):
            if _is_package(module, package):
                found.append(f"{relative}:{line}: imports {module}")
    return found


def test_only_megatron_adapters_imports_megatron():
    found = violations(ROOT, "megatron", MEGATRON_ALLOWED)
    assert not found, "move these megatron imports into megatron_adapters/:\n" + "\n".join(found)


def test_only_the_rollout_adapter_imports_sglang():
    found = violations(ROOT, "sglang", SGLANG_ALLOWED)
    assert not found, "move these sglang imports into the rollout adapter:\n" + "\n".join(found)


def test_scanner_covers_the_packages():
    scanned = {path.relative_to(ROOT).parts[0] for path in python_files(ROOT)}
    assert {"hybridflow", "megatron_adapters", "moe", "reshard", "launch"} <= scanned
    assert "tests" not in scanned and ".venv" not in scanned


def test_scanner_catches_planted_imports(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "bad.py").write_text(
        "import os, megatron.core\n"
        "from megatron.core.models.gpt import GPTModel\n"
        "import megatron\n"
        "import importlib\n"
        "engine = importlib.import_module('sglang.srt.entrypoints.engine')\n"
        "def f():\n"
        "    from sglang import Engine\n"
    )
    (tmp_path / "pkg" / "fine.py").write_text(
        "import megatron_adapters\nfrom megatron_adapters.model import build\nfrom . import megatron\n"
        "import sglang_utils\n"
    )
    (tmp_path / "megatron_adapters").mkdir()
    (tmp_path / "megatron_adapters" / "model.py").write_text("import megatron.core\n")
    (tmp_path / "rollout").mkdir()
    (tmp_path / "rollout" / "sglang_engine.py").write_text("import sglang\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("import megatron.core\nimport sglang\n")

    assert violations(tmp_path, "megatron", MEGATRON_ALLOWED) == [
        "pkg/bad.py:1: imports megatron.core",
        "pkg/bad.py:2: imports megatron.core.models.gpt",
        "pkg/bad.py:3: imports megatron",
    ]
    assert violations(tmp_path, "sglang", SGLANG_ALLOWED) == [
        "pkg/bad.py:5: imports sglang.srt.entrypoints.engine",
        "pkg/bad.py:7: imports sglang",
    ]
