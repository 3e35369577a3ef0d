"""Everything one rank holds during a run, set up in dependency order.

```
rank 0: task files, model directory  ──barrier──►  every rank reads them
every rank: tokenizer, prompts (train / held-out), actor (megatron-core, the actor's layout)
rank 0: MLflow run
each replica's driver (and, for an engine spanning nodes, the first rank of each of its other
nodes): its SGLang engine (its own scheduler processes)
every rank: EngineSync (the reshard plan from shapes; engine handles on the drivers only)
```

The replica drivers generate each step (``replicas``); each data-parallel rank receives only
the samples it trains on (``exchange``, ``shares``) and its leader scores them; the scores and
a few numbers per sample reach every rank, and the trainer work runs on every rank under the
actor's layout, each DP rank on its own rows. What the runtime calls on the trainer roles, the
engine and the tracker is typed by small Protocols (``ModelRole``, ``RolloutEngine``,
``MetricSink``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from hybridflow.algorithms.recipes import AlgorithmSpec
    from hybridflow.config import AlgorithmConfig
    from hybridflow.rollout.base import RolloutEngine
    from hybridflow.runtime.sync import EngineSync

import torch
import torch.distributed as dist

from hfschema.train import TrainConfig
from hybridflow.config import HybridflowConfig
from hybridflow.data import DataReport, PromptSampler, TokenizedPrompt, read_rows, sft_key, tokenize_rows
from hybridflow.runtime import console
from hybridflow.runtime.channel import Channel
from hybridflow.runtime.model_dir import run_model_dir
from hybridflow.runtime.shares import Shard, single_process
from hybridflow.runtime.state import RunState

__all__ = ["MetricSink", "ModelRole", "Session", "broadcast", "build_policy", "start_engine"]

logger = logging.getLogger(__name__)

DRIVER = 0

# torchrun's variables: SGLang's scheduler processes must not take them for their own
_TORCHRUN_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "GROUP_WORLD_SIZE",
    "ROLE_NAME",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)


def broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (pickled over the default group)."""
    box = [value]
    dist.broadcast_object_list(box, src=DRIVER)
    return box[0]


def engine_parallel_args(cfg: HybridflowConfig) -> dict[str, int]:
    """SGLang's parallel settings beyond tp and ep that the plan assumed (sent only when set):
    attention data parallelism (SGLang 0.5.23 calls it ``attn_dp_size``; its ``dp_size`` now
    means whole-model replicas, which hybridflow runs as ``rollout.num_replicas``) and MoE DP."""
    rollout = cfg.rollout
    args = {"attn_dp_size": rollout.dp_size if rollout.enable_dp_attention else 1, "moe_dp_size": rollout.moe_dp}
    return {key: value for key, value in args.items() if value != 1}


