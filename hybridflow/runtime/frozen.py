"""Frozen models the graph calls without training them: the reference policy, the reward model
(``reward_model.path``), the distillation teacher (``distillation.teacher_path``) and the
generative judge (``judge.path``).

```
reward_model.path ── reward_model_source (checked: a score head) ──► MegatronRewardModel under
                     reward_model.parallel (groups of its own, parallel.layout_groups) or the
                     actor's layout and groups, each rank reading its own slices
                     (the teacher likewise, under distillation.parallel; the reference under
                     reference.parallel, from the actor's starting weights)
rollout rows ── tokens(): the policy's ids as they are when the reward model's tokenizer and chat
                template are the policy's; else prompt (as its data row has it) + response text
                rendered in the reward model's own template ──► ids [b, T], lengths [b]
on_device(): with <section>.offload (reference, reward_model, distillation) the parameters live
             on the host and come to the device for each use
whole_batch(): under a layout of its own a frozen model's DP ranks are not the actor's: every
             DP rank's rows are gathered into one batch on every rank (token ids, small beside
             the model), the model scores its DP share of it, and its results come back whole
GPUs of their own (reward_model.gpus, distillation.gpus) ── the model lives on its own ranks
             (runtime.frozen_ranks); the actor ranks hold a Remote: the whole batch's token ids
             go out (Remote.start), the scores or log-probs come back (Remote.result)
judge.path ── an engine of its own on rank 0 (real weights, no pushes), or judge.gpus / judge.tp
             replicas on GPUs of their own (runtime.frozen_ranks; the actor ranks hold a Remote)
             ── judge_request: each DP leader's rows to rank 0, one judging request each
             (judge.template in the judge's chat template), submitted; the engines generate while
             the trainer computes log-probs
             ── judge: the greedy replies collected and parsed (judge.pattern x judge.scale,
             judge.on_unparsable), the scores [N] and the unparsable count back to every rank
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hfschema.engines import ENGINES, resolve
from hfschema.hf_config import read_hf_config
from hybridflow.runtime.trainers import trainer_of

__all__ = [
    "Judge",
    "PendingReplies",
    "Remote",
    "RemoteReplies",
    "RewardModel",
    "build_reference",
    "build_reward_model",
    "build_teacher",
    "gathered",
    "in_micro_batches",
    "judge_tokens",
    "load_frozen",
    "on_device",
    "to_host_if_offloaded",
    "own_layout",
    "start_judge",
    "whole_batch",
]


@dataclass
class Remote:
    """A frozen model on GPUs of its own, from the actor ranks: its joint channel
    (``runtime.channel.join``; its ranks answer in ``runtime.frozen_ranks``)."""

    channel: Any

    def start(self, kind: str, whole: dict[str, torch.Tensor], **options) -> None:
        """Every actor rank calls it with the whole batch: actor rank 0 sends it, the model's
        ranks compute while the actor ranks go on."""
        self.ask(kind, {k: v.cpu() for k, v in whole.items()}, **options)  # pickled: host tensors

    def ask(self, kind: str, payload: Any, **options) -> None:
        """Every actor rank calls it; actor rank 0's ``payload`` (picklable) is the request."""
        self.channel.announce((kind, payload, options))

    def result(self) -> torch.Tensor:
        """The answer to the request started last (every actor rank waits for it)."""
        return self.channel.broadcast(None, src=self.channel.actors)


