"""``hybridflow train`` on one rank: set up, SFT warm-up, RL, evaluate, report.

    torchrun --nproc-per-node N -m hybridflow.runtime.worker CONFIG [key=value ...]

```
check the config and graph (before anything heavy)  ──►  resume point (run.resume)
files, tokenizer, prompts  ──►  SFT (unless done)  ──►  actor (+ reference) from the newest
checkpoint  ──►  engine (rank 0), first weight sync, held-out score after SFT
──►  loop.train_rl (checkpoints)  ──►  held-out score after RL  ──►  summary.json, plot, MLflow
```
"""

from __future__ import annotations

import gc

if __name__ == "__main__":  # a rank's start: main() turns it on again after the imports (hfschema/gc_pause.py)
    gc.disable()

import contextlib
import dataclasses
import logging
import os
import shutil
import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
import yaml

from hfschema.files import write_atomic
from hybridflow import sample_files
from hybridflow.algorithms.recipes import algorithm_spec
from hybridflow.algorithms.shaping import kl_controller
from hybridflow.config import HybridflowConfig, job_worlds, load_config, to_yaml
from hybridflow.data import PromptSampler
from hybridflow.lowering import lower, trainer_text
from hybridflow.rewards import RewardError
from hybridflow.runtime import checksums, console, determinism, disk_full, frozen_ranks, report, startup_clock, stops
from hybridflow.runtime import state as run_state
from hybridflow.runtime.channel import Channel, colocated, join
from hybridflow.runtime.engine_client import EngineClient
from hybridflow.runtime.engine_ranks import serve
from hybridflow.runtime.loop import heldout, train_rl
from hybridflow.runtime.pipeline import Pipeline
from hybridflow.runtime.progress import read_progress
from hybridflow.runtime.recovery import EngineRestarts
from hybridflow.runtime.replicas import engine_nodes, node_role, replica_of
from hybridflow.runtime.samples import SampleWriter
from hybridflow.runtime.session import (
    DRIVER,
    Models,
    RunContext,
    RunData,
    Session,
    broadcast,
    load_prompts,
    prepare_files,
    start_engine,
    stop_token_ids,
)
from hybridflow.runtime.sft import run_sft, sft_train_config
from hybridflow.runtime.shares import Shard
from hybridflow.runtime.sync import EngineSync
from hybridflow.runtime.tracking import Tracker
from hybridflow.runtime.trainers import TrainerBackend, trainer_of
from launch.failures import record_failure
from moe.routes import check_replay_device
from moe.stats import summarise as summarise_router_stats

__all__ = ["main", "run"]

logger = logging.getLogger("hybridflow.train")


def _save(s: Session, name: str, *, with_optimizer: bool, policy=None, export_hf: bool = False) -> None:
    """Write ``checkpoints/<name>`` completely or not at all (see ``runtime.state``); ``export_hf``:
    with the actor as a Hugging Face model directory beside it (``run_state.HF_EXPORT``)."""
    trainer = trainer_of(s.cfg)
    final = s.run.out_dir / "checkpoints" / name
    staging = run_state.staging_dir(final)
    # a stop signal now waits for the checkpoint (within the launcher's grace)
    with stops.deferred(), _disk_full_named(s.run.out_dir, staging):
        if s.run.is_driver:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        dist.barrier()
        trainer.save(policy or s.models.actor, staging / "actor", with_optimizer=with_optimizer, step=s.run.state.step)
        if export_hf and s.run.is_driver:
            _export_hf(trainer, staging)
        if policy is None and s.models.critic is not None:
            trainer_of(s.cfg, "critic").save(
                s.models.critic, staging / "critic", with_optimizer=with_optimizer, step=s.run.state.step
            )
        # asynchronous RL: the engine drivers save the batches started ahead beside the checkpoint
        buffer = s.pipeline.save(staging) if s.pipeline is not None else []
        if s.run.is_driver:
            write_atomic(staging / run_state.CONFIG_FILE, to_yaml(s.cfg))  # what a resume compares with
        _record_checksums(s, staging)
        if s.run.is_driver:
            s.run.state.mlflow_run_id = s.run.tracker.run_id
            s.run.state.wandb_run_id = s.run.tracker.wandb_run_id
            s.run.state.start_seconds = s.run.start_seconds()
            s.run.state.wall_seconds = sum(s.run.state.start_seconds)
            s.run.state.async_buffer = buffer
            s.run.state.checksummed = True
            run_state.save_state(staging, s.run.state)
            run_state.publish(staging, final)
            run_state.prune(s.run.out_dir, s.cfg.run.keep_checkpoints)
        dist.barrier()