def _node_args(cfg: HybridflowConfig, node_rank: int, dist_init_addr: str | None) -> dict[str, Any]:
    """Where this part of the engine runs: from this rank's GPU on (colocated: engine rank i on
    actor GPU i), and, for an engine spanning nodes, which node it is and how its nodes meet."""
    args: dict[str, Any] = {}
    if torch.cuda.is_available():
        args["base_gpu_id"] = torch.cuda.current_device()
    nodes = max(1, cfg.rollout.tp // cfg.rollout.gpus_per_node)
    if nodes > 1:
        args.update(nnodes=nodes, node_rank=node_rank, dist_init_addr=dist_init_addr)
    return args


def start_engine(cfg: HybridflowConfig, model_dir: Path, *, node_rank: int = 0, dist_init_addr: str | None = None):
    """The rollout engine of this replica driver, started from ``model_dir``: SGLang without
    torchrun's variables, or the transformers engine (small runs, GPU machines without SGLang).
    ``node_rank`` > 0 starts the part of a multi-node SGLang engine on another node instead
    (``SGLangNode``: schedulers only, commanded by the driver at ``dist_init_addr``)."""
    with console.engine_output(cfg.run.output_dir, int(os.environ.get("RANK", "0")), verbose=cfg.run.verbose):
        return _start_engine(cfg, model_dir, node_rank=node_rank, dist_init_addr=dist_init_addr)


def _start_engine(cfg: HybridflowConfig, model_dir: Path, *, node_rank: int, dist_init_addr: str | None):
    from hybridflow.rollout import make_engine

    # the directory has no weights (model_dir.py): both engines start empty, the first push fills them
    if cfg.rollout.engine == "hf":  # in this process, on the driver's device
        from megatron_adapters.parallel import device

        return make_engine(
            "hf",
            model_path=str(model_dir),
            dtype=cfg.rollout.dtype,
            seed=cfg.run.seed,
            device=str(device()),
            return_routed_experts=cfg.moe.routing_replay == "r3",
            load_format="dummy",
        )
    saved = {k: os.environ.pop(k) for k in _TORCHRUN_ENV if k in os.environ}
    placement = {**engine_parallel_args(cfg), **_node_args(cfg, node_rank, dist_init_addr)}
    try:
        if node_rank > 0:
            from hybridflow.rollout.sglang.engine import start_node

            return start_node(
                str(model_dir),
                tp=cfg.rollout.tp,
                ep=cfg.rollout.ep,
                dtype=cfg.rollout.dtype,
                max_total_tokens=cfg.rollout.max_total_tokens,
                seed=cfg.run.seed,
                load_format="dummy",
                deterministic=_engine_deterministic(cfg),
                **placement,
            )
        return make_engine(
            "sglang",
            model_path=str(model_dir),
            tp=cfg.rollout.tp,
            ep=cfg.rollout.ep,
            dtype=cfg.rollout.dtype,
            max_total_tokens=cfg.rollout.max_total_tokens,
            seed=cfg.run.seed,
            load_format="dummy",
            bucket_bytes=cfg.rollout.push_bucket_mb << 20,
            deterministic=_engine_deterministic(cfg),
            generate_timeout_s=cfg.rollout.generate_timeout_s,
            **placement,
            **_adapter_slots(cfg),
        )
    finally:
        os.environ.update(saved)


def _adapter_slots(cfg: HybridflowConfig) -> dict:
    """SGLang's LoRA settings when the run pushes adapters (``lora.push=adapter``), else none."""
    if not cfg.lora.pushes_adapters:
        return {}
    from hfschema.lora import engine_target_modules
    from hybridflow.rollout.sglang.cpu import has_cuda_gpu
    from hybridflow.rollout.sglang.engine import lora_args

    return lora_args(
        rank=cfg.lora.rank, target_modules=engine_target_modules(cfg.lora.target_modules), on_cpu=not has_cuda_gpu()
    )


def _engine_deterministic(cfg: HybridflowConfig) -> bool:
    """SGLang's deterministic inference under run.deterministic, on GPUs: SGLang refuses it on
    CPU, where the engine already reproduces (hybridflow/runtime/determinism.py)."""
    return cfg.run.deterministic and torch.cuda.is_available()


def build_policy(cfg: HybridflowConfig, train: TrainConfig, pg, *, trainable: bool = True, moe=None, lora=None):
    """A megatron-core policy of the actor's model under the actor's layout (``moe``: the RL
    actor's routing replay, router statistics and router settings; ``lora``: the RL actor's
    adapters). A pretrained model's policy is not randomly initialised: weights are loaded next."""
    from megatron_adapters.policy import MegatronPolicy

    return MegatronPolicy(
        cfg.model,
        cfg.actor.parallel,
        train,
        pg_collection=pg,
        trainable=trainable,
        moe=moe,
        lora=lora,
        packing_config=cfg.packing,
        initialize=not cfg.model.pretrained,
    )


class ModelRole(Protocol):
    """What the runtime calls on a model role (``megatron_adapters.policy.MegatronPolicy``)."""

    routing: Any
    """Router control (routing replay, statistics), or None for dense models."""

    def forward_logprobs(
        self,
        batch,
        *,
        micro_batch_size: int | None = None,
        with_entropy: bool = False,
        record_routes: bool = False,
        local_rows: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def train_step(self, batch, loss_fn, *, local_rows: bool = False) -> Any: ...

    def offload_training_state(self) -> None: ...

    def restore_training_state(self) -> None: ...

    def snapshot(self) -> Any: ...

    def rollback(self, snapshot: Any) -> None: ...


class StepUndo:
    """Host snapshots of the roles this RL step updates, taken before each role's first update,
    when ``run.on_nan=skip`` and the step makes more than one update (one update that fails is
    never applied, so it needs none): a skipped step then changes no weights at all."""

    def __init__(self, active: bool) -> None:
        self.active = active
        self._taken: list[tuple[ModelRole, Any]] = []

    def before_update(self, role: ModelRole) -> None:
        if self.active and all(r is not role for r, _ in self._taken):
            self._taken.append((role, role.snapshot()))

    def rollback(self) -> bool:
        """Undo every update of the step; whether there was any to undo."""
        for role, snap in self._taken:
            role.rollback(snap)
        undone, self._taken = bool(self._taken), []
        return undone


class MetricSink(Protocol):
    """What the runtime calls on the run's tracker (``hybridflow.runtime.tracking.Tracker``)."""

    run_id: str | None
    """The tracking run, kept in the run state so that a resumed run logs into it; None: none."""
    uri: str | None
    """Where the run is tracked, for the summary; None: not tracked (or not on this rank)."""

    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_artifact(self, path: str | os.PathLike) -> None: ...

    def close(self, status: str = "FINISHED") -> None: ...


@dataclass
class Session:
    """One rank's view of a run; see the module docstring."""

    cfg: HybridflowConfig
    out_dir: Path
    rank: int
    tokenizer: Any
    model_dir: Path
    train_prompts: list[TokenizedPrompt]
    heldout_prompts: list[TokenizedPrompt]
    sft_rows: list[TokenizedPrompt]
    sampler: PromptSampler
    state: RunState
    tracker: MetricSink
    shard: Shard = field(default_factory=single_process)
    """This rank's data-parallel share of every rollout (``shares``)."""
    device: torch.device = torch.device("cpu")
    """The rank's device: where rollout samples travel to it."""
    channel: Channel | None = None
    """The processes rollouts and pushes span: the actor ranks, and the engine ranks when separate."""
    engine: RolloutEngine | None = None
    """This rank's replica's engine when it drives one."""
    actor: ModelRole | None = None
    reference: ModelRole | None = None
    critic: ModelRole | None = None
    """The critic also has ``forward_values`` (``megatron_adapters.critic.MegatronCritic``)."""
    sync: EngineSync | None = None
    restarts: Any = None
    """Replaces lost engines (``recovery.EngineRestarts``), on every rank once rollout started."""
    stop_ids: tuple[int, ...] = ()
    algo: AlgorithmConfig | None = None
    """``cfg.algorithm`` with the values the algorithm filled in (e.g. DAPO's clip_ratio_high)."""
    spec: AlgorithmSpec | None = None
    """The algorithm's ``AlgorithmSpec`` (estimator, loss, which roles run)."""
    pg: Any = None
    """The actor layout's process groups (megatron ``ProcessGroupCollection``)."""
    replica: int | None = None
    """The rollout replica this rank drives (its engine is ``engine``), or None."""
    engine_node: Any = None
    """This node's part of a multi-node engine that another rank drives (``SGLangNode``), or None."""
    pipeline: Any = None
    """Asynchronous RL's buffer of batches started ahead (``pipeline.Pipeline``), or None (sync)."""
    stale_weights: torch.Tensor | None = None
    """[N] loss weights of the step's samples past ``async_rl.max_staleness`` (on_stale=downweight),
    or None: every sample weighs 1."""
    rollout_calls: int = 0
    """Generate calls so far, counted alike on every rank (names each call's shared chunk counter)."""
    mode: str | None = None
    """What the colocated GPUs hold now: generate, sync, train, or None (everything, at start)."""
    executed_stages: list[str] = field(default_factory=list)
    """The first RL step of this process as it ran: each stage and the switch executed before
    it, in ``hybridflow plan``'s words (the summary reports it)."""
    step_metrics: dict[str, float] = field(default_factory=dict)
    """Metrics the ops of the running step report beside their fields (reset every step)."""
    undo: StepUndo = field(default_factory=lambda: StepUndo(False))
    """The running step's snapshots for ``run.on_nan=skip`` (reset every step)."""
    kl_reward: Any = None
    """The in-reward KL coefficient's controller (``shaping.kl_controller``): fixed or adaptive."""
    reward_errors: int = 0
    """Reward calls that raised so far (scored 0)."""
    data_rows_skipped: dict[str, int] = field(default_factory=dict)
    """Bad data rows skipped when the prompts were read, by data set (train, heldout)."""
    moe_tokens_per_expert: list | None = None
    """The last training pass's tokens per expert and MoE layer, for the summary."""
    started: float = 0.0
    """``time.time()`` when this process started the run."""
    wall_before: float = 0.0
    """Wall seconds of the run before this process started (a resumed run's earlier part)."""

    @property
    def is_driver(self) -> bool:
        return self.rank == DRIVER

    def prompt_batch(self, step: int, offset: int = 0) -> list[TokenizedPrompt]:
        """The prompts of RL step ``step`` (``offset`` > 0: extra draws, e.g. dynamic sampling)."""
        index = self.sampler.batch(step + offset * 1_000_003)
        return [self.train_prompts[i] for i in index]


def prepare_files(cfg: HybridflowConfig, out_dir: Path) -> tuple[list[str], list[str], Path]:
    """Data files and model directory (written by rank 0 when generated), the same on every rank."""
    from hybridflow.tasks import make_task_files

    paths = None
    if dist.get_rank() == DRIVER:
        out_dir.mkdir(parents=True, exist_ok=True)
        train, heldout = list(cfg.data.train_files), list(cfg.data.heldout_files)
        if not train:
            t, h = make_task_files(
                cfg.task, cfg.data, out_dir / "data", seed=cfg.run.seed, sft_key=cfg.sft.response_key
            )
            train, heldout = [str(t)], heldout or [str(h)]
        model_dir = run_model_dir(cfg.model, out_dir / "model", seed=cfg.run.seed)
        paths = (train, heldout, model_dir)
    return broadcast(paths)


def load_prompts(cfg: HybridflowConfig, tokenizer, train: list[str], heldout: list[str]):
    """Tokenised training prompts (with SFT targets when SFT runs), held-out prompts, and the bad
    rows skipped under ``data.on_bad_row=skip`` (unreadable or untokenisable) by data set."""
    report = DataReport()
    prompts, too_long = tokenize_rows(
        read_rows(train, cfg.data, sft_key=sft_key(cfg), report=report), tokenizer, cfg.data
    )
    skipped = {"train": report.num_skipped + too_long}
    held = []
    if heldout and cfg.run.heldout_prompts > 0:
        report = DataReport()
        rows = read_rows(heldout, cfg.data, report=report)[: cfg.run.heldout_prompts]
        held, too_long = tokenize_rows(rows, tokenizer, cfg.data)
        skipped["heldout"] = report.num_skipped + too_long
    return prompts, held, skipped


def stop_token_ids(tokenizer, model_dir: Path | None = None) -> tuple[int, ...]:
    """End-of-text and end-of-turn ids the responses stop at: the tokenizer's, and those the
    model's generation_config.json names (Qwen's lists both <|im_end|> and <|endoftext|>)."""
    ids = {tokenizer.eos_token_id, *_generation_eos(model_dir)}
    for token in ("<|im_end|>", "<|endoftext|>"):
        found = tokenizer.convert_tokens_to_ids(token)
        if isinstance(found, int) and found != tokenizer.unk_token_id:
            ids.add(found)
    return tuple(sorted(i for i in ids if i is not None))


def _generation_eos(model_dir: Path | None) -> list[int]:
    path = None if model_dir is None else Path(model_dir) / "generation_config.json"
    if path is None or not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}); fix or remove it") from None
    return [eos] if isinstance(eos, int) else [i for i in eos or [] if isinstance(i, int)]
