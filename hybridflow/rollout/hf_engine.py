"""The transformers engine: the reference for SGLang, and the engine of small runs.

```
generate(prompts, params)
   each prompt x params.n ──► rows, left-padded into one batch
   prefill: forward(rows) ─────────────► KV cache (DynamicCache)
   decode loop, one token per row and step:
       raw logits of the last position
        ├─ log_softmax(raw logits)[chosen]            ──► log-prob (unscaled distribution)
        └─ greedy (temperature 0), or /temperature, top-k, top-p, multinomial (seeded generator)
       a row ends at EOS or a stop token (kept; "stop"), or at max_new_tokens or the context
       ("length"); the loop ends when every row has
   MoE (return_routed_experts): top-k of each MoE layer's router logits at every fed position

push_weights(weights)   HF names, as held in memory (fused experts: mlp.experts.gate_up_proj)
                        or as in a checkpoint (mlp.experts.0.gate_proj.weight); every name and
                        shape is checked before any weight changes
```

Sampling is exact: the log-probs equal a teacher-forced forward over prompt + response.

Legend: R rows (prompts x n), S positions, V vocabulary, L MoE layers, k experts per token.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from .base import (
    FINISH_LENGTH,
    FINISH_STOP,
    RolloutBatch,
    RolloutSample,
    SamplingParams,
    WeightPushReport,
    memory_tags,
    register_engine,
)

__all__ = ["HFEngine", "PUSH_ROUTES", "sample_next"]

logger = logging.getLogger(__name__)

PUSH_ROUTES = ("full", "sliced")
"""Weight-push routes; one unsharded rank's slice is the whole tensor, so both move the same."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------- sampling


def _filter_top_k(logits_RV: torch.Tensor, top_k: int) -> torch.Tensor:
    if top_k < 0 or top_k >= logits_RV.shape[-1]:
        return logits_RV
    kth_R1 = torch.topk(logits_RV, top_k, dim=-1).values[:, -1:]
    return logits_RV.masked_fill(logits_RV < kth_R1, float("-inf"))


def _filter_top_p(logits_RV: torch.Tensor, top_p: float) -> torch.Tensor:
    if top_p >= 1.0:
        return logits_RV
    sorted_RV, order_RV = torch.sort(logits_RV, dim=-1, descending=True)
    probs_RV = torch.softmax(sorted_RV, dim=-1)
    # drop a token when the more likely ones already hold top_p; the first is always kept
    drop_RV = probs_RV.cumsum(dim=-1) - probs_RV >= top_p
    drop_RV = drop_RV.scatter(-1, order_RV, drop_RV)
    return logits_RV.masked_fill(drop_RV, float("-inf"))