def _save_step(s: Session, step: int) -> None:
    """An RL checkpoint, and the run's figure as it stands (``run.png``, in the trackers too)."""
    _save(s, f"step_{step:06d}", with_optimizer=True)
    if s.run.is_driver:
        figure = report.plot_run(s.run.out_dir, s.run.state)
        if figure is not None:
            s.run.tracker.log_artifact(figure)


@contextlib.contextmanager
def _disk_full_named(out_dir: Path, staging: Path) -> Iterator[None]:
    """A full disk while writing ``staging``: ``DiskFull`` naming the directory and what is kept."""
    try:
        yield
    except BaseException as error:  # torch's CheckpointException is a BaseException
        full = disk_full.is_disk_full(error)
        if type(error).__name__ == "CheckpointException":  # raised on every rank together, after its
            full = _on_any_rank(full)  # gather; only the coordinator's copy holds the ranks' errors
        if not full:
            raise
        newest = run_state.latest_checkpoint(out_dir)
        kept = f"the newest complete checkpoint, {newest.name}, is kept" if newest else "no checkpoint is complete yet"
        kept = f"it stays {staging.name}, which resume never reads, and {kept}"
        doing = f"writing checkpoint {staging.name}"
        raise disk_full.DiskFull(disk_full.message(staging.parent, doing, kept)) from error


def _on_any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on some rank (collective over the default group)."""
    flags: list = [None] * dist.get_world_size()
    dist.all_gather_object(flags, flag)
    return any(flags)


def _export_hf(trainer: TrainerBackend, staging: Path) -> None:
    """The checkpoint's actor as a Hugging Face directory (safetensors, the run's config.json,
    tokenizer and chat template): what the user takes away, and what RL after the warm-up (and a
    reference of a random model's initial weights) loads through ``model.path``'s loader, the
    path a user's own model takes, under any layout."""
    nbytes = trainer.export_hf(staging / "actor", staging / run_state.HF_EXPORT)
    final = staging.with_suffix("")
    logger.info(
        "exported %s's model as a Hugging Face directory %s (%.1f MB)",
        final.name,
        final / run_state.HF_EXPORT,
        nbytes / 1e6,
    )


def _record_checksums(s: Session, staging: Path) -> None:
    """Every file of the checkpoint being written, hashed by the actor ranks in shares of equal
    bytes, into its ``checksums.json`` (collective; rank 0 deals the files and writes it)."""
    dist.barrier()  # every file in place before rank 0 lists them
    shares = broadcast(
        checksums.shares_of(staging, checksums.listed_files(staging), dist.get_world_size())
        if s.run.is_driver
        else None
    )
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, checksums.hash_files(staging, shares[dist.get_rank()]))
    if s.run.is_driver:
        checksums.write_manifest(staging, parts)


def _warm_up(s: Session, resume_from: Path | None) -> bool:
    """SFT into ``checkpoints/sft`` unless a checkpoint says it is done; an unfinished one goes on
    from its ``sft_<step>`` checkpoint. False: stopped on a checkpoint request (saved first)."""
    cfg = s.cfg
    if s.run.state.sft_done or cfg.sft.steps == 0:
        return True
    trainer = trainer_of(cfg)
    policy = trainer.build_policy(cfg, sft_train_config(cfg), s.models.pg, model_dir=s.engines.model_dir)
    if s.run.state.sft_step:  # resume_from is the unfinished SFT's checkpoint
        trainer.load(policy, resume_from / "actor", with_optimizer=True)
    else:
        _load_starting_weights(s, trainer, policy)
    end_id = s.data.stop_ids[-1] if s.data.stop_ids else s.data.tokenizer.eos_token_id
    end_id = s.data.tokenizer.convert_tokens_to_ids("<|im_end|>") if s.data.tokenizer.chat_template else end_id
    requested = False

    def after(step: int, result) -> bool:
        nonlocal requested
        s.run.tracker.log_metrics({"sft/loss": result.loss}, step=step)
        s.run.state.sft_losses.append(result.loss)
        done = s.run.state.sft_step = step + 1
        scheduled, requested = stops.checkpoint_due(
            s.run.out_dir,
            done=done,
            total=cfg.sft.steps,
            every=cfg.sft.checkpoint_every,
            is_driver=s.run.is_driver,
            group=s.run.shard.group,
        )
        if requested or (scheduled and done < cfg.sft.steps):  # the last step saves as checkpoints/sft
            _save(s, f"sft_{done:06d}", with_optimizer=True, policy=policy)
        return requested

    run_sft(
        policy,
        s.data.train_prompts,
        s.data.tokenizer,
        steps=cfg.sft.steps,
        start=s.run.state.sft_step,
        batch_size=cfg.sft.batch_size,
        seed=cfg.run.seed,
        end_id=end_id,
        row_multiple=cfg.actor.parallel.dp * cfg.train.micro_batch_size,
        on_step=after,
    )
    if requested:
        if s.run.is_driver:
            stops.done_request(s.run.out_dir)
            logger.warning("checkpointed SFT step %d as %s asked; stopping", s.run.state.sft_step, stops.REQUEST_FILE)
        return False
    s.run.state.sft_done = True
    _save(s, "sft", with_optimizer=False, policy=policy, export_hf=cfg.sft.export_hf)
    return True


