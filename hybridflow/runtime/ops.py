"""What each graph op does on a rank: ``OPS[node.op](session, node, fields, step) -> new fields``.

The graph (``hybridflow.algorithms.recipes.build_graph``) says which ops run and in which order;
each handler reads its node's input fields and returns its output fields. The replica drivers
generate (``replicas``); each data-parallel rank receives only the rows it trains on
(``shares.owner``: whole groups, so group statistics stay local) and its leader scores them;
only the scores ``[N]`` and a few numbers per sample are shared by every rank. Batch-wide
statistics (whitening, metrics, the response width) are sums over the DP ranks (``Shard``).

Field layouts (N samples in all, B = b of them on this DP rank, T prompt + response columns, R
response columns): ``responses`` a ``Rollout`` (this rank's packed ``[B, T]`` tensors and texts,
every sample's group, length and truncation ``[N]``); ``scores`` ``[N]``;
``old_logprobs``/``ref_logprobs``/``entropy``/``advantages``/``returns`` ``[B, T]``;
``token_rewards`` ``[B, R]``; ``kept`` a filtered ``Rollout`` with its ``[N']`` scores.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from hybridflow.algorithms.correction import rollout_correction
from hybridflow.algorithms.estimators import get_estimator, scores_to_token_rewards
from hybridflow.algorithms.losses import agg_parts, get_policy_loss, kl_penalty, masked_mean, value_loss_terms
from hybridflow.algorithms.shaping import filter_groups, kl_in_reward, overlong_penalty, pf_ppo_resample
from hybridflow.rewards import score_responses
from hybridflow.rollout.base import FINISH_LENGTH, RolloutSample, SamplingParams
from hybridflow.rollout.tokens import pack_batch
from hybridflow.runtime import replicas, switches
from hybridflow.runtime.batch import from_response, pad_rows, to_response
from hybridflow.runtime.session import Session

__all__ = ["OPS", "NonFiniteStep", "Rollout", "as_rollout", "heldout_reward", "sampling", "step_seed"]

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
    """Sampled responses of a batch of prompts: this data-parallel rank's rows, packed for the
    trainer, and the few numbers of every row that batch-wide steps need (N samples in all, b
    here)."""

    batch: dict[str, torch.Tensor]
    """``pack_batch``'s tensors of this rank's rows (right padding)."""
    texts: list[str]
    """Decoded responses of this rank's rows."""
    answers: list[Any]
    """Reference answer of each of this rank's rows' prompts."""
    sources: list[Any]
    """``data_source`` of each of this rank's rows' prompts."""
    extra_infos: list[Any]
    """The ``extra_info`` column of each of this rank's rows' prompts (None where absent), for
    reward functions that take it."""
    rows: torch.Tensor
    """[b] position of each of this rank's rows among all N samples."""
    groups: torch.Tensor
    """[N] group id of every sample (one per prompt)."""
    lengths: torch.Tensor
    """[N] response length of every sample."""
    truncated: torch.Tensor
    """[N] whether each sample hit the length cap."""
    seconds: float
    """Generation wall time."""

    @property
    def total(self) -> int:
        """N, the samples over every DP rank."""
        return len(self.groups)

    @property
    def index(self) -> torch.Tensor:
        """[b] group id of this rank's rows."""
        return self.groups[self.rows]

    @property
    def num_response(self) -> int:
        """Response columns R of the whole batch (the same on every rank)."""
        return int(self.lengths.max()) if self.total else 0

    def local_index(self, source: torch.Tensor) -> torch.Tensor:
        """For each global sample position in ``source``, its row on this rank, or -1."""
        local = torch.full((self.total,), -1, dtype=torch.long)
        local[self.rows] = torch.arange(len(self.rows))
        return local[source]

    def take(self, source: torch.Tensor) -> "Rollout":
        """The rollout whose sample j is sample ``source[j]`` of this one (a global index, the same
        on every rank); each rank keeps the new rows whose source it holds."""
        src = self.local_index(source)
        mine = (src >= 0).nonzero().flatten()
        pick = src[mine]
        picked = pick.tolist()
        return replace(
            self,
            batch={k: v[pick] for k, v in self.batch.items()},
            texts=[self.texts[i] for i in picked],
            answers=[self.answers[i] for i in picked],
            sources=[self.sources[i] for i in picked],
            extra_infos=[self.extra_infos[i] for i in picked],
            rows=mine,
            groups=self.groups[source],
            lengths=self.lengths[source],
            truncated=self.truncated[source],
        )

    def select(self, keep: torch.Tensor) -> "Rollout":
        """The samples where ``keep`` [N] is True."""
        return self.take(keep.nonzero().flatten())