@dataclass
class RewardModel:
    """A loaded reward model and how rollout rows become its input."""

    model: Any
    """The trainer backend's frozen model with a score head (``build_frozen(scores=True)``); None on
    GPUs of its own (``remote``)."""
    pad_id: int | None
    """Its config.json's ``pad_token_id``: the pooled token is the last one that is not padding."""
    tokenizer: Any | None
    """Its own tokenizer when it differs from the policy's (texts are rendered again); None:
    the policy's token ids serve as they are."""
    end_id: int | None = None
    """The token it expects after a response (its chat's end of turn, else end of text)."""
    use_chat: bool = True
    """Whether its tokenizer has a chat template to render the prompt in."""
    offload: bool = False
    """Parameters on the host between uses."""
    remote: Remote | None = None
    """On GPUs of its own (``reward_model.gpus``): where its requests go."""

    def tokens(self, ro) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids`` [b, T] (right-padded) and lengths [b] of this rank's rows of rollout ``ro``."""
        if self.tokenizer is None:
            ids = ro.batch["input_ids"]
            return ids, ro.batch["attention_mask"].sum(dim=1).long()
        from hybridflow.data import as_encodable
        from hybridflow.rollout.tokens import encode_prompts

        rows = []
        for prompt, text in zip(ro.prompts, ro.texts):
            (prompt_ids,) = encode_prompts(self.tokenizer, [as_encodable(prompt, self.use_chat)])
            rows.append(list(prompt_ids) + self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.end_id])
        width = max((len(r) for r in rows), default=1)
        pad = self.pad_id if self.pad_id is not None else 0
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
        return ids, torch.tensor([len(r) for r in rows], dtype=torch.long)


def _same_tokens(theirs, ours) -> bool:
    """Whether two tokenizers map text to the same ids in the same chat template."""
    return theirs.get_vocab() == ours.get_vocab() and getattr(theirs, "chat_template", None) == getattr(
        ours, "chat_template", None
    )


def build_reward_model(cfg, pg, policy_tokenizer, remote: Remote | None = None) -> RewardModel:
    """``reward_model.path`` under its layout (every rank of the actor's), loaded and frozen; or,
    on GPUs of its own (``remote``), only what turns rollout rows into its input."""
    from transformers import AutoTokenizer

    from hfschema.model_source import reward_model_source

    source, _ = reward_model_source(cfg.reward_model.path)
    model = None if remote is not None else load_frozen(cfg, "reward_model", *_groups(cfg, "reward_model", pg))
    tokenizer = AutoTokenizer.from_pretrained(str(source.files))
    own = not _same_tokens(tokenizer, policy_tokenizer)
    chat = bool(getattr(tokenizer, "chat_template", None))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>") if chat else tokenizer.eos_token_id
    rm = RewardModel(
        model=model,
        pad_id=read_hf_config(source.files).get("pad_token_id"),
        tokenizer=tokenizer if own else None,
        end_id=end,
        use_chat=chat,
        offload=cfg.reward_model.offload,
        remote=remote,
    )
    if model is not None:
        to_host_if_offloaded(model, rm.offload)
    return rm


def build_teacher(cfg, pg, policy_tokenizer, remote: Remote | None = None):
    """``distillation.teacher_path`` as a frozen policy under its layout, loaded (or ``remote``: on
    GPUs of its own); its tokenizer must map text as the student's does (its log-probs are read at
    the student's ids)."""
    from transformers import AutoTokenizer

    from hfschema.model_source import teacher_source

    key = "distillation.teacher_path"
    source, _ = teacher_source(cfg.distillation.teacher_path, cfg.model.vocab_size, key=key)
    if AutoTokenizer.from_pretrained(str(source.files)).get_vocab() != policy_tokenizer.get_vocab():
        raise ValueError(
            f"{key}={cfg.distillation.teacher_path}: the teacher's tokenizer maps tokens to other ids than "
            "the student's; on-policy distillation needs the student's tokenizer"
        )
    if remote is not None:
        return remote
    return to_host_if_offloaded(load_frozen(cfg, "teacher", *_groups(cfg, "teacher", pg)), cfg.distillation.offload)


def load_frozen(cfg, role: str, layout, pg):
    """Frozen model ``role`` (reward_model, teacher) under ``layout`` and its groups ``pg``, its
    weights read slice by slice (on the actor's ranks, or on its own: ``frozen_ranks``)."""
    from hfschema.model_source import reward_model_source, teacher_source

    trainer = trainer_of(cfg)
    if role == "reward_model":
        source, architecture = reward_model_source(cfg.reward_model.path)
        model = trainer.build_frozen(architecture, cfg, layout, pg, model_dir=source.files, scores=True)
        trainer.load_reward_model(model, source)
        return model
    key = "distillation.teacher_path"
    source, architecture = teacher_source(cfg.distillation.teacher_path, cfg.model.vocab_size, key=key)
    model = trainer.build_frozen(architecture, cfg, layout, pg, model_dir=source.files)
    trainer.load_pretrained(model, source)
    return model


