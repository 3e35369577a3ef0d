"""Installs the tests' fault and probe hooks (``tests/injection.py``) into every Python process of
a job whose environment selects one (a ``HYBRIDFLOW_INJECT_*`` variable).

A test puts this folder first on ``PYTHONPATH`` (``tests.injection.environment``); Python imports
``sitecustomize`` at the start of every interpreter (the launcher, torchrun, each rank, the
processes megatron's checkpoint writer and SGLang start), so the hooks reach all of them without
a line of the product knowing.
"""

import os

if any(name.startswith("HYBRIDFLOW_INJECT_") for name in os.environ):
    from tests.injection import install

    install()