def sample_next(
    logits_RV: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token of each row and its log-prob under ``log_softmax`` of the raw logits.

    Greedy (argmax) when ``params.temperature == 0``; otherwise temperature, then top-k, then
    top-p shape the distribution that is sampled from, but not the returned log-prob.
    """
    logits_RV = logits_RV.float()
    logprobs_RV = torch.log_softmax(logits_RV, dim=-1)
    if params.temperature == 0:
        tokens_R = logits_RV.argmax(dim=-1)
    else:
        shaped_RV = _filter_top_p(_filter_top_k(logits_RV / params.temperature, params.top_k), params.top_p)
        probs_RV = torch.softmax(shaped_RV, dim=-1)
        tokens_R = torch.multinomial(probs_RV, 1, generator=generator).squeeze(-1)
    return tokens_R, logprobs_RV.gather(-1, tokens_R[:, None]).squeeze(-1)


# --------------------------------------------------------------------------- decoding state


@dataclasses.dataclass(kw_only=True)
class _Row:
    """One response being generated."""

    prompt: tuple[int, ...]
    budget: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    experts: list[torch.Tensor] = dataclasses.field(default_factory=list)
    finish: str | None = None

    def add(self, token: int, logprob: float, stop_ids: frozenset[int]) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if token in stop_ids:
            self.finish = FINISH_STOP
        elif len(self.tokens) >= self.budget:
            self.finish = FINISH_LENGTH

    def sample(self, prompt_index: int, sample_index: int) -> RolloutSample:
        return RolloutSample(
            prompt_index=prompt_index,
            sample_index=sample_index,
            prompt_ids=self.prompt,
            response_ids=tuple(self.tokens),
            logprobs=tuple(self.logprobs),
            finish_reason=self.finish,
            routed_experts=torch.cat(self.experts) if self.experts else None,
        )


def _left_pad(prompts: Sequence[tuple[int, ...]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, S]`` ids and attention mask with each prompt at the right end."""
    length = max(len(p) for p in prompts)
    ids_RS = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    mask_RS = torch.zeros((len(prompts), length), dtype=torch.long)
    for r, prompt in enumerate(prompts):
        ids_RS[r, length - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask_RS[r, length - len(prompt) :] = 1
    return ids_RS.to(device), mask_RS.to(device)


def _eos_ids(model) -> frozenset[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


# --------------------------------------------------------------------------- weight pushes


def _check_push(weights: Mapping[str, object], expected: Mapping[str, torch.Tensor]) -> None:
    """ValueError naming the first pushed tensor whose name or shape ``expected`` lacks."""
    for name, tensor in weights.items():
        if not isinstance(tensor, torch.Tensor):
            problem = f"pushed weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor"
        elif name not in expected:
            problem = (
                f"pushed weight {name!r} is not a parameter of the engine's model "
                f"(names look like {sorted(expected)[:3]})"
            )
        elif tensor.shape != expected[name].shape:
            problem = (
                f"pushed weight {name!r} has shape {tuple(tensor.shape)}; the model's is {tuple(expected[name].shape)}"
            )
        else:
            continue
        raise ValueError(f"{problem}; the engine keeps its previous weights")


def _checkpoint_state(model) -> dict[str, torch.Tensor]:
    """The model's weights under checkpoint names (transformers' save-time conversion)."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(Path(tmp).glob("*.safetensors")):
            state.update(load_file(str(shard)))
    return state


def _reload(model, checkpoint: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """In-memory state dict of ``model``'s architecture loaded from checkpoint-named weights."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        model.config.save_pretrained(tmp)
        tensors = {k: v.contiguous() for k, v in checkpoint.items()}
        save_file(tensors, str(Path(tmp) / "model.safetensors"))
        fresh = AutoModelForCausalLM.from_pretrained(tmp, dtype=model.dtype)
    return fresh.state_dict()


# --------------------------------------------------------------------------- engine


class HFEngine:
    """A ``RolloutEngine`` over one transformers causal LM on one device."""

    def __init__(
        self,
        model,
        *,
        max_context: int,
        seed: int = 0,
        return_routed_experts: bool = False,
        weights_loaded: bool = True,
    ) -> None:
        self.model = model.eval()
        self.max_context = max_context
        self.eos_token_ids = _eos_ids(model)
        self.device = next(model.parameters()).device
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._top_k_experts = self._routed_top_k() if return_routed_experts else None
        self._pad_id = model.generation_config.pad_token_id or 0
        self._paused = False
        self._released = False
        self._needs_push = not weights_loaded  # load_format="dummy": the first push brings them

    def _routed_top_k(self) -> int:
        config = self.model.config
        if "num_experts_per_tok" not in config.to_dict():
            raise ValueError(
                f"return_routed_experts=True needs an MoE model; {config.model_type} has no num_experts_per_tok"
            )
        return config.num_experts_per_tok

    # ---- state

    def _check_alive(self) -> None:
        if self.model is None:
            raise RuntimeError("the engine is shut down")

    def _check_ready(self) -> None:
        self._check_alive()
        if self._paused:
            raise RuntimeError("the engine is paused; call resume() first")
        if self._released:
            raise RuntimeError("the engine's memory is released; call resume_memory() first")
        if self._needs_push:
            raise RuntimeError(
                "the engine holds no weights yet (it started with load_format='dummy'); "
                "push every tensor with push_weights() first"
            )

    def pause(self) -> None:
        """Refuse new ``generate`` calls until ``resume`` (calls are synchronous: none is in flight)."""
        self._paused = True

    def resume(self) -> None:
        """Accept ``generate`` calls again."""
        self._paused = False

    def flush_cache(self) -> None:
        """Nothing to drop: each ``generate`` call builds and frees its own KV cache."""

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """With the ``weights`` tag (default: all tags), move the weights to the CPU (they keep
        their values) and free the accelerator's cache; no-op on the CPU. The KV cache lives
        only inside each ``generate`` call, so the other tags free nothing."""
        if "weights" not in memory_tags(tags):
            return
        self._check_alive()
        if self.device.type != "cpu":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self._released = True

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """With the ``weights`` tag (default: all), move the weights back to the engine's device."""
        if "weights" not in memory_tags(tags):
            return
        self._check_alive()
        self.model.to(self.device)
        self._released = False

    def shutdown(self) -> None:
        """Drop the model; the engine refuses work afterwards."""
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- generation

    def _check_prompts(self, prompts: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        vocab = self.model.config.vocab_size
        checked = []
        for index, prompt in enumerate(prompts):
            prompt = tuple(int(t) for t in prompt)
            if not prompt:
                raise ValueError(f"prompt {index} is empty; give at least one token")
            if len(prompt) >= self.max_context:
                raise ValueError(
                    f"prompt {index} has {len(prompt)} tokens; the context holds {self.max_context} "
                    f"(max_context), which leaves no room for a response"
                )
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {index} has token id {bad[0]} outside the vocabulary [0, {vocab})")
            checked.append(prompt)
        if not checked:
            raise ValueError("generate needs at least one prompt")
        return checked

    def _forward(self, ids_RS: torch.Tensor, mask_RS: torch.Tensor, cache):
        """Last-position logits ``[R, V]`` and per-layer router logits (or None)."""
        positions_RS = (mask_RS.cumsum(-1) - 1).clamp(min=0)[:, -ids_RS.shape[1] :]
        inputs = dict(
            input_ids=ids_RS, attention_mask=mask_RS, position_ids=positions_RS, past_key_values=cache, use_cache=True
        )
        if self._top_k_experts is None:
            return self.model(**inputs, logits_to_keep=1).logits[:, -1], None
        # The causal-LM head would also compute the router aux loss, which cannot take a cached
        # step's mask; ask the decoder for the router logits and apply the LM head here.
        out = self.model.get_decoder()(**inputs, output_router_logits=True)
        return self.model.get_output_embeddings()(out.last_hidden_state[:, -1]), out.router_logits

    def _record_experts(self, rows: list[_Row], router_logits, ids_RS: torch.Tensor, mask_RS: torch.Tensor) -> None:
        """Append the experts each open row's fed (non-pad) tokens were routed to."""
        if router_logits is None:
            return
        k = self._top_k_experts
        # each layer's router logits are [R * S, E]; top-k of the logits = top-k of the softmax
        experts_RSLk = (
            torch.stack(
                [torch.topk(layer, k, dim=-1).indices.reshape(*ids_RS.shape, k) for layer in router_logits], dim=2
            )
            .to(torch.int32)
            .cpu()
        )
        fed_RS = mask_RS[:, -ids_RS.shape[1] :].bool().cpu()
        for r, row in enumerate(rows):
            if row.finish is None:
                row.experts.append(experts_RSLk[r][fed_RS[r]])

    def _decode(self, prompts: list[tuple[int, ...]], params: SamplingParams) -> list[_Row]:
        from transformers import DynamicCache

        # the context caps a response like max_new_tokens does ("length")
        rows = [_Row(prompt=p, budget=min(params.max_new_tokens, self.max_context - len(p))) for p in prompts]
        stop_ids = self.eos_token_ids | frozenset(params.stop_token_ids)
        generator = self._generator
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        ids_RS, mask_RS = _left_pad(prompts, self._pad_id, self.device)
        cache = DynamicCache(config=self.model.config)
        logits_RV, router_logits = self._forward(ids_RS, mask_RS, cache)
        self._record_experts(rows, router_logits, ids_RS, mask_RS)
        while True:
            tokens_R, logprobs_R = sample_next(logits_RV, params, generator)
            for row, token, logprob in zip(rows, tokens_R.tolist(), logprobs_R.tolist()):
                if row.finish is None:
                    row.add(token, logprob, stop_ids)
            if all(row.finish is not None for row in rows):
                return rows
            ids_RS = tokens_R[:, None]
            mask_RS = torch.cat([mask_RS, mask_RS.new_ones((len(rows), 1))], dim=1)
            logits_RV, router_logits = self._forward(ids_RS, mask_RS, cache)
            self._record_experts(rows, router_logits, ids_RS, mask_RS)

    @torch.no_grad()
    def reseed(self, seed: int) -> None:
        """Reset the generator used by calls without ``SamplingParams.seed``."""
        self._generator.manual_seed(int(seed))

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutBatch:
        """``params.n`` samples of each prompt, prompt-major; all rows decode as one batch."""
        self._check_ready()
        started = time.perf_counter()
        checked = self._check_prompts(prompts)
        rows = self._decode([p for p in checked for _ in range(params.n)], params)
        samples = tuple(row.sample(r // params.n, r % params.n) for r, row in enumerate(rows))
        return RolloutBatch(samples=samples, seconds=time.perf_counter() - started)

    # ---- weights

    def push_weights(self, weights: Mapping[str, torch.Tensor], *, route: str = "full") -> WeightPushReport:
        """Load HF-named tensors (all of the model's or some), in-memory or checkpoint names.

        Names and shapes are all checked first: a bad one is a ValueError naming it, and the
        engine keeps its previous weights. Checkpoint names (per-expert MoE weights) go through
        transformers' own loading conversion, by way of a temporary safetensors checkpoint.
        """
        self._check_alive()
        if route not in PUSH_ROUTES:
            raise ValueError(f"push route {route!r} is not one of: {', '.join(PUSH_ROUTES)}")
        if not weights:
            raise ValueError("push_weights got no tensors")
        started = time.perf_counter()
        live = self.model.state_dict()
        if set(weights) <= set(live):
            _check_push(weights, live)
            self._copy_in(live, weights)
        else:
            self._copy_in(live, self._from_checkpoint_names(weights, live))
        self._needs_push = False
        pushed = sum(t.numel() * t.element_size() for t in weights.values())
        seconds = time.perf_counter() - started
        logger.debug("pushed %d tensors (%d bytes) in %.3f s", len(weights), pushed, seconds)
        return WeightPushReport(seconds=seconds, bytes_per_rank=(pushed,), route=route)

    def _from_checkpoint_names(
        self, weights: Mapping[str, torch.Tensor], live: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The full in-memory state after loading checkpoint-named ``weights`` over the current."""
        checkpoint = _checkpoint_state(self.model)
        # Name the bad tensor in whichever naming the push follows more closely.
        unknown_live, unknown_checkpoint = (len(set(weights) - set(n)) for n in (live, checkpoint))
        _check_push(weights, live if unknown_live < unknown_checkpoint else checkpoint)
        checkpoint.update({k: v.detach().to("cpu", checkpoint[k].dtype) for k, v in weights.items()})
        return _reload(self.model, checkpoint)

    @staticmethod
    def _copy_in(live: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in weights.items():
                live[name].copy_(tensor)


@register_engine("hf")
def _start(
    model_path: str,
    *,
    max_context: int | None = None,
    dtype: str = "float32",
    seed: int = 0,
    device: str = "cpu",
    return_routed_experts: bool = False,
    load_format: str = "auto",
) -> HFEngine:
    """An ``HFEngine`` on the transformers model in ``model_path``.

    ``max_context`` caps prompt + response (default: the model's max_position_embeddings);
    ``seed`` seeds sampling for calls without ``SamplingParams.seed``; ``return_routed_experts``
    (MoE models) fills ``RolloutSample.routed_experts``; ``load_format="dummy"`` builds the model
    from its config alone (a directory without weights, as runs write it): ``generate`` then
    refuses until the first ``push_weights`` filled every tensor.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of: {', '.join(_DTYPES)}")
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format={load_format!r} is not one of: auto, dummy")
    if load_format == "dummy":
        config = AutoConfig.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_config(config, dtype=_DTYPES[dtype]).to(device)
        if (Path(model_path) / "generation_config.json").exists():  # its stop ids, as from_pretrained reads them
            from transformers import GenerationConfig

            model.generation_config = GenerationConfig.from_pretrained(model_path)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=_DTYPES[dtype]).to(device)
    logger.info("hf engine: %s (%s) on %s", model_path, dtype, device)
    limit = model.config.max_position_embeddings
    if max_context is None:
        max_context = limit
    if not 1 < max_context <= limit:
        raise ValueError(f"max_context={max_context} must be in 2..{limit} (the model's max_position_embeddings)")
    return HFEngine(
        model,
        max_context=max_context,
        seed=seed,
        return_routed_experts=return_routed_experts,
        weights_loaded=load_format != "dummy",
    )
