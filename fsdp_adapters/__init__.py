"""The FSDP2 trainer backend: Hugging Face's own model classes, sharded with ``fully_shard``.

    model.py    the role's transformers model for ``model.path``, sharded per decoder layer and at
                the root, each rank reading only its shard of the checkpoint
    scores.py   next-token log-probs and entropy from the last hidden states, chunk by chunk, so no
                rank holds [tokens x vocab] at once
    policy.py   FSDP2Policy: forward_logprobs and train_step with the megatron backend's contract
                (``hfschema.trainer``) and optimizer semantics

Imports ``hfschema`` of the project and nothing of megatron (``tests/test_boundaries.py``).
"""
