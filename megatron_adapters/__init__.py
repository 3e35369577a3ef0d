"""Everything in hybridflow that imports megatron-core lives in this package.

Importing it blocks CUDA-only extension modules on CPU machines first (see ``cpu_compat``), so
that megatron-core's own optional-import guards behave; the other CPU workarounds are installed
by ``parallel.initialize``.
"""

from . import cpu_compat

cpu_compat.block_cuda_only_imports()