def _load_actor(s: Session, resume_from: Path | None) -> None:
    trainer = trainer_of(s.cfg)
    s.models.actor = trainer.build_policy(
        s.cfg, s.cfg.train, s.models.pg, model_dir=s.engines.model_dir, moe=s.cfg.moe, lora=s.cfg.lora
    )
    sft = run_state.sft_checkpoint(s.run.out_dir)
    if resume_from is None and _reference_is_initial(s, sft):  # kept for every later start, any layout
        _save(s, run_state.INITIAL, with_optimizer=False, policy=s.models.actor, export_hf=True)
    if resume_from is not None and run_state.is_rl_checkpoint(resume_from):
        trainer.load(s.models.actor, resume_from / "actor", with_optimizer=True)
    elif (sft / "actor").is_dir():
        _load_sft(trainer, s.models.actor, sft)
    else:
        _load_starting_weights(s, trainer, s.models.actor)
    if s.models.spec.needs_critic:
        critics = trainer_of(s.cfg, "critic")
        s.models.critic = critics.build_critic(s.cfg, s.models.pg, model_dir=s.engines.model_dir)
        if resume_from is not None and (resume_from / "critic").is_dir():
            critics.load(s.models.critic, resume_from / "critic", with_optimizer=True)
        else:  # the policy's (SFT) transformer under a fresh value head, as PPO critics start
            skipped = _copy_weights(critics, s.models.actor, s.models.critic)
            if any(not name.startswith("output_layer.") for name in skipped):
                raise AssertionError(f"the critic differs from the actor beyond its value head: {skipped}")
    if s.cfg.reward_model.path:
        from hybridflow.runtime.frozen import build_reward_model

        s.models.reward_model = build_reward_model(s.cfg, s.models.pg, s.data.tokenizer, _remote(s, "reward_model"))
    if s.cfg.judge.path:
        s.models.judge = _judge(s)
    if s.cfg.distillation.teacher_path:
        from hybridflow.runtime.frozen import build_teacher

        s.models.teacher = build_teacher(s.cfg, s.models.pg, s.data.tokenizer, _remote(s, "teacher"))
    if s.models.spec.uses_reference:
        from hybridflow.runtime.frozen import build_reference

        s.models.reference = build_reference(
            s.cfg, s.models.pg, model_dir=s.engines.model_dir, load=lambda ref: _reference_weights(s, sft, ref)
        )


def _judge(s: Session):
    """The judge: rank 0's own engine (None on the other ranks), or with ``judge.gpus`` the
    remote replicas, which every actor rank asks (rank 0 with the requests, in the judge's
    tokens)."""
    from hybridflow.runtime.frozen import Judge, judge_tokens, start_judge

    remote = _remote(s, "judge")
    if remote is None:
        return start_judge(s.cfg) if s.run.is_driver else None
    tokenizer = judge_tokens(s.cfg)[1] if s.run.is_driver else None
    return Judge(engine=None, tokenizer=tokenizer, stop_ids=(), remote=remote)


def _remote(s: Session, role: str):
    """Frozen model ``role`` on GPUs of its own: where its requests go (None: on the actor's)."""
    from hybridflow.runtime.frozen import Remote

    channel = s.run.frozen_channels.get(role)
    return Remote(channel) if channel is not None else None


def _reference_is_initial(s: Session, sft: Path) -> bool:
    """Whether the reference is a random model's initial weights (no SFT warm-up, no model.path)."""
    return s.models.spec.uses_reference and not s.cfg.model.pretrained and not (sft / "actor").is_dir()


def _reference_weights(s: Session, sft: Path, reference) -> None:
    """The reference's weights, read under its own layout from where the actor started (read
    again: a resumed actor has moved away from them)."""
    initial = run_state.initial_checkpoint(s.run.out_dir)
    trainer = trainer_of(s.cfg, "reference")
    if (sft / "actor").is_dir():
        _load_sft(trainer, reference, sft)
    elif s.cfg.model.pretrained:
        _load_starting_weights(s, trainer, reference)
    elif (initial / run_state.HF_EXPORT).is_dir():
        _load_sft(trainer, reference, initial)
    elif reference.layout == s.cfg.actor.parallel:  # a run begun before checkpoints/initial was kept
        logger.warning("%s is missing: the reference starts from the resumed actor's weights", initial)
        _copy_weights(trainer, s.models.actor, reference)
    else:
        raise ValueError(
            f"{initial} is missing, and reference.parallel differs from actor.parallel: this run began "
            "before hybridflow kept a random model's initial weights; set reference.parallel=${actor.parallel} "
            "to resume it, or start in a new run.output_dir"
        )