# --------------------------------------------------------------------------- rollout and reward


def sampling(s: Session, *, greedy: bool = False) -> SamplingParams:
    r = s.cfg.rollout
    return SamplingParams(
        n=1 if greedy else r.n,
        temperature=0.0 if greedy else r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=s.cfg.data.max_response_length,
        stop_token_ids=s.stop_ids,
    )


def rollout(s: Session, prompts, params: SamplingParams, seed: int, group_offset: int = 0) -> Rollout:
    """Generate on the replica drivers; each data-parallel rank receives its own rows.

    The GPUs must already hold what generation needs: the plan's switch before a generate
    stage (or ``switches.enter(s, "generate")`` outside the graph) put it there."""
    if s.cfg.rollout.placement == "colocated" and s.mode != "generate":
        raise AssertionError(f"rollout in mode {s.mode!r}: the plan's switches did not bring the engine in")
    s.rollout_calls += 1
    ids = [p.prompt_ids for p in prompts]
    s.channel.announce(("generate", ids, params, seed, s.rollout_calls))  # separate: the engine ranks follow
    out = replicas.generate(
        s.cfg,
        s.engine,
        ids,
        params,
        seed,
        call=s.rollout_calls,
        channel=s.channel,
        replica=s.replica,
        shard=s.shard,
        device=s.device,
        restarts=s.restarts,
    )
    return as_rollout(s, prompts, out, group_offset)


def as_rollout(s: Session, prompts, out: replicas.ReplicaOutput, group_offset: int = 0) -> Rollout:
    """The ``Rollout`` of a generate call's delivered samples (this DP rank's rows)."""
    for replica, count in enumerate(out.samples_per_replica):
        s.step_metrics[f"rollout/replica{replica}/samples"] = float(count)
    received = s.shard.max(torch.tensor([float(out.received_bytes)]))
    s.step_metrics["rollout/received_bytes_max_rank"] = float(received)
    samples = out.samples
    # the busiest DP rank's tokens over the mean: its micro-batches set the step's pace
    tokens = torch.tensor([float(sum(len(x.prompt_ids) + len(x.response_ids) for x in samples))])
    mean = float(s.shard.sum(tokens)) / s.shard.dp_size
    s.step_metrics["rollout/dp_tokens_max_over_mean"] = float(s.shard.max(tokens)) / max(mean, 1.0)
    pad = s.tokenizer.pad_token_id
    batch = pack_batch(samples, pad_id=pad) if samples else _empty_batch(pad, out.metas)
    texts = s.tokenizer.batch_decode([list(x.response_ids) for x in samples], skip_special_tokens=True)
    rows = [prompts[x.prompt_index].row for x in samples]
    metas = out.metas
    return Rollout(
        batch=batch,
        texts=texts,
        answers=[r.answer for r in rows],
        sources=[r.data_source for r in rows],
        extra_infos=[r.extra.get("extra_info") for r in rows],
        rows=torch.tensor(out.positions, dtype=torch.long),
        groups=torch.tensor([group_offset + m.prompt_index for m in metas], dtype=torch.long),
        lengths=torch.tensor([m.response_len for m in metas], dtype=torch.long),
        truncated=torch.tensor([m.finish_reason == FINISH_LENGTH for m in metas], dtype=torch.bool),
        seconds=out.seconds,
    )


def _empty_batch(pad_id: int, metas) -> dict[str, torch.Tensor]:
    """``pack_batch``'s tensors with no rows (a DP rank that owns none of a call's prompts)."""
    shape = next((m.routes_shape for m in metas if m.routes_shape is not None), None)
    routes = None if shape is None else torch.zeros(1, *shape[1:], dtype=torch.long)
    dummy = RolloutSample(
        prompt_index=0,
        sample_index=0,
        prompt_ids=(pad_id,),
        response_ids=(pad_id,),
        logprobs=(0.0,),
        finish_reason=FINISH_LENGTH,
        routed_experts=routes,
    )
    return {k: v[:0] for k, v in pack_batch([dummy], pad_id=pad_id).items()}


