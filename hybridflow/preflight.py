"""What ``hybridflow train | launch | slurm`` check in this process, before any rank starts.

    load_config(CONFIG, overrides)
      └─ preflight(cfg, command=...)
           lower(cfg, with_reshard=False)   the graph against the enabled roles and placement
           check_runtime_support(cfg)       what ``hybridflow plan`` accepts but the runtime does not run yet
           check_packing(cfg, ...)          packing: the token budget holds the longest sample; a loss
                                            computed token by token
           check_reward(cfg.reward)         reward.function resolves and takes reward.kwargs
           check_data(cfg)                  data files exist, hold rows with the configured columns;
                                            prints which reward scores which data_source
           routing replay, engine vs this machine   (not for slurm: a login node may have no GPU)
           check_node_gpus(cfg, ...)        train only: the actor's layout fits this node's GPUs
           check_resume(cfg, ...)           run.resume vs the run directory: damaged checkpoints
                                            (run.resume_fallback), a model the checkpoint cannot
                                            load into; prints the checkpoint a start resumes from
      └─ launch.torchrun | launch.multinode | launch.slurm, with plain values (the actor's layout,
         the config path and overrides): they start processes and never read the config

Every refusal is a ``ValueError`` naming the key and the fix; the CLI prints it and exits 2.
What passes but deserves a look (a data_source verifier an explicit reward.function bypasses, a
damaged checkpoint passed over) is one ``warning:`` line on stderr; the rest one line on stdout.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import yaml

from hfschema.engines import ENGINES, resolve
from hfschema.hf_config import read_hf_config
from hfschema.model_source import (
    check_padded_vocab,
    has_chat_template,
    model_source,
    reward_model_source,
    teacher_source,
)
from hybridflow.agentic.engine import check_agentic
from hybridflow.config import (
    ROLE_NAMES,
    HybridflowConfig,
    frozen_gpus,
    frozen_layout,
    frozen_layout_key,
    job_worlds,
    to_yaml,
)
from hybridflow.data import PREVIEW_ROWS, few_rows_warning, preview_files, preview_rows, sft_key
from hybridflow.host_memory import available_bytes, host_memory
from hybridflow.lowering import lower
from hybridflow.memory import GIB
from hybridflow.rewards import check_reward, describe_routing
from hybridflow.runtime import checksums
from hybridflow.runtime.model_dir import GENERATED_FAMILIES
from hybridflow.runtime.state import (
    DAMAGED_SUFFIX,
    check_config_loads,
    checkpoint_problem,
    find_resume,
    initial_checkpoint,
    sft_checkpoint,
)

if TYPE_CHECKING:
    from launch.slurm import SlurmJob

__all__ = [
    "check_async",
    "check_data",
    "check_engine_device",
    "check_engine_serves",
    "check_model_weights",
    "check_node_gpus",
    "check_packing",
    "check_resume",
    "check_runtime_support",
    "check_separate_nodes",
    "check_trainer_backends",
    "check_transformers_builds",
    "check_slurm_run",
    "engine_ranks",
    "more_ranks",
    "preflight",
    "process_count",
]


def check_runtime_support(cfg: HybridflowConfig) -> None:
    """What ``hybridflow plan`` accepts but this version's runtime does not run (yet)."""
    check_trainer_backends(cfg)
    if cfg.critic.enabled and cfg.critic.parallel != cfg.actor.parallel:
        raise ValueError(
            "critic.parallel differs from actor.parallel: the runtime builds the critic on the "
            "actor's ranks under the actor's layout; set critic.parallel=${actor.parallel}"
        )
    if cfg.rollout.num_replicas != 1 and cfg.rollout.sync_route == "full" and cfg.rollout.tp != 1:
        raise ValueError(
            f"rollout.num_replicas={cfg.rollout.num_replicas} with rollout.sync_route=full and rollout.tp="
            f"{cfg.rollout.tp}: the full route gathers whole tensors on each replica's driver, one rank per "
            "replica in this version; set rollout.sync_route=sliced, rollout.tp=1 or rollout.num_replicas=1"
        )
    tp, per_node = cfg.rollout.tp, cfg.rollout.gpus_per_node
    if tp > per_node and tp % per_node:
        raise ValueError(
            f"rollout.tp={tp} does not fill whole nodes of rollout.gpus_per_node={per_node}: an engine "
            f"spanning nodes takes all GPUs of each; set rollout.tp to a multiple of {per_node}"
        )
    if cfg.rollout.placement == "separate":
        _check_separate(cfg)
    if cfg.lora.enabled and cfg.run.mode == "sft":
        raise ValueError(
            "lora.enabled=true with run.mode=sft: adapters train the RL actor only (the SFT warm-up "
            "and run.mode=sft train the whole model); set lora.enabled=false or run.mode=rl"
        )
    if cfg.lora.pushes_adapters:
        _check_adapter_push(cfg)