def _load_sft(trainer: TrainerBackend, policy, sft: Path) -> None:
    """The warm-up's weights: from its Hugging Face export through ``model.path``'s loader, or
    from its trainer checkpoint where the export is absent (a checkpoint saved before exports)."""
    from hfschema.model_source import model_source

    if (sft / run_state.HF_EXPORT).is_dir():
        trainer.load_pretrained(policy, model_source(sft / run_state.HF_EXPORT))
    else:
        trainer.load(policy, sft / "actor")


def _load_starting_weights(s: Session, trainer: TrainerBackend, policy) -> None:
    """``model.path``'s weights into a fresh policy; a random model keeps its seeded init."""
    if not s.cfg.model.pretrained:
        return
    from hfschema.model_source import model_source

    trainer.load_pretrained(policy, model_source(s.cfg.model.path))


def _copy_weights(trainer: TrainerBackend, source, target) -> list[str]:
    """Copy every parameter ``target`` shares with ``source`` (same name and shape; both held by
    ``trainer``); returns the names of ``target``'s parameters left as they were."""
    return trainer.copy_weights(source, target)


def _start_rollout(s: Session) -> None:
    trainer = trainer_of(s.cfg)
    run, engines = s.run, s.engines
    engines.restarts = EngineRestarts(
        engines, respawn=None if run.channel.separate else lambda replicas: _respawn(s, replicas)
    )
    if run.channel.separate:  # the engine ranks start the engines, from the directory rank 0 wrote
        run.channel.announce(str(engines.model_dir))
    else:
        engines.replica = replica_of(s.cfg, run.rank)
        _start_parts(s, None)
    adapters = s.cfg.lora.pushes_adapters
    engines.sync = EngineSync(
        s.cfg,
        channel=run.channel,
        device=run.device,
        engines=engines,
        source_params=lambda: trainer.named_parameters(s.models.actor, merge_adapters=not adapters),
        adapters=(lambda: trainer.adapter_push(s.models.actor)) if adapters else None,
    )
    engines.sync.restarts = engines.restarts
    startup_clock.mark("engines")  # with the sync's plan, and separate: the engine ranks' start
    engines.sync.push()
    startup_clock.mark("first_push")


def _start_parts(s: Session, replicas: set[int] | None) -> None:
    """This rank's part of the engines of ``replicas`` (None: all), if it starts one: the
    driver's, or another node's of an engine spanning nodes (collective: every engine's node
    parts start together, their schedulers meet at start-up at the driver's address)."""
    role, addresses = node_role(s.cfg, s.run.rank), _engine_addresses(s)
    if role is not None and (replicas is None or role[0] in replicas):
        replica, node = role
        engine = start_engine(s.cfg, s.engines.model_dir, node_rank=node, dist_init_addr=addresses[replica])
        s.engines.engine, s.engines.node_part = (engine, None) if node == 0 else (None, engine)


def _respawn(s: Session, replicas: set[int]) -> None:
    """Replace every node's part of the engines of ``replicas`` (engines spanning nodes; every
    rank calls it, ``recovery.EngineRestarts``): the old parts are shut down, then new ones
    start and meet at the drivers' new addresses."""
    role = node_role(s.cfg, s.run.rank)
    if role is not None and role[0] in replicas:
        (s.engines.engine if role[1] == 0 else s.engines.node_part).shutdown()  # kills and reaps whatever of it is left
    _start_parts(s, replicas)


def _engine_addresses(s: Session) -> list[str | None]:
    """Each replica's ``host:port`` where the nodes of an engine spanning nodes meet (its driver's
    host; ``HYBRIDFLOW_ENGINE_HOST`` overrides the name), gathered on every rank; None per
    replica when engines fit a node."""
    mine = None
    if engine_nodes(s.cfg) > 1 and s.engines.replica is not None:
        host = os.environ.get("HYBRIDFLOW_ENGINE_HOST") or socket.gethostbyname(socket.gethostname())
        with socket.socket() as sock:
            sock.bind(("", 0))
            mine = (s.engines.replica, f"{host}:{sock.getsockname()[1]}")
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    found = dict(item for item in gathered if item is not None)
    return [found.get(replica) for replica in range(s.cfg.rollout.num_replicas)]


