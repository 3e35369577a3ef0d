"""Import boundaries: only ``megatron_adapters`` imports megatron; only the rollout adapter imports
sglang; the project's packages import each other along a DAG with the leaf ``hfschema`` at the bottom.

Every ``.py`` file in the repository is parsed with ``ast`` (nothing is imported) except those
under ``tests/``, hidden folders (``.venv``, ``.git``) and build output. Caught: ``import x``,
``from x import y`` and ``importlib.import_module("x")`` / ``__import__("x")`` with a literal
name, where ``x`` is the package or one of its submodules (``megatron_adapters`` is not
``megatron``), wherever they sit: module level, inside functions, under ``if TYPE_CHECKING:``.

The package layering (an arrow: may import):

    hfschema, moe        nothing of the project
    reshard, launch      ──► hfschema
    megatron_adapters    ──► hfschema, reshard, moe
    fsdp_adapters        ──► hfschema
    hybridflow           ──► all of the above
    scripts, benchmarks  ──► any package (they import, nothing imports them)
"""

import ast
import os
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# folders never scanned: tests may compare against megatron directly; the rest is not our source
SKIPPED_DIRS = {"tests", "build", "dist", "runs", "mlruns", "__pycache__"}
MEGATRON_ALLOWED = ("megatron_adapters/", "benchmarks/reshard_exec.py")
"""benchmarks/reshard_exec.py times megatron-core's own ``megatron.core.resharding`` as a
competitor's baseline: it runs megatron-core's code, it does not build on it."""
SGLANG_ALLOWED = ("rollout/sglang",)
PACKAGES = ("hfschema", "moe", "reshard", "megatron_adapters", "fsdp_adapters", "launch", "hybridflow")
"""The project's top-level packages: the nodes of the package import graph."""
IMPORTERS = (*PACKAGES, "scripts", "benchmarks")
"""Top-level folders whose imports are edges of the graph (scripts and benchmarks only import)."""
MAY_IMPORT = {
    "hfschema": (),
    "moe": (),
    "reshard": ("hfschema",),
    "launch": ("hfschema",),
    "megatron_adapters": ("hfschema", "reshard", "moe"),
    "fsdp_adapters": ("hfschema",),
    "hybridflow": ("hfschema", "reshard", "megatron_adapters", "fsdp_adapters", "moe", "launch"),
}
"""The layering: which other packages each package may import."""


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


Edges = dict[tuple[str, str], list[str]]


def package_imports(root: Path) -> Edges:
    """(importing folder, imported package) -> ``path:line: imports module`` for each import of
    one of ``PACKAGES`` from another top-level folder of ``IMPORTERS``."""
    edges: Edges = defaultdict(list)
    for path in python_files(root):
        relative = path.relative_to(root).as_posix()
        source = relative.split("/", 1)[0]
        if source not in IMPORTERS:
            continue
        for line, module in sorted(imported_modules(path.read_text(), relative)):
            target = module.split(".", 1)[0]
            if target in PACKAGES and target != source:
                edges[source, target].append(f"{relative}:{line}: imports {module}")
    return dict(edges)


def find_cycle(edges: Edges) -> list[str]:
    """One cycle of the graph as its nodes ``[a, b, ..., a]``; ``[]`` if the graph is a DAG."""
    graph: dict[str, list[str]] = defaultdict(list)
    for source, target in sorted(edges):
        graph[source].append(target)
    done: set[str] = set()
    path: list[str] = []  # the depth-first path from the current root: an edge back into it closes a cycle

    def visit(node: str) -> list[str]:
        path.append(node)
        for target in graph[node]:
            if target in path:
                return path[path.index(target) :] + [target]
            if target not in done and (cycle := visit(target)):
                return cycle
        done.add(path.pop())
        return []

    for node in sorted(graph):
        if node not in done and (cycle := visit(node)):
            return cycle
    return []


def cycle_report(cycle: list[str], edges: Edges) -> str:
    """The cycle on one line, then the imports that make each of its edges."""
    lines = [" -> ".join(cycle)]
    for source, target in zip(cycle, cycle[1:]):
        lines += [f"  {source} -> {target}:", *(f"    {where}" for where in edges[source, target])]
    return "\n".join(lines)


def layering_violations(edges: Edges) -> list[str]:
    """``path:line: imports module (P may import only: ...)`` for each edge ``MAY_IMPORT`` forbids."""
    found = []
    for (source, target), wheres in sorted(edges.items()):
        allowed = MAY_IMPORT.get(source)
        if allowed is not None and target not in allowed:
            only = ", ".join(allowed) or "nothing of the project"
            found += [f"{where} ({source} may import only: {only})" for where in wheres]
    return found


