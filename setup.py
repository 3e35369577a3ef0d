"""Packaging for hybridflow.

Dependencies are read from ``requirements/*.txt`` so that the pins live in one place:
``scripts/install.sh`` installs the same files with pip, and the extras here are built from
them. ``pip install -e .`` installs the runtime; ``.[test]`` adds pytest; ``.[gpu]`` adds
transformer-engine and belongs only on machines with CUDA (NVIDIA apex is not on PyPI: see
the README to build it from source).
"""

import ast
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
TOP_LEVEL_PACKAGES = ("hybridflow", "hfschema", "megatron_adapters", "fsdp_adapters", "moe", "reshard", "launch")


def read_version() -> str:
    """``__version__`` from hybridflow/__init__.py, read without importing the package."""
    tree = ast.parse((ROOT / "hybridflow" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__version__" for target in node.targets
        ):
            return ast.literal_eval(node.value)
    raise RuntimeError("hybridflow/__init__.py does not set __version__")


def read_requirements(name: str) -> list[str]:
    """Requirement lines of requirements/NAME.txt, without comments and blank lines."""
    lines = (ROOT / "requirements" / f"{name}.txt").read_text().splitlines()
    stripped = (line.split("#", 1)[0].strip() for line in lines)
    return [line for line in stripped if line]


setup(
    name="hybridflow",
    version=read_version(),
    description="RL post-training for mixture-of-experts LLMs on megatron-core and SGLang",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=[pattern for name in TOP_LEVEL_PACKAGES for pattern in (name, f"{name}.*")]),
    install_requires=read_requirements("runtime"),
    extras_require={
        "test": read_requirements("test"),
        "gpu": read_requirements("gpu"),
    },
    entry_points={"console_scripts": ["hybridflow = hybridflow.cli:main"]},
)