def check_trainer_backends(cfg: HybridflowConfig) -> None:
    """Every role's trainer is one the runtime has (``hybridflow.runtime.trainers``), and what an
    FSDP2 actor is asked to do is what that backend does."""
    from hybridflow.runtime.trainers import TRAINERS

    for role in ROLE_NAMES:
        name = getattr(cfg, role).backend
        if name is not None and name not in TRAINERS:
            raise ValueError(f"{role}.backend={name}: not a trainer hybridflow runs; set one of {', '.join(TRAINERS)}")
        if name is not None and name != cfg.actor.backend:
            raise ValueError(
                f"{role}.backend={name} with actor.backend={cfg.actor.backend}: a run trains every role with "
                f"one backend in this version; leave {role}.backend unset (it follows the actor)"
            )
    TRAINER_CHECKS[cfg.actor.backend].config(cfg)


FSDP2_NOT_YET = (
    ("reward_model.path", lambda cfg, spec: bool(cfg.reward_model.path)),
    ("distillation.teacher_path", lambda cfg, spec: bool(cfg.distillation.teacher_path)),
    ("run.mode=rm", lambda cfg, spec: cfg.run.mode == "rm"),
    ("lora.enabled=true", lambda cfg, spec: cfg.lora.enabled),
    ("reference.parallel other than actor.parallel", lambda cfg, spec: cfg.reference.parallel != cfg.actor.parallel),
    ("reference.offload=true (fsdp2.offload keeps every shard on the host)", lambda cfg, spec: cfg.reference.offload),
)
"""What the FSDP2 backend does not train yet, refused by name before any rank starts."""


def _check_fsdp2(cfg: HybridflowConfig) -> None:
    from hybridflow.algorithms.recipes import algorithm_spec

    layout = cfg.actor.parallel
    sizes = {k: getattr(layout, k) for k in ("tp", "pp", "ep", "etp")}
    split = [f"actor.parallel.{k}={v}" for k, v in sizes.items() if v > 1]
    if split:
        raise ValueError(
            f"{', '.join(split)} with actor.backend=fsdp2: FSDP2 shards every parameter over data (and "
            "sequence) parallel alone; set them to 1 (and actor.parallel.dp to the GPUs), or use actor.backend=megatron"
        )
    for name, heads in (
        ("num_attention_heads", cfg.model.num_attention_heads),
        ("num_kv_heads", cfg.model.num_kv_heads),
    ):
        if heads % layout.cp:
            raise ValueError(
                f"actor.parallel.cp={layout.cp} does not divide model.{name}={heads}: FSDP2's sequence parallel "
                "(Ulysses) splits the heads evenly over its ranks; set actor.parallel.cp to a divisor of both"
            )
    if cfg.model.is_moe:
        raise ValueError(
            f"model.family={cfg.model.family} (MoE) with actor.backend=fsdp2: transformers fuses the experts "
            "into one parameter per layer, whose weight sync is not built; use actor.backend=megatron for MoE models"
        )
    spec = algorithm_spec(cfg)
    for what, asked in FSDP2_NOT_YET:
        if asked(cfg, spec):
            raise ValueError(f"{what} is not built on actor.backend=fsdp2 yet; use actor.backend=megatron for it")


def _check_adapter_push(cfg: HybridflowConfig) -> None:
    """``lora.push=adapter``: what this version's adapter-only weight sync covers."""
    if not ENGINES[cfg.rollout.engine].adapters:
        takers = "|".join(name for name, t in ENGINES.items() if t.adapters)
        raise ValueError(
            f"lora.push=adapter with rollout.engine={cfg.rollout.engine}: that engine takes merged weights only "
            f"(adapters are pushed through SGLang's LoRA adapter API); set rollout.engine={takers} or lora.push=merged"
        )
    expert = [t for t in cfg.lora.target_modules if t in ("experts", "shared_experts")]
    if expert:
        raise ValueError(
            f"lora.push=adapter with lora.target_modules {expert}: SGLang serves expert adapters only "
            "through its triton MoE LoRA kernels, which hybridflow does not run yet; set lora.push=merged "
            "or target the attention and dense MLP projections only"
        )


ROW_WISE_POLICY_LOSSES = ("gspo", "gmpo", "geo_mean", "clip_cov", "kl_cov")
"""Policy losses that read each sample's row as a whole (a packed row holds several samples)."""


