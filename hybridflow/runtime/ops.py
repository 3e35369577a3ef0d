"""What each graph op does on a rank: ``OPS[node.op](session, node, fields, step) -> new fields``.

The graph (``hybridflow.algorithms.recipes.build_graph``) says which ops run and in which order;
each handler reads its node's input fields and returns its output fields. Each replica's
driver generates its share and scores its share of the samples (``replicas``); both are
gathered to every rank, and everything else runs on every rank.

Field layouts (B samples, T prompt + response columns, R response columns):
``responses`` a ``Rollout`` (packed ``[B, T]`` tensors, texts, group index ``[B]``); ``scores``
``[B]``; ``old_logprobs``/``ref_logprobs``/``entropy``/``advantages``/``returns`` ``[B, T]``;
``token_rewards`` ``[B, R]``; ``kept`` a filtered ``Rollout`` with its scores.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.algorithms.estimators import get_estimator, scores_to_token_rewards
from hybridflow.algorithms.losses import agg_parts, get_policy_loss, kl_penalty, masked_mean, value_loss_terms
from hybridflow.algorithms.shaping import filter_groups, kl_in_reward, overlong_penalty, pf_ppo_resample
from hybridflow.rewards import score_responses
from hybridflow.rollout.base import SamplingParams
from hybridflow.rollout.tokens import pack_batch
from hybridflow.runtime import replicas, switches
from hybridflow.runtime.batch import from_response, pad_rows, to_response
from hybridflow.runtime.session import Session

__all__ = ["OPS", "NonFiniteStep", "Rollout", "heldout_reward", "step_seed"]

logger = logging.getLogger(__name__)

Op = Callable[[Session, Any, dict[str, Any], int], dict[str, Any]]
OPS: dict[str, Op] = {}


class NonFiniteStep(RuntimeError):
    """The actor's loss or gradients were not finite; the update was not applied."""


def op(name: str) -> Callable[[Op], Op]:
    def add(fn: Op) -> Op:
        OPS[name] = fn
        return fn

    return add


def step_seed(seed: int, step: int, draw: int = 0) -> int:
    """The engine's sampling seed for one generate call of one step."""
    return (seed * 1_000_003 + step * 101 + draw) % (2**31 - 1)


@dataclass(frozen=True)
class Rollout:
    """Sampled responses of a batch of prompts, packed for the trainer."""

    batch: dict[str, torch.Tensor]
    """``pack_batch``'s tensors (right padding)."""
    texts: list[str]
    """Decoded responses."""
    index: torch.Tensor
    """[B] group id of each sample (one per prompt)."""
    answers: list[Any]
    """Reference answer of each sample's prompt."""
    sources: list[Any]
    """``data_source`` of each sample's prompt."""
    seconds: float
    """Generation wall time."""

    @property
    def num_response(self) -> int:
        return int(self.batch["response_lengths"].max().item()) if len(self.texts) else 0

    def rows(self, keep: torch.Tensor) -> "Rollout":
        """The samples where ``keep`` is True."""
        idx = keep.nonzero().flatten()
        batch = {k: v[idx] for k, v in self.batch.items()}
        pick = idx.tolist()
        return replace(self, batch=batch, texts=[self.texts[i] for i in pick], index=self.index[idx],
                       answers=[self.answers[i] for i in pick], sources=[self.sources[i] for i in pick])


# --------------------------------------------------------------------------- rollout and reward


def _sampling(s: Session, *, greedy: bool = False) -> SamplingParams:
    r = s.cfg.rollout
    return SamplingParams(n=1 if greedy else r.n, temperature=0.0 if greedy else r.temperature,
                          top_p=r.top_p, top_k=r.top_k, max_new_tokens=s.cfg.data.max_response_length,
                          stop_token_ids=s.stop_ids)