def build_reference(cfg, pg, *, model_dir: Path, load) -> Any:
    """The reference policy: the frozen model of the actor's own architecture under its layout
    (``reference.parallel``); ``load(model)`` gives it its weights (the SFT warm-up's,
    ``model.path``'s, or a random model's initial ones), which the caller knows."""
    trainer = trainer_of(cfg, "reference")
    reference = trainer.build_frozen(cfg.model, cfg, *_groups(cfg, "reference", pg), model_dir=model_dir)
    load(reference)
    return to_host_if_offloaded(reference, cfg.reference.offload)


def _groups(cfg, role: str, actor_groups) -> tuple[Any, Any]:
    """Frozen model ``role``'s layout and process groups: the actor's, or groups of its own over
    the same ranks (built collectively: every rank builds the frozen models in one order)."""
    from hybridflow.config import frozen_layout, frozen_layout_key

    layout = frozen_layout(cfg, role)
    if layout == cfg.actor.parallel:
        return layout, actor_groups
    return layout, trainer_of(cfg).layout_groups(layout, prefix=frozen_layout_key(role))


def _move(model, device: torch.device) -> None:
    for chunk in model.chunks:
        for tensor in [*chunk.parameters(), *chunk.buffers()]:
            tensor.data = tensor.data.to(device, non_blocking=True)


def own_layout(model, cfg) -> bool:
    """Whether frozen ``model`` holds a layout other than the actor's (its DP ranks then score
    shares of the whole batch rather than the actor's DP rows)."""
    return model.layout != cfg.actor.parallel


def whole_batch(shard, ro, inputs: dict[str, torch.Tensor], model, micro_rows: int) -> dict[str, torch.Tensor]:
    """This rank's rows ``inputs`` of rollout ``ro`` joined with every other DP rank's into the
    whole batch ``[N', W]`` on every rank (zeros right of a row's own width), N' rounded up with
    masked copies so that ``model``'s DP ranks split it into whole micro-batches."""
    return in_micro_batches(gathered(shard, ro, inputs), model, micro_rows)


