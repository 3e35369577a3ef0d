"""Typed run configuration: one schema, one default, every user error a ValueError.

The dataclasses below are the schema and hold the only defaults; YAML files in
``configs/`` and ``key=value`` overrides only change them:

    HybridflowConfig (schema) <- configs/*.yaml <- overrides  --merge-->  DictConfig
        --check keys-->  --resolve ${...}-->  --to_object, __post_init__ checks-->  HybridflowConfig

Each section validates itself in ``__post_init__`` and raises ``ConfigError`` with keys
relative to itself; ``load_config`` prefixes the section path, so every message names
a full key such as ``actor.parallel.tp``.

The sections every package shares (``ModelConfig``, ``TrainConfig``, ``MoEConfig``,
``ParallelLayout``, ``ConfigError``) live in the leaf package ``hfschema``, which imports nothing
of the project; they are re-exported here as part of the schema.
"""

import dataclasses
import difflib
import logging
import os
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from hfschema.checks import check_choice, check_non_negative, check_positive
from hfschema.engines import ENGINE_NAMES, ENGINES
from hfschema.hf_config import read_hf_config
from hfschema.layout import ConfigError, ParallelLayout
from hfschema.lora import LoRAConfig, check_lora_model
from hfschema.model import FAMILY_DERIVED, MODEL_FAMILIES, UNMAPPED_FAMILY, ModelConfig, RopeScalingConfig
from hfschema.packing import PackingConfig
from hfschema.sglang import SGLangSettings
from hfschema.train import MoEConfig, TrainConfig
from hybridflow.lengths import SYNTHETIC
from hybridflow.lengths import decide as decide_lengths
from hybridflow.lengths import logger as decision_logger

if TYPE_CHECKING:
    from reshard.stats import Bandwidth

__all__ = [
    "CORRECTION_LEVELS",
    "CORRECTION_MODES",
    "PF_PPO_MODES",
    "ChecksConfig",
    "ConfigError",
    "HybridflowConfig",
    "ModelConfig",
    "ModelSection",
    "MODEL_FAMILIES",
    "MoEConfig",
    "ParallelLayout",
    "ROLE_NAMES",
    "TRAINER_BACKENDS",
    "ROLLOUT_ENGINES",
    "ReferenceConfig",
    "RoleConfig",
    "RolloutConfig",
    "RopeScalingConfig",
    "RunConfig",
    "TrackingConfig",
    "TrainConfig",
    "AlgorithmConfig",
    "AsyncRLConfig",
    "DataConfig",
    "LoRAConfig",
    "TaskConfig",
    "RewardConfig",
    "SFTConfig",
    "RMConfig",
    "RewardModelConfig",
    "DistillationConfig",
    "JudgeConfig",
    "enabled_roles",
    "frozen_gpus",
    "job_worlds",
    "frozen_layout",
    "frozen_offload",
    "frozen_paths",
    "frozen_layout_key",
    "reward_weights",
    "load_config",
    "to_yaml",
]

logger = logging.getLogger(__name__)

ROLE_NAMES = ("actor", "reference", "critic")
TRAINER_BACKENDS = ("megatron", "fsdp2")
"""The trainers a role may name (``hybridflow.runtime.trainers`` holds the ones that run)."""
TRANSFORMERS_TRAINERS = ("fsdp2",)
"""Trainer backends that build transformers' own class of ``model.path``: they train an
architecture no family maps (``model.family=transformers``)."""
ROLLOUT_ENGINES = ENGINE_NAMES
ROLLOUT_PLACEMENTS = ("colocated", "separate")
ROLLOUT_DTYPES = ("bfloat16", "float16", "float32")


# --------------------------------------------------------------------------- schema


MODEL_INITS = ("pretrained", "random")


@dataclass(kw_only=True)
class ModelSection(ModelConfig):
    """The model: its architecture (``ModelConfig``'s keys) and where its weights come from.

    With ``path`` set, the architecture is read from the directory's config.json when the
    config loads; a ``model.*`` key set beside it must agree (``model_source.architecture``).
    """

    path: Optional[str] = None
    """Starting model: a Hugging Face model directory (config.json, *.safetensors, tokenizer,
    chat template, generation_config.json) or a checkpoint written by ``hybridflow convert
    hf-to-mcore`` (or a run). Its tokenizer, chat template and stop tokens are the run's."""
    init: Optional[str] = None
    """pretrained (the weights at ``path``) or random (seeded initialisation: the synthetic
    quickstart's SFT warm-up and tests); None: pretrained when ``path`` is set, else random."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.init is not None:
            check_choice("init", self.init, MODEL_INITS)
        if self.init == "pretrained" and not self.path:
            raise ConfigError(
                "{p}init=pretrained needs {p}path (a Hugging Face model directory or a converted checkpoint)"
            )

    @property
    def architecture(self) -> ModelConfig:
        """The architecture alone (what a model directory's config.json describes)."""
        return ModelConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ModelConfig)})

    @property
    def has_tensor_list(self) -> bool:
        """Whether the tensors are known: a family's table, or an unmapped architecture's weight
        files at ``path`` (absent while a recipe is planned before its directory exists)."""
        return self.family != UNMAPPED_FAMILY or (bool(self.path) and os.path.exists(os.path.expanduser(self.path)))

    @property
    def described(self) -> str:
        """The family, or for an unmapped architecture its model_type and who builds it."""
        if self.family != UNMAPPED_FAMILY:
            return self.family
        try:
            model_type = read_hf_config(os.path.expanduser(self.path)).get("model_type")
        except (TypeError, ValueError):
            model_type = "unknown"
        return f"{model_type} (transformers' own class; no family mapping)"

    @property
    def pretrained(self) -> bool:
        """Whether the run starts from the weights at ``path``."""
        return bool(self.path) and self.init != "random"


@dataclass(kw_only=True)
class RoleConfig:
    """One model role (actor, reference, critic): whether it runs and how it is sharded."""

    enabled: Optional[bool] = True
    """Whether this role is built; the reference and critic are optional. The critic's None (its
    default): built when the algorithm's estimator reads values (ppo's and vapo's gae)."""
    parallel: Optional[ParallelLayout] = field(default_factory=ParallelLayout)
    """megatron-core parallel layout of this role; the reference's and critic's None (their
    default): the actor's layout. The reference is a frozen model: a layout of its own must fill
    the actor's ranks (groups of its own over them); the runtime builds the critic under the
    actor's layout only."""
    backend: Optional[str] = "megatron"
    """The trainer that holds this role: megatron (megatron-core, every layout above) or fsdp2
    (FSDP2 over transformers' own model class, sharded over ``parallel.dp`` alone: dense models;
    ``fsdp2`` holds its settings). The reference's and critic's None (their default): the actor's."""

    def __post_init__(self) -> None:
        if self.backend is not None:
            check_choice("backend", self.backend, TRAINER_BACKENDS)


@dataclass(kw_only=True)
class FSDP2Config:
    """The FSDP2 trainer's settings (``actor.backend=fsdp2``)."""

    activation_checkpointing: bool = True
    """Recompute each decoder layer's activations in the backward pass (transformers' gradient
    checkpointing): a layer's inputs stay, not its insides."""
    offload: bool = False
    """Keep the parameter shards, their gradients and the optimizer state on the host (FSDP2's
    ``CPUOffloadPolicy``; the optimizer steps on the CPU): a GPU then holds one layer's gathered
    weights at a time."""


@dataclass(kw_only=True)
class ReferenceConfig(RoleConfig):
    """The frozen reference policy: a role of the actor's architecture, built without gradients."""

    offload: bool = False
    """Keep the reference's parameters on the host between its uses (its GPU memory is free for
    generation and training; each use copies them in)."""


TRACKERS = ("mlflow", "tensorboard", "wandb")


@dataclass(kw_only=True)
class TrackingConfig:
    """Where metrics and run metadata go."""

    trackers: list[str] = field(default_factory=lambda: ["mlflow"])
    """Where metrics, the held-out tables and the run's figure go, any of: mlflow (a local store
    under run.output_dir unless ``uri``), tensorboard (event files under run.output_dir/tensorboard),
    wandb (Weights & Biases; offline under run.output_dir/wandb without a key). [] = the console
    and the run directory only."""
    uri: Optional[str] = None
    """MLflow tracking server URI; None = a local SQLite store under run.output_dir."""
    experiment: str = "hybridflow"
    """MLflow experiment name runs are grouped under."""
    wandb_project: str = "hybridflow"
    """The wandb project runs go to."""
    wandb_mode: str = "auto"
    """online, offline (``wandb sync`` uploads the run directory later) or auto: online where an
    API key is known (WANDB_API_KEY or ~/.netrc), else offline."""

    def __post_init__(self) -> None:
        for name in self.trackers:
            check_choice("trackers", name, TRACKERS)
        if len(set(self.trackers)) != len(self.trackers):
            raise ConfigError("{p}trackers={v} names a tracker twice", v=self.trackers)
        check_choice("wandb_mode", self.wandb_mode, ("auto", "online", "offline"))