def check_packing(cfg: HybridflowConfig, *, policy_loss: str, loss_agg_mode: str) -> None:
    """``packing``: a budget that holds the longest possible sample, and a loss computed token by
    token (a packed row holds several samples, so per-row reductions would mix them)."""
    packing = cfg.packing
    if not packing.enabled:
        return
    layout = cfg.actor.parallel
    if layout.cp > 1:
        raise ValueError(
            f"packing.enabled with actor.parallel.cp={layout.cp}: packed rows are not split over "
            "context parallelism in this version; set actor.parallel.cp=1 or packing.enabled=false"
        )
    budget = packing.max_tokens_per_micro_batch
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    multiple = layout.tp * layout.cp
    if budget is not None and budget - budget % multiple < longest:
        raise ValueError(
            f"packing.max_tokens_per_micro_batch={budget} is below the longest possible sample, "
            f"data.max_prompt_length + data.max_response_length = {longest} (a packed row is a "
            f"multiple of actor.parallel.tp={layout.tp}); raise it to at least "
            f"{-(-longest // multiple) * multiple}"
        )
    if not loss_agg_mode.startswith("token-"):
        raise ValueError(
            f"packing.enabled with {_algorithm_setting(cfg, 'loss_agg_mode', loss_agg_mode)}: a packed row "
            "holds several samples, so per-sequence means would mix them; use token-mean or token-sum, or "
            "packing.enabled=false"
        )
    if policy_loss in ROW_WISE_POLICY_LOSSES:
        raise ValueError(
            f"packing.enabled with {_algorithm_setting(cfg, 'policy_loss', policy_loss)}: that loss reduces each "
            "sample's row as a whole and a packed row holds several; set packing.enabled=false"
        )
    if cfg.algorithm.rollout_correction is not None and cfg.algorithm.rollout_correction_level != "token":
        raise ValueError(
            f"packing.enabled with algorithm.rollout_correction_level="
            f"{cfg.algorithm.rollout_correction_level}: sequence weights reduce each row as a "
            "whole; use rollout_correction_level=token or packing.enabled=false"
        )


def _algorithm_setting(cfg: HybridflowConfig, key: str, value: str) -> str:
    """``algorithm.<key>=<value>`` as the user set it, or the algorithm that chose it: a refusal
    names the setting the user typed."""
    if getattr(cfg.algorithm, key) is not None:
        return f"algorithm.{key}={value}"
    return f"algorithm.name={cfg.algorithm.name} (its {key} is {value})"


def _check_separate(cfg: HybridflowConfig) -> None:
    r = cfg.rollout
    if not ENGINES[r.engine].own_ranks:
        own = "|".join(name for name, t in ENGINES.items() if t.own_ranks)
        raise ValueError(
            f"rollout.placement=separate with rollout.engine={r.engine}: it runs in the driving process, "
            f"not on engine ranks of its own; set rollout.engine={own} (or rollout.placement=colocated)"
        )
    if r.tp > r.gpus_per_node:
        raise ValueError(
            f"rollout.placement=separate with rollout.tp={r.tp} > rollout.gpus_per_node="
            f"{r.gpus_per_node}: separate engines spanning nodes are not run in this version; "
            "set rollout.tp <= rollout.gpus_per_node, or rollout.placement=colocated"
        )


def check_async(cfg: HybridflowConfig, plan=None) -> None:
    """``async_rl`` against the placement and the graph: one line naming the keys."""
    a = cfg.async_rl
    if a.mode == "async" and a.max_staleness < 1:
        raise ValueError(
            f"async_rl.max_staleness={a.max_staleness} under async_rl.mode=async: generation runs "
            "K >= 1 policy versions ahead; set async_rl.max_staleness >= 1 (or async_rl.mode=sync)"
        )
    if a.buffer_batches < 1:
        raise ValueError(
            f"async_rl.buffer_batches={a.buffer_batches} is smaller than one batch (run.prompts_per_step"
            f" x rollout.n = {cfg.run.prompts_per_step * cfg.rollout.n} samples); set it >= 1"
        )
    if a.mode == "sync":
        if a.partial_rollout:
            raise ValueError(
                "async_rl.partial_rollout=true with async_rl.mode=sync: nothing is generated ahead, so no "
                "request spans a weight update; set async_rl.mode=one_step_off or async (or "
                "async_rl.partial_rollout=false)"
            )
        return
    if a.partial_rollout and a.lag < 2:
        raise ValueError(
            f"async_rl.partial_rollout=true with async_rl.mode={a.mode} (max_staleness {a.lag}): the "
            "next batch is finished during the step that starts it, so no request spans an update; set "
            "async_rl.mode=async with async_rl.max_staleness >= 2 (or async_rl.partial_rollout=false)"
        )
    if a.partial_rollout and a.segment_tokens >= cfg.data.max_response_length:
        raise ValueError(
            f"async_rl.segment_tokens={a.segment_tokens} >= data.max_response_length="
            f"{cfg.data.max_response_length}: every request would end in its first segment, so none spans "
            "a weight update; set async_rl.segment_tokens below it (or async_rl.partial_rollout=false)"
        )
    if cfg.rollout.placement != "separate":
        raise ValueError(
            f"async_rl.mode={a.mode} with rollout.placement={cfg.rollout.placement}: colocated engines "
            "share the actor's GPUs, so there is nothing to overlap; set rollout.placement=separate "
            "or async_rl.mode=sync"
        )
    if a.mode == "one_step_off" and a.max_staleness != 1:
        raise ValueError(
            f"async_rl.max_staleness={a.max_staleness} with async_rl.mode=one_step_off, which is K=1 by "
            "definition; set async_rl.mode=async for K > 1"
        )
    if a.buffer_batches < a.lag:
        raise ValueError(
            f"async_rl.buffer_batches={a.buffer_batches} cannot hold the {a.lag} batch(es) generation "
            f"runs ahead under async_rl.mode={a.mode} (max_staleness {a.lag}); set "
            f"async_rl.buffer_batches >= {a.lag}"
        )
    ops = [stage.node.op for stage in (plan.stages if plan is not None else ())]
    if "generate_greedy" in ops or "filter_groups" in ops:
        raise ValueError(
            f"async_rl.mode={a.mode} with algorithm.name={cfg.algorithm.name}: its graph draws more "
            "than one rollout per step (a greedy baseline or dynamic sampling), which the async "
            "pipeline does not run ahead yet; set async_rl.mode=sync, or algorithm.dynamic_sampling="
            "false"
        )