def _stop_engines(s: Session, *, in_order: bool) -> None:
    """Drivers shut their engines down first (that stops every node's schedulers), then each
    node reaps its own; after a failure, each rank cleans up what it has at once."""
    if s.models.judge is not None and s.models.judge.engine is not None:  # rank 0's own, whatever the placement
        s.models.judge.engine.shutdown()
    if in_order:  # frozen models on GPUs of their own leave (after a failure torchrun stops them)
        for channel in s.run.frozen_channels.values():
            channel.announce(("stop", None, {}))
            channel.barrier()
    if s.run.channel is not None and s.run.channel.separate:
        if in_order:  # the engine ranks stop theirs (serve); after a failure torchrun stops them
            # before the rollout started (run.mode=sft, a stop during SFT) they wait for its directory
            s.run.channel.announce(("stop",) if s.engines.sync is not None else None)
            s.run.channel.barrier()
        return
    if s.engines.engine is not None:
        s.engines.engine.shutdown()
    if in_order:
        dist.barrier()
    if s.engines.node_part is not None:
        s.engines.node_part.shutdown()


def _shard(trainer: TrainerBackend) -> Shard:
    """This rank's data-parallel share; batch-wide sums on a gloo group of every rank."""
    dp_rank, dp_size, leader = trainer.data_coords()
    group = dist.new_group(backend="gloo") if dist.get_world_size() > 1 else None
    return Shard(dp_rank=dp_rank, dp_size=dp_size, leader=leader, group=group)


