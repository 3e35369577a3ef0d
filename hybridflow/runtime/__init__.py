"""The run-time side of ``hybridflow train``: what every rank does once torchrun started it.

``worker`` sets up a ``session`` (files, prompts, the megatron-core actor, the SGLang engine on
rank 0, the weight sync), runs ``sft`` then ``loop.train_rl`` over the algorithm's graph (each
node an entry of ``ops.OPS``), checkpoints through ``state`` and reports through ``tracking``
(MLflow) and ``report`` (summary, reward curve).
"""