def engine_ranks(cfg: HybridflowConfig) -> int:
    """Processes of their own the engines take: rollout.tp x num_replicas when separate, else 0."""
    return job_worlds(cfg).get("engine", 0)


def more_ranks(cfg: HybridflowConfig) -> int:
    """Processes of their own beyond the actor's: the separate engines' and the frozen models'
    own GPUs (``reward_model.gpus``, ``distillation.gpus``, ``judge.gpus``)."""
    return sum(job_worlds(cfg).values()) - cfg.actor.parallel.world_size


def process_count(cfg: HybridflowConfig) -> int:
    """Processes (and GPUs) one run takes: the actor's ranks and those of their own."""
    return cfg.actor.parallel.world_size + more_ranks(cfg)


def check_separate_nodes(cfg: HybridflowConfig, nproc_per_node: int) -> None:
    """Separate engine ranks follow the actor's, ``nproc_per_node`` to a node, and a judge's own
    GPUs follow them: each engine's tp ranks must share one node (its driver starts SGLang on
    that node's GPUs)."""
    actors, tp = cfg.actor.parallel.world_size, cfg.rollout.tp
    for replica in range(cfg.rollout.num_replicas if engine_ranks(cfg) else 0):
        first = actors + replica * tp
        if first // nproc_per_node != (first + tp - 1) // nproc_per_node:
            raise ValueError(
                f"rollout.placement=separate: engine replica {replica} (ranks {first}..{first + tp - 1}) "
                f"would span two nodes of {nproc_per_node} processes; make actor.parallel's "
                f"{actors} ranks and rollout.tp={tp} fill whole nodes (or set rollout.placement=colocated)"
            )
    judge = frozen_gpus(cfg).get("judge", range(0))
    for first in judge[:: cfg.judge.tp]:
        last = first + cfg.judge.tp - 1
        if first // nproc_per_node != last // nproc_per_node:
            raise ValueError(
                f"judge.gpus: judge replica {(first - judge.start) // cfg.judge.tp} (ranks {first}..{last}) "
                f"would span two nodes of {nproc_per_node} processes; make the ranks before it "
                f"({judge.start}) and judge.tp={cfg.judge.tp} fill whole nodes"
            )


def check_node_gpus(cfg: HybridflowConfig, available: int) -> None:
    """``hybridflow train`` starts one rank per GPU of this node: the layout must fit them."""
    world = process_count(cfg)
    what = "actor.parallel" if world == cfg.actor.parallel.world_size else "actor.parallel + the ranks of their own"
    if world > available:
        raise ValueError(
            f"{what} needs {world} GPUs ({cfg.actor.parallel.describe()}) but this node has "
            f"{available}: lower actor.parallel.dp (or tp / pp / ep), or run on more nodes with "
            "hybridflow launch or hybridflow slurm"
        )


_SHOWN_CHANGES = 8  # config changes listed on the resume line


_PRODUCT_ON_STDOUT = ("plan", "slurm")
"""Commands whose standard output is what they make (the plan, the batch script): their
preflight lines go to standard error, so the output stays usable as it is."""


def _say(command: str, line: str, *, warning: bool = False) -> None:
    stream = sys.stderr if warning or command in _PRODUCT_ON_STDOUT else sys.stdout
    stream.write(f"hybridflow {command}: {'warning: ' if warning else ''}{line}\n")


def check_data(cfg: HybridflowConfig, *, command: str = "train") -> None:
    """The data files as far as a look at their first rows tells (``data.preview_files``), and
    one line saying which reward function scores the rows of each data_source."""
    files = model_source(cfg.model.path).files if cfg.model.path and os.path.isdir(cfg.model.path) else None
    sources = preview_files(
        cfg.data,
        sft_key=sft_key(cfg),
        with_heldout=cfg.run.heldout_prompts > 0,
        no_chat_template=str(files) if files and not has_chat_template(files) else None,
    )
    if cfg.data.train_files:
        _check_data_size(cfg, sum(sources.values()), command)
        _check_overlap(cfg, command)
    else:  # the synthetic task's rows name it as their data_source
        sources[cfg.task.name] += cfg.task.train_size
    line, warnings = describe_routing(cfg.reward, sources)
    _say(command, line + (" (the first rows of each file)" if cfg.data.train_files else ""))
    for warning in warnings:
        _say(command, warning, warning=True)


