"""What planning and the checks before any rank starts need of each rollout engine.

One ``EngineTraits`` record per engine name (``rollout.engine``, ``judge.engine``): which weight
routes it takes, whether a replica spans ranks, whether it runs on ranks of its own, takes LoRA
adapter pushes, where its model classes are listed. Values only, read without importing the
engine (SGLang takes seconds to import), and where the engine's own code says how a run's
settings start it (``start``, ``judge_args``: ``module:function`` names, imported when an engine
starts); the factory itself registers with the engine (``hybridflow.rollout.base.register_engine``).
A fourth engine adds a record here and the modules it names; ``tests/test_boundaries.py`` holds
every record to that.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ENGINES", "ENGINE_NAMES", "EngineTraits", "resolve"]


@dataclass(frozen=True, kw_only=True)
class EngineTraits:
    """A rollout engine as the plan and the checks see it."""

    label: str
    """Its name in messages (``SGLang``)."""
    module: str
    """The module whose import registers the engine's factory (``rollout.base.register_engine``)."""
    routes: tuple[str, ...]
    """Weight-sync routes it takes (``rollout.sync_route``): ``sliced`` (each rank the rows it
    lacks, by the reshard plan) and / or ``full`` (whole Hugging Face tensors on its driver)."""
    splits: tuple[str, ...]
    """The ``rollout`` settings by which a replica spans several ranks (``tp``, ``ep``, ``moe_dp``,
    ``dp_size`` with ``enable_dp_attention``), and ``nodes`` where a replica may span nodes;
    empty: one device each (``num_replicas`` for more)."""
    own_ranks: bool
    """Runs on engine ranks of its own (``rollout.placement=separate``)."""
    adapters: bool
    """Takes LoRA adapter pushes (``lora.push=adapter``) instead of merged weights."""
    cpu_expert_parallel: bool
    """Splits experts over ranks (ep > 1) on a machine without a GPU."""
    model_classes: str | None
    """``module:function`` listing the ``architectures`` it builds, read without starting it;
    None: it builds whatever transformers builds."""
    start: str
    """``module:function`` starting a replica's driver engine from the run's settings
    (``(cfg, model_dir, *, device, node_rank, dist_init_addr)``; node_rank > 0: its part on another
    node), called with torchrun's variables out of the environment."""
    judge_args: str
    """``module:function`` mapping the judge section onto the factory's arguments (``(cfg, *, device)``)."""
    start_processes: str
    """What a replica adds beside the rank's own process: ``schedulers`` (one per rank, and a
    detokenizer), ``server`` (one process of its own, under another interpreter), ``none`` (it runs
    in the driver's process)."""
    environment: str | None = None
    """``module:function`` raising a one-line ValueError where the engine cannot start for a config
    (``(cfg, on_gpu=...)``: not installed, a shape it refuses on this machine); None: nothing to check."""
    padded_vocab: str | None = None
    """``module:function`` giving the embedding rows the engine allocates for a vocabulary split
    ``parts`` ways (``(vocab, parts) -> rows``, for the memory estimate); None: the vocabulary as is."""
    sliced_payload: str | None = None
    """With the sliced route: ``module:function`` packing a destination rank's buffers for the
    engine (``(engine-local rank, buffers, the rank's parameters) -> (payload, kept tensors)``)."""


ENGINES: dict[str, EngineTraits] = {
    "sglang": EngineTraits(
        label="SGLang",
        module="hybridflow.rollout.sglang.engine",
        routes=("sliced", "full"),
        splits=("tp", "ep", "moe_dp", "dp_size", "enable_dp_attention", "nodes"),
        own_ranks=True,
        adapters=True,
        cpu_expert_parallel=False,  # its torch-native MoE does not handle non-local experts
        model_classes="hybridflow.rollout.sglang.served:served_architectures",
        start="hybridflow.rollout.sglang.start:start_replica",
        judge_args="hybridflow.rollout.sglang.start:judge_args",
        start_processes="schedulers",
        padded_vocab="hfschema.sglang:pad_vocab",
        sliced_payload="hybridflow.rollout.sglang.handles:prepare_rank_payload",
    ),
    "hf": EngineTraits(
        label="transformers",
        module="hybridflow.rollout.hf_engine",
        routes=("full",),
        splits=(),
        own_ranks=False,
        adapters=False,
        cpu_expert_parallel=False,
        model_classes=None,
        start="hybridflow.rollout.hf_start:start_replica",
        judge_args="hybridflow.rollout.hf_start:judge_args",
        start_processes="none",
    ),
    "vllm": EngineTraits(
        label="vLLM",
        module="hybridflow.rollout.vllm.engine",
        routes=("sliced", "full"),
        splits=("tp",),  # tensor parallelism on one node: its expert and attention DP are not planned
        own_ranks=True,
        adapters=False,
        cpu_expert_parallel=False,
        model_classes="hybridflow.rollout.vllm.env:served_architectures",
        start="hybridflow.rollout.vllm.start:start_replica",
        judge_args="hybridflow.rollout.vllm.start:judge_args",
        start_processes="server",
        environment="hybridflow.rollout.vllm.env:check_environment",
        padded_vocab="hybridflow.rollout.vllm.env:padded_vocab",
        sliced_payload="hybridflow.rollout.vllm.handles:prepare_rank_payload",
    ),
}
"""Each rollout engine's traits, by its ``rollout.engine`` name."""

ENGINE_NAMES = tuple(ENGINES)
"""The engine names a config may choose (``rollout.engine``, ``judge.engine``)."""


def resolve(reference: str):
    """The function a ``module:function`` field names (imported on demand: the engine's module)."""
    import importlib

    module, function = reference.split(":")
    return getattr(importlib.import_module(module), function)