def gathered(shard, ro, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's rows ``inputs`` of rollout ``ro`` joined with every other DP rank's into the
    whole batch ``[N, W]`` on every rank (zeros right of a row's own width)."""
    width = int(shard.max(torch.tensor([inputs["input_ids"].shape[1]]))[0])
    whole = {}
    for key, value in inputs.items():
        if value.dim() > 1:
            value = torch.nn.functional.pad(value, (0, width - value.shape[1]))
        whole[key] = shard.gather(ro.rows, value, ro.total)
    return whole


def in_micro_batches(whole: dict[str, torch.Tensor], model, micro_rows: int) -> dict[str, torch.Tensor]:
    """``whole``'s rows rounded up with masked copies so that ``model``'s DP ranks split them into
    whole micro-batches."""
    from hybridflow.runtime.batch import pad_rows

    return pad_rows(whole, model.pg.dp.size() * micro_rows)[0]


@contextlib.contextmanager
def on_device(model, offload: bool) -> Iterator[None]:
    """Frozen ``model``'s parameters on its device for the block (moved in and back out when
    ``offload``: ``<section>.offload``; on a CPU-only rank both are the host and nothing moves,
    but the tests' device guard follows the marks)."""
    if not offload:
        yield
        return
    _move(model, model.device)
    try:
        yield
    finally:
        _move(model, torch.device("cpu"))


def to_host_if_offloaded(model, offload: bool):
    """A freshly loaded frozen model, its parameters on the host when offloaded between uses."""
    if offload:
        _move(model, torch.device("cpu"))
    return model


@dataclass
class Judge:
    """A generative judge and how a sample becomes its request: its engine (rank 0's; a driver
    rank's of its own GPUs), or, with ``judge.gpus``, on every actor rank the ``remote`` whose
    ranks run the engines (``runtime.frozen_ranks``)."""

    engine: Any
    """A ``RolloutEngine`` with the judge's own weights; None when ``remote``."""
    tokenizer: Any
    """The judge's tokenizer (None on the actor ranks but 0 of a remote judge: they send nothing)."""
    stop_ids: tuple[int, ...]
    remote: Remote | None = None

    def request(self, cfg, items: list[tuple[Any, str, Any]] | None) -> "PendingReplies | RemoteReplies":
        """The judge's greedy replies to each (prompt, response, answer), started: the judge
        generates while the trainer goes on (``.texts()`` collects them). A remote judge's
        request is collective: every actor rank calls it, rank 0 with the items."""
        ids = None if items is None else self.encode(cfg, items)
        if self.remote is not None:
            self.remote.ask("generate", ids)
            return RemoteReplies(self.remote)
        return self.submit(cfg, ids)

    def encode(self, cfg, items: list[tuple[Any, str, Any]]) -> list[list[int]]:
        """Each item's judging request (``judge.template`` as the user turn of the judge's chat
        template, if it has one) as token ids."""
        from hybridflow.judge import render
        from hybridflow.rollout.tokens import encode_prompts

        chat = bool(getattr(self.tokenizer, "chat_template", None))
        requests = [render(cfg.judge.template, prompt=p, response=r, answer=a) for p, r, a in items]
        return encode_prompts(self.tokenizer, [[{"role": "user", "content": q}] if chat else q for q in requests])

    def submit(self, cfg, ids: list[list[int]]) -> "PendingReplies":
        """Greedy replies to the requests ``ids``, generated by this process's engine."""
        from hybridflow.rollout.base import SamplingParams, submit

        params = SamplingParams(n=1, temperature=0.0, max_new_tokens=cfg.judge.max_tokens, stop_token_ids=self.stop_ids)
        return PendingReplies(submit(self.engine, ids, params), self.tokenizer, len(ids))


@dataclass
class PendingReplies:
    """The judge's replies, being generated."""

    pending: Any
    """``rollout.base.PendingBatch``."""
    tokenizer: Any
    count: int

    def texts(self) -> list[str]:
        """Each request's reply text, in request order (waits for the engine)."""
        texts = [""] * self.count
        for sample in self.pending.result().samples:
            texts[sample.prompt_index] = self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        return texts


@dataclass
class RemoteReplies:
    """A judge on GPUs of its own, answering: its replicas generate while the actor ranks go on."""

    remote: Remote

    def texts(self) -> list[str]:
        """Each request's reply text, in request order, on every actor rank (waits for them)."""
        return self.remote.result()


def judge_tokens(cfg) -> tuple[Any, Any, tuple[int, ...]]:
    """(the judge's checked source, its tokenizer, its stop token ids), from ``judge.path``."""
    from transformers import AutoTokenizer

    from hfschema.model_source import judge_source
    from hybridflow.runtime.session import stop_token_ids

    source, _ = judge_source(cfg.judge.path, cfg.judge.tp)
    tokenizer = AutoTokenizer.from_pretrained(str(source.files))
    return source, tokenizer, stop_token_ids(tokenizer, source.files)


def start_judge(cfg) -> Judge:
    """The judge's engine, started from ``judge.path``'s own weights on this rank's GPU on (rank 0
    calls it, or each replica's first rank of the judge's own GPUs)."""
    import os

    from hybridflow.rollout import make_engine
    from hybridflow.runtime import console
    from hybridflow.runtime.session import plain_engine_env

    source, tokenizer, stop_ids = judge_tokens(cfg)
    judge, rank = cfg.judge, int(os.environ.get("RANK", "0"))
    with console.engine_output(cfg.run.output_dir, rank, verbose=cfg.run.verbose), plain_engine_env():
        args = resolve(ENGINES[judge.engine].judge_args)(cfg, device=str(trainer_of(cfg).device()))
        engine = make_engine(judge.engine, model_path=str(source.weights), **args)
    return Judge(engine=engine, tokenizer=tokenizer, stop_ids=stop_ids)
