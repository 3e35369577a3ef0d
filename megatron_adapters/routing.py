"""Routing replay, router statistics and router freezing on megatron-core's own routers.

```
transformer_config(moe=...)  moe_enable_routing_replay: every TopKRouter gets a RouterReplay
                             (megatron-core 0.16.1, transformer/moe/router_replay.py)
RouterControl(chunks)        finds each chunk's routers and their global MoE-layer index
  one pass = forward_logprobs or train_step:
    begin_pass ─► per micro-batch and model chunk, in the schedule's order:
      before_forward: batch has routed_experts ─► RouterReplay: set_target_indices(to_router_order
                      (table of layer l)) + REPLAY_FORWARD;   record=True ─► RECORD;  else off
      (model forward; a forward hook on each router adds its statistics)
      after_forward:  RECORD ─► get_recorded_indices() [N, k] ─► from_router_order ─► local table
    end_pass ─► all-reduce over every rank (each (row, position, layer) is routed on exactly one
                rank): the recorded [B, T, L, k] table (max over -1 fill) and the stat sums
```

The statistics hook recomputes the router's logits from its input and, where a reference route
exists, the natural top-k through megatron's own ``topk_routing_with_score_function`` (no
replay), so the top-k mismatch compares what the router would choose with what it was told.
The replay match is read from the routing map the router returned — what was dispatched.

Freezing: the router weight (and bias) stop requiring gradients before DDP and the optimizer are
built, and the expert-bias update rate is 0 in the transformer config.

Legend: B rows, T positions, L MoE layers, k experts per token, b micro-batch rows, S positions
on this TP rank, N = S * b router tokens, E experts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from hfschema.layout import ParallelLayout
from hfschema.model import ModelConfig
from hfschema.train import MoEConfig
from moe.routes import (
    UNROUTED,
    check_suffix_unrouted,
    fill_unrouted,
    from_router_order,
    moe_layer_index,
    to_router_order,
)
from moe.stats import RouterStats, router_probs, routing_map_topk, topk_differs

__all__ = ["ROUTES_KEY", "VALID_KEY", "RouterControl", "moe_config_fields"]

ROUTES_KEY = "routed_experts"
"""Batch key of a ``[B, T, L, k]`` routing table; a batch that carries one is replayed."""
VALID_KEY = "attention_mask"
"""Batch key of ``[B, T]`` real-token flags; statistics count only these tokens when present."""


def moe_config_fields(moe: MoEConfig | None) -> dict[str, Any]:
    """megatron ``TransformerConfig`` fields for ``moe`` (None: replay off, no router losses)."""
    if moe is None:
        return {}
    return {
        "moe_enable_routing_replay": moe.routing_replay != "off",
        "moe_router_bias_update_rate": moe.bias_update_rate,
        "moe_router_load_balancing_type": "aux_loss" if moe.aux_loss_coef > 0 else "none",
        "moe_aux_loss_coeff": moe.aux_loss_coef,
        "moe_z_loss_coeff": moe.z_loss_coef or None,
    }


@dataclasses.dataclass
class _Call:
    """Where the tokens of one router call sit in the pass's tables."""

    layer: int
    rows: slice
    positions: slice
    valid_N: torch.Tensor
    target_Nk: torch.Tensor | None
    replayed: bool


@dataclasses.dataclass
class _Pass:
    kind: str
    record: bool
    rows: int
    row_offset: int
    length: int
    micro_rows: int
    local_rows: bool = False
    """The tables cover this DP rank's rows only (completed over its model-parallel group)."""
    micro_index: dict[int, int] = dataclasses.field(default_factory=dict)
    table_BTLk: torch.Tensor | None = None
    flags_BTL: torch.Tensor | None = None
    stats: RouterStats | None = None


