"""MoE-specific pieces of RL post-training, kept free of megatron and sglang imports.

``routes``: routing tables (the experts each token went to) between the trainer's ``[B, T, L, k]``
layout and the order megatron-core's router sees tokens in, for routing replay. ``stats``: router
statistics (tokens per expert, load imbalance, router entropy, dropped tokens, top-k mismatch,
replay match) and their end-of-run summary. Code here works on plain tensors and config values;
``megatron_adapters.routing`` wires it into megatron-core's routers.
"""