def _check_data_size(cfg: HybridflowConfig, usable: int, command: str) -> None:
    """Fewer usable training rows than one step's prompts (each file read whole: ``usable`` is
    under the preview's row count) would fill every step by repeating rows: said before launch."""
    if usable < cfg.run.prompts_per_step and usable < PREVIEW_ROWS and cfg.run.mode != "sft":
        _say(command, few_rows_warning(usable, cfg.run.prompts_per_step), warning=True)


def _check_overlap(cfg: HybridflowConfig, command: str) -> None:
    """A held-out set that is (or shares prompts with) the training set measures recall, not
    learning: the same file, or prompts of its first rows among the training files' first rows."""
    if cfg.run.heldout_prompts <= 0 or not cfg.data.heldout_files:
        return
    train = [os.fspath(p) for p in cfg.data.train_files]
    for index, path in enumerate(os.fspath(p) for p in cfg.data.heldout_files):
        same = [j for j, t in enumerate(train) if os.path.exists(t) and os.path.samefile(path, t)]
        if same:
            _say(command, f"data.heldout_files[{index}] is data.train_files[{same[0]}]: the held-out reward will "
                 "measure prompts the policy trains on; hold out rows of their own", warning=True)  # fmt: skip
            return
    seen = {json.dumps(row.prompt, sort_keys=True) for row in preview_rows(cfg, train)}
    held = [json.dumps(row.prompt, sort_keys=True) for row in preview_rows(cfg, cfg.data.heldout_files)]
    shared = sum(prompt in seen for prompt in held)
    if shared:
        _say(command, f"{shared} of the first {len(held)} held-out prompts are also among the first training "
             "rows: the held-out reward partly measures prompts the policy trains on", warning=True)  # fmt: skip


def check_context(cfg: HybridflowConfig) -> None:
    """A prompt and its response must fit the model's context: the engine refuses a request that
    would not, and only at the first generation (minutes in, after the warm-up)."""
    d, context = cfg.data, cfg.model.max_position_embeddings
    if d.max_prompt_length + d.max_response_length > context:
        source = f"{cfg.model.path}/config.json" if cfg.model.pretrained else "model.max_position_embeddings"
        raise ValueError(
            f"data.max_prompt_length={d.max_prompt_length} + data.max_response_length={d.max_response_length} = "
            f"{d.max_prompt_length + d.max_response_length} exceeds the model's context of {context} tokens "
            f"({source}); lower them to sum to at most {context}"
        )


def check_prompt_lengths(cfg: HybridflowConfig, *, command: str = "train") -> None:
    """The prompts of the first rows of each data file, tokenised as the run will (the model's
    tokenizer and chat template, the system prompt, the tools): a run that would drop more than
    ``data.max_dropped_share`` of them as too long is refused here, before any rank starts, in the
    line the run itself would stop with. Only for ``model.path`` directories (a generated
    tokenizer exists only once rank 0 made it)."""
    path = cfg.model.path
    if not (cfg.data.train_files and path and os.path.isdir(path)):
        return
    from hybridflow.data import DataReport, model_tokenizer, preview_rows, tokenize_rows, tool_schemas

    tokenizer = model_tokenizer(path)
    tools = tool_schemas(cfg)
    sets = [("training", "data.train_files", cfg.data.train_files)]
    if cfg.run.heldout_prompts > 0 and cfg.data.heldout_files:
        sets.append(("held-out", "data.heldout_files", cfg.data.heldout_files))
    for name, key, paths in sets:
        report = DataReport()
        rows = preview_rows(cfg, [os.fspath(p) for p in paths])
        kept, _ = tokenize_rows(rows, tokenizer, replace(cfg.data, on_bad_row="skip"), tools, name=name, report=report)
        report.check_dropped(name, key, cfg.data, kept=len(kept))  # the line the run would stop with
        if report.too_long:
            _say(command, f"{key}: {len(report.too_long)} of the first {len(rows)} prompts are longer than "
                 f"data.max_prompt_length={cfg.data.max_prompt_length} and will be skipped", warning=True)  # fmt: skip


def check_engine_serves(cfg: HybridflowConfig) -> None:
    """The engine has a model class for ``model.path``'s architecture, where it exists here and the
    engine lists its classes (``EngineTraits.model_classes``: SGLang's; the hf engine runs whatever
    transformers builds, which ``check_transformers_builds`` asks for FSDP2's actor alike)."""
    path, listing = cfg.model.path, ENGINES[cfg.rollout.engine].model_classes
    if listing is None or cfg.run.mode != "rl" or not path:
        return
    if not os.path.exists(os.path.expanduser(path)):
        return
    source = model_source(path)
    classes = read_hf_config(source.files).get("architectures") or []
    served = resolve(listing)()
    if served and classes and not any(name in served for name in classes):
        engine = cfg.rollout.engine
        others = "|".join(name for name, t in ENGINES.items() if t.model_classes is None)
        raise ValueError(
            f"model.path={source.files}: the installed {ENGINES[engine].label} has no model class for "
            f"{', '.join(classes)}, so rollout.engine={engine} cannot generate from it; set rollout.engine={others} "
            f"(transformers' own class generates, rollout.tp=1), or train a model {ENGINES[engine].label} serves"
        )