@dataclass(kw_only=True)
class ChecksConfig:
    """Correctness gates every RL run evaluates from its own metrics (``hybridflow/runtime/gates.py``),
    and what a failed one does."""

    on_fail: str = "warn"
    """A failed gate: warn (logged, counted in ``checks/failed``) or stop (the run exits with
    the gate's message before the step's checkpoint is written)."""
    first_step_ppo_kl: float = 1e-3
    """Step-0 invariant: at the first mini-batch of the first RL step the trainer's new
    log-probs equal its old ones, so |ppo_kl| must stay below this (and the clip fraction 0)."""
    token_mult_prob_error: float = 1.05
    """Engine vs trainer, every step: the token mean of exp(|logp_trainer - logp_engine|)
    (NeMo-RL's ``token_mult_prob_error``; 1.0 = the engine samples from the trainer's
    distribution) must stay below this. A broken weight sync gives far more; bf16 engines
    typically stay under 1.02."""
    refit_every: int = 10
    """The refit verifier: on the first weight push and then every this many, each engine's
    parameters are read back (an SGLang custom loader digests them in place) and compared with
    the tensors the trainer shared (sliced route only; 0 = off). Costs one pass over the
    engine's weights."""
    refit_tolerance: float = 1e-6
    """The verifier's largest allowed relative difference of a parameter's sum or sum of
    squares (the engine holds the shared tensors bit for bit, so any difference is a fault)."""
    no_signal_steps: int = 3
    """Warn when this many RL steps in a row carried no learning signal (every prompt group's
    rewards equal, so every group-normalised advantage is 0), naming the reward function, why
    and an example response; 0 = never. A warning, whatever ``on_fail`` says."""
    response_clip_ratio: float = 0.25
    """Warn (once a run) when this share of a step's responses or more hit
    ``data.max_response_length`` before they finished; 0 = never. A warning, whatever
    ``on_fail`` says."""

    def __post_init__(self) -> None:
        check_choice("on_fail", self.on_fail, ("warn", "stop"))
        check_non_negative(self, ("refit_every", "no_signal_steps"))
        check_positive(self, ("refit_tolerance",))
        check_positive(self, ("first_step_ppo_kl",))
        if not 0.0 <= self.response_clip_ratio <= 1.0:
            raise ConfigError("{p}response_clip_ratio={v} must be in [0, 1]", v=self.response_clip_ratio)
        if self.token_mult_prob_error <= 1.0:
            raise ConfigError(
                "{p}token_mult_prob_error={v} must be > 1 (1.0 is a perfect match)", v=self.token_mult_prob_error
            )


ASYNC_MODES = ("sync", "one_step_off", "async")


@dataclass(kw_only=True)
class AsyncRLConfig:
    """Overlapping generation with training (``hybridflow/runtime/pipeline.py``): the engine
    ranks of separate placement generate later steps' batches while the actor trains."""

    mode: str = "sync"
    """sync: generate, then train, every step; one_step_off: batch k+1 is generated (with the
    weights before step k's update) while step k trains; async: batches run up to max_staleness
    policy versions ahead of the trainer."""
    max_staleness: int = 1
    """K: the trainer takes only samples generated by policy versions >= its own - K (async;
    one_step_off is K = 1). Batch b is generated with version max(first, b - K): the interleaving
    is a function of the step and K, never of timing, so runs and resumed runs reproduce."""
    on_stale: str = "drop"
    """A sample older than K versions (only a guard here: the fixed interleaving never makes
    one): drop (left out of the step) or downweight (its advantages scaled by stale_weight)."""
    stale_weight: float = 0.5
    """The down-weighting factor of on_stale=downweight, in (0, 1]."""
    buffer_batches: int = 2
    """Batches the buffer holds (pending on the engine ranks: generated or generating, not yet
    trained on); must hold the max_staleness batches the engines run ahead."""
    resume: str = "checkpoint"
    """The buffer at a checkpoint: checkpoint (the pending batches are saved with their versions
    beside the checkpoint, so a resumed run trains on the same samples and reproduces the
    metrics) or drop (a resumed run regenerates them with the resumed weights)."""
    partial_rollout: bool = False
    """Weight updates that do not wait for generation: a batch started ahead samples at most
    segment_tokens per request with the weights it started under; at each later step, while the
    actor trains, the engines continue its unfinished requests a segment further with that
    step's weights, to their end at the step before it is trained on. Each token keeps the
    version that sampled it (metrics async/tokens_version_lag_*). async with max_staleness >= 2
    only. Otherwise each batch is generated whole with the version it started under."""
    segment_tokens: int = 8
    """partial_rollout: the response tokens a request may sample per policy version (the batch
    trained next runs to its end)."""

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, ASYNC_MODES)
        if self.segment_tokens < 1:
            raise ConfigError("{p}segment_tokens={v} must be >= 1", v=self.segment_tokens)
        check_choice("on_stale", self.on_stale, ("drop", "downweight"))
        check_choice("resume", self.resume, ("checkpoint", "drop"))
        if not 0.0 < self.stale_weight <= 1.0:
            raise ConfigError("{p}stale_weight={v} must be in (0, 1]", v=self.stale_weight)

    @property
    def lag(self) -> int:
        """Versions generation runs ahead of training: 0 (sync), 1 (one_step_off), K (async)."""
        return {"sync": 0, "one_step_off": 1}.get(self.mode, self.max_staleness)

    def describe(self) -> str:
        """One line for ``hybridflow plan``: what the runtime overlaps."""
        if self.mode == "sync":
            return "sync: each step generates, then trains"
        partial = (
            f"; partial rollouts: {self.segment_tokens} token(s) per request per version, continued after "
            "each push with the new weights"
            if self.partial_rollout
            else ""
        )
        return (
            f"{self.mode}: batch b generated by policy version max(start, b-{self.lag}) on the engine ranks while "
            f"the actor trains; samples older than {self.lag} version(s) {self.on_stale}; buffer "
            f"{self.buffer_batches} batch(es), resume={self.resume}{partial}"
        )


