"""What one rank holds for a whole run, set up in dependency order.

```
rank 0: task files, model directory  ──barrier──►  every rank reads them
every rank: RunContext (config, output directory, DP share, channel, run state, tracker)
            RunData (tokenizer, prompts: train / held-out, the sampler)
            Models (the algorithm; actor, reference, critic after the warm-up, the actor's layout)
rank 0: MLflow run
each replica's driver (and, for an engine spanning nodes, the first rank of each of its other
nodes): its SGLang engine (its own scheduler processes), kept in the EngineClient
every rank: EngineSync (the reshard plan from shapes; it reads the engine from the EngineClient)
```

The replica drivers generate each step (``replicas``); each data-parallel rank receives only
the samples it trains on (``exchange``, ``shares``) and its leader scores them; the scores and
a few numbers per sample reach every rank, and the trainer work runs on every rank under the
actor's layout, each DP rank on its own rows. A step's own values are not kept here: its ops
hand them on as the graph's fields and return what they measured (``step``). What the runtime
calls on the trainer roles, the engine and the tracker is typed by small Protocols
(``ModelRole``, ``RolloutEngine``, ``MetricSink``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from hybridflow.algorithms.recipes import AlgorithmSpec
    from hybridflow.config import AlgorithmConfig
    from hybridflow.runtime.pipeline import Pipeline

import torch
import torch.distributed as dist

from hfschema.engines import ENGINES, resolve
from hybridflow.config import HybridflowConfig
from hybridflow.data import (
    DataReport,
    PromptSampler,
    TokenizedPrompt,
    few_rows_warning,
    read_rows,
    sft_key,
    tokenize_rows,
    tool_schemas,
)
from hybridflow.runtime import console
from hybridflow.runtime.channel import Channel
from hybridflow.runtime.engine_client import EngineClient
from hybridflow.runtime.model_dir import run_model_dir
from hybridflow.runtime.samples import SampleWriter
from hybridflow.runtime.shares import Shard, single_process
from hybridflow.runtime.state import RunState

__all__ = [
    "MetricSink",
    "ModelRole",
    "Models",
    "RunContext",
    "RunData",
    "Session",
    "broadcast",
    "start_engine",
]

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
    """Rank 0's ``value`` on every rank (pickled over the default group; as it is in one process)."""
    if not _several_ranks():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=DRIVER)
    return box[0]


def gather_to_driver(value: Any, group=None) -> list | None:
    """Every rank's ``value`` on rank 0, in rank order (pickled over ``group``, the default when
    None); None on the other ranks; ``[value]`` in one process."""
    if not _several_ranks():
        return [value]
    parts = [None] * dist.get_world_size() if dist.get_rank() == DRIVER else None
    dist.gather_object(value, parts, dst=DRIVER, group=group)
    return parts


def _several_ranks() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def start_engine(cfg: HybridflowConfig, model_dir: Path, *, node_rank: int = 0, dist_init_addr: str | None = None):
    """The rollout engine of this replica driver, started from ``model_dir`` by ``rollout.engine``'s
    own start. ``node_rank`` > 0 starts the part of an engine spanning nodes on another node
    instead (SGLang's ``SGLangNode``: schedulers only, commanded by the driver at ``dist_init_addr``)."""
    with console.engine_output(cfg.run.output_dir, int(os.environ.get("RANK", "0")), verbose=cfg.run.verbose):
        engine = _start_engine(cfg, model_dir, node_rank=node_rank, dist_init_addr=dist_init_addr)
    if cfg.agentic.enabled and node_rank == 0:  # its samples are multi-turn trajectories
        from transformers import AutoTokenizer

        from hybridflow.agentic.engine import AgenticEngine

        engine = AgenticEngine(engine, cfg, AutoTokenizer.from_pretrained(str(model_dir)))
    return engine


