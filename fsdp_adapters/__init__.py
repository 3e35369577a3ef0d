"""The FSDP2 trainer backend: Hugging Face's own model classes, sharded with ``fully_shard``.

    backend.py     what the runtime calls (``hybridflow.runtime.trainers``: ``actor.backend: fsdp2``)
    model.py       the role's transformers model for a model directory, sharded per decoder layer
                   and at the root, each rank reading only its shard of the checkpoint
    scores.py      next-token log-probs and entropy from the last hidden states, chunk by chunk, so
                   no rank holds [tokens x vocab] at once
    policy.py      FSDP2Policy (forward_logprobs, train_step with the megatron backend's contract,
                   ``hfschema.trainer``, and optimizer semantics; packing; undo) and FSDP2Critic
    ulysses.py     sequence parallel through transformers' attention-function registry
    checkpoint.py  DCP checkpoints, loadable at another data-parallel size
    export.py      the weights out: buckets of whole tensors, a Hugging Face directory

Imports ``hfschema`` of the project and nothing of megatron (``tests/test_boundaries.py``).
"""