@pytest.mark.claim("package-dag")
def test_only_megatron_adapters_imports_megatron():
    found = violations(ROOT, "megatron", MEGATRON_ALLOWED)
    assert not found, "move these megatron imports into megatron_adapters/:\n" + "\n".join(found)


TRAINER_PICKERS = ("hybridflow/runtime/trainers.py", "hybridflow/cli.py", "hybridflow/rollout/sglang/cpu.py")
"""Where ``hybridflow`` may name ``megatron_adapters``: the registry that picks a trainer backend;
the command line's converters (megatron-core checkpoints are their subject); SGLang's CPU import
shim, which borrows the list of GPU-only kernel packages from megatron_adapters' CPU workarounds."""


@pytest.mark.claim("trainer-seam")
@pytest.mark.parametrize("backend", ["megatron_adapters", "fsdp_adapters"])
def test_the_runtime_reaches_the_trainer_through_the_backend_registry(backend):
    """Outside the registry (``hybridflow/runtime/trainers.py``) and the converters, nothing in
    ``hybridflow`` imports a trainer backend's package: the worker, the session, the frozen models,
    the reward-model mode, the engine ranks, the pipeline and the self-test call ``trainer_of(cfg)``."""
    found = [
        hit
        for hit in violations(ROOT / "hybridflow", backend, ())
        if not any(f"hybridflow/{hit.split(':', 1)[0]}" == allowed for allowed in TRAINER_PICKERS)
    ]
    assert not found, "call the trainer backend (hybridflow.runtime.trainers.trainer_of) instead:\n" + "\n".join(found)


@pytest.mark.claim("package-dag")
def test_only_the_rollout_adapter_imports_sglang():
    found = violations(ROOT, "sglang", SGLANG_ALLOWED)
    assert not found, "move these sglang imports into the rollout adapter:\n" + "\n".join(found)


@pytest.mark.claim("package-dag")
def test_packages_form_a_dag():
    edges = package_imports(ROOT)
    cycle = find_cycle(edges)
    assert not cycle, "the packages import each other in a cycle; cut one of its edges:\n" + cycle_report(cycle, edges)


@pytest.mark.claim("package-dag")
def test_hfschema_is_a_leaf():
    """hfschema (and moe) import nothing of the project; reshard and launch import only hfschema;
    megatron_adapters imports no hybridflow or launch (``MAY_IMPORT``)."""
    found = layering_violations(package_imports(ROOT))
    assert not found, (
        "these imports break the package layering (move the value into hfschema, or pass "
        "plain values in):\n" + "\n".join(found)
    )


def test_scanner_covers_the_packages():
    scanned = {path.relative_to(ROOT).parts[0] for path in python_files(ROOT)}
    assert set(PACKAGES) | {"scripts", "benchmarks"} <= scanned
    assert set(MAY_IMPORT) == set(PACKAGES)
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


def test_graph_checks_catch_planted_imports(tmp_path):
    planted = {
        "hfschema/model.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from hybridflow.config import HybridflowConfig\n",
        "reshard/planner.py": "from hfschema.model import ModelConfig\nfrom . import layouts\n"
        "def plan():\n    from megatron_adapters.policy import MegatronPolicy\n",
        "launch/torchrun.py": "import hfschema.layout, importlib\n"
        "state = importlib.import_module('hybridflow.runtime.state')\n",
        "megatron_adapters/policy.py": "import moe.routes\nimport reshard\n",
        "hybridflow/cli.py": "import reshard, launch.slurm\nfrom hfschema.layout import ParallelLayout\n",
        "scripts/tool.py": "import hybridflow.cli\n",
        "tests/test_x.py": "import hybridflow\nimport reshard\n",  # tests are not scanned
    }
    for name, text in planted.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)

    edges = package_imports(tmp_path)
    assert edges["launch", "hybridflow"] == ["launch/torchrun.py:2: imports hybridflow.runtime.state"]
    assert ("scripts", "hybridflow") in edges and not any(source == "tests" for source, _ in edges)
    cycle = find_cycle(edges)
    assert cycle == ["hfschema", "hybridflow", "hfschema"]
    report = cycle_report(cycle, edges)
    assert "hfschema/model.py:3: imports hybridflow.config" in report
    assert "hybridflow/cli.py:2: imports hfschema.layout" in report
    assert layering_violations(edges) == [
        "hfschema/model.py:3: imports hybridflow.config (hfschema may import only: nothing of the project)",
        "launch/torchrun.py:2: imports hybridflow.runtime.state (launch may import only: hfschema)",
        "reshard/planner.py:4: imports megatron_adapters.policy (reshard may import only: hfschema)",
    ]

    for name in ("hfschema/model.py", "reshard/planner.py", "launch/torchrun.py"):  # the planted imports out
        (tmp_path / name).write_text("import os\n")
    edges = package_imports(tmp_path)
    assert find_cycle(edges) == [] and layering_violations(edges) == []


