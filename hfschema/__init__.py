"""The values every package of the project shares, in a leaf that imports nothing of the project.

    layout.py     ParallelLayout (tp, pp, vpp, ep, etp, cp, dp), ConfigError, divisors
    checks.py     the small field checks the config sections run in ``__post_init__``
    families.py   each model family's one registration (config.json reader and writer, fixed
                  settings, router rules, attention and MoE block, SGLang traits)
    model.py      ModelConfig (+ RopeScalingConfig): the architecture, HF-style
    train.py      TrainConfig (optimizer, schedule, batches), MoEConfig (MoE RL stability)
    trainer.py    what every trainer backend promises: StepResult, the loss function's shape,
                  megatron-core's learning-rate schedule and weight-decay rule
    sglang.py     SGLangSettings (the engines' parallel settings), pad_vocab
    hf_config.py  a Hugging Face directory's config.json -> ModelConfig (no torch)
    buckets.py    consecutive groups of items under a size budget
    files.py      atomic text writes
    gc_pause.py   start-up work with the cyclic garbage collector paused

Package imports (an arrow: may import; ``tests/test_boundaries.py`` checks them):

    hfschema            nothing of the project
    moe                 nothing of the project
    reshard             ──► hfschema
    launch              ──► hfschema
    megatron_adapters   ──► hfschema, reshard, moe
    fsdp_adapters       ──► hfschema
    hybridflow          ──► hfschema, reshard, megatron_adapters, fsdp_adapters, moe, launch

Nothing here imports torch, megatron or sglang; the application config
(``hybridflow.config``) composes these sections with its own and re-exports them.
"""