def rollout(s: Session, prompts, params: SamplingParams, seed: int, group_offset: int = 0) -> Rollout:
    """Generate on rank 0 and share the samples with every rank.

    The GPUs must already hold what generation needs: the plan's switch before a generate
    stage (or ``switches.enter(s, "generate")`` outside the graph) put it there."""
    if s.cfg.rollout.placement == "colocated" and s.mode != "generate":
        raise AssertionError(f"rollout in mode {s.mode!r}: the plan's switches did not bring the engine in")
    s.rollout_calls += 1
    out = replicas.generate(s.cfg, s.engine, [p.prompt_ids for p in prompts], params, seed, call=s.rollout_calls)
    samples, seconds = out.samples, out.seconds
    for replica, count in enumerate(out.samples_per_replica):
        s.step_metrics[f"rollout/replica{replica}/samples"] = float(count)
    batch = pack_batch(samples, pad_id=s.tokenizer.pad_token_id)
    texts = s.tokenizer.batch_decode([list(x.response_ids) for x in samples], skip_special_tokens=True)
    rows = [prompts[x.prompt_index].row for x in samples]
    index = torch.tensor([group_offset + x.prompt_index for x in samples], dtype=torch.long)
    return Rollout(batch=batch, texts=texts, index=index, answers=[r.answer for r in rows],
                   sources=[r.data_source for r in rows], seconds=seconds)


def score(s: Session, ro: Rollout) -> torch.Tensor:
    """Rewards of every sample, computed in parallel by the replica drivers (driver k scores
    samples k, k + R, ...; errors logged there) and shared with every rank."""
    mine: dict[int, float] = {}
    errors = 0
    if s.replica is not None:
        picked = range(s.replica, len(ro.texts), s.cfg.rollout.num_replicas)
        scores, failures = score_responses([ro.texts[i] for i in picked], [ro.answers[i] for i in picked],
                                           [ro.sources[i] for i in picked], s.cfg.reward)
        mine, errors = dict(zip(picked, scores)), len(failures)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, errors))
    merged = {i: v for part, _ in gathered for i, v in part.items()}
    s.reward_errors += sum(e for _, e in gathered)
    return torch.tensor([merged[i] for i in range(len(ro.texts))], dtype=torch.float32)


@op("generate")
def generate(s: Session, node, f: dict, step: int) -> dict:
    ro = rollout(s, f["prompts"], _sampling(s), step_seed(s.cfg.run.seed, step))
    return {"responses": ro, "rollout_logprobs": ro.batch["logprobs"]}


@op("generate_greedy")
def generate_greedy(s: Session, node, f: dict, step: int) -> dict:
    # one greedy response per prompt, repeated so it lines up with the n samples of the prompt
    ro = rollout(s, f["prompts"], _sampling(s, greedy=True), 0)
    n = s.cfg.rollout.n
    repeat = torch.arange(len(ro.texts)).repeat_interleave(n)
    return {"baseline_responses": _repeat(ro, repeat)}


def _repeat(ro: Rollout, idx: torch.Tensor) -> Rollout:
    pick = idx.tolist()
    return replace(ro, batch={k: v[idx] for k, v in ro.batch.items()}, texts=[ro.texts[i] for i in pick],
                   index=ro.index[idx], answers=[ro.answers[i] for i in pick], sources=[ro.sources[i] for i in pick])


@op("reward")
def reward(s: Session, node, f: dict, step: int) -> dict:
    options = dict(node.options)
    source, target = options.get("responses_field", "responses"), options.get("scores_field", "scores")
    return {target: score(s, f[source])}


@op("filter_groups")
def filter_groups_op(s: Session, node, f: dict, step: int) -> dict:
    """DAPO dynamic sampling: keep groups whose rewards differ; draw more prompts until the step
    has ``run.prompts_per_step`` groups or ``algorithm.max_sampling_rounds`` rounds ran."""
    want = s.cfg.run.prompts_per_step
    ro, scores = f["responses"], f["scores"]
    keep = filter_groups(scores, ro.index)
    kept, kept_scores = [ro.rows(keep)], [scores[keep]]
    groups = int(keep.sum()) // s.cfg.rollout.n
    rounds = 1
    while groups < want and rounds < s.spec.max_sampling_rounds:
        prompts = s.prompt_batch(step, offset=rounds)
        extra = rollout(s, prompts, _sampling(s), step_seed(s.cfg.run.seed, step, rounds), group_offset=rounds * want)
        extra_scores = score(s, extra)
        keep = filter_groups(extra_scores, extra.index)
        kept.append(extra.rows(keep))
        kept_scores.append(extra_scores[keep])
        groups += int(keep.sum()) // s.cfg.rollout.n
        rounds += 1
    s.step_metrics.update({"dapo/kept_groups": float(groups), "dapo/sampling_rounds": float(rounds)})
    if groups == 0:
        logger.warning("step %d: every group had equal rewards; the actor update is skipped", step)
    return {"kept": (_concat(kept), torch.cat(kept_scores))}