def _session(cfg: HybridflowConfig, out_dir: Path, resume_from: Path | None, pg, channel: Channel) -> Session:
    from transformers import AutoTokenizer

    trainer = trainer_of(cfg)
    train, heldout, model_dir = prepare_files(cfg, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if cfg.run.mode == "rm" and cfg.data.train_files:  # preference pairs, read by runtime.rm_train
        prompts, held, skipped = [], [], {}
    else:
        prompts, held, skipped = load_prompts(cfg, tokenizer, train, heldout)
    state = run_state.read_state(resume_from) if resume_from else run_state.RunState()
    rank = dist.get_rank()
    run = RunContext(
        cfg=cfg,
        out_dir=out_dir,
        rank=rank,
        state=state,
        tracker=Tracker(
            cfg,
            active=rank == DRIVER,
            run_id=state.mlflow_run_id,
            wandb_run_id=state.wandb_run_id,
            history=state.history,
            logged_until=_logged(out_dir, state),
        ),
        shard=_shard(trainer),
        device=trainer.device(),
        channel=channel,
        started=time.time(),
        wall_before=state.wall_seconds,
        starts_before=state.start_seconds or ([state.wall_seconds] if state.wall_seconds else []),
        samples=SampleWriter(out_dir, budget_mb=cfg.run.samples_budget_mb) if rank == DRIVER else None,
    )
    data = RunData(
        tokenizer=tokenizer,
        train_prompts=prompts,
        heldout_prompts=held,
        sampler=PromptSampler(len(prompts), cfg.run.prompts_per_step, cfg.run.seed, cfg.data.shuffle),
        stop_ids=stop_token_ids(tokenizer, model_dir),
        rows_skipped=skipped,
    )
    return Session(run=run, data=data, models=_models(cfg, pg, state), engines=EngineClient(cfg, model_dir))


def _models(cfg: HybridflowConfig, pg, state: run_state.RunState) -> Models:
    """The algorithm's settings (with what it filled in) and its KL controller; the models
    themselves are built after the warm-up (``_load_actor``)."""
    spec = algorithm_spec(cfg)
    filled = {key.removeprefix("algorithm."): value for key, value in spec.filled}
    algo = dataclasses.replace(cfg.algorithm, **filled)
    kl = kl_controller(algo.kl_reward_coef, algo.kl_reward_target, algo.kl_reward_horizon, state.history)
    return Models(spec=spec, algo=algo, kl_reward=kl, pg=pg)


def _logged(out_dir: Path, state: run_state.RunState) -> int:
    """The last RL step an earlier start finished, and so logged into the MLflow run this start
    reopens (``progress.json``); 0 for a start without one (it logs into a new run)."""
    progress = read_progress(out_dir) if state.mlflow_run_id else None
    return int(progress["done"]) if progress and progress.get("phase") == "rl" else 0


def _finish(s: Session, heldout_after_rl: float | None) -> dict:
    wall = s.run.wall_before + time.time() - s.run.started
    first = s.run.state.history[0] if s.run.state.history else {}
    extra = {
        "first_step_logprob_diff_max": first.get("rollout/logprob_diff_max"),
        "first_step_ppo_kl": first.get("actor/ppo_kl_first_mini"),
        "first_step_clipfrac": first.get("actor/clipfrac_first_mini"),
        "mlflow_run_id": s.run.tracker.run_id,
        "mlflow_uri": s.run.tracker.uri,
        "executed_stages": s.run.executed_stages,
        "tensorboard_dir": s.run.tracker.tensorboard_dir,
        "engine_restarts": s.engines.restarts.used if s.engines.restarts is not None else 0,
        "wall_seconds_per_start": s.run.start_seconds(),
        "heldout_examples": sample_files.heldout_examples(s.run.out_dir, s.run.state.step),
    }
    if s.models.teacher is not None:
        extra["heldout_teacher_kl"] = [list(x) for x in s.run.state.heldout_teacher_kl]
    if s.pipeline is not None:
        extra["async_rl"] = report.summarise_async(s.cfg.async_rl, s.run.state.history)
    if s.cfg.agentic.enabled:
        extra["agentic"] = report.summarise_agentic(s.run.state.history)
    if s.cfg.model.is_moe and s.cfg.moe.router_stats:
        extra["moe"] = {
            "routing_replay": s.cfg.moe.routing_replay,
            "freeze_router": s.cfg.moe.freeze_router,
            "metrics": summarise_router_stats(s.run.state.history),
            "tokens_per_expert_last_step": _tokens_per_expert(s.models.actor),
        }
    summary = report.summarise(
        s.cfg,
        s.run.state,
        heldout_after_rl=heldout_after_rl,
        wall_seconds=wall,
        data_rows_skipped=s.data.rows_skipped,
        reward_errors=s.run.state.reward_errors,
        extra=extra,
    )
    if s.run.is_driver:
        path = report.write_summary(s.run.out_dir, summary)
        plot = report.plot_rewards(s.run.out_dir, s.run.state)
        figure = report.plot_run(s.run.out_dir, s.run.state)
        s.run.tracker.log_metrics({"heldout/reward_after_rl": heldout_after_rl or 0.0}, step=s.run.state.step)
        for artifact in (path, plot, figure):
            if artifact is not None:
                s.run.tracker.log_artifact(artifact)
        sys.stdout.write(report.format_summary(summary, s.run.out_dir) + "\n")
    return summary


def _tokens_per_expert(actor) -> list | None:
    """The last training pass's tokens per expert and MoE layer (router statistics), if any."""
    stats = actor.routing.last_stats.get("train") if actor is not None and actor.routing is not None else None
    return None if stats is None else stats.counts().tolist()


class DeviceMemoryError(RuntimeError):
    """The GPU ran out of memory; the message names the settings that lower the peak."""


@contextlib.contextmanager
def out_of_memory_hint(cfg: HybridflowConfig, phase: str) -> Iterator[None]:
    """Turn a CUDA out-of-memory error in ``phase`` into one line naming what to change."""
    try:
        yield
    except torch.OutOfMemoryError:
        free, total = torch.cuda.mem_get_info() if torch.cuda.is_available() else (0, 0)
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise DeviceMemoryError(
            f"rank {rank} ran out of GPU memory in {phase} ({(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB "
            f"in use): lower train.micro_batch_size (now {cfg.train.micro_batch_size}) or "
            f"data.max_response_length (now {cfg.data.max_response_length}), or raise actor.parallel.tp / pp / ep "
            f"(now {cfg.actor.parallel.describe()})"
        ) from None


def _resume_point(cfg: HybridflowConfig, out_dir: Path) -> tuple[Path | None, list[str]]:
    """Rank 0: the checkpoint this start continues from (damaged newer ones set aside) and the
    settings changed since it was saved; refused key by key when this config's model cannot load
    it (what preflight checked already)."""
    path = run_state.resume_point(out_dir, cfg.run.resume, fallback=cfg.run.resume_fallback, set_aside_damaged=True)
    changes = [] if path is None else run_state.check_config_loads(path, out_dir, yaml.safe_load(to_yaml(cfg)))
    if changes:
        logger.info("changed since %s was saved: %s", path.name, "; ".join(changes))
    return path, changes


def run(cfg: HybridflowConfig, channel: Channel | None = None, *, frozen: dict[str, Channel] | None = None) -> dict:
    """The whole job on this rank (every rank of the actor's layout calls it); ``channel``: the
    joint group with the engine ranks (separate placement), None when colocated; ``frozen``: the
    joint group with each frozen model on GPUs of its own."""
    with out_of_memory_hint(cfg, "start-up"):
        return _run(cfg, channel, frozen or {})


def _run(cfg: HybridflowConfig, channel: Channel | None, frozen: dict[str, Channel]) -> dict:
    plan = lower(cfg, with_reshard=False)  # the stages `hybridflow plan` prints are the ones that run
    check_replay_device(cfg.moe.routing_replay, on_gpu=torch.cuda.is_available())
    out_dir = Path(cfg.run.output_dir)
    resume_from, changes = broadcast(_resume_point(cfg, out_dir) if dist.get_rank() == DRIVER else None)
    if dist.get_rank() == DRIVER and resume_from is None:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(out_dir / "config.yaml", to_yaml(cfg))
    pg = trainer_of(cfg).initialize(cfg.actor.parallel, seed=cfg.run.seed, prefix="actor.parallel")
    s = _session(cfg, out_dir, resume_from, pg, channel or colocated())
    s.run.frozen_channels = frozen
    startup_clock.mark("session")
    if changes:  # the summary says what this start changed, and from which step
        s.run.state.changes.append({"step": s.run.state.step, "changed": changes})
    s.run.tracker.log_params(
        {
            "algorithm": cfg.algorithm.name,
            "actor_layout": cfg.actor.parallel.describe(),
            "rollout": cfg.rollout.describe(),
            **{f"algorithm.{k}": v for k, v in asdict(cfg.algorithm).items()},
        },
        step=s.run.state.step,
    )
    try:
        with out_of_memory_hint(cfg, "the SFT warm-up"):
            if not _warm_up(s, resume_from):  # checkpointed on request: a later start goes on from there
                return _stopped_on_request(s)
        startup_clock.mark("warm_up")
        if cfg.run.mode == "sft":
            summary = _finish(s, None)
            _stop_engines(s, in_order=True)
            return summary
        if cfg.run.mode == "rm":
            from hybridflow.runtime.rm_train import train_reward_model

            sft_export = run_state.sft_checkpoint(out_dir) / run_state.HF_EXPORT
            summary = train_reward_model(
                s,
                sft_export if s.run.state.sft_done and sft_export.is_dir() else None,
                resume_from,
                save=lambda name, model: _save(s, name, with_optimizer=True, policy=model),
            )
            if not summary:  # checkpointed on request: a later start goes on from there
                return _stopped_on_request(s)
            s.run.tracker.close()
            _stop_engines(s, in_order=True)
            return summary
        with out_of_memory_hint(cfg, "building the actor and the engine"):
            with _said(s, f"building the actor ({trainer_text(cfg, cfg.actor.parallel)}) and loading its weights"):
                _load_actor(s, resume_from)
            startup_clock.mark("models")
            with _said(s, f"starting the rollout engine ({cfg.rollout.describe()}) and pushing the weights"):
                _start_rollout(s)
        _freeze_startup_objects()
        if cfg.async_rl.mode != "sync":
            s.pipeline = Pipeline(s.run, s.data, resume_from)
        state = s.run.state
        if state.heldout_after_sft is None:  # the held-out score before RL (after SFT, where it ran)
            state.heldout_after_sft = heldout(s, state.step, announce=True)
            state.heldout.append((state.step, state.heldout_after_sft))
            if state.heldout_after_sft is not None:
                s.run.tracker.log_metrics({"heldout/reward": state.heldout_after_sft}, step=state.step)
        with out_of_memory_hint(cfg, "the RL steps"):
            finished = train_rl(s, plan, save=lambda step: _save_step(s, step))
        if not finished:  # checkpointed on request (stops.REQUEST_FILE): a later start resumes there
            return _stopped_on_request(s)
        after_rl = heldout(s, state.step)
        if after_rl is not None:
            state.heldout.append((state.step, after_rl))
        summary = _finish(s, after_rl)
        s.run.tracker.close()
        _stop_engines(s, in_order=True)
        return summary
    except BaseException as error:
        s.run.tracker.close(status="KILLED" if isinstance(error, stops.Stopped) else "FAILED")
        _stop_engines(s, in_order=False)
        raise


@contextlib.contextmanager
def _said(s: Session, what: str) -> Iterator[None]:
    """A phase that can take minutes at scale (weights read from disk, engines started), said on
    the driver when it begins and when it ends: no silent minute."""
    started = time.perf_counter()
    if s.run.is_driver:
        logger.info("%s ...", what)
    yield
    if s.run.is_driver:
        logger.info("%s: done in %.0f s", what.split(" (")[0], time.perf_counter() - started)


def _freeze_startup_objects() -> None:
    """Put every object made so far (the modules of torch, megatron-core and SGLang, the models,
    the engine's handles) out of the garbage collector's reach; they live as long as the run.

    Why: megatron-core's distributed optimizer runs a full ``gc.collect()`` in every checkpoint's
    sharded state dict (two per save), and each scanned all of them: 0.77 s per call in a quickstart
    rank here, 1.5 s of every 1.8 s save. Garbage is collected once first, so none is kept."""
    gc.collect()
    gc.freeze()


def _stopped_on_request(s: Session) -> dict:
    s.run.tracker.close(status="KILLED")
    _stop_engines(s, in_order=True)
    return {}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    stops.install()
    cfg = load_config(argv[0], argv[1:])
    trainer = trainer_of(cfg)  # the trainer's modules (megatron-core) are imports too: frozen below
    startup_clock.mark("imports")
    if not gc.isenabled():  # off from the module's first line, as a rank's main (hfschema/gc_pause.py)
        gc.freeze()  # the imports' objects live as long as the process: no later collection scans them
        gc.enable()
    determinism.apply(cfg.run.deterministic)  # before anything is built or started
    minutes = cfg.run.collective_timeout_minutes
    joined = None
    worlds = job_worlds(cfg)
    if len(worlds) > 1:  # several worlds in one torchrun job, joined (runtime/channel.py)
        if torch.cuda.is_available():  # before the joint NCCL group first talks
            torch.cuda.set_device(trainer.device())
        joined = join(worlds, timeout_minutes=minutes)
        trainer.init_default_group(
            minutes, store=dist.PrefixStore(f"{joined.world}/", joined.store), rank=joined.rank, world_size=joined.size
        )
    else:
        trainer.init_default_group(timeout_minutes=minutes)
    startup_clock.mark("rendezvous")
    console.configure(
        cfg.run.output_dir,
        rank=int(os.environ.get("RANK", "0")),
        driver=int(os.environ.get("RANK", "0")) == DRIVER,
        verbose=cfg.run.verbose,
    )
    try:
        if joined is not None and joined.world == "engine":
            serve(cfg, joined.engines)
        elif joined is not None and joined.world != "actor":
            frozen_ranks.serve(cfg, joined.world, joined.frozen[joined.world])
        else:
            run(cfg, joined.engines if joined else None, frozen=joined.frozen if joined else {})
    except stops.Stopped as stop:  # engines are shut down (run); now leave at once
        _leave(stop)
    except BaseException as error:  # before the clean-up below: a peer's later error cannot look first
        named = _one_line_error(error, cfg)
        if named is not None:  # one line, not a traceback: the message says what to change
            record_failure(named, detail=False)
            logging.getLogger("hybridflow.train").error("%s", named)
            sys.stderr.write(f"hybridflow train: error: {named}\n")
            return 1
        try:
            _wait_for_a_stop(error)
        except stops.Stopped as stop:
            _leave(stop)
        record_failure(error, context=getattr(error, "failed_stage", ""))
        # the whole traceback in the rank's log too (logs/rank<R>.log), beside its record
        logging.getLogger("hybridflow.train").error("rank failed", exc_info=error, extra={"file_only": True})
        raise
    finally:
        trainer.teardown()
        dist.destroy_process_group()
    return 0


def _one_line_error(error: BaseException, cfg: HybridflowConfig) -> BaseException | None:
    """The error to report in one line when its message says what to change, else None (a reward
    function that failed under reward.on_error=fail names the sample and the setting; a traceback
    and the engines' teardown noise would bury that line)."""
    if isinstance(error, (DeviceMemoryError, disk_full.DiskFull, RewardError)):
        return error
    if disk_full.is_disk_full(error):  # outside a checkpoint: the tracking store, a report
        return disk_full.DiskFull(
            disk_full.message(Path(cfg.run.output_dir), "writing the run's files", "the complete checkpoints are kept")
        )
    return None


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
PEER_STOP_WAIT_S = 2.0
"""How long a rank whose collective broke because a peer left waits for a stop signal of its own."""


def _wait_for_a_stop(error: BaseException) -> None:
    """A collective broken by a peer that left: torchrun forwards a stop signal to the ranks one
    after another, so a peer that took it first may be gone before this rank's arrives. Wait for
    it briefly (it raises ``Stopped`` here): a stop then ends as a stop, not as a gloo traceback.
    Only for a lost peer, so a rank's own failure is recorded at once and stays the first."""
    if isinstance(error, Exception) and any(gone in str(error) for gone in _PEER_GONE):
        time.sleep(PEER_STOP_WAIT_S)


def _leave(stop: stops.Stopped) -> None:
    """Exit on a stop signal, after one line from rank 0 (every rank got the signal)."""
    if os.environ.get("RANK", "0") == "0":
        logging.getLogger("hybridflow.train").warning("%s", stop)
    sys.stdout.flush()
    sys.stderr.flush()
    # no process-group teardown: a step cut short leaves collectives unmatched, and
    # destroying their groups then waits for peers that are gone (seen: until torchrun's SIGKILL)
    os._exit(128 + stop.signum)


def _exit_at_once(code: int) -> None:
    """Exit with ``code`` without the interpreter's own teardown, after a run that returned.

    Why: by then everything that must outlive the process is closed (the tracker, the engines, the
    process groups; checkpoints are written synchronously), and what is left is freeing the objects
    of torch, megatron-core and SGLang one by one: 1.5-3.7 s per rank here, the engine's driver the
    longest, at the end of every run. A failing run still goes through the interpreter's exit (its
    traceback)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_at_once(main())