@dataclass(kw_only=True)
class RunConfig:
    """Identity and outputs of one run."""

    name: str = "quickstart"
    """Run name; also names the output directory by default."""
    output_dir: str = "runs/${run.name}"
    """Directory for checkpoints, logs and the resolved config."""
    seed: int = 1234
    """Global random seed."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """Metrics tracking."""
    mode: str = "rl"
    """rl: SFT warm-up (if sft.steps > 0) then the algorithm; sft: SFT only; rm: train a
    reward model on preference pairs (the ``rm`` section; after the SFT warm-up, if any, whose
    model it starts from) and export it for ``reward_model.path``."""
    steps: int = 20
    """RL steps (one generation + update each)."""
    prompts_per_step: int = 16
    """Prompts drawn per RL step; each is sampled rollout.n times."""
    checkpoint_every: int = 10
    """Save the actor (with optimizer state) and the run state every this many steps; 0 = only at the end."""
    collective_timeout_minutes: int = 10
    """How long a rank waits in a torch.distributed collective before the job fails (NCCL / gloo
    timeout): a dead or hung rank stops the others after this."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept; older ones are deleted after a newer one is complete."""
    resume: str = "auto"
    """auto: continue from the newest complete checkpoint in output_dir if there is one;
    never: start fresh (refuses a directory that already holds checkpoints)."""
    resume_fallback: str = "previous"
    """A newest checkpoint found damaged at a start (a shard missing or truncated, its metadata
    unreadable; the file is named): previous (set it aside as ``<name>.damaged`` and resume from
    the newest complete one) or stop (refuse to start)."""
    heldout_prompts: int = 200
    """Held-out prompts scored (greedy) after SFT and after RL; 0 = skip."""
    heldout_every: int = 0
    """Also score the held-out set every this many RL steps (0 = only after SFT and at the end)."""
    samples_per_step: int = 16
    """Samples of each RL step written to ``<output_dir>/samples/step_NNNNNN.jsonl`` (whole prompt
    groups: prompt, response, reward, advantage, tokens, finish reason, ...); 0 = none. Every
    held-out scoring writes all its generations (``heldout_step_NNNNNN.jsonl``) whatever this is."""
    samples_budget_mb: float = 200.0
    """Largest size of ``<output_dir>/samples/``: past it the oldest step files are removed."""
    deterministic: bool = False
    """Same config and seed, same metrics bit for bit: deterministic torch, megatron-core, NCCL and
    (on GPUs) SGLang kernels (``hybridflow/runtime/determinism.py``); slower on GPUs."""
    verbose: bool = False
    """Show megatron-core's, SGLang's and Python's own log lines and warnings on the terminal too
    (``hybridflow train -v``); by default they go only to ``<output_dir>/logs/`` (``runtime.console``)."""
    on_nan: str = "stop"
    """A non-finite loss or grad norm: stop (the step is not applied, no checkpoint is written,
    the run exits with an error) or skip (the step is dropped whole and the run goes on: when a
    step makes more than one update, every trained role is copied to the host before its first
    update and rolled back, which costs one host copy of the training state per step)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("{p}name must not be empty")
        check_choice("mode", self.mode, ("rl", "sft", "rm"))
        check_choice("resume", self.resume, ("auto", "never"))
        check_choice("resume_fallback", self.resume_fallback, ("previous", "stop"))
        check_choice("on_nan", self.on_nan, ("stop", "skip"))
        check_non_negative(
            self, ("seed", "steps", "checkpoint_every", "heldout_prompts", "heldout_every", "samples_per_step")
        )
        check_positive(self, ("prompts_per_step", "keep_checkpoints", "samples_budget_mb"))


@dataclass(kw_only=True)
class RolloutConfig:
    """The inference engines that generate rollouts and receive the actor's weights."""

    engine: str = "sglang"
    """Rollout engine: sglang; vllm (a server under vLLM's own environment, ``bash scripts/install.sh
    --vllm``; a replica splits by tp on one node); or hf (transformers, in the driving process on
    its device: small runs, and GPU machines without SGLang; needs sync_route=full)."""
    tp: int = 1
    """Ranks per engine (SGLang ``--tp-size``, vLLM ``tensor_parallel_size``)."""
    ep: int = 1
    """Expert-parallel size inside an engine (``--ep-size``)."""
    moe_dp: int = 1
    """MoE data-parallel size inside an engine (``--moe-dp-size``); moe_tp = tp / ep / moe_dp.
    Only 1 for now: SGLang pairs moe_dp > 1 with attention context parallelism, not planned."""
    enable_dp_attention: bool = False
    """Attention data parallel (``--enable-dp-attention``): attention tp = tp / dp_size."""
    dp_size: int = 1
    """Attention DP groups per engine (``--dp-size``); > 1 only with enable_dp_attention."""
    num_replicas: int = 1
    """Independent engines; tp * num_replicas ranks in all."""
    placement: str = "colocated"
    """colocated: engine rank i on the actor's GPU i; separate: engines on their own nodes."""
    gpus_per_node: int = 8
    """GPUs per node, for both sides: decides which weight transfers stay inside a node."""
    dtype: str = "bfloat16"
    """Weight dtype on the wire: bfloat16, float16 or float32."""
    n: int = 8
    """Responses sampled per prompt (the group of GRPO-style estimators)."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts (held-out scoring is greedy)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k sampling (-1 = off)."""
    max_total_tokens: int = 8192
    """KV-cache capacity of each engine, in tokens."""
    reshard_bucket_mb: int = 64
    """Bucket of the reshard executor: the most bytes one round of weight-sync sends and
    receives per process (bounds the sync's extra memory)."""
    push_bucket_mb: int = 512
    """Bucket of a full-route push into SGLang or vLLM: tensors per update call (vLLM: per file in
    shared memory, whole fused modules each)."""
    intra_node_gbps: float = 200.0
    """Per-rank intra-node bandwidth (NVLink, one direction) the weight-sync time model assumes."""
    inter_node_gbps: float = 25.0
    """Per-rank network bandwidth (one direction; 200 Gb/s InfiniBand = 25 GB/s) of the time model."""
    dispatch_chunks: int = 4
    """With several replicas, a step's prompts are cut into num_replicas * dispatch_chunks
    chunks that each replica's driver takes one at a time as it gets free (more: finer
    balance of long-tail generations, smaller engine batches); one replica takes one chunk."""
    sync_route: str = "sliced"
    """Weight push: sliced (each engine rank receives its reshard-plan share, shared from the
    actor process that holds it) or full (the plan gathers whole HF tensors on the driving
    process and every engine rank receives every tensor; the baseline)."""
    generate_timeout_s: float = 300.0
    """A generate call (one chunk on one replica) that runs longer counts as a hung engine:
    it is killed and restarted (max_engine_restarts) or the run stops naming it. Must stay
    below run.collective_timeout_minutes, which bounds the other ranks' wait meanwhile."""
    max_engine_restarts: int = 3
    """Engine restarts the run survives (an engine whose processes died or that hung): the
    replica's engine is restarted, given the current weights and the step's generate call
    retried with the same seeds; one more failure stops the run. 0: stop at the first."""

    def __post_init__(self) -> None:
        check_choice("engine", self.engine, ROLLOUT_ENGINES)
        if self.generate_timeout_s <= 0:
            raise ConfigError("{p}generate_timeout_s={t} must be > 0 (seconds)", t=self.generate_timeout_s)
        if self.max_engine_restarts < 0:
            raise ConfigError(
                "{p}max_engine_restarts={k} must be >= 0 (0: stop at the first engine failure)",
                k=self.max_engine_restarts,
            )
        check_choice("sync_route", self.sync_route, ("sliced", "full"))
        check_positive(
            self,
            (
                "n",
                "max_total_tokens",
                "dispatch_chunks",
                "reshard_bucket_mb",
                "push_bucket_mb",
                "intra_node_gbps",
                "inter_node_gbps",
            ),
        )
        if not 0.0 <= self.temperature:
            raise ConfigError("{p}temperature={t} must be >= 0", t=self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError("{p}top_p={t} must be in (0, 1]", t=self.top_p)
        check_choice("placement", self.placement, ROLLOUT_PLACEMENTS)
        check_choice("dtype", self.dtype, ROLLOUT_DTYPES)
        check_positive(self, ("tp", "ep", "moe_dp", "dp_size", "num_replicas", "gpus_per_node"))
        traits = ENGINES[self.engine]
        self._check_splits(traits.splits)
        if self.sync_route not in traits.routes:
            raise ConfigError(
                "{p}engine={e} takes {routes} weight pushes only: set {p}sync_route={route} (sliced pushes "
                "write each rank's share into an engine that splits its replicas by the reshard plan)",
                e=self.engine,
                routes=" / ".join(traits.routes),
                route=traits.routes[0],
            )
        try:
            self.parallel_split()  # the engine's own rules: dp_size | tp, ep * moe_dp | tp
        except ValueError as e:
            raise _rollout_error(e) from None

    def _check_splits(self, splits: tuple[str, ...]) -> None:
        """Each parallel setting the engine does not split a replica by is refused, naming the
        engines that do (``hfschema.engines.EngineTraits.splits``)."""
        # (the split it needs, the key, its value): a tp over one node's GPUs spans nodes
        asked = [(key, key, getattr(self, key)) for key in ("tp", "ep", "moe_dp", "dp_size") if getattr(self, key) > 1]
        if self.enable_dp_attention:
            asked.append(("enable_dp_attention", "enable_dp_attention", "true"))
        if self.tp > self.gpus_per_node:
            across = f"{self.tp} (over gpus_per_node={self.gpus_per_node}: a replica across nodes)"
            asked = [("nodes", "tp", across), *(a for a in asked if a[1] != "tp")]
        for split, key, value in asked:
            if split in splits:
                continue
            engines = "|".join(name for name, t in ENGINES.items() if split in t.splits)
            raise ConfigError(
                "{p}{key}={value} needs {p}engine={engines}: {p}engine={e} "
                + ("splits a replica by {splits} only" if splits else "runs each replica unsharded on one device")
                + "; use {p}num_replicas for more engines",
                key=key,
                value=value,
                engines=engines,
                e=self.engine,
                splits=", ".join(s for s in splits if s != "nodes"),
            )

    @property
    def num_ranks(self) -> int:
        """Engine ranks of all replicas: tp * num_replicas."""
        return self.tp * self.num_replicas

    def parallel_split(self) -> SGLangSettings:
        """The engines' parallel split (tp, ep, DP attention, replicas) as
        ``hfschema.sglang.SGLangSettings``, whose rules SGLang's layout plans with; a replica of an
        engine that does not shard (hf, vLLM in this version) is a tp=1 engine: it loads every
        canonical tensor whole."""
        return SGLangSettings(
            tp=self.tp,
            ep=self.ep,
            moe_dp=self.moe_dp,
            enable_dp_attention=self.enable_dp_attention,
            dp_size=self.dp_size,
            num_replicas=self.num_replicas,
        )

    def bandwidth(self) -> "Bandwidth":
        """The weight-sync time model's link speeds (``reshard.stats.Bandwidth``)."""
        from reshard.stats import Bandwidth

        return Bandwidth(intra_node_gbps=self.intra_node_gbps, inter_node_gbps=self.inter_node_gbps)

    def describe(self) -> str:
        """One line, e.g. ``sglang tp=8 ep=8 x8 replicas (64 ranks); colocated, 8 GPUs per node;
        bfloat16``."""
        return f"{self.engines_text()}; {self.placement}, {self.gpus_per_node} GPUs per node; {self.dtype}"

    def engines_text(self) -> str:
        """The engines alone: a sharded engine's parallel settings, else ``hf x2 replicas (2 ranks)``."""
        if ENGINES[self.engine].splits:
            return self.parallel_split().describe(self.engine)
        return f"{self.engine} x{self.num_replicas} replicas ({self.num_ranks} ranks)"


def _rollout_error(error: ValueError) -> ConfigError:
    """An ``SGLangSettings`` / ``reshard.sglang`` error, whose keys read ``sglang.tp``, as a
    rollout-section error."""
    template = str(error).replace("{", "{{").replace("}", "}}")
    return ConfigError(re.sub(r"\bsglang\.", "{p}", template))


VALUE_ALGORITHMS = ("ppo", "vapo")
"""Algorithms whose own estimator (gae) reads a critic's values (``algorithm_spec(...).needs_critic``;
tests/algorithms checks the two agree)."""
VALUE_ESTIMATORS = ("gae",)
"""Estimators that read a critic's values."""


def needs_values(algorithm: "AlgorithmConfig") -> bool:
    """Whether the algorithm (with its estimator override) trains on a critic's values."""
    if algorithm.adv_estimator is not None:
        return algorithm.adv_estimator in VALUE_ESTIMATORS
    return algorithm.name in VALUE_ALGORITHMS


ALGORITHMS = (
    "ppo",
    "grpo",
    "dapo",
    "vapo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "gspo",
    "gpg",
    "cispo",
)
PF_PPO_MODES = ("pow", "max_min", "max_random")
"""PF-PPO's sample weightings (``algorithm.pf_ppo``; their functions: ``algorithms.shaping``)."""
CORRECTION_MODES = ("tis", "mis", "mask")
"""Rollout corrections (``algorithm.rollout_correction``; the functions: ``algorithms.correction``)."""
CORRECTION_LEVELS = ("token", "sequence", "geometric")
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_TYPES = ("k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "abs+", "low_var_kl+", "k3+")


@dataclass(kw_only=True)
class AlgorithmConfig:
    """The RL algorithm: which graph runs, and the knobs of its estimator and losses.

    ``name`` picks a registered algorithm (``hybridflow.algorithms``); it fixes the advantage
    estimator, the policy loss and which roles run. The fields below tune them; a field an
    algorithm does not use is ignored (``hybridflow plan`` prints what is used).
    """

    name: str = "grpo"
    """Registered algorithm: ppo, grpo, dapo, vapo, rloo, reinforce_plus_plus,
    reinforce_plus_plus_baseline, remax, gspo, gpg, cispo."""
    adv_estimator: Optional[str] = None
    """Override the algorithm's advantage estimator (a name in the estimator registry)."""
    policy_loss: Optional[str] = None
    """Override the algorithm's policy loss (a name in the policy-loss registry)."""
    loss_agg_mode: Optional[str] = None
    """Override how token losses are averaged: token-mean, token-sum, seq-mean-token-sum,
    seq-mean-token-mean or seq-mean-token-sum-norm (None = the algorithm's own)."""
    clip_ratio_low: float = 0.2
    """PPO ratio clip below 1 (1 - clip_ratio_low)."""
    clip_ratio_high: Optional[float] = None
    """PPO ratio clip above 1; None = clip_ratio_low (DAPO's clip-higher sets 0.28)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (> 1)."""
    gamma: float = 1.0
    """Discount of GAE-style estimators."""
    lam: float = 1.0
    """GAE lambda of the actor's advantages."""
    critic_lam: Optional[float] = None
    """GAE lambda of the critic's returns; None = lam (VAPO decouples them: 1.0)."""
    length_adaptive_lam_alpha: Optional[float] = None
    """VAPO: the actor's lambda per sequence = 1 - 1 / (alpha * response length); None = the
    algorithm's own (VAPO: 0.05, others: off), 0 = off."""
    norm_adv_by_std: bool = True
    """GRPO: divide group-centred rewards by the group's std (false = Dr. GRPO)."""
    kl_loss_coef: float = 0.0
    """Weight of the KL(actor || reference) term in the policy loss; > 0 needs the reference."""
    kl_reward_coef: float = 0.0
    """Weight of the KL penalty subtracted from token rewards; > 0 needs the reference. With
    ``kl_reward_target`` set, the adaptive controller's starting value."""
    kl_reward_target: Optional[float] = None
    """None: kl_reward_coef stays fixed. A value: after every step the coefficient is steered
    towards this KL (the batch mean of each response's token-mean KL), by at most 20% per
    ``kl_reward_horizon`` responses (Ziegler et al., 2019; verl's adaptive kl_ctrl, target_kl)."""
    kl_reward_horizon: int = 10000
    """Responses over which the adaptive KL controller may move its coefficient by 20%."""
    kl_type: str = "low_var_kl"
    """KL estimator: k1, abs, mse (= k2), low_var_kl (= k3); a ``+`` suffix (k1+, abs+, low_var_kl+,
    k3+) keeps that estimator's value with the gradient of k2 (straight through)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight in the policy loss."""
    lm_loss_coef: Optional[float] = None
    """VAPO positive-example LM loss weight (negative log-likelihood of correct samples); None =
    the algorithm's own (VAPO: 0.1, others: 0), 0 = off."""
    value_clip: float = 0.5
    """Critic value clipping around the old values."""
    value_pretrain_steps: int = 0
    """VAPO: critic-only steps before the actor starts updating."""
    ppo_epochs: int = 1
    """Passes over each step's rollouts."""
    mini_batches: int = 1
    """Optimizer updates per pass (the step's samples split into this many mini-batches)."""
    dynamic_sampling: Optional[bool] = None
    """DAPO: drop prompt groups whose rewards are all equal and keep sampling until the batch
    is full (at most max_sampling_rounds); None = the algorithm's own (DAPO: on, others: off)."""
    max_sampling_rounds: int = 3
    """DAPO dynamic sampling: generation rounds per step before training on what was kept."""
    overlong_buffer_len: Optional[int] = None
    """DAPO overlong shaping: linear penalty over the last this many tokens of the budget; None =
    the algorithm's own (DAPO: a fifth of data.max_response_length, others: off), 0 = off."""
    overlong_penalty_factor: float = 1.0
    """DAPO overlong shaping: the penalty at the full budget."""
    pf_ppo: Optional[str] = None
    """PF-PPO reweighting of samples by reward: pow, max_min or max_random; None = off."""
    pf_ppo_weight_pow: float = 2.0
    """PF-PPO pow mode's exponent."""
    rollout_correction: Optional[str] = None
    """Correct for the engine's sampling policy differing from the trainer's (``hybridflow/
    algorithms/correction.py``): tis (truncated importance weights), mis (weights, samples
    outside the bounds dropped), mask (dropped only); None = off. Works with every policy loss."""
    rollout_correction_level: str = "token"
    """Where the importance ratio is taken: token, sequence (product) or geometric (its
    length-normalised mean)."""
    rollout_correction_upper: float = 2.0
    """The ratio's upper bound: TIS truncates there, MIS and mask drop above it."""
    rollout_correction_lower: Optional[float] = None
    """MIS and mask drop below this ratio too; None = no lower bound."""
    log_ratio_clamp: Optional[float] = 20.0
    """Every ratio-based policy loss clamps log(pi / pi_old) to +/- this before exp, so one wild
    token cannot overflow the ratio. verl clamps at 20 in vanilla, sapo and dppo but not in
    clip_cov, kl_cov and geo_mean: None reproduces those exactly (and lets a ratio overflow)."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: at most this fraction of a micro-batch's tokens lose their gradient."""
    clip_cov_lb: float = 1.0
    """clip_cov: a token is a candidate when its covariance term (A - mean A) * (logp - mean logp)
    lies strictly between clip_cov_lb and clip_cov_ub."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper bound of that covariance term (see clip_cov_lb)."""
    clip_cov_seed: int = 0
    """clip_cov: seed of the draw among the candidates, mixed with a hash of the micro-batch's old
    log-probs and advantages (verl draws with the global RNG; this is reproducible)."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: the fraction of a micro-batch's tokens, those of largest covariance, that get the
    |log-ratio| penalty."""
    ppo_kl_coef: float = 0.1
    """kl_cov: weight of that |log(pi / pi_old)| penalty."""
    sapo_tau_pos: float = 1.0
    """sapo: temperature of the soft gate on tokens with a positive advantage."""
    sapo_tau_neg: float = 1.05
    """sapo: temperature of the soft gate on the others (advantage <= 0); SAPO gates them more
    sharply."""

    def __post_init__(self) -> None:
        check_choice("name", self.name, ALGORITHMS)
        if self.loss_agg_mode is not None:
            check_choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        check_choice("kl_type", self.kl_type, KL_TYPES)
        if self.pf_ppo is not None:
            check_choice("pf_ppo", self.pf_ppo, PF_PPO_MODES)
        self._check_rollout_correction()
        self._check_policy_loss_knobs()
        check_positive(self, ("ppo_epochs", "mini_batches", "max_sampling_rounds", "clip_ratio_low"))
        check_positive(self, ("kl_reward_horizon",))
        if self.kl_reward_target is not None and not self.kl_reward_target > 0:
            raise ConfigError(
                "{p}kl_reward_target={v} must be > 0 (null: a fixed kl_reward_coef)", v=self.kl_reward_target
            )
        if self.kl_reward_target is not None and self.kl_reward_coef <= 0:
            raise ConfigError(
                "{p}kl_reward_target={v} steers {p}kl_reward_coef, which is 0: set "
                "{p}kl_reward_coef > 0 as its starting value (verl's default 0.001)",
                v=self.kl_reward_target,
            )
        check_non_negative(
            self, ("kl_loss_coef", "kl_reward_coef", "entropy_coef", "value_pretrain_steps", "value_clip")
        )
        for key in ("lm_loss_coef", "overlong_buffer_len", "length_adaptive_lam_alpha"):  # None: the algorithm's
            if getattr(self, key) is not None:
                check_non_negative(self, (key,))
        for key in ("gamma", "lam"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError("{p}{key}={v} must be in [0, 1]", key=key, v=getattr(self, key))
        if self.clip_ratio_c <= 1.0:
            raise ConfigError(
                "{p}clip_ratio_c={c} must be > 1 (dual clip bounds the loss at c * |A|)", c=self.clip_ratio_c
            )

    def _check_rollout_correction(self) -> None:
        if self.rollout_correction is None:
            return
        check_choice("rollout_correction", self.rollout_correction, CORRECTION_MODES)
        check_choice("rollout_correction_level", self.rollout_correction_level, CORRECTION_LEVELS)
        low, high = self.rollout_correction_lower, self.rollout_correction_upper
        if high <= 0 or (low is not None and not 0 <= low < high):
            raise ConfigError(
                "{p}rollout_correction_lower={low} / rollout_correction_upper={high} must "
                "satisfy 0 <= lower < upper (e.g. lower 0.5, upper 2.0)",
                low=low,
                high=high,
            )

    def _check_policy_loss_knobs(self) -> None:
        check_positive(self, ("log_ratio_clamp", "sapo_tau_pos", "sapo_tau_neg"))
        check_non_negative(self, ("ppo_kl_coef",))
        for key in ("clip_cov_ratio", "kl_cov_ratio"):
            if not 0.0 < getattr(self, key) <= 1.0:
                raise ConfigError(
                    "{p}{key}={v} must be in (0, 1] (a fraction of the tokens; verl uses 2e-4)",
                    key=key,
                    v=getattr(self, key),
                )
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ConfigError(
                "{p}clip_cov_lb={lb} must be below {p}clip_cov_ub={ub} (verl: 1 and 5)",
                lb=self.clip_cov_lb,
                ub=self.clip_cov_ub,
            )

    @property
    def clip_high(self) -> float:
        """The upper clip ratio actually used."""
        return self.clip_ratio_low if self.clip_ratio_high is None else self.clip_ratio_high


@dataclass(kw_only=True)
class DataConfig:
    """Prompts for RL (and SFT targets), from parquet or jsonl files.

    One row per prompt, the field's common layout: a ``prompt`` column (a string, or a chat as
    a list of ``{role, content}``), the verifier's reference answer under ``answer_key`` (dots
    walk nested columns, e.g. ``reward_model.ground_truth``), optionally ``data_source`` to pick
    the reward function per row (under ``reward.function=auto``), and an SFT target under
    ``sft.response_key``.
    """

    train_files: list[str] = field(default_factory=list)
    """Training prompts: parquet or jsonl paths. Empty = generate the synthetic ``task``."""
    heldout_files: list[str] = field(default_factory=list)
    """Held-out prompts scored after SFT and after RL. Empty = the synthetic task's split."""
    prompt_key: str = "prompt"
    """Column holding the prompt; a row without ``prompt`` but with chat ``messages`` reads those
    (the turns before a final assistant turn; that turn is the SFT target)."""
    answer_key: str = "reward_model.ground_truth"
    """Column holding the reference answer given to the reward function."""
    apply_chat_template: bool = True
    """Wrap string prompts as one user turn and apply the tokenizer's chat template."""
    system_prompt: Optional[str] = None
    """A system turn put before every chat prompt that has none (with the chat template only)."""
    max_prompt_length: Optional[int] = None
    """Prompts longer than this (in tokens) are bad rows. Unset: the longest prompt of the
    training files' first rows as the model's tokenizer and chat template make it, rounded up to
    a multiple of 64 (the synthetic task: 64)."""
    max_response_length: Optional[int] = None
    """Generation budget per response (tokens). Unset: 1.5 x the longest warm-up answer
    (``sft.response_key``) of the training files' first rows, rounded up to a multiple of 64, else
    1024, within the model's context (the synthetic task: 16)."""
    on_bad_row: str = "skip"
    """A malformed row (missing column, wrong type, too long): skip (logged with file and row) or fail."""
    max_dropped_share: float = 0.05
    """Under ``on_bad_row=skip``, the largest share of a data set's rows (training, held-out) that
    may be skipped before the run refuses to start, naming the setting that keeps them (1.0:
    never refuse): a run that quietly drops most of its data trains on something else."""
    shuffle: bool = True
    """Shuffle training prompts each epoch (seeded by run.seed)."""

    def __post_init__(self) -> None:
        check_choice("on_bad_row", self.on_bad_row, ("skip", "fail"))
        if not self.train_files:  # the synthetic task: nothing to measure, its own few tokens
            prompt, response = SYNTHETIC
            self.max_prompt_length = prompt if self.max_prompt_length is None else self.max_prompt_length
            self.max_response_length = response if self.max_response_length is None else self.max_response_length
        check_positive(self, [k for k in ("max_prompt_length", "max_response_length") if getattr(self, k) is not None])
        if not 0.0 <= self.max_dropped_share <= 1.0:
            raise ConfigError("{p}max_dropped_share={v} must be in [0, 1]", v=self.max_dropped_share)


@dataclass(kw_only=True)
class TaskConfig:
    """A synthetic verifiable task, generated when ``data.train_files`` is empty."""

    name: str = "arithmetic"
    """Task generator: arithmetic (a+b, a-b with small numbers), max (the larger of two numbers),
    countdown, or multiply (a*b of operands up to max_operand, with demonstrations that call the
    calculator tool: agentic.enabled=true, agentic.tools=[calculator])."""
    train_size: int = 2000
    """Training prompts generated."""
    heldout_size: int = 200
    """Held-out prompts (disjoint from the training ones)."""
    max_operand: int = 20
    """Largest operand."""
    sft_noise: float = 0.5
    """Fraction of SFT demonstrations carrying a wrong answer: imitation alone then plateaus and
    the verifier's reward is what RL has to add."""

    def __post_init__(self) -> None:
        check_choice("name", self.name, ("arithmetic", "max", "countdown", "multiply"))
        check_positive(self, ("train_size", "heldout_size", "max_operand"))
        if not 0.0 <= self.sft_noise < 1.0:
            raise ConfigError("{p}sft_noise={v} must be in [0, 1)", v=self.sft_noise)


@dataclass(kw_only=True)
class RewardConfig:
    """How a response is scored."""

    function: str = "auto"
    """Reward function of every row: a registered name (math, gsm8k, math_boxed, dapo_math,
    math_verify, countdown, exact_match, arithmetic, max) or a dotted path ``package.module.function`` called as
    fn(response, answer, **kwargs) -> float (or verl's compute_score(data_source, solution_str,
    ground_truth, extra_info)); auto: a row's data_source when it names a registered reward (the
    synthetic tasks' rows and verl's openai/gsm8k, lighteval/MATH do), else math."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of the reward function."""
    on_error: str = "zero"
    """A reward function that raises or times out: zero (reward 0, logged with the sample) or fail."""
    timeout_s: float = 60.0
    """A reward call that takes longer is a reward error (``on_error`` says what follows); the call
    is abandoned, not stopped (a function that never returns keeps a thread); 0 = no limit."""
    rule_weight: Optional[float] = None
    """Weight of ``function``'s score in a sample's reward; None: 1, or 0 when a reward model or a
    judge scores the samples (set it to mix the rule with them; 0: the rule is not called)."""
    source_weights: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per ``data_source``: ``{rule: w, model: w, judge: w}`` in place of ``rule_weight``,
    ``reward_model.weight`` and ``judge.weight`` for its rows (a mix of verifiable math and
    open-ended chat gives each its own)."""
    math_equivalence: str = "verl"
    """How ``auto`` scores rows of verl's math data sources (openai/gsm8k, lighteval/MATH, math_dapo,
    aime*): verl (their own checks, as verl scores them: comparable reward curves) or math_verify
    (the math-verify package's symbolic equivalence: more answers count as right)."""

    def __post_init__(self) -> None:
        check_choice("on_error", self.on_error, ("zero", "fail"))
        check_non_negative(self, ("timeout_s",))
        for source, weights in self.source_weights.items():
            unknown = sorted(set(weights) - {"rule", "model", "judge"})
            if unknown:
                raise ConfigError(
                    "{p}source_weights[{s}] has {u}; a source weighs rule, model and judge only",
                    s=source,
                    u=unknown[0],
                )
        check_choice("math_equivalence", self.math_equivalence, ("verl", "math_verify"))


@dataclass(kw_only=True)
class SFTConfig:
    """Supervised fine-tuning: the RL warm-up, or the whole run with ``run.mode=sft``."""

    steps: int = 0
    """Optimizer steps of SFT before RL (0 = none)."""
    lr: float = 1e-3
    """SFT learning rate (constant)."""
    batch_size: int = 32
    """Sequences per SFT step (the actor's global batch for SFT)."""
    response_key: str = "sft_response"
    """Column holding the SFT target response; a dotted path reads a nested field (a verl GSM8K
    parquet's worked solution: ``extra_info.answer``)."""
    checkpoint_every: int = 0
    """Also save the SFT actor with its optimizer state every this many SFT steps, as
    ``checkpoints/sft_<step>`` (0 = only when SFT ends, or a checkpoint is requested); a start
    continues an unfinished SFT from the newest one, which are removed once SFT is complete."""
    export_hf: bool = True
    """Write the finished SFT model as a Hugging Face directory too (``checkpoints/sft/hf``), which
    RL then loads through ``model.path``'s loader. Rank 0 converts it alone, reading the whole
    checkpoint once: for a model of hundreds of GB, false skips that (RL then loads the megatron
    checkpoint, and ``hybridflow convert mcore-to-hf`` exports it when wanted)."""

    def __post_init__(self) -> None:
        check_non_negative(self, ("steps", "checkpoint_every"))
        check_positive(self, ("lr", "batch_size"))


@dataclass(kw_only=True)
class RMConfig:
    """Reward-model training (``run.mode=rm``): a Bradley-Terry loss on preference pairs, the
    model the actor's architecture under a one-label score head, on the actor's layout."""

    steps: int = 200
    """Optimizer steps."""
    lr: float = 1e-3
    """Learning rate (constant)."""
    batch_size: int = 32
    """Preference pairs per step."""
    chosen_key: str = "chosen"
    """Column of the preferred response: text, or a chat ending in the assistant's turn (whose
    earlier turns are the prompt)."""
    rejected_key: str = "rejected"
    """Column of the other response, in the same form."""
    heldout_pairs: int = 200
    """Held-out pairs (``data.heldout_files``, or the task's held-out split) whose accuracy is
    measured before and after training; 0 = none."""
    checkpoint_every: int = 100
    """Save the reward model with its optimizer state every this many steps, and at the last, as
    ``checkpoints/rm_<step>`` (0 = at the last step, or when a checkpoint is requested); a start
    goes on from the newest. ``run.keep_checkpoints`` of them are kept."""

    def __post_init__(self) -> None:
        check_positive(self, ("steps", "lr", "batch_size"))
        check_non_negative(self, ("heldout_pairs", "checkpoint_every"))


@dataclass(kw_only=True)
class RewardModelConfig:
    """A frozen reward model scoring the rollouts (a node of the graph, placed on the actor's
    GPUs under the actor's layout), its score mixed with the rule-based reward."""

    path: Optional[str] = None
    """A Hugging Face ``*ForSequenceClassification`` directory (num_labels=1), a
    ``hybridflow convert hf-to-mcore`` checkpoint of one, or a ``run.mode=rm`` export; None: no
    reward model."""
    weight: float = 1.0
    """Weight of the reward model's score in a sample's reward (``reward.rule_weight`` and
    ``reward.source_weights`` set the rest of the mix)."""
    offload: bool = False
    """Keep the reward model's parameters on the host between its uses (its GPU memory is free
    for generation and training; each use copies them in)."""
    parallel: Optional[ParallelLayout] = None
    """Its own megatron-core layout on the actor's ranks (tp*pp*cp*dp = the actor's world; for
    example a dense reward model under tp=1 beside an MoE actor's tp x ep), or on its own GPUs
    (``gpus``: tp*pp*cp*dp = gpus); None: the actor's, or dp=gpus on its own GPUs."""
    gpus: int = 0
    """GPUs of its own (processes, on a CPU): 0 runs it on the actor's GPUs; N > 0 starts N ranks
    for it after the actor's (and the separate engines'), which score each step's samples while
    the actor's ranks compute their log-probs."""

    def __post_init__(self) -> None:
        check_non_negative(self, ("gpus",))
        if self.gpus and self.offload:
            raise ConfigError("{p}offload=true with {p}gpus={v}: its own GPUs hold nothing else; set one", v=self.gpus)


@dataclass(kw_only=True)
class JudgeConfig:
    """A generative judge: a frozen causal LM on an engine of its own (on the first ``tp`` ranks
    of the actor's GPUs, driven by rank 0; or ``gpus`` of its own, ``gpus / tp`` replicas)
    answers a judging prompt per sample; the number its reply holds is the sample's judge score,
    mixed into the reward with ``weight``."""

    path: Optional[str] = None
    """The judge: a Hugging Face causal LM directory (weights read by the engine); None: no judge."""
    engine: str = "sglang"
    """sglang; vllm (vLLM's own environment); or hf (transformers in the driver's process: small
    judges, machines without SGLang)."""
    tp: int = 1
    """Tensor-parallel ranks of the judge's engine."""
    gpus: int = 0
    """GPUs of its own, after the actor's (and separate engines'): ``gpus / tp`` replicas of the
    judge's engine share each step's requests; 0: one engine on the actor's first ``tp`` GPUs."""
    dtype: str = "bfloat16"
    """The judge engine's weights and activations: bfloat16, float16 or float32."""
    template: str = (
        "Question: {prompt}\nReference answer: {answer}\nResponse: {response}\n"
        "Rate the response from 0 to 10. Reply with the number only."
    )
    """The judging request, sent as the judge's user turn: ``{response}`` (required), ``{prompt}``
    (the prompt's text, a chat's last user turn) and ``{answer}`` (the row's answer)."""
    pattern: str = r"(-?\d+(?:\.\d+)?)"
    """Regular expression whose first group is the score in the judge's reply (the first number)."""
    scale: float = 0.1
    """Multiplier of the parsed number (0-10 -> 0-1)."""
    on_unparsable: float = 0.0
    """Score of a reply the pattern finds no number in (counted in ``judge/unparsable``)."""
    max_tokens: int = 16
    """Tokens the judge may reply with."""
    weight: float = 1.0
    """Weight of the judge's score in a sample's reward."""
    max_total_tokens: int = 4096
    """The judge engine's KV-cache tokens (SGLang)."""

    def __post_init__(self) -> None:
        from hybridflow.judge import template_problem

        check_choice("engine", self.engine, ROLLOUT_ENGINES)
        check_choice("dtype", self.dtype, ("bfloat16", "float16", "float32"))
        check_positive(self, ("tp", "max_tokens", "max_total_tokens"))
        check_non_negative(self, ("gpus",))
        if self.gpus % self.tp:
            raise ConfigError(
                "{p}gpus={v} is not a multiple of {p}tp={tp}: each replica of the judge takes tp GPUs; "
                "set {p}gpus={fit}",
                v=self.gpus,
                tp=self.tp,
                fit=max(self.tp, self.gpus // self.tp * self.tp),
            )
        problem = template_problem(self.template)
        if problem is not None:
            raise ConfigError("{p}template {why}", why=problem)
        try:
            re.compile(self.pattern)
        except re.error as error:
            raise ConfigError("{p}pattern={v} is not a regular expression ({e})", v=self.pattern, e=error) from None
        if re.compile(self.pattern).groups < 1:
            raise ConfigError("{p}pattern={v} has no group; its first group is the score", v=self.pattern)


@dataclass(kw_only=True)
class DistillationConfig:
    """On-policy distillation (slime's OPD, Thinking Machines' on-policy distillation): a frozen
    teacher's log-probs of the student's own sampled tokens; each response token's advantage
    loses ``coef`` x (log p_student - log p_teacher), the per-token reverse-KL estimate, after the
    algorithm's estimator. With every sample's reward equal (a group-normalised estimator then
    gives 0), the teacher alone trains the student."""

    teacher_path: Optional[str] = None
    """The teacher: a Hugging Face causal LM directory or a converted checkpoint, with the
    student's tokenizer (the same vocabulary); None: no distillation."""
    coef: float = 1.0
    """Weight of the reverse-KL term in each token's advantage."""
    parallel: Optional[ParallelLayout] = None
    """The teacher's own megatron-core layout on the actor's ranks (tp*pp*cp*dp = the actor's
    world; a teacher larger than the student takes more tp or pp), or on its own GPUs (``gpus``:
    tp*pp*cp*dp = gpus); None: the actor's, or dp=gpus on its own GPUs."""
    gpus: int = 0
    """GPUs of its own (processes, on a CPU): 0 runs the teacher on the actor's GPUs; N > 0
    starts N ranks for it after the actor's, the separate engines' and the reward model's."""
    offload: bool = False
    """Keep the teacher's parameters on the host between its uses (on the actor's GPUs)."""

    def __post_init__(self) -> None:
        check_positive(self, ("coef",))
        check_non_negative(self, ("gpus",))
        if self.gpus and self.offload:
            raise ConfigError("{p}offload=true with {p}gpus={v}: its own GPUs hold nothing else; set one", v=self.gpus)


@dataclass(kw_only=True)
class AgenticConfig:
    """Multi-turn rollouts with tools (``hybridflow/agentic``): each sample is a trajectory of
    policy turns and tool answers, trained on the policy's own tokens only."""

    enabled: bool = False
    """Roll out trajectories instead of single responses (every prompt of the run)."""
    tools: list[str] = field(default_factory=list)
    """Tools the policy may call: a registered name (calculator; python, the code sandbox) or
    module:function of a function decorated with hybridflow.agentic.tools.tool."""
    tool_parser: str = "hermes"
    """How tool calls are read from a turn: hermes (Qwen2.5 / Qwen3 / Hermes
    <tool_call>{json}</tool_call>)."""
    environment: Optional[str] = None
    """module:Class of an environment with state, built per trajectory as Class(tools, parse,
    pool=, row=) (row: the trajectory's hybridflow.data.PromptRow) with a step(text) method
    (hybridflow.agentic.env.Environment); None: the tools answer (ToolEnvironment). Rows whose
    data_source environments names take that one instead."""
    environments: dict[str, str] = field(default_factory=dict)
    """data_source -> module:Class: the environment of that source's rows (a run mixing a
    search task and a coding task gives each its own); other rows take environment."""
    max_turns: int = 4
    """Policy turns per trajectory."""
    turn_tokens: Optional[int] = None
    """Tokens one policy turn may sample; None: data.max_response_length. A trajectory's turns
    and answers together stay within data.max_response_length."""
    observation_tokens: int = 256
    """Tokens one round of tool answers may take; longer ones have their text cut to fit."""
    schedule: str = "independent"
    """independent: a trajectory's next turn is sampled as soon as its tools answered;
    turn_synchronous: every trajectory waits for the slowest tool of its call."""
    tool_workers: int = 16
    """Tool calls running at once per replica driver."""
    sandbox: str = "bubblewrap"
    """Where the python tool runs programs: bubblewrap (this machine, apt-get install
    bubblewrap) or remote (a service at sandbox_url)."""
    sandbox_url: Optional[str] = None
    """The sandbox service's URL (sandbox=remote)."""
    sandbox_wall_seconds: float = 10.0
    """A program is stopped after this long."""
    sandbox_memory_mb: int = 512
    """A program's memory budget: each of its processes, together with the files it writes
    (sandbox_disk_mb of it)."""
    sandbox_disk_mb: int = 64
    """The files a program may write, in all (its /work and /tmp, a tmpfs of this size)."""
    tool_output_special_tokens: str = "escape"
    """The tokenizer's special and added tokens written in tool output (a program printing
    <|im_end|> could fake a turn): escape (a zero-width space inside each, so they tokenise as
    text) or refuse (the observation is replaced by a line saying why)."""

    def __post_init__(self) -> None:
        check_choice("schedule", self.schedule, ("independent", "turn_synchronous"))
        check_choice("sandbox", self.sandbox, ("bubblewrap", "remote"))
        check_positive(self, ("max_turns", "observation_tokens", "tool_workers", "sandbox_wall_seconds"))
        check_positive(self, ("sandbox_memory_mb", "sandbox_disk_mb"))
        check_choice("tool_output_special_tokens", self.tool_output_special_tokens, ("escape", "refuse"))
        if self.sandbox_disk_mb >= self.sandbox_memory_mb:
            raise ConfigError(
                "{p}sandbox_disk_mb={d} must be below {p}sandbox_memory_mb={m}: the files share the memory budget",
                d=self.sandbox_disk_mb,
                m=self.sandbox_memory_mb,
            )
        if self.turn_tokens is not None and self.turn_tokens < 1:
            raise ConfigError("{p}turn_tokens={v} must be >= 1 (or null)", v=self.turn_tokens)
        if self.sandbox == "remote" and not self.sandbox_url:
            raise ConfigError("{p}sandbox=remote needs {p}sandbox_url, the sandbox service's address")


@dataclass(kw_only=True)
class HybridflowConfig:
    """The whole run: model, per-role layouts, rollout engines, training and run settings."""

    model: ModelSection = field(default_factory=ModelSection)
    """Model architecture shared by all roles, and the weights they start from."""
    actor: RoleConfig = field(default_factory=RoleConfig)
    """The policy being trained; the rollout engines generate with its weights."""
    reference: ReferenceConfig = field(
        default_factory=lambda: ReferenceConfig(enabled=False, parallel=None, backend=None)
    )
    """Frozen reference policy for the KL penalty; off by default."""
    critic: RoleConfig = field(default_factory=lambda: RoleConfig(enabled=None, parallel=None, backend=None))
    """Value model for GAE-style estimators; on when the algorithm needs one."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimizer and batch settings."""
    run: RunConfig = field(default_factory=RunConfig)
    """Run name, outputs, seed and tracking."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Inference engines that generate rollouts from the actor's weights."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The RL algorithm and its estimator / loss settings."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt files, columns and length limits."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Synthetic task generated when data.train_files is empty."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised warm-up / SFT mode."""
    rm: RMConfig = field(default_factory=RMConfig)
    """Reward-model training (``run.mode=rm``)."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """A reward model scoring rollouts (off unless ``reward_model.path`` is set)."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """A generative judge scoring rollouts (off unless ``judge.path`` is set)."""
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    """On-policy distillation from a teacher (off unless ``distillation.teacher_path`` is set)."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """MoE RL stability: routing replay, router statistics, router freezing and losses."""
    packing: PackingConfig = field(default_factory=PackingConfig)
    """Sequence packing and token-budget micro-batches of the trained roles."""
    fsdp2: FSDP2Config = field(default_factory=FSDP2Config)
    """The FSDP2 trainer's settings (``actor.backend=fsdp2``)."""
    checks: ChecksConfig = field(default_factory=ChecksConfig)
    """Correctness gates evaluated every RL step."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters for the RL actor (off by default)."""
    async_rl: AsyncRLConfig = field(default_factory=AsyncRLConfig)
    """Asynchronous RL: generation of later steps overlapping training (separate placement)."""
    agentic: AgenticConfig = field(default_factory=AgenticConfig)
    """Multi-turn rollouts with tools (off by default)."""

    def __post_init__(self) -> None:
        critic_layout_given = self.critic.parallel is not None
        for role in (self.reference, self.critic):
            if role.parallel is None:
                role.parallel = dataclasses.replace(self.actor.parallel)
        if self.critic.enabled is None:
            self.critic.enabled = needs_values(self.algorithm)
            if critic_layout_given and not self.critic.enabled:  # a layout for a model no step builds
                raise ValueError(
                    f"critic.parallel is set, but algorithm.name={self.algorithm.name} trains no critic (its "
                    "advantages need no values): remove critic.parallel, or choose an algorithm with a critic "
                    f"({', '.join(sorted(VALUE_ALGORITHMS))})"
                )
        for name, layout in enabled_roles(self).items():
            layout.check_model(self.model, prefix=f"{name}.parallel")
        for role, section in FROZEN_SECTIONS.items():
            part, key = getattr(self, section), frozen_layout_key(role)
            if getattr(part, "gpus", 0) and part.parallel is None:
                part.parallel = ParallelLayout(dp=part.gpus)
            if part.parallel is not None and getattr(part, "enabled", True):  # a disabled reference: unused
                _check_frozen_world(part.parallel, self.actor.parallel, key, own_gpus=getattr(part, "gpus", 0))
        self._check_unmapped_model()
        self._check_rollout()
        self._check_moe_section()
        check_lora_model(self.lora, self.model, self.actor.parallel)

    def _check_unmapped_model(self) -> None:
        """An architecture no family maps (``model.family=transformers``) is transformers' class for
        ``model.path``, which FSDP2 trains and the engines load whole."""
        if self.model.family != UNMAPPED_FAMILY:
            return
        for wrong, fix in (
            (not self.model.path, "set model.path to its Hugging Face directory (the architecture is its config.json)"),
            (
                self.actor.backend not in TRANSFORMERS_TRAINERS,
                f"set actor.backend={'|'.join(TRANSFORMERS_TRAINERS)} (megatron-core builds mapped families only)",
            ),
            (
                self.rollout.sync_route != "full",
                "set rollout.sync_route=full (the engine's loader splits whole tensors: how its model class "
                "fuses them is not described for an unmapped architecture)",
            ),
        ):
            if wrong:
                raise ValueError(f"model.family={UNMAPPED_FAMILY}, {self.model.described}: {fix}")

    def _check_moe_section(self) -> None:
        moe = self.moe
        if not self.model.is_moe:
            for key, active in (
                ("routing_replay", moe.routing_replay != "off"),
                ("freeze_router", moe.freeze_router),
                ("aux_loss_coef", moe.aux_loss_coef > 0),
                ("z_loss_coef", moe.z_loss_coef > 0),
            ):
                if active:
                    raise ValueError(
                        f"moe.{key}={getattr(moe, key)} needs an MoE model (model.num_experts > 0); "
                        f"model.family={self.model.family!r} is dense"
                    )
        if moe.routing_replay != "off" and self.actor.parallel.cp > 1:
            raise ValueError(
                f"moe.routing_replay={moe.routing_replay} with actor.parallel.cp="
                f"{self.actor.parallel.cp}: replay maps routes for cp=1 only; set "
                f"actor.parallel.cp=1 or moe.routing_replay=off"
            )

    def _check_rollout(self) -> None:
        from reshard.sglang import check_settings  # here: reshard is the slow import

        try:
            check_settings(self.model, self.rollout.parallel_split())
        except ValueError as e:
            raise _rollout_error(e).under("rollout") from None
        world, ranks = self.actor.parallel.world_size, self.rollout.num_ranks
        if self.rollout.placement == "colocated" and ranks > world:
            raise ValueError(
                f"rollout.placement=colocated puts rollout.tp*num_replicas = "
                f"{self.rollout.tp}*{self.rollout.num_replicas} = {ranks} engine ranks on the "
                f"actor's GPUs, but actor.parallel fills only {world}; lower rollout.num_replicas "
                f"(or rollout.tp) so that tp*num_replicas <= {world}, or set "
                f"rollout.placement=separate"
            )
        if self.rollout.generate_timeout_s >= 60 * self.run.collective_timeout_minutes:
            # the other ranks wait for the drivers in a collective: past its timeout the job fails first
            raise ValueError(
                f"rollout.generate_timeout_s={self.rollout.generate_timeout_s:g} must stay below "
                f"run.collective_timeout_minutes={self.run.collective_timeout_minutes} (in seconds), "
                "or the waiting ranks fail before a hung engine is caught; lower the first or raise "
                "the second"
            )


def reward_weights(cfg: HybridflowConfig, source: str | None) -> dict[str, float]:
    """The weight of each score in the reward of a row from ``source``: rule, and model / judge
    when a reward model / judge scores (``reward.source_weights`` first)."""
    scorers = {"model": cfg.reward_model.weight} if cfg.reward_model.path else {}
    scorers |= {"judge": cfg.judge.weight} if cfg.judge.path else {}
    rule = cfg.reward.rule_weight if cfg.reward.rule_weight is not None else (0.0 if scorers else 1.0)
    weights = {"rule": rule, **scorers}
    given = cfg.reward.source_weights.get(source or "", {})
    return {name: given.get(name, w) for name, w in weights.items()}


FROZEN_SECTIONS = {"reference": "reference", "reward_model": "reward_model", "teacher": "distillation"}
"""The config section of each frozen megatron model's role (its ``parallel`` is its layout)."""


def frozen_layout(cfg: HybridflowConfig, role: str) -> ParallelLayout:
    """The layout of frozen model ``role`` (reference, reward_model, teacher): its own, else the
    actor's."""
    own = getattr(cfg, FROZEN_SECTIONS[role]).parallel
    return own if own is not None else cfg.actor.parallel


def frozen_gpus(cfg: HybridflowConfig) -> dict[str, range]:
    """The global ranks of each frozen model that has GPUs of its own (``reward_model.gpus``,
    ``distillation.gpus``, ``judge.gpus``), numbered after the actor's and the separate engines',
    in FROZEN_SECTIONS order, then the judge's."""
    start = cfg.actor.parallel.world_size + (cfg.rollout.num_ranks if cfg.rollout.placement == "separate" else 0)
    pools = {}
    sections = {**FROZEN_SECTIONS, "judge": "judge"}
    for role, section in sections.items():
        gpus = getattr(getattr(cfg, section), "gpus", 0)
        if gpus and frozen_paths(cfg).get(role):
            pools[role] = range(start, start + gpus)
            start += gpus
    return pools


def job_worlds(cfg: HybridflowConfig) -> dict[str, int]:
    """The processes of one run, by world in rank order: the actor's, the separate engines'
    (``engine``), and each frozen model's on GPUs of its own (``frozen_gpus``)."""
    worlds = {"actor": cfg.actor.parallel.world_size}
    if cfg.rollout.placement == "separate":
        worlds["engine"] = cfg.rollout.num_ranks
    return worlds | {role: len(ranks) for role, ranks in frozen_gpus(cfg).items()}


def frozen_paths(cfg: HybridflowConfig) -> dict[str, str | None]:
    """Where each frozen model the config may name is read from (None: not used): the reward
    model, the distillation teacher and the generative judge."""
    return {"reward_model": cfg.reward_model.path, "teacher": cfg.distillation.teacher_path, "judge": cfg.judge.path}


def frozen_offload(cfg: HybridflowConfig, role: str) -> bool:
    """Whether frozen model ``role`` (reference, reward_model, teacher) is on the host between its
    uses (``<section>.offload``)."""
    return getattr(cfg, FROZEN_SECTIONS[role]).offload


def frozen_layout_key(role: str) -> str:
    """The config key of frozen model ``role``'s layout."""
    return f"{FROZEN_SECTIONS[role]}.parallel"


def _check_frozen_world(layout: ParallelLayout, actor: ParallelLayout, key: str, *, own_gpus: int = 0) -> None:
    """A frozen model's own layout fills exactly the ranks it runs on: the actor's, or its own
    ``own_gpus``."""
    ranks = own_gpus or actor.world_size
    if layout.world_size == ranks:
        return
    model_ranks = layout.tp * layout.pp * layout.cp
    fix = (
        f"set {key}.dp={ranks // model_ranks}"
        if ranks % model_ranks == 0
        else f"choose {key}.tp*pp*cp dividing {ranks}"
    )
    where = (
        f"its own {ranks} GPUs ({key.removesuffix('.parallel')}.gpus)"
        if own_gpus
        else f"the actor's {ranks} ranks (actor.parallel)"
    )
    raise ValueError(
        f"{key}: tp*pp*cp*dp = {layout.tp}*{layout.pp}*{layout.cp}*{layout.dp} = {layout.world_size} ranks, but "
        f"a frozen model runs on {where}; {fix}"
    )


def enabled_roles(cfg: HybridflowConfig) -> dict[str, ParallelLayout]:
    """Parallel layout of each enabled role, in ROLE_NAMES order."""
    roles = {name: getattr(cfg, name) for name in ROLE_NAMES}
    return {name: role.parallel for name, role in roles.items() if role.enabled}


# --------------------------------------------------------------------------- loading


def load_config(
    path: str | None, overrides: Sequence[str] = (), *, model_path_must_exist: bool = False
) -> HybridflowConfig:
    """Schema defaults <- YAML file at ``path`` (if any) <- ``key=value`` overrides
    (<- ``model.path``'s config.json), validated.

    Raises ``ValueError`` naming the offending key for every user error: missing file,
    malformed override, unknown key, wrong type, bad value, a model directory that is
    incomplete or contradicts a ``model.*`` key, or a layout that does not fit the model.
    A ``model.path`` that does not exist (a recipe's placeholder, planned before the model is
    downloaded) leaves the config's own ``model.*`` keys, with a warning; preflight refuses to
    train from it, and ``model_path_must_exist=True`` refuses it here.
    """
    sources = []
    if path is not None:
        sources.append((f"config file {path}", _read_yaml(path)))
    if overrides:
        sources.append(("overrides", _parse_overrides(overrides)))
    merged = OmegaConf.structured(HybridflowConfig)
    # the schema's model section comes from a ModelConfig() whose family-derived flags are
    # resolved for the default family; unset them so a YAML that changes model.family gets its own
    for key in FAMILY_DERIVED:
        merged.model[key] = None
    # likewise the data lengths: the schema's DataConfig() filled in the synthetic task's
    for key in ("max_prompt_length", "max_response_length"):
        merged.data[key] = None
    for origin, source in sources:
        merged = _merge(merged, source, origin)
    _read_model_path(merged, sources, must_exist=model_path_must_exist)
    try:
        cfg = _to_object(merged, "")
    except OmegaConfBaseException as e:  # e.g. a ${...} that does not resolve
        _check_resolved(merged)  # a ${...} that resolves to the wrong kind: name its key
        raise ValueError(_omegaconf_message(e)) from None
    decision = decide_lengths(cfg)
    if decision is not None:
        decision_logger.info("%s", decision.why)
        cfg.data.max_prompt_length, cfg.data.max_response_length = decision.prompt, decision.response
    logger.debug("loaded config %s with overrides %s", path, list(overrides))
    return cfg


def _read_model_path(merged: DictConfig, sources: list[tuple[str, DictConfig]], *, must_exist: bool) -> None:
    """With ``model.path`` set, the model section's architecture is its config.json's."""
    from hfschema.model_source import architecture, model_source

    path = merged.model.path
    if not path:
        return
    if not must_exist and not os.path.exists(os.path.expanduser(path)):
        logger.warning("model.path=%s does not exist (yet): using the model.* keys of the config", path)
        return
    model = OmegaConf.to_container(merged.model, resolve=True)
    explicit = {
        key: model[key] for _, source in sources for key in (source.get("model") or {}) if key not in ("path", "init")
    }
    values = architecture(
        model_source(path),
        {k: v for k, v in explicit.items() if v is not None},
        unmapped=merged.actor.backend in TRANSFORMERS_TRAINERS,
    )
    for key, value in values.items():
        merged.model[key] = OmegaConf.structured(value) if dataclasses.is_dataclass(value) else value


def _check_resolved(merged: DictConfig) -> None:
    """The kind checks of ``_check_keys`` on the resolved config (OmegaConf's error for a
    ``${...}`` that resolves to a list where a string belongs names no key)."""
    try:  # resolved untyped, so that a wrong kind resolves instead of failing without a key
        resolved = OmegaConf.to_container(OmegaConf.create(OmegaConf.to_container(merged)), resolve=True)
    except OmegaConfBaseException:
        return  # the resolution itself failed: the caller's message says where
    _check_keys(resolved, HybridflowConfig, "")


def to_yaml(cfg: HybridflowConfig) -> str:
    """The whole config as resolved YAML; ``load_config`` on it gives ``cfg`` back."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg), resolve=True)


_YAML11_WORDS = frozenset(f(w) for w in ("yes", "no", "on", "off") for f in (str.lower, str.title, str.upper))
"""Words YAML 1.1 reads as booleans that people type as a choice (``moe.routing_replay: off``). One
rule for every key: they stay text. A setting that takes a boolean reads them as one (OmegaConf's
boolean nodes accept on / off / yes / no), and one that names a choice gets the word typed, checked
against its choices, rather than a ``'False'`` it never offered. Only true / false are booleans."""


def _typed_words(node: yaml.Node, path: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(dotted key, text) of each unquoted YAML 1.1 boolean word among ``node``'s mapping values."""
    if isinstance(node, yaml.MappingNode):
        return [
            found
            for key, value in node.value
            if isinstance(key, yaml.ScalarNode) and key.value != "<<"
            for found in _typed_words(value, (*path, key.value))
        ]
    if isinstance(node, yaml.ScalarNode) and node.style is None and node.value in _YAML11_WORDS:
        return [(".".join(path), node.value)]
    return []


def _read_yaml(path: str) -> DictConfig:
    if not os.path.isfile(path):
        raise ValueError(f"config file not found: {path}")
    try:
        source = OmegaConf.load(path)
        with open(path, encoding="utf-8") as text:
            words = _typed_words(yaml.compose(text, Loader=yaml.SafeLoader))
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(source, DictConfig):
        raise ValueError(f"config file {path} must hold a mapping of sections (model, actor, ...)")
    for key, word in words:
        OmegaConf.update(source, key, word, merge=False)
    return source


def _parse_overrides(overrides: Sequence[str]) -> DictConfig:
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item!r} must look like key=value, e.g. train.lr=3e-4")
        try:
            OmegaConf.from_dotlist([item])
        except (OmegaConfBaseException, yaml.YAMLError) as e:
            detail = str(getattr(e, "msg", None) or e).splitlines()[0]
            raise ValueError(
                f"override {item!r} does not parse ({detail}); quote a value with "
                f"special characters, e.g. '{key.strip()}=\"...\"'"
            ) from None
    source = OmegaConf.from_dotlist(list(overrides))
    for key, _, value in (item.partition("=") for item in overrides):
        if value.strip() in _YAML11_WORDS:  # as in a file (_YAML11_WORDS): the word, not a boolean
            OmegaConf.update(source, key.strip(), value.strip(), merge=False)
    return source


def _field_types(cls: type) -> dict[str, Any]:
    """Declared type of each dataclass field of ``cls``."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """``(X, True)`` for ``Optional[X]``, else ``(tp, False)``."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return inner, True
    return tp, False


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _check_keys(source: dict, cls: type, path: str) -> None:
    """Reject keys the schema does not have, and values of the wrong kind (a mapping, a list or
    a scalar where the schema wants another): OmegaConf's own errors for those name no key."""
    types = _field_types(cls)
    for key, value in source.items():
        if key not in types:
            raise ValueError(_unknown_key_message(str(key), path, list(types)))
        _check_kind(value, types[key], _join(path, key))


def _check_kind(value: object, declared: Any, key: str) -> None:
    """``value`` (plain YAML data) has the container kind of ``declared``; OmegaConf converts
    and checks scalars itself (``'3'`` into an int, ``'abc'`` refused with the key)."""
    tp, optional = _unwrap_optional(declared)
    if value is None and optional or _is_interpolation(value) or tp is Any:
        return
    if value is None:
        raise ValueError(f"{key}: expected {_type_name(declared)}, got null")
    origin = typing.get_origin(tp) or tp
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"{key}: expected a mapping with keys {', '.join(_field_types(tp))}, got {_show(value)}")
        _check_keys(value, tp, key)
    elif origin in (list, tuple):
        if not isinstance(value, list):
            raise ValueError(f"{key}: expected {_type_name(tp)}, e.g. {key}=[a, b], got {_show(value)}")
        item = (typing.get_args(tp) or (Any,))[0]
        for index, element in enumerate(value):
            _check_kind(element, item, f"{key}[{index}]")
    elif origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key}: expected a mapping, e.g. {key}={{name: value}}, got {_show(value)}")
    elif isinstance(value, (dict, list)) or tp is bool and type(value) is int and value not in (0, 1):
        raise ValueError(f"{key}: expected {_type_name(declared)}, got {_show(value)}")


def _type_name(declared: Any) -> str:
    """``int``, ``str or null``, ``a list of str``, ``a ModelConfig mapping``."""
    tp, optional = _unwrap_optional(declared)
    origin = typing.get_origin(tp) or tp
    if dataclasses.is_dataclass(tp):
        name = f"a {tp.__name__} mapping"
    elif origin in (list, tuple):
        name = f"a list of {_type_name((typing.get_args(tp) or (Any,))[0])}"
    elif origin is dict:
        name = "a mapping"
    else:
        name = getattr(tp, "__name__", str(tp))
    return f"{name} or null" if optional else name


def _show(value: object) -> str:
    """A user's value as they would write it in YAML-ish form."""
    return "null" if value is None else repr(value)


def _is_interpolation(value: object) -> bool:
    return isinstance(value, str) and value.startswith("${")


def _unknown_key_message(key: str, path: str, valid: list[str]) -> str:
    where = f"under {path}" if path else "at the top level"
    message = f"unknown config key '{_join(path, key)}'; valid keys {where}: {', '.join(valid)}"
    close = difflib.get_close_matches(key, valid, n=1)
    return message + (f" (did you mean '{close[0]}'?)" if close else "")


def _merge(base: DictConfig, source: DictConfig, origin: str) -> DictConfig:
    """``base`` updated with ``source``; errors name the key and where it came from."""
    try:
        _check_keys(OmegaConf.to_container(source), HybridflowConfig, "")
        return OmegaConf.merge(base, source)
    except OmegaConfBaseException as e:
        raise ValueError(f"{_omegaconf_message(e, source)} (in {origin})") from None
    except ValueError as e:
        raise ValueError(f"{e} (in {origin})") from None


def _omegaconf_message(error: OmegaConfBaseException, source: DictConfig | None = None) -> str:
    """Turn an OmegaConf error into ``key: expected TYPE, got VALUE`` where possible."""
    key = error.full_key
    detail = str(error.msg or error).splitlines()[0]
    if not key:
        return detail
    expected = _expected_type(key)
    if expected is None or source is None or not isinstance(error, ValidationError):
        return f"{key}: {detail}"
    got = OmegaConf.select(source, key, throw_on_missing=False)
    if OmegaConf.is_config(got):
        got = OmegaConf.to_container(got)
    return f"{key}: expected {expected}, got {_show(got)}"


def _expected_type(key: str) -> str | None:
    """Readable schema type of the field at dotted ``key``; None if there is no such field."""
    cls, declared = HybridflowConfig, None
    for part in key.split("."):
        types = _field_types(cls) if dataclasses.is_dataclass(cls) else {}
        if part not in types:
            return None
        declared = types[part]
        cls, _ = _unwrap_optional(declared)
    return _type_name(declared)


def _to_object(node: DictConfig, path: str) -> Any:
    """``OmegaConf.to_object`` that reports which section a ``ConfigError`` came from.

    Sections are converted depth first, so when a section fails all of its subsections
    have already passed and the error is the section's own.
    """
    section_type = OmegaConf.get_type(node)
    for f in dataclasses.fields(section_type):
        child = node[f.name]
        if isinstance(child, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(child)):
            _to_object(child, _join(path, f.name))
    try:
        return OmegaConf.to_object(node)
    except ConfigError as e:
        raise e.under(path) from None
