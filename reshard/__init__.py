"""Moving the actor's weights from the training layout to the rollout layout.

This package will hold the tensor-layout descriptions of both sides (Megatron TP / PP / EP /
ETP / DP and SGLang TP / EP / DP-attention, fused tensors as views of canonical HF tensors),
the pure planner that picks a source for every region each destination rank lacks, plan
statistics against the lower bound, and an executor that runs a plan over torch.distributed in
bounded-memory buckets with optional checksum verification. The planner takes values and
returns values: no process groups, no CUDA, no I/O.
"""