def score(s: Session, ro: Rollout) -> torch.Tensor:
    """[N] rewards of every sample, on every rank: each DP rank's leader scores its own rows (in
    parallel; errors logged there), and only the scores are shared."""
    local = torch.zeros(len(ro.texts), dtype=torch.float32)
    errors = 0
    if s.shard.leader and ro.texts:
        scores, failures = score_responses(ro.texts, ro.answers, ro.sources, s.cfg.reward, ro.extra_infos)
        local, errors = torch.tensor(scores, dtype=torch.float32), len(failures)
    s.reward_errors += int(s.shard.sum(torch.tensor([errors]))[0])
    return s.shard.gather(ro.rows, local, ro.total)


@op("generate")
def generate(s: Session, node, f: dict, step: int) -> dict:
    if s.pipeline is not None:  # asynchronous RL: batch ``step`` was started ahead (runtime/pipeline.py)
        ro = _admitted(s, step, *s.pipeline.rollout(step))
    else:
        ro = rollout(s, f["prompts"], sampling(s), step_seed(s.cfg.run.seed, step))
    return {"responses": ro, "rollout_logprobs": ro.batch["logprobs"]}


def _admitted(s: Session, step: int, out: replicas.ReplicaOutput, version: int) -> Rollout:
    """Batch ``step`` as the trainer takes it: samples past ``async_rl.max_staleness`` dropped or
    down-weighted (``s.stale_weights``, which the advantages scale by)."""
    ro = as_rollout(s, s.prompt_batch(step), out)
    keep, weight, metrics = s.pipeline.admit(step, version, ro.total)
    s.step_metrics.update(metrics)
    if s.cfg.async_rl.partial_rollout:  # every rank: the numbers are sums over the DP ranks
        s.step_metrics.update(_token_version_metrics(s, token_versions(ro), step))
    s.step_metrics["async/generation_tokens_per_s"] = float(ro.lengths.sum()) / max(ro.seconds, 1e-9)
    s.stale_weights = None if bool((weight == 1).all()) else weight[keep]
    return ro if bool(keep.all()) else ro.select(keep)


def token_versions(ro: Rollout) -> torch.Tensor:
    """[b, T] policy version of each response token of this rank's rows (partial rollouts), -1
    where none: padding, prompts, a rank without rows, samples generated before tagging."""
    default = torch.full(ro.batch["response_mask"].shape, -1, dtype=torch.long, device=ro.batch["response_mask"].device)
    return ro.batch.get("token_versions", default)


def _token_version_metrics(s: Session, versions: torch.Tensor, step: int) -> dict[str, float]:
    """Partial rollouts, over every DP rank: the response tokens sampled d versions behind the
    trainer (d = 0 .. K), their mean lag, and the samples whose tokens span several versions."""
    k = s.cfg.async_rl.lag
    lag = (step - versions[versions >= 0]).clamp(0, k)
    spanning = sum(len(set(row[row >= 0].tolist())) > 1 for row in versions)
    counts = s.shard.sum(
        torch.cat([torch.bincount(lag, minlength=k + 1).double(), torch.tensor([float(spanning)], dtype=torch.float64)])
    )
    tokens = float(counts[:-1].sum())
    mean = float((counts[:-1] * torch.arange(k + 1, dtype=torch.float64)).sum()) / max(tokens, 1.0)
    return {
        **{f"async/tokens_version_lag_{d}": float(c) for d, c in enumerate(counts[:-1].tolist())},
        "async/token_staleness_mean": mean,
        "async/partial_samples": float(counts[-1]),
    }


@op("generate_greedy")
def generate_greedy(s: Session, node, f: dict, step: int) -> dict:
    # one greedy response per prompt, repeated so it lines up with the n samples of the prompt
    ro = rollout(s, f["prompts"], sampling(s, greedy=True), 0)
    n = s.cfg.rollout.n
    repeat = torch.arange(ro.total).repeat_interleave(n)
    return {"baseline_responses": ro.take(repeat)}


@op("reward")
def reward(s: Session, node, f: dict, step: int) -> dict:
    source, target = node.option("responses_field"), node.option("scores_field")
    return {target: score(s, f[source])}