@contextlib.contextmanager
def plain_engine_env() -> Iterator[None]:
    """torchrun's variables out of the environment while an engine starts (SGLang would read
    them as its own), put back after."""
    saved = {k: os.environ.pop(k) for k in _TORCHRUN_ENV if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _start_engine(cfg: HybridflowConfig, model_dir: Path, *, node_rank: int, dist_init_addr: str | None):
    """The engine's own start (``hfschema.engines.ENGINES[...].start``) on the trainer's device; the
    directory has no weights (model_dir.py): every engine starts empty, the first push fills them."""
    from hybridflow.runtime.trainers import trainer_of

    start = resolve(ENGINES[cfg.rollout.engine].start)
    with plain_engine_env():
        return start(
            cfg, model_dir, device=str(trainer_of(cfg).device()), node_rank=node_rank, dist_init_addr=dist_init_addr
        )


class ModelRole(Protocol):
    """What the runtime calls on a model role (a trainer backend's policy: ``runtime.trainers``)."""

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


class MetricSink(Protocol):
    """What the runtime calls on the run's tracker (``hybridflow.runtime.tracking.Tracker``)."""

    run_id: str | None
    """The tracking run, kept in the run state so that a resumed run logs into it; None: none."""
    uri: str | None
    """Where the run is tracked, for the summary; None: not tracked (or not on this rank)."""
    wandb_run_id: str | None
    """The wandb run, kept in the run state like ``run_id``; None: none."""

    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_table(self, name: str, records: list[dict], columns: Sequence[str], *, mlflow: bool = True) -> None: ...

    def log_artifact(self, path: str | os.PathLike) -> None: ...

    def close(self, status: str = "FINISHED") -> None: ...


@dataclass
class RunContext:
    """What lives for the whole run on this rank: its config and place, its record and tracker."""

    cfg: HybridflowConfig
    out_dir: Path
    rank: int
    state: RunState
    """The run's record, saved with every checkpoint (steps, history, held-out scores, counters)."""
    tracker: MetricSink
    shard: Shard = field(default_factory=single_process)
    """This rank's data-parallel share of every rollout (``shares``)."""
    device: torch.device = torch.device("cpu")
    """The rank's device: where rollout samples travel to it."""
    channel: Channel | None = None
    """The processes rollouts and pushes span: the actor ranks, and the engine ranks when separate."""
    frozen_channels: dict[str, Channel] = field(default_factory=dict)
    """Each frozen model on GPUs of its own (``reward_model.gpus``...): its joint channel with the
    actor ranks (``frozen.Remote`` sends over it)."""
    started: float = 0.0
    """``time.time()`` when this process started the run."""
    wall_before: float = 0.0
    """Wall seconds of the run before this process started (a resumed run's earlier part)."""
    starts_before: list[float] = field(default_factory=list)
    """Each earlier start's wall seconds (``RunState.start_seconds``; a state saved before the
    field: its one total)."""

    def start_seconds(self) -> list[float]:
        """Each start's wall seconds, this one's (so far) last."""
        return [*self.starts_before, time.time() - self.started]

    samples: SampleWriter | None = None
    """The driver's writer of ``<run>/samples/`` (``runtime.samples``); None elsewhere."""

    executed_stages: list[str] = field(default_factory=list)
    """The first RL step of this process as it ran: each stage and the switch executed before
    it, in ``hybridflow plan``'s words (the summary reports it)."""

    @property
    def is_driver(self) -> bool:
        return self.rank == DRIVER


@dataclass
class RunData:
    """The tokenizer, the prompts and how each step draws them."""

    tokenizer: Any
    train_prompts: list[TokenizedPrompt]
    heldout_prompts: list[TokenizedPrompt]
    sampler: PromptSampler
    stop_ids: tuple[int, ...] = ()
    """End-of-text and end-of-turn ids the responses stop at."""
    rows_skipped: dict[str, int] = field(default_factory=dict)
    """Bad data rows skipped when the prompts were read, by data set (train, heldout)."""

    def prompt_batch(self, step: int, offset: int = 0) -> list[TokenizedPrompt]:
        """The prompts of RL step ``step`` (``offset`` > 0: extra draws, e.g. dynamic sampling)."""
        index = self.sampler.batch(step + offset * 1_000_003)
        return [self.train_prompts[i] for i in index]


@dataclass
class Models:
    """The trained and frozen models under the actor's layout, and the algorithm they follow."""

    spec: AlgorithmSpec
    """The algorithm's ``AlgorithmSpec`` (estimator, loss, which roles run)."""
    algo: AlgorithmConfig
    """``cfg.algorithm`` with the values the algorithm filled in (e.g. DAPO's clip_ratio_high)."""
    kl_reward: Any
    """The in-reward KL coefficient's controller (``shaping.kl_controller``): fixed or adaptive."""
    pg: Any = None
    """The actor layout's process groups (megatron ``ProcessGroupCollection``)."""
    actor: ModelRole | None = None
    reference: ModelRole | None = None
    critic: ModelRole | None = None
    """The critic also has ``forward_values`` (a trainer backend's ``build_critic``)."""
    reward_model: Any = None
    """The frozen reward model (``runtime.frozen.RewardModel``) with ``reward_model.path``."""
    teacher: ModelRole | None = None
    """The frozen distillation teacher with ``distillation.teacher_path``."""
    judge: Any = None
    """The generative judge's engine (``runtime.frozen.Judge``), on rank 0 with ``judge.path``."""

    def updates_per_step(self) -> int:
        """Optimizer updates one RL step makes (every trained role, every epoch and mini-batch)."""
        roles = sum(role is not None for role in (self.actor, self.critic))
        return roles * self.algo.ppo_epochs * self.algo.mini_batches


@dataclass
class Session:
    """One rank's view of a run; see the module docstring. Each step's values are not kept
    here: the stages return them (``ops.Produced``) and the loop passes them on."""

    run: RunContext
    data: RunData
    models: Models
    engines: EngineClient
    pipeline: Pipeline | None = None
    """Asynchronous RL's buffer of batches started ahead, or None (sync)."""
    mode: str | None = None
    """What the colocated GPUs hold now: generate, sync, train, or None (everything, at start)."""

    @property
    def cfg(self) -> HybridflowConfig:
        return self.run.cfg


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
    tools = tool_schemas(cfg)
    rows = read_rows(train, cfg.data, sft_key=sft_key(cfg), report=report)
    prompts, too_long = tokenize_rows(rows, tokenizer, cfg.data, tools, name="training prompts", report=report)
    report.check_dropped("training", "data.train_files", cfg.data, kept=len(prompts))
    driver = not dist.is_initialized() or dist.get_rank() == DRIVER
    if len(prompts) < cfg.run.prompts_per_step and cfg.run.mode != "sft" and driver:
        logger.warning("%s", few_rows_warning(len(prompts), cfg.run.prompts_per_step))
    skipped = {"train": report.num_skipped + too_long}
    held = []
    if heldout and cfg.run.heldout_prompts > 0:
        report = DataReport()
        rows = read_rows(heldout, cfg.data, report=report)[: cfg.run.heldout_prompts]
        held, too_long = tokenize_rows(rows, tokenizer, cfg.data, tools, name="held-out prompts", report=report)
        report.check_dropped("held-out", "data.heldout_files", cfg.data, kept=len(held))
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