@pytest.mark.claim("trainer-seam")
def test_every_backend_defines_the_calls_the_runtime_makes():
    """The registry's contract (``TrainerBackend``), the calls each backend exports
    (``hfschema.trainer.BACKEND_CALLS``) and the functions each backend module defines are one list."""
    import importlib

    from hfschema.trainer import BACKEND_CALLS
    from hybridflow.runtime.trainers import TRAINERS, TrainerBackend

    contract = {name for name in vars(TrainerBackend) if not name.startswith("_")}
    assert contract == set(BACKEND_CALLS)
    for name, module in TRAINERS.items():
        backend = importlib.import_module(module)
        missing = [call for call in BACKEND_CALLS if not callable(getattr(backend, call, None))]
        assert not missing, f"{name} ({module}) lacks {missing}"


@pytest.mark.claim("trainer-seam")
def test_every_planning_registration_names_every_trainer_backend():
    """Planning reaches a backend through its registrations (the runtime through ``TRAINERS``):
    the sync's source layout, the memory model, the plan's words, the checks before any rank
    starts, resume's checkpoint files. A backend added to one and forgotten in another fails here;
    none of those modules compares ``actor.backend`` with a backend's name."""
    import ast

    from hybridflow.config import TRAINER_BACKENDS
    from hybridflow.lowering import TRAINER_TEXT
    from hybridflow.memory import TRAINER_MEMORY
    from hybridflow.preflight import TRAINER_CHECKS
    from hybridflow.runtime.state import _MODEL_FILES
    from hybridflow.runtime.trainers import TRAINERS
    from hybridflow.weight_sync import SOURCE_LAYOUTS

    for table in (TRAINERS, SOURCE_LAYOUTS, TRAINER_MEMORY, TRAINER_TEXT, TRAINER_CHECKS, _MODEL_FILES):
        assert list(table) == list(TRAINER_BACKENDS), table
    branches = []
    for path in sorted((ROOT / "hybridflow").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(
                isinstance(side, ast.Constant) and side.value in TRAINER_BACKENDS
                for side in (node.left, *node.comparators)
            ):
                branches.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert branches == []


@pytest.mark.claim("engine-seam")
def test_every_engine_registration_names_every_rollout_engine():
    """An engine is one ``hfschema.engines.ENGINES`` record, whose functions (the rollout and judge
    starts, the sliced route's payload) exist, and the sliced route's layout where it takes that
    route. Outside ``hybridflow/rollout/`` nothing compares an ``engine`` setting with an engine's
    name."""
    import ast

    from hfschema.engines import ENGINES, resolve
    from hybridflow.config import ROLLOUT_ENGINES
    from hybridflow.rollout.base import _BUILTIN_MODULES
    from hybridflow.weight_sync import DESTINATION_LAYOUTS

    names = list(ROLLOUT_ENGINES)
    for table in (ENGINES, _BUILTIN_MODULES):
        assert sorted(table) == sorted(names), table
    for traits in ENGINES.values():  # each engine's own start and judge arguments, its vocab padding
        assert callable(resolve(traits.start)) and callable(resolve(traits.judge_args)), traits.label
        assert traits.padded_vocab is None or callable(resolve(traits.padded_vocab)), traits.label
    sliced = [name for name, traits in ENGINES.items() if "sliced" in traits.routes]
    assert sorted(DESTINATION_LAYOUTS) == sorted(sliced)
    for name in sliced:
        assert callable(resolve(ENGINES[name].sliced_payload))
    branches = []
    for path in sorted((ROOT / "hybridflow").rglob("*.py")):
        if path.is_relative_to(ROOT / "hybridflow" / "rollout"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            sides = (node.left, *node.comparators) if isinstance(node, ast.Compare) else ()
            if any(isinstance(side, ast.Attribute) and side.attr == "engine" for side in sides) and any(
                isinstance(side, ast.Constant) and side.value in names for side in sides
            ):
                branches.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert branches == []