@op("filter_groups")
def filter_groups_op(s: Session, node, f: dict, step: int) -> dict:
    """DAPO dynamic sampling: keep groups whose rewards differ; draw more prompts until the step
    has ``run.prompts_per_step`` groups or ``algorithm.max_sampling_rounds`` rounds ran."""
    want = s.cfg.run.prompts_per_step
    ro, scores = f["responses"], f["scores"]
    keep = filter_groups(scores, ro.groups)
    kept, kept_scores = [ro.select(keep)], [scores[keep]]
    groups = int(keep.sum()) // s.cfg.rollout.n
    rounds = 1
    while groups < want and rounds < node.option("max_rounds"):
        prompts = s.prompt_batch(step, offset=rounds)
        extra = rollout(s, prompts, sampling(s), step_seed(s.cfg.run.seed, step, rounds), group_offset=rounds * want)
        extra_scores = score(s, extra)
        keep = filter_groups(extra_scores, extra.groups)
        kept.append(extra.select(keep))
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
    offsets = [0]
    for p in parts:
        offsets.append(offsets[-1] + p.total)
    return Rollout(
        batch={k: torch.cat(v) for k, v in batch.items()},
        texts=sum((p.texts for p in parts), []),
        answers=sum((p.answers for p in parts), []),
        sources=sum((p.sources for p in parts), []),
        extra_infos=sum((p.extra_infos for p in parts), []),
        rows=torch.cat([p.rows + o for p, o in zip(parts, offsets)]),
        groups=torch.cat([p.groups for p in parts]),
        lengths=torch.cat([p.lengths for p in parts]),
        truncated=torch.cat([p.truncated for p in parts]),
        seconds=sum(p.seconds for p in parts),
    )


def current(f: dict) -> tuple[Rollout, torch.Tensor]:
    """The samples the trainer uses: DAPO's kept ones when the graph filters, else all."""
    if "kept" in f:
        return f["kept"]
    return f["responses"], f["scores"]


# --------------------------------------------------------------------------- trainer-side scoring