def _concat(parts: list[Rollout]) -> Rollout:
    length = max(p.batch["input_ids"].shape[1] for p in parts)
    batch: dict[str, list] = {}
    for p in parts:
        for k, v in p.batch.items():
            if v.dim() >= 2 and v.shape[1] < length:
                v = torch.cat([v, v.new_zeros(v.shape[0], length - v.shape[1], *v.shape[2:])], dim=1)
            batch.setdefault(k, []).append(v)
    return Rollout(batch={k: torch.cat(v) for k, v in batch.items()}, texts=sum((p.texts for p in parts), []),
                   index=torch.cat([p.index for p in parts]), answers=sum((p.answers for p in parts), []),
                   sources=sum((p.sources for p in parts), []), seconds=sum(p.seconds for p in parts))


def current(f: dict) -> tuple[Rollout, torch.Tensor]:
    """The samples the trainer uses: DAPO's kept ones when the graph filters, else all."""
    if "kept" in f:
        return f["kept"]
    return f["responses"], f["scores"]


# --------------------------------------------------------------------------- trainer-side scoring


def _row_multiple(s: Session) -> int:
    return s.cfg.actor.parallel.dp * s.cfg.train.micro_batch_size


def _logprobs(s: Session, policy, ro: Rollout, *, with_entropy: bool, routes: torch.Tensor | None = None,
              record: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the rollout; ``routes``: replay these experts, ``record``: keep the ones the
    routers chose (``policy.routing.take_recorded()``). ``attention_mask`` marks the real tokens,
    which the router statistics count."""
    inputs = {"input_ids": ro.batch["input_ids"], "attention_mask": ro.batch["attention_mask"]}
    if routes is not None:
        inputs["routed_experts"] = routes
    inputs, rows = pad_rows(inputs, _row_multiple(s))
    logp, ent = policy.forward_logprobs(inputs, with_entropy=with_entropy, record_routes=record)
    return logp[:rows], ent[:rows]


def _engine_routes(ro: Rollout) -> torch.Tensor:
    if "routed_experts" not in ro.batch:
        raise ValueError("moe.routing_replay=r3 but the rollout engine returned no routed experts; SGLang "
                         "returns them for MoE models on a GPU (use moe.routing_replay=r2 otherwise)")
    return ro.batch["routed_experts"]


@op("old_logprob")
def old_logprob(s: Session, node, f: dict, step: int) -> dict:
    ro, _ = current(f)
    # routing replay: r3 scores with the engine's experts, as training will; r2 records the
    # actor's own experts, which training replays
    mode = s.cfg.moe.routing_replay
    routes = _engine_routes(ro) if mode == "r3" else None
    logp, ent = _logprobs(s, s.actor, ro, with_entropy=True, routes=routes, record=mode == "r2")
    if mode == "r2":
        routes = s.actor.routing.take_recorded()[: len(logp)]
    mask = ro.batch["response_mask"].bool()
    if mask.any():  # the engine's log-probs against the trainer's, same weights: a sync check
        diff = (logp - ro.batch["logprobs"]).abs()[mask]
        s.step_metrics.update({"rollout/logprob_diff_max": float(diff.max()),
                                    "rollout/logprob_diff_mean": float(diff.mean())})
    return {"old_logprobs": logp, "entropy": ent, **({} if routes is None else {"routed_experts": routes})}


@op("ref_logprob")
def ref_logprob(s: Session, node, f: dict, step: int) -> dict:
    ro, _ = current(f)
    logp, _ = _logprobs(s, s.reference, ro, with_entropy=False)
    return {"ref_logprobs": logp}


@op("values")
def values(s: Session, node, f: dict, step: int) -> dict:
    ro, _ = current(f)
    inputs, rows = pad_rows({"input_ids": ro.batch["input_ids"]}, _row_multiple(s))
    return {"values": s.critic.forward_values(inputs)[:rows]}


# --------------------------------------------------------------------------- rewards -> advantages


def _response_view(ro: Rollout, x_BT: torch.Tensor) -> torch.Tensor:
    return to_response(x_BT, ro.batch["prompt_lengths"], ro.num_response)


@op("token_rewards")
def token_rewards(s: Session, node, f: dict, step: int) -> dict:
    ro, scores = current(f)
    algo = s.algo
    mask_BR = _response_view(ro, ro.batch["response_mask"])
    if s.spec.overlong_shaping:
        scores = scores + overlong_penalty(ro.batch["response_lengths"],
                                           max_response_length=s.cfg.data.max_response_length,
                                           buffer_len=s.spec.overlong_buffer_len,
                                           penalty_factor=algo.overlong_penalty_factor)
    rewards_BR = scores_to_token_rewards(scores, mask_BR)
    if algo.kl_reward_coef > 0:
        rewards_BR, kl = kl_in_reward(rewards_BR, _response_view(ro, f["old_logprobs"]),
                                      _response_view(ro, f["ref_logprobs"]), mask_BR, algo.kl_reward_coef,
                                      algo.kl_type)
        s.step_metrics["actor/reward_kl"] = float(kl)
    return {"token_rewards": rewards_BR}


@op("advantages")
def advantages(s: Session, node, f: dict, step: int) -> dict:
    ro, _ = current(f)
    mask_BR = _response_view(ro, ro.batch["response_mask"])
    estimator = get_estimator(dict(node.options).get("estimator", s.spec.estimator))
    baseline = f.get("baseline_scores")
    values_BR = _response_view(ro, f["values"]) if "values" in f else None
    adv_BR, ret_BR = estimator(f["token_rewards"], mask_BR, index=ro.index, cfg=s.algo,
                               values=values_BR, baseline=baseline)
    length = ro.batch["input_ids"].shape[1]
    lengths = ro.batch["prompt_lengths"]
    return {"advantages": from_response(adv_BR, lengths, length), "returns": from_response(ret_BR, lengths, length)}


# --------------------------------------------------------------------------- updates


def actor_loss(s: Session, num_response: int) -> Callable:
    """``loss_fn(logp, entropy, micro)`` of the actor update: policy loss (+ entropy, KL, LM terms),
    aggregated as parts so micro-batches and data-parallel ranks add up to the global batch."""
    algo, spec = s.algo, s.spec
    policy_loss = get_policy_loss(spec.policy_loss)

    def loss_fn(logp, entropy, micro):
        mask = micro["response_mask"]
        mat, metrics = policy_loss(micro["old_logprobs"], logp, micro["advantages"], mask, algo)
        if algo.entropy_coef > 0:
            mat = mat - algo.entropy_coef * entropy * mask
        if algo.kl_loss_coef > 0:
            kl = kl_penalty(logp, micro["ref_logprobs"], algo.kl_type) * mask
            mat = mat + algo.kl_loss_coef * kl
            metrics["kl_loss"] = masked_mean(kl.detach(), mask)
        if spec.lm_loss:
            mat = mat - spec.lm_loss_coef * logp * mask * micro["positive"][:, None]
        num, den = agg_parts(mat, mask, spec.loss_agg_mode, max_response_length=num_response)
        metrics["entropy"] = masked_mean(entropy.detach(), mask)
        return num, den, {k: torch.as_tensor(v, dtype=torch.float32) for k, v in metrics.items()}

    return loss_fn


def _train_rows(s: Session, f: dict, ro: Rollout, scores: torch.Tensor, step: int) -> dict[str, torch.Tensor]:
    rows = {"input_ids": ro.batch["input_ids"], "response_mask": ro.batch["response_mask"].float(),
            "attention_mask": ro.batch["attention_mask"], "old_logprobs": f["old_logprobs"],
            "advantages": f["advantages"], "positive": (scores > 0).float()}
    for key in ("ref_logprobs", "routed_experts"):  # routing replay: the experts to train with
        if key in f:
            rows[key] = f[key]
    if s.spec.pf_ppo:
        generator = torch.Generator().manual_seed(step_seed(s.cfg.run.seed, step, 7))
        idx = pf_ppo_resample(scores, s.spec.pf_ppo, generator, pow=s.algo.pf_ppo_weight_pow)
        rows = {k: v[idx] for k, v in rows.items()}
    return rows


def _mini_batches(rows: dict[str, torch.Tensor], count: int, multiple: int) -> list[dict[str, torch.Tensor]]:
    total = rows["input_ids"].shape[0]
    bounds = [round(i * total / count) for i in range(count + 1)]
    parts = [{k: v[a:b] for k, v in rows.items()} for a, b in zip(bounds, bounds[1:]) if b > a]
    return [pad_rows(p, multiple)[0] for p in parts]


@op("update_actor")
def update_actor(s: Session, node, f: dict, step: int) -> dict:
    ro, scores = current(f)
    if not len(ro.texts) or step < dict(node.options).get("start_step", 0):
        # nothing kept, or the critic's warm-up
        return {"actor_metrics": {"actor/updated": 0.0, **_router_metrics(s)}}
    loss_fn = actor_loss(s, ro.num_response)
    rows = _train_rows(s, f, ro, scores, step)
    results = []
    for _ in range(s.algo.ppo_epochs):
        for mini in _mini_batches(rows, s.algo.mini_batches, _row_multiple(s)):
            result = s.actor.train_step(mini, loss_fn)
            if not result.applied:
                raise NonFiniteStep(f"step {step}: the actor loss or a gradient is not finite "
                                    f"(loss {result.loss}); the update was not applied")
            results.append(result)
    last = results[-1]
    metrics = {"actor/pg_loss": sum(r.loss for r in results) / len(results), "actor/grad_norm": last.grad_norm,
               "actor/lr": last.lr, "actor/updated": 1.0}
    for name in last.metrics:
        metrics[f"actor/{name}"] = sum(r.metrics[name] for r in results) / len(results)
    return {"actor_metrics": {**metrics, **_router_metrics(s)}}


def _router_metrics(s: Session) -> dict[str, float]:
    """``moe/...`` router statistics of this step's actor forwards (old log-probs and training)."""
    routing = s.actor.routing
    if routing is None or not s.cfg.moe.router_stats:
        return {}
    metrics = routing.pop_metrics()
    if "train" in routing.last_stats:
        s.moe_tokens_per_expert = routing.last_stats["train"].counts().tolist()
    return metrics


def critic_loss(clip: float) -> Callable:
    """``loss_fn(values, _, micro)``: the clipped value loss, token-mean over the global batch."""

    def loss_fn(values_BT, _unused, micro):
        mask = micro["response_mask"]
        mat, metrics = value_loss_terms(values_BT, micro["old_values"], micro["returns"], mask, clip=clip)
        num, den = agg_parts(mat, mask, "token-mean")
        metrics["vpred_mean"] = masked_mean(values_BT.detach(), mask)
        return num, den, {k: torch.as_tensor(v, dtype=torch.float32) for k, v in metrics.items()}

    return loss_fn


@op("update_critic")
def update_critic(s: Session, node, f: dict, step: int) -> dict:
    ro, _ = current(f)
    rows = {"input_ids": ro.batch["input_ids"], "response_mask": ro.batch["response_mask"].float(),
            "old_values": f["values"], "returns": f["returns"]}
    loss_fn = critic_loss(s.algo.value_clip)
    results = []
    for _ in range(s.algo.ppo_epochs):
        for mini in _mini_batches(rows, s.algo.mini_batches, _row_multiple(s)):
            result = s.critic.train_step(mini, loss_fn)
            if not result.applied:
                raise NonFiniteStep(f"step {step}: the critic loss or a gradient is not finite; not applied")
            results.append(result)
    metrics = {"critic/vf_loss": sum(r.loss for r in results) / len(results),
               "critic/grad_norm": results[-1].grad_norm}
    for name in results[-1].metrics:
        metrics[f"critic/{name}"] = sum(r.metrics[name] for r in results) / len(results)
    return {"critic_metrics": metrics}


@op("sync_weights")
def sync_weights(s: Session, node, f: dict, step: int) -> dict:
    if not f["actor_metrics"].get("actor/updated") and not s.sync.engine_drops_weights:
        return {"rollout_weights": {}}  # the engine already has these weights
    return {"rollout_weights": s.sync.push()}


# --------------------------------------------------------------------------- evaluation


def heldout_reward(s: Session) -> float | None:
    """Mean reward of greedy responses to the held-out prompts (the engine's current weights)."""
    if not s.heldout_prompts:
        return None
    switches.enter(s, "generate")
    ro = rollout(s, s.heldout_prompts, _sampling(s, greedy=True), 0)
    return float(score(s, ro).mean())
