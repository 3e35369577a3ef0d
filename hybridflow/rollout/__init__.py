"""Rollout engines: the interface (``base``), token bookkeeping (``tokens``), a transformers
reference engine (``hf_engine``) and the SGLang adapter (``sglang/``, the only place that
imports sglang). Importing this package registers no engine: each engine module registers
itself when imported, so the SGLang adapter loads only when asked for.
"""

from .base import (  # noqa: F401
    ENGINE_PROTOCOLS,
    FINISH_LENGTH,
    FINISH_STOP,
    AdapterReceiver,
    BackgroundGenerator,
    PendingBatch,
    RolloutBatch,
    RolloutEngine,
    RolloutSample,
    SamplingParams,
    SlicedWeightReceiver,
    WeightPushReport,
    engine_names,
    make_engine,
    register_engine,
    require,
    submit,
)