def _padded(s: Session, inputs: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    """``inputs`` padded with masked rows to the same number of micro-batches on every DP rank
    (the most rows any DP rank holds, rounded up to micro-batches)."""
    most = int(s.shard.max(torch.tensor([inputs["input_ids"].shape[0]]))[0])
    return pad_rows(inputs, s.cfg.train.micro_batch_size, rows=_micro_rows(s, max(most, 1)))


def _micro_rows(s: Session, rows: int) -> int:
    """``rows`` rounded up to whole micro-batches."""
    micro = s.cfg.train.micro_batch_size
    return -(-rows // micro) * micro


def _logprobs(
    s: Session, policy, ro: Rollout, *, with_entropy: bool, routes: torch.Tensor | None = None, record: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of this rank's rows of the rollout; ``routes``: replay these experts, ``record``:
    keep the ones the routers chose (``policy.routing.take_recorded()``). ``attention_mask``
    marks the real tokens, which the router statistics count."""
    inputs = {"input_ids": ro.batch["input_ids"], "attention_mask": ro.batch["attention_mask"]}
    if routes is not None:
        inputs["routed_experts"] = routes
    inputs, rows = _padded(s, inputs)
    logp, ent = policy.forward_logprobs(inputs, with_entropy=with_entropy, record_routes=record, local_rows=True)
    return logp[:rows], ent[:rows]


def _engine_routes(ro: Rollout) -> torch.Tensor:
    if "routed_experts" not in ro.batch:
        raise ValueError(
            "moe.routing_replay=r3 but the rollout engine returned no routed experts; SGLang "
            "returns them for MoE models on a GPU (use moe.routing_replay=r2 otherwise)"
        )
    return ro.batch["routed_experts"]


@op("old_logprob")
def old_logprob(s: Session, node, f: dict, step: int) -> dict:
    ro, _ = current(f)
    # routing replay: r3 scores with the engine's experts, as training will; r2 records the
    # actor's own experts, which training replays
    mode = node.option("routing_replay")
    routes = _engine_routes(ro) if mode == "r3" else None
    logp, ent = _logprobs(s, s.actor, ro, with_entropy=True, routes=routes, record=mode == "r2")
    if mode == "r2":
        routes = s.actor.routing.take_recorded()[: len(logp)]
    mask = ro.batch["response_mask"].bool()
    # the engine's log-probs against the trainer's, same weights: a sync check
    diff = (logp - ro.batch["logprobs"]).abs()[mask].double()
    largest = s.shard.max(torch.tensor([float(diff.max()) if diff.numel() else -1.0]))
    # host floats: the shard's group is gloo, whatever device the log-probs are on
    stats = [float(diff.sum()), float(torch.exp(diff).sum()), float(diff.numel())]
    total, mult, count = s.shard.sum(torch.tensor(stats, dtype=torch.float64))
    # a batch generated by an older version measures how far behind the behaviour policy is, not the sync
    prefix = "rollout" if _staleness(s) == 0 else "async/behaviour"
    if count:
        s.step_metrics.update(
            {
                f"{prefix}/logprob_diff_max": float(largest),
                f"{prefix}/logprob_diff_mean": float(total / count),
                f"{prefix}/token_mult_prob_error": float(mult / count),
            }
        )
    if s.cfg.async_rl.partial_rollout:  # the tags checked against the trainer's own weights
        s.step_metrics.update(_diff_by_version(s, diff, token_versions(ro)[mask].to(diff.device) == step))
    return {"old_logprobs": logp, "entropy": ent, **({} if routes is None else {"routed_experts": routes})}


def _diff_by_version(s: Session, diff: torch.Tensor, current: torch.Tensor) -> dict[str, float]:
    """|engine - trainer| log-prob of the tokens tagged with the trainer's own version (the same
    weights: the sync check's size) and the mean over the older ones, over every rank."""
    largest = s.shard.max(torch.tensor([float(diff[current].max()) if bool(current.any()) else -1.0]))
    older = s.shard.sum(torch.tensor([float(diff[~current].sum()), float((~current).sum())], dtype=torch.float64))
    out = {"async/behaviour/current_version_logprob_diff_max": float(largest)} if float(largest) >= 0 else {}
    if older[1]:
        out["async/behaviour/older_versions_logprob_diff_mean"] = float(older[0] / older[1])
    return out


def _staleness(s: Session) -> float:
    """The step's largest sample staleness (0 without asynchronous RL)."""
    return s.step_metrics.get("async/staleness_max", 0.0)


@op("ref_logprob")
def ref_logprob(s: Session, node, f: dict, step: int) -> dict:
    ro, _ = current(f)
    logp, _ = _logprobs(s, s.reference, ro, with_entropy=False)
    return {"ref_logprobs": logp}


@op("values")
def values(s: Session, node, f: dict, step: int) -> dict:
    ro, _ = current(f)
    inputs, rows = _padded(s, {"input_ids": ro.batch["input_ids"]})
    return {"values": s.critic.forward_values(inputs, local_rows=True)[:rows]}


# --------------------------------------------------------------------------- rewards -> advantages


def _response_view(ro: Rollout, x_BT: torch.Tensor) -> torch.Tensor:
    return to_response(x_BT, ro.batch["prompt_lengths"], ro.num_response)


@op("token_rewards")
def token_rewards(s: Session, node, f: dict, step: int) -> dict:
    ro, scores = current(f)
    scores = scores[ro.rows]
    algo = s.algo
    mask_BR = _response_view(ro, ro.batch["response_mask"])
    buffer = node.option("overlong_buffer_len")
    if buffer > 0:
        scores = scores + overlong_penalty(
            ro.batch["response_lengths"],
            max_response_length=s.cfg.data.max_response_length,
            buffer_len=buffer,
            penalty_factor=algo.overlong_penalty_factor,
        )
    rewards_BR = scores_to_token_rewards(scores, mask_BR)
    if node.option("kl_penalty"):
        coef = s.kl_reward.value
        rewards_BR, kl_B = kl_in_reward(
            rewards_BR,
            _response_view(ro, f["old_logprobs"]),
            _response_view(ro, f["ref_logprobs"]),
            mask_BR,
            coef,
            algo.kl_type,
        )
        kl_sum, count = s.shard.sum(torch.tensor([float(kl_B.sum()), float(len(kl_B))], dtype=torch.float64))
        # verl's measure: the batch mean of each response's token-mean KL, over this many responses
        s.step_metrics.update(
            {
                "actor/reward_kl": float(kl_sum / count.clamp(min=1)),
                "actor/reward_kl_coef": coef,
                "actor/reward_kl_responses": float(count),
            }
        )
    return {"token_rewards": rewards_BR}


@op("advantages")
def advantages(s: Session, node, f: dict, step: int) -> dict:
    ro, _ = current(f)
    mask_BR = _response_view(ro, ro.batch["response_mask"])
    estimator = get_estimator(node.option("estimator"))
    baseline = f["baseline_scores"][ro.rows] if "baseline_scores" in f else None
    values_BR = _response_view(ro, f["values"]) if "values" in f else None
    cfg = s.algo
    if values_BR is not None:  # GAE's lambdas, as the graph resolved them
        cfg = replace(
            cfg,
            critic_lam=node.option("critic_lam"),
            length_adaptive_lam_alpha=node.option("length_adaptive_lam_alpha"),
        )
    adv_BR, ret_BR = estimator(
        f["token_rewards"], mask_BR, index=ro.index, cfg=cfg, values=values_BR, baseline=baseline, split=s.shard
    )
    if s.stale_weights is not None:  # async_rl.on_stale=downweight: a scaled advantage scales the policy loss
        adv_BR = adv_BR * s.stale_weights[ro.rows][:, None]
    length = ro.batch["input_ids"].shape[1]
    lengths = ro.batch["prompt_lengths"]
    return {"advantages": from_response(adv_BR, lengths, length), "returns": from_response(ret_BR, lengths, length)}


# --------------------------------------------------------------------------- updates


def actor_loss(s: Session, node, num_response: int) -> Callable:
    """``loss_fn(logp, entropy, micro)`` of the actor update: policy loss (+ entropy, KL, LM terms),
    aggregated as parts so micro-batches and data-parallel ranks add up to the global batch."""
    algo = replace(s.algo, clip_ratio_high=node.option("clip_ratio_high"))
    policy_loss = get_policy_loss(node.option("policy_loss"))
    agg_mode, kl_loss, lm_coef = node.option("loss_agg_mode"), node.option("kl_loss"), node.option("lm_loss_coef")

    def loss_fn(logp, entropy, micro):
        mask = micro["response_mask"]
        correction = None
        if algo.rollout_correction is not None:  # drop what it drops, weight the rest
            correction = rollout_correction(
                micro["old_logprobs"],
                micro["rollout_logprobs"],
                mask,
                mode=algo.rollout_correction,
                level=algo.rollout_correction_level,
                upper=algo.rollout_correction_upper,
                lower=algo.rollout_correction_lower,
            )
            mask = mask * correction.keep
        mat, metrics = policy_loss(micro["old_logprobs"], logp, micro["advantages"], mask, algo)
        if correction is not None:
            mat = mat * correction.weights
            metrics.update(correction.metrics)
        if algo.entropy_coef > 0:
            mat = mat - algo.entropy_coef * entropy * mask
        if kl_loss:
            kl = kl_penalty(logp, micro["ref_logprobs"], algo.kl_type) * mask
            mat = mat + algo.kl_loss_coef * kl
            metrics["kl_loss"] = masked_mean(kl.detach(), mask)
        if lm_coef:
            mat = mat - lm_coef * logp * mask * micro["positive"][:, None]
        num, den = agg_parts(mat, mask, agg_mode, max_response_length=num_response)
        metrics["entropy"] = masked_mean(entropy.detach(), mask)
        if agg_mode == "token-sum":  # no divisor: weight the metrics by tokens instead
            metrics["weight"] = mask.sum()
        return num, den, {k: torch.as_tensor(v, dtype=torch.float32) for k, v in metrics.items()}

    return loss_fn


def _train_rows(
    s: Session, f: dict, ro: Rollout, scores: torch.Tensor, step: int, pf_ppo: str | None
) -> dict[str, torch.Tensor]:
    rows = {
        "input_ids": ro.batch["input_ids"],
        "response_mask": ro.batch["response_mask"].float(),
        "attention_mask": ro.batch["attention_mask"],
        "old_logprobs": f["old_logprobs"],
        "advantages": f["advantages"],
        "positive": (scores[ro.rows] > 0).float(),
    }
    for key in ("ref_logprobs", "routed_experts"):  # routing replay: the experts to train with
        if key in f:
            rows[key] = f[key]
    if s.algo.rollout_correction is not None:  # the engine's log-probs of the sampled tokens
        rows["rollout_logprobs"] = ro.batch["logprobs"]
    if pf_ppo:  # drawn over the whole batch, alike on every rank; each keeps its own rows
        generator = torch.Generator().manual_seed(step_seed(s.cfg.run.seed, step, 7))
        idx = pf_ppo_resample(scores, pf_ppo, generator, pow=s.algo.pf_ppo_weight_pow)
        pick = ro.local_index(idx)
        rows = {k: v[pick[pick >= 0]] for k, v in rows.items()}
    return rows


def _mini_batches(s: Session, rows: dict[str, torch.Tensor], count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` mini-batches of this rank's rows, each padded to the same micro-batches on every
    DP rank (together the DP ranks' i-th parts are the global i-th mini-batch)."""
    total = rows["input_ids"].shape[0]
    bounds = [round(i * total / count) for i in range(count + 1)]
    sizes = s.shard.max(torch.tensor([b - a for a, b in zip(bounds, bounds[1:])]))
    micro = s.cfg.train.micro_batch_size
    parts = []
    for (a, b), most in zip(zip(bounds, bounds[1:]), sizes.tolist()):
        if most:  # a part no rank holds rows of is skipped everywhere alike
            parts.append(pad_rows({k: v[a:b] for k, v in rows.items()}, micro, rows=_micro_rows(s, most))[0])
    return parts


@op("update_actor")
def update_actor(s: Session, node, f: dict, step: int) -> dict:
    ro, scores = current(f)
    if not ro.total or step < node.option("start_step"):
        # nothing kept, or the critic's warm-up
        return {"actor_metrics": {"actor/updated": 0.0, **_router_metrics(s)}}
    loss_fn = actor_loss(s, node, ro.num_response)
    rows = _train_rows(s, f, ro, scores, step, node.option("pf_ppo"))
    results = []
    s.undo.before_update(s.actor)
    for _ in range(s.algo.ppo_epochs):
        for mini in _mini_batches(s, rows, s.algo.mini_batches):
            result = s.actor.train_step(mini, loss_fn, local_rows=True)
            if not result.applied:
                raise NonFiniteStep(
                    f"step {step}: the actor loss or a gradient is not finite "
                    f"(loss {result.loss}); the update was not applied"
                )
            results.append(result)
    last = results[-1]
    # the mean over the step's updates, as the loss: the last mini-batch alone may hold no signal
    metrics = {
        "actor/pg_loss": sum(r.loss for r in results) / len(results),
        "actor/grad_norm": sum(r.grad_norm for r in results) / len(results),
        "actor/lr": last.lr,
        "actor/updated": 1.0,
    }
    for name in last.metrics:
        metrics[f"actor/{name}"] = sum(r.metrics[name] for r in results) / len(results)
    for name in ("ppo_kl", "clipfrac"):  # before any update of the step: old log-probs vs the trainer's
        if name in results[0].metrics:
            metrics[f"actor/{name}_first_mini"] = results[0].metrics[name]
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
    rows = {
        "input_ids": ro.batch["input_ids"],
        "response_mask": ro.batch["response_mask"].float(),
        "old_values": f["values"],
        "returns": f["returns"],
    }
    loss_fn = critic_loss(s.algo.value_clip)
    results = []
    s.undo.before_update(s.critic)
    for _ in range(s.algo.ppo_epochs):
        for mini in _mini_batches(s, rows, s.algo.mini_batches):
            result = s.critic.train_step(mini, loss_fn, local_rows=True)
            if not result.applied:
                raise NonFiniteStep(f"step {step}: the critic loss or a gradient is not finite; not applied")
            results.append(result)
    metrics = {
        "critic/vf_loss": sum(r.loss for r in results) / len(results),
        "critic/grad_norm": sum(r.grad_norm for r in results) / len(results),
        "critic/lr": results[-1].lr,
    }
    for name in results[-1].metrics:
        metrics[f"critic/{name}"] = sum(r.metrics[name] for r in results) / len(results)
    return {"critic_metrics": metrics}


@op("sync_weights")
def sync_weights(s: Session, node, f: dict, step: int) -> dict:
    if s.pipeline is not None:
        s.pipeline.training_done()
    if not f["actor_metrics"].get("actor/updated") and not s.sync.engine_drops_weights:
        return {"rollout_weights": {}}  # the engine already has these weights
    return {"rollout_weights": s.sync.push()}


# --------------------------------------------------------------------------- evaluation


def heldout_reward(s: Session) -> float | None:
    """Mean reward of greedy responses to the held-out prompts (the engine's current weights)."""
    if not s.heldout_prompts:
        return None
    switches.enter(s, "generate")
    ro = rollout(s, s.heldout_prompts, sampling(s, greedy=True), 0)
    return float(score(s, ro).mean())
