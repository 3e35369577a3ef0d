"""Not imported as a package: ``cpu.apply_cpu_environment`` puts this directory on PYTHONPATH so
that its ``sgl_kernel`` shadows the CUDA one (this file only makes packaging include it)."""
