"""MoE-specific pieces of RL post-training, kept free of megatron and sglang imports.

This package will hold expert placement across expert-parallel ranks, router statistics and
load-balance metrics, routing replay (experts recorded per token at rollout and replayed in
training so both sides route alike), and the aux-loss-free expert-bias update. Code here
works on plain tensors and config values; ``megatron_adapters`` wires it into megatron-core.
"""
