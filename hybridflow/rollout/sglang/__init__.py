"""The SGLang rollout adapter: the only package that imports ``sglang``.

``engine`` (the ``RolloutEngine``, registered as ``"sglang"``), ``cpu`` (the CPU engine's
environment and the ``sgl_kernel`` stand-in), ``padding`` (planner layout -> engine layout),
``param_report`` (runs inside SGLang's scheduler processes). Importing this package imports
none of them, so SGLang's processes can import ``param_report`` cheaply.
"""