class RouterControl:
    """Replay, recording and statistics for the routers of one policy's model chunks."""

    def __init__(
        self,
        chunks: list,
        model: ModelConfig,
        layout: ParallelLayout,
        moe: MoEConfig,
        *,
        tp_rank: int,
        device: torch.device,
    ) -> None:
        if layout.cp > 1:
            raise ValueError(f"routing replay / router statistics map tokens for cp=1 only (cp={layout.cp})")
        self.model = model
        self.moe = moe
        self.device = device
        """The policy's device: recorded tables and statistics live there (collectives on it)."""
        self.tp_size, self.tp_rank = layout.tp, tp_rank
        self.num_layers = model.num_layers - model.first_k_dense_layers
        self.routers: dict[int, list[tuple[int, TopKRouter]]] = {}
        for chunk in chunks:
            self.routers[id(chunk)] = _chunk_routers(chunk, model.first_k_dense_layers)
        self._pass: _Pass | None = None
        self._calls: dict[int, _Call] = {}
        self._step: dict[str, RouterStats] = {}
        self._any_layer: dict[str, torch.Tensor] = {}
        self.recorded: torch.Tensor | None = None
        self.last_stats: dict[str, RouterStats] = {}
        """The per-pass-kind statistics ``pop_metrics`` last reported (all-reduced)."""
        if moe.freeze_router:
            self.freeze()
        if moe.router_stats:
            for pairs in self.routers.values():
                for _, router in pairs:
                    router.register_forward_hook(self._stats_hook)

    def rebind(self, chunks: list) -> None:
        """Key the routers by the wrapped chunks (DDP) that the schedule passes to the forward."""
        self.routers = {id(chunk): self.routers[id(getattr(chunk, "module", chunk))] for chunk in chunks}

    def freeze(self) -> None:
        """No gradient for the router weight (and bias); call before DDP and the optimizer."""
        for pairs in self.routers.values():
            for _, router in pairs:
                router.weight.requires_grad_(False)
                if router.bias is not None:
                    router.bias.requires_grad_(False)

    # ------------------------------------------------------------------------ a pass

    def begin_pass(
        self,
        kind: str,
        *,
        rows: int,
        row_offset: int,
        length: int,
        micro_rows: int,
        record: bool,
        routes: torch.Tensor | None,
        local_rows: bool = False,
    ) -> None:
        """Start a forward pass over ``rows`` global rows of ``length`` positions, this DP rank's
        from ``row_offset``; ``routes`` is this rank's ``[b, T, L, k]`` replay table or None.
        ``local_rows``: the ``rows`` are this DP rank's alone, and so is the recorded table."""
        if routes is not None:
            self._check_routes(routes, record)
        p = _Pass(
            kind=kind,
            record=record,
            rows=rows,
            row_offset=row_offset,
            length=length,
            micro_rows=micro_rows,
            local_rows=local_rows,
        )
        if record:
            if self.moe.routing_replay == "off":
                raise ValueError("recording routes needs moe.routing_replay=r2 or r3 (megatron's RouterReplay)")
            p.table_BTLk = torch.full(
                (rows, length, self.num_layers, self.model.moe_top_k), UNROUTED, dtype=torch.long, device=self.device
            )
        if self.moe.router_stats:
            p.stats = RouterStats(self.num_layers, self.model.num_experts, self.model.moe_top_k, device=self.device)
            p.flags_BTL = torch.full((rows, length, self.num_layers), -1, dtype=torch.int32, device=self.device)
        self._pass = p

    def before_forward(self, chunk, micro: dict[str, torch.Tensor]) -> None:
        """Set each router of ``chunk`` for this micro-batch (the next one this chunk sees)."""
        p = self._pass
        index = p.micro_index.get(id(chunk), 0)
        p.micro_index[id(chunk)] = index + 1
        start = p.row_offset + index * p.micro_rows
        padded = micro["input_ids"].shape[1]
        span = padded // self.tp_size if self.tp_size > 1 else padded
        first = self.tp_rank * span if self.tp_size > 1 else 0
        rows, positions = slice(start, start + micro["input_ids"].shape[0]), slice(first, first + span)
        valid_N = self._valid(micro, p.length)
        table = micro.get(ROUTES_KEY)
        for layer, router in self.routers[id(chunk)]:
            target = None if table is None else self._order(table[:, :, layer])
            self._set_router(router.router_replay, target, p.record)
            self._calls[id(router)] = _Call(
                layer=layer,
                rows=rows,
                positions=positions,
                valid_N=valid_N,
                target_Nk=target,
                replayed=target is not None,
            )

    def after_forward(self, chunk) -> None:
        """Collect what the routers of ``chunk`` recorded; leave their replay state empty."""
        p = self._pass
        for layer, router in self.routers[id(chunk)]:
            replay = router.router_replay
            call = self._calls.pop(id(router))
            if p.record:
                recorded_bSk = from_router_order(replay.get_recorded_indices(), call.rows.stop - call.rows.start)
                view_bSk = p.table_BTLk[call.rows, call.positions, layer]  # the policy's padding cut off
                view_bSk.copy_(recorded_bSk[:, : view_bSk.shape[1]])
            if replay is not None:
                replay.clear_indices()
                replay.clear_router_replay_action()

    def end_pass(self) -> None:
        """Combine every rank's share: the tables over the ranks that hold the same rows (every
        rank for the global batch, the model-parallel group for DP-local rows), the statistics
        over every rank."""
        p, self._pass = self._pass, None
        same_rows = parallel_state.get_model_parallel_group() if p.local_rows else None
        if p.record:
            dist.all_reduce(p.table_BTLk, op=dist.ReduceOp.MAX, group=same_rows)
            self.recorded = p.table_BTLk
        if p.stats is None:
            return
        dist.all_reduce(p.stats.sums)
        dist.all_reduce(p.flags_BTL, op=dist.ReduceOp.MAX, group=same_rows)
        self._merge(
            p.kind, p.stats, p.flags_BTL, other_rows=parallel_state.get_data_parallel_group() if p.local_rows else None
        )

    # ------------------------------------------------------------------------ results

    def take_recorded(self) -> torch.Tensor:
        """The ``[B, T, L, k]`` table the last recording pass produced, on the host."""
        if self.recorded is None:
            raise RuntimeError("no recorded routes: call forward_logprobs(..., record_routes=True) first")
        table, self.recorded = self.recorded, None
        return table.cpu()  # a runtime field, on the host like the batch it joins

    def pop_metrics(self, *, per_layer: bool = True) -> dict[str, float]:
        """``moe/<pass>/...`` statistics of the passes since the last call (same on every rank);
        the sums behind them stay in ``last_stats``."""
        out: dict[str, float] = {}
        for stats in self._step.values():
            stats.sums = stats.sums.cpu()  # one host copy per pass kind, then plain reads
        self.last_stats = dict(self._step)
        for kind, stats in sorted(self._step.items()):
            out.update(stats.metrics(f"moe/{kind}", per_layer=per_layer))
            compared, differs = (float(x) for x in self._any_layer[kind])
            if compared:
                out[f"moe/{kind}/topk_mismatch_any_layer"] = differs / compared
        self._step.clear()
        self._any_layer.clear()
        return out

    # ------------------------------------------------------------------------ pieces

    def _check_routes(self, routes: torch.Tensor, record: bool) -> None:
        if record:
            raise ValueError("a pass either records routes or replays them, not both")
        if self.moe.routing_replay == "off":
            raise ValueError(f"the batch carries {ROUTES_KEY} but moe.routing_replay=off built no RouterReplay")
        want = (self.num_layers, self.model.moe_top_k)
        if routes.dim() != 4 or tuple(routes.shape[2:]) != want:
            raise ValueError(
                f"{ROUTES_KEY} of shape {tuple(routes.shape)} is not [B, T, L, k] with "
                f"(L, k) = {want} (MoE layers, model.moe_top_k)"
            )
        check_suffix_unrouted(routes)

    def _order(self, table_bTk: torch.Tensor) -> torch.Tensor:
        return to_router_order(
            table_bTk, tp_size=self.tp_size, tp_rank=self.tp_rank, sequence_parallel=self.tp_size > 1
        )

    def _valid(self, micro: dict[str, torch.Tensor], length: int) -> torch.Tensor:
        ids = micro["input_ids"]
        valid_bT = torch.arange(ids.shape[1], device=ids.device)[None, :] < length
        if VALID_KEY in micro:
            valid_bT = valid_bT & micro[VALID_KEY].bool()
        return self._order(valid_bT.expand_as(ids)[..., None])[:, 0]

    @staticmethod
    def _set_router(replay, target_Nk: torch.Tensor | None, record: bool) -> None:
        if replay is None:
            return
        replay.clear_indices()
        if target_Nk is not None:
            replay.set_target_indices(fill_unrouted(target_Nk))
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        elif record:
            replay.set_router_replay_action(RouterReplayAction.RECORD)
        else:
            replay.clear_router_replay_action()

    def _stats_hook(self, router: TopKRouter, args, output) -> None:
        call, p = self._calls.get(id(router)), self._pass
        if call is None or p is None or p.stats is None:
            return
        with torch.no_grad():
            logits_NE = router.gating(args[0].detach()).reshape(-1, router.num_experts)
            natural_Nk = None if call.target_Nk is None else _natural_topk(router, logits_NE)
            p.stats.add(
                call.layer,
                routing_map_NE=output[1],
                probs_NE=router_probs(logits_NE, router.score_function),
                valid_N=call.valid_N,
                natural_Nk=natural_Nk,
                target_Nk=call.target_Nk,
                replayed=call.replayed,
            )
            if natural_Nk is not None:
                self._flag(p, call, natural_Nk)

    def _flag(self, p: _Pass, call: _Call, natural_Nk: torch.Tensor) -> None:
        """1 / 0 where a compared token's natural top-k differs / agrees, in the [B, T, L] flags."""
        compared_N = call.valid_N & (call.target_Nk >= 0).all(dim=-1)
        flags_N = torch.where(compared_N, topk_differs(natural_Nk, call.target_Nk).int(), -1)
        flags_bS = from_router_order(flags_N[:, None], call.rows.stop - call.rows.start)[..., 0]
        view_bS = p.flags_BTL[call.rows, call.positions, call.layer]
        view_bS.copy_(flags_bS[:, : view_bS.shape[1]])

    def _merge(self, kind: str, stats: RouterStats, flags_BTL: torch.Tensor, *, other_rows=None) -> None:
        """Add a pass's statistics; ``other_rows``: the group over which the DP ranks' flag
        counts still add up (each DP rank's flags cover its own rows only)."""
        if kind in self._step:
            self._step[kind].sums += stats.sums
        else:
            self._step[kind] = stats
        compared_BT = (flags_BTL >= 0).any(dim=-1)
        differs_BT = (flags_BTL == 1).any(dim=-1)
        counts = torch.stack([compared_BT.sum(), differs_BT.sum()]).double()
        if other_rows is not None:
            dist.all_reduce(counts, group=other_rows)
        self._any_layer[kind] = self._any_layer.get(kind, torch.zeros_like(counts)) + counts


def _chunk_routers(chunk, first_k_dense: int) -> list[tuple[int, TopKRouter]]:
    """(MoE-layer index, router) of every MoE layer in one model chunk."""
    module = getattr(chunk, "module", chunk)
    decoder = getattr(module, "decoder", None)
    pairs = []
    for layer in decoder.layers if decoder is not None else []:
        router = getattr(layer.mlp, "router", None)
        if isinstance(router, TopKRouter):
            pairs.append((moe_layer_index(layer.layer_number, first_k_dense), router))
    return pairs


def _natural_topk(router: TopKRouter, logits_NE: torch.Tensor) -> torch.Tensor:
    """The experts the router would choose for these logits, replay or not."""
    config = router.config
    _, map_NE = topk_routing_with_score_function(
        logits_NE,
        router.topk,
        use_pre_softmax=config.moe_router_pre_softmax,
        num_groups=config.moe_router_num_groups,
        group_topk=config.moe_router_group_topk,
        scaling_factor=config.moe_router_topk_scaling_factor,
        score_function=router.score_function,
        expert_bias=router.expert_bias,
        fused=False,
        router_replay=None,
    )
    return routing_map_topk(map_NE, router.topk)