def check_transformers_builds(source) -> None:
    """What ``actor.backend=fsdp2`` builds from ``model.path``: transformers' causal-LM class of its
    config.json, sharded per decoder layer (its ``_no_split_modules``), from a Hugging Face directory."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if source.kind != "hf":
        raise ValueError(
            f"model.path={source.weights} is a megatron-core checkpoint; actor.backend=fsdp2 reads Hugging Face "
            "directories: write one with hybridflow convert mcore-to-hf, or use actor.backend=megatron"
        )
    try:
        config = AutoConfig.from_pretrained(source.files)
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ValueError, OSError) as error:
        cause = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(
            f"model.path={source.files}: transformers {transformers.__version__} cannot build it as a causal LM "
            f"({cause}); actor.backend=fsdp2 trains what AutoModelForCausalLM loads: upgrade transformers, or fix "
            "config.json"
        ) from None
    if not getattr(model_class, "_no_split_modules", None):
        raise ValueError(
            f"model.path={source.files}: {model_class.__name__} names no decoder layer class (_no_split_modules), "
            "which FSDP2 shards one by one; use actor.backend=megatron for it"
        )


def check_model_weights(
    cfg: HybridflowConfig, *, on_cluster: bool, must_exist: bool = True, command: str = "train"
) -> None:
    """A run that would post-train a random network by accident is refused: on GPUs (or Slurm) a
    model without ``model.path`` must say ``model.init=random``; ``model.path`` must hold a model
    (``must_exist=False``: a warning when it does not exist). A random model needs a starting
    directory the run can write (``model_dir.GENERATED_FAMILIES``)."""
    model = cfg.model
    if model.path:
        if must_exist or os.path.exists(os.path.expanduser(model.path)):
            source = model_source(model.path)  # load_config let a missing one plan
            check_engine_serves(cfg)
            TRAINER_CHECKS[cfg.actor.backend].model(cfg, source)
        else:
            _say(
                command,
                f"model.path={model.path} does not exist here; the job will fail unless it does on the cluster's nodes",
                warning=True,
            )
        return
    if model.init is None and on_cluster:
        raise ValueError(
            "model.path is not set: this run would post-train a randomly initialised network; set "
            "model.path=DIR (a Hugging Face model directory or a `hybridflow convert hf-to-mcore` "
            "checkpoint), or model.init=random to train from random weights on purpose"
        )
    if model.family not in GENERATED_FAMILIES:
        raise ValueError(
            f"model.family={model.family} without model.path: a random {model.family} model has no "
            f"starting directory (the run writes one for {', '.join(GENERATED_FAMILIES)}); set "
            f"model.path to a {model.family} model directory"
        )


def check_frozen_models(cfg: HybridflowConfig, *, must_exist: bool = True, command: str = "train") -> None:
    """A reward model that is not one (no score head, several labels), a teacher with another
    vocabulary, or either with a shape its layout (its own or the actor's) cannot split, is
    refused in one line before any rank starts."""
    checks = {
        "reward_model.path": ("reward_model", cfg.reward_model.path, reward_model_source),
        "distillation.teacher_path": (
            "teacher",
            cfg.distillation.teacher_path,
            lambda p: teacher_source(p, cfg.model.vocab_size),
        ),
    }
    for key, (role, path, source) in checks.items():
        if not path:
            continue
        if not must_exist and not os.path.exists(os.path.expanduser(path)):
            _say(command, f"{key}={path} does not exist here; the job fails unless it does on the nodes", warning=True)
            continue
        _, model = source(path)
        layout, own_key = frozen_layout(cfg, role), frozen_layout_key(role)
        if layout != cfg.actor.parallel:
            layout.check_model(model, prefix=own_key)
            continue
        try:
            layout.check_model(model, prefix=f"actor.parallel ({key}'s layout)")
        except ValueError as e:
            raise ValueError(f"{e}; or give it a layout of its own on the actor's ranks ({own_key})") from None


def check_rm_mode(cfg: HybridflowConfig) -> None:
    """``run.mode=rm`` with preference files has no prompt rows for an SFT warm-up."""
    if cfg.run.mode == "rm" and cfg.data.train_files and cfg.sft.steps:
        raise ValueError(
            f"run.mode=rm with data.train_files: the files hold preference pairs, and sft.steps={cfg.sft.steps} "
            "needs prompt rows with SFT targets; set sft.steps=0 (the reward model starts from model.path)"
        )


def check_engine_device(cfg: HybridflowConfig, *, on_gpu: bool) -> None:
    """What the rollout engine refuses on this machine, said before the SFT warm-up instead of
    at the engine's start after it."""
    r = cfg.rollout
    # (setting, engine, model, tp): the judge's model is read at its start, its shape unchecked here
    engines = [(f"rollout.engine={r.engine}", r.engine, cfg.model, r.tp)]
    if cfg.judge.path:
        engines.append((f"judge.engine={cfg.judge.engine}", cfg.judge.engine, None, cfg.judge.tp))
    for setting, name, model, tp in engines:
        if ENGINES[name].environment is not None:
            resolve(ENGINES[name].environment)(model, on_gpu=on_gpu, setting=setting, tp=tp)
    if not ENGINES[r.engine].cpu_expert_parallel and not on_gpu and r.ep > 1:
        raise ValueError(
            f"rollout.ep={r.ep} on a machine without a GPU: {ENGINES[r.engine].label}'s CPU engine runs only ep=1 "
            "(its torch-native MoE does not handle non-local experts); set rollout.ep=1 or run on GPUs"
        )


def check_trainer_device(cfg: HybridflowConfig, *, on_gpu: bool) -> None:
    """What the trainer cannot run on this machine, said before any rank starts."""
    TRAINER_CHECKS[cfg.actor.backend].device(cfg, on_gpu)


def _check_megatron_device(cfg: HybridflowConfig, on_gpu: bool) -> None:
    cp = cfg.actor.parallel.cp
    if cp > 1 and not on_gpu:
        raise ValueError(
            f"actor.parallel.cp={cp} with actor.backend=megatron on a machine without a GPU: megatron-core's "
            "context parallel runs in TransformerEngine's attention, on GPUs; on a CPU use actor.backend=fsdp2 "
            "(Ulysses sequence parallel over the same cp ranks) or set actor.parallel.cp=1"
        )


def _check_megatron_model(cfg: HybridflowConfig, source) -> None:
    layout = cfg.actor.parallel
    check_padded_vocab(source, layout.padded_vocab_size(cfg.model), layout.tp)


@dataclass(frozen=True, kw_only=True)
class TrainerChecks:
    """What a trainer backend refuses before any rank starts: its registration here."""

    config: Callable[[HybridflowConfig], None]
    """The run's settings the backend does not train (yet)."""
    model: Callable[[HybridflowConfig, Any], None]
    """``model.path``'s directory or checkpoint (a ``ModelSource``) as the backend reads it."""
    device: Callable[[HybridflowConfig, bool], None]
    """(cfg, whether this machine has a GPU): what the backend runs on GPUs only."""


TRAINER_CHECKS = {
    "megatron": TrainerChecks(config=lambda cfg: None, model=_check_megatron_model, device=_check_megatron_device),
    "fsdp2": TrainerChecks(
        config=_check_fsdp2, model=lambda cfg, source: check_transformers_builds(source), device=lambda cfg, gpu: None
    ),
}
"""Each trainer backend's checks (``hybridflow.runtime.trainers.TRAINERS`` runs them)."""


def check_output_dir(cfg: HybridflowConfig, *, room: bool = True) -> None:
    """``run.output_dir`` is (or can be made) a directory this user writes into, and (``room``) on a
    file system with room for one checkpoint of the run (``memory.checkpoint_bytes``): a full disk
    found at the first save loses the steps before it."""
    import shutil

    from hfschema.files import existing_ancestor, writable_directory_problem
    from hybridflow.memory import checkpoint_bytes
    from reshard.stats import format_bytes

    out = cfg.run.output_dir
    problem = writable_directory_problem(out)
    if problem is not None:
        raise ValueError(
            f"run.output_dir={out} {problem}; set run.output_dir to a directory this user can write, "
            "on a file system mounted read-write"
        )
    need, free = checkpoint_bytes(cfg), shutil.disk_usage(existing_ancestor(out)).free
    if room and free < need:
        raise ValueError(
            f"run.output_dir={out}: its file system has {format_bytes(free)} free, less than one "
            f"checkpoint of this run (about {format_bytes(need)}: the trained roles' weights and "
            "optimizer state); free space there, or set run.output_dir to a larger file system"
        )


def check_resume(
    cfg: HybridflowConfig, *, command: str = "train", uses_reference: bool = False, content: bool = True
) -> None:
    """``run.resume`` against the run directory: the checkpoint a start continues from, the
    damaged ones passed over (``run.resume_fallback``), and a config its model cannot load.
    ``uses_reference``: the reference policy loads from the SFT checkpoint, which must then be
    complete too. ``content``: compare the files with their checksums (once per job: the ranks
    this process launches are told, ``checksums.VERIFIED_ENV``)."""
    found = find_resume(cfg.run.output_dir, cfg.run.resume, fallback=cfg.run.resume_fallback, content=content)
    if content and found.path is not None:
        os.environ[checksums.VERIFIED_ENV] = str(found.path)
    sft = sft_checkpoint(cfg.run.output_dir)
    source = sft if sft.is_dir() else initial_checkpoint(cfg.run.output_dir)  # the reference's weights
    if (
        uses_reference
        and found.path not in (None, source)
        and source.is_dir()
        and (problem := checkpoint_problem(source, content=content))
    ):
        raise ValueError(
            f"checkpoint {source.name} is damaged: {problem}; the reference policy loads from it (algorithm."
            "kl_loss_coef / kl_reward_coef > 0): restore its files, or set a new run.output_dir"
        )
    for path, problem in found.damaged:
        _say(
            command,
            f"checkpoint {path.name} is damaged: {problem}; the run sets it aside as "
            f"{path.name}{DAMAGED_SUFFIX} and resumes from an earlier one (run.resume_fallback=previous)",
            warning=True,
        )
    if found.path is None:
        return
    changes = check_config_loads(found.path, cfg.run.output_dir, yaml.safe_load(to_yaml(cfg)))
    _say(command, f"resuming from {found.path}")
    if changes:
        more = f" (and {len(changes) - _SHOWN_CHANGES} more)" if len(changes) > _SHOWN_CHANGES else ""
        _say(command, f"changed since {found.path.name} was saved: {'; '.join(changes[:_SHOWN_CHANGES])}{more}")


def preflight(
    cfg: HybridflowConfig, *, command: str = "train", content: bool = True, model_must_exist: bool = True
) -> None:
    """What can be checked in this process before any rank starts: the algorithm's graph
    against the enabled roles and placement, the reward function, the data files, the engine
    on this machine, and ``run.resume`` against the run directory (``content``: with the
    checksums, which the node that hosts rank 0 compares, once per job)."""
    plan = lower(cfg, with_reshard=False)  # graph, roles, placement: every check that needs no process
    check_runtime_support(cfg)
    check_async(cfg, plan)
    check_packing(cfg, policy_loss=plan.spec.policy_loss, loss_agg_mode=plan.spec.loss_agg_mode)
    check_reward(cfg.reward)
    check_trackers(cfg)
    check_agentic(cfg)
    check_model_weights(cfg, on_cluster=command == "slurm" or _has_gpu(), must_exist=model_must_exist, command=command)
    check_frozen_models(cfg, must_exist=model_must_exist, command=command)
    check_rm_mode(cfg)
    check_context(cfg)
    if not (cfg.run.mode == "rm" and cfg.data.train_files):  # preference pairs: no prompt rows to preview
        check_data(cfg, command=command)
        check_prompt_lengths(cfg, command=command)
    check_output_dir(cfg, room=model_must_exist)  # a dry run's script for a model not downloaded yet
    if command != "slurm":  # this machine runs the ranks (a Slurm login node may have no GPU)
        import torch

        from moe.routes import check_replay_device

        check_replay_device(cfg.moe.routing_replay, on_gpu=torch.cuda.is_available())
        check_engine_device(cfg, on_gpu=torch.cuda.is_available())
        check_trainer_device(cfg, on_gpu=torch.cuda.is_available())
    if command == "train" and torch.cuda.is_available():
        check_node_gpus(cfg, torch.cuda.device_count())
    elif command == "train":
        check_host_memory(cfg, available_bytes())
    check_resume(cfg, command=command, uses_reference=plan.spec.uses_reference, content=content)


TRACKER_PACKAGES = {"mlflow": "mlflow", "tensorboard": "tensorboard", "wandb": "wandb"}


def check_trackers(cfg: HybridflowConfig) -> None:
    """Each tracker ``run.tracking.trackers`` lists has its package here: found missing now, not
    when rank 0 starts tracking after the ranks' start-up."""
    import importlib.util

    for name in cfg.run.tracking.trackers:
        if importlib.util.find_spec(TRACKER_PACKAGES[name]) is None:
            raise ValueError(
                f"run.tracking.trackers lists {name}, but the {TRACKER_PACKAGES[name]} package is not installed "
                f"here: pip install {TRACKER_PACKAGES[name]} (requirements/runtime.txt pins it), or drop {name} "
                "from the list"
            )


def check_host_memory(cfg: HybridflowConfig, available: int | None, *, command: str = "train") -> None:
    """A CPU run whose processes would hold more than the machine has free is killed by the
    out-of-memory killer minutes in (after the warm-up, at the engine's start): said before."""
    estimate = host_memory(cfg)
    if available is None or estimate.total <= available:
        return
    _say(command, f"{estimate.line()}, more than the {available / GIB:.2f} GiB this machine has free: the run "
         "will likely be killed for memory; lower train.micro_batch_size, rollout.max_total_tokens or the "
         "data lengths, or use fewer processes (actor.parallel, rollout.tp)", warning=True)  # fmt: skip


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def check_slurm_run(cfg: HybridflowConfig, job: SlurmJob, *, dry_run: bool = False) -> None:
    """Check the run as ``hybridflow launch`` would, before ``launch.slurm`` renders its script:
    a requeued job must resume, and the allocation must start exactly the actor's ranks
    (``dry_run``: a script printed for a model not downloaded yet is only warned about)."""
    if cfg.run.resume != "auto":
        raise ValueError(
            f"run.resume={cfg.run.resume}: a Slurm job must be able to resume after a requeue; "
            "use run.resume=auto (the default) and a new run.output_dir for a fresh run"
        )
    job.check_layout(cfg.actor.parallel, more_ranks(cfg))
    check_separate_nodes(cfg, job.nproc_per_node)
    # the job's node 0 compares the checksums when it starts
    preflight(cfg, command="slurm", content=False, model_must_exist=not dry_run)
