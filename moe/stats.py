"""Router statistics as plain tensor functions, a per-layer accumulator, and a run summary.

```
each router call (megatron_adapters.routing)                 per pass, then per RL step
  routing_map [N, E], router logits [N, E], valid [N]   ──►  RouterStats.add(layer, ...)
  natural top-k [N, k] (what the router would choose)          │ sums [L, E + F] (all-reduced
  target top-k [N, k] (the rollout's / recorded route)         │ over ranks: tokens are disjoint)
                                                               ▼
                             RouterStats.metrics(): moe/<pass>/load_max_mean, load_cv,
                             router_entropy, dropped_frac, topk_mismatch, replay_match (+ per layer)
                                                               │ history of every step
                                                               ▼
                                                summarise(history) -> summary.json["moe"]
```

Definitions (tokens are the valid ones: real tokens of the batch):

- tokens per expert: how many (token, slot) assignments each expert received; sums to
  k x tokens without capacity dropping;
- load imbalance: max / mean of tokens per expert (1 = perfectly even), and the coefficient of
  variation std / mean (population std);
- router entropy: mean over tokens of the entropy (nats) of the router's distribution over all
  experts: softmax of the logits, or for sigmoid routers the sigmoid scores normalised to sum 1;
- dropped: assignments removed by the capacity factor, as a fraction of k x tokens;
- top-k mismatch: fraction of tokens whose set of top-k experts (natural routing of this forward)
  differs from the reference route (rollout engine or recorded); order inside the set is ignored;
- replay match: fraction of tokens whose dispatched experts equal the replay target.

Legend: N tokens, E experts, k experts per token, L MoE layers, F scalar sums per layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = [
    "RouterStats",
    "load_imbalance",
    "router_entropy",
    "router_probs",
    "routing_map_topk",
    "summarise",
    "tokens_per_expert",
    "topk_differs",
]


def tokens_per_expert(experts_Nk: torch.Tensor, num_experts: int, valid_N: torch.Tensor | None = None) -> torch.Tensor:
    """``[E]`` count of (token, slot) assignments per expert over valid tokens."""
    if valid_N is not None:
        experts_Nk = experts_Nk[valid_N]
    return torch.bincount(experts_Nk.reshape(-1).long(), minlength=num_experts).float()


def load_imbalance(counts_E: torch.Tensor) -> tuple[float, float]:
    """(max / mean, std / mean) of tokens per expert; (1, 0) for an empty count."""
    counts_E = counts_E.double()
    mean = counts_E.mean()
    if mean <= 0:
        return 1.0, 0.0
    return float(counts_E.max() / mean), float(counts_E.std(unbiased=False) / mean)


def router_probs(logits_NE: torch.Tensor, score_function: str) -> torch.Tensor:
    """The router's distribution over all experts: softmax, or sigmoid scores normalised."""
    logits_NE = logits_NE.float()
    if score_function == "softmax":
        return torch.softmax(logits_NE, dim=-1)
    if score_function == "sigmoid":
        scores_NE = torch.sigmoid(logits_NE)
        return scores_NE / scores_NE.sum(dim=-1, keepdim=True)
    raise ValueError(f"score function {score_function!r} is not softmax or sigmoid")


def router_entropy(probs_NE: torch.Tensor) -> torch.Tensor:
    """``[N]`` entropy in nats of each token's router distribution."""
    return -(probs_NE * torch.log(probs_NE.clamp(min=1e-30))).sum(dim=-1)


def topk_differs(a_Nk: torch.Tensor, b_Nk: torch.Tensor) -> torch.Tensor:
    """``[N]`` True where the two sets of experts differ (order ignored)."""
    return (a_Nk.sort(dim=-1).values != b_Nk.sort(dim=-1).values).any(dim=-1)


def routing_map_topk(routing_map_NE: torch.Tensor, k: int) -> torch.Tensor:
    """``[N, k]`` experts marked in a routing map (ascending; -1 fills dropped slots)."""
    experts_E = torch.arange(routing_map_NE.shape[-1], device=routing_map_NE.device)
    # experts where the map is set, the rest pushed past the end, then the k smallest
    keyed_NE = torch.where(routing_map_NE.bool(), experts_E, experts_E.new_tensor(routing_map_NE.shape[-1]))
    chosen_Nk = keyed_NE.sort(dim=-1).values[:, :k]
    return torch.where(chosen_Nk < routing_map_NE.shape[-1], chosen_Nk, chosen_Nk.new_tensor(-1))


# per-layer scalar sums, one column each after the E expert counts
_TOKENS, _ENTROPY, _DROPPED, _COMPARED, _DIFFERS, _REPLAYED, _MATCHED = range(7)
_NUM_FIELDS = 7


class RouterStats:
    """Per-layer sums over the router calls of one pass; add, all-reduce ``sums``, read metrics."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, device: torch.device | str = "cpu") -> None:
        self.num_experts = num_experts
        self.top_k = top_k
        self.sums = torch.zeros(num_layers, num_experts + _NUM_FIELDS, dtype=torch.float64, device=device)
        """``[L, E + F]``: tokens per expert, then the scalar sums (summable across ranks), on
        the device of the router's tokens: ``add`` never waits for the device."""

    def add(
        self,
        layer: int,
        *,
        routing_map_NE: torch.Tensor,
        probs_NE: torch.Tensor,
        valid_N: torch.Tensor,
        natural_Nk: torch.Tensor | None = None,
        target_Nk: torch.Tensor | None = None,
        replayed: bool = False,
    ) -> None:
        """One router call's tokens; ``target_Nk`` rows < 0 have no reference and are not compared."""
        row = self.sums[layer]
        valid_N = valid_N.bool()
        map_NE = routing_map_NE.bool()[valid_N]
        row[: self.num_experts] += map_NE.sum(dim=0).to(row)
        fields = row[self.num_experts :]
        tokens = valid_N.sum().to(row)
        fields[_TOKENS] += tokens
        fields[_ENTROPY] += router_entropy(probs_NE[valid_N]).sum().to(row)
        fields[_DROPPED] += tokens * self.top_k - map_NE.sum().to(row)
        if target_Nk is None:
            return
        compared_N = valid_N & (target_Nk >= 0).all(dim=-1)
        if natural_Nk is not None:
            fields[_COMPARED] += compared_N.sum().to(row)
            fields[_DIFFERS] += topk_differs(natural_Nk, target_Nk)[compared_N].sum().to(row)
        if replayed:
            used_Nk = routing_map_topk(routing_map_NE, self.top_k)
            fields[_REPLAYED] += compared_N.sum().to(row)
            fields[_MATCHED] += (~topk_differs(used_Nk, target_Nk))[compared_N].sum().to(row)

    def totals(self) -> dict[str, float]:
        """The scalar sums over all layers: tokens, entropy, dropped, compared, differs, replayed,
        matched (counts of (token, layer) pairs)."""
        names = ("tokens", "entropy", "dropped", "compared", "differs", "replayed", "matched")
        return {name: float(self._field(i).sum()) for i, name in enumerate(names)}

    def counts(self) -> torch.Tensor:
        """``[L, E]`` tokens per expert."""
        return self.sums[:, : self.num_experts]

    def _field(self, index: int) -> torch.Tensor:
        return self.sums[:, self.num_experts + index]

    def layer_metrics(self) -> list[dict[str, float]]:
        """Each layer's statistics (keys absent where nothing was measured)."""
        out = []
        for layer in range(self.sums.shape[0]):
            tokens = float(self._field(_TOKENS)[layer])
            if tokens == 0:
                out.append({})
                continue
            peak, cv = load_imbalance(self.counts()[layer])
            m = {
                "load_max_mean": peak,
                "load_cv": cv,
                "router_entropy": float(self._field(_ENTROPY)[layer]) / tokens,
                "dropped_frac": float(self._field(_DROPPED)[layer]) / (tokens * self.top_k),
            }
            for name, num, den in (("topk_mismatch", _DIFFERS, _COMPARED), ("replay_match", _MATCHED, _REPLAYED)):
                if float(self._field(den)[layer]) > 0:
                    m[name] = float(self._field(num)[layer]) / float(self._field(den)[layer])
            out.append(m)
        return out

    def metrics(self, prefix: str, *, per_layer: bool = True) -> dict[str, float]:
        """``{prefix}/{stat}`` averaged over layers (and ``{prefix}/layer{l}/{stat}``)."""
        layers = self.layer_metrics()
        out: dict[str, float] = {}
        for name in sorted({key for m in layers for key in m}):
            values = [m[name] for m in layers if name in m]
            out[f"{prefix}/{name}"] = sum(values) / len(values)
        if per_layer:
            for index, m in enumerate(layers):
                out.update({f"{prefix}/layer{index}/{name}": value for name, value in m.items()})
        return out


def summarise(history: Sequence[Mapping[str, float]], prefix: str = "moe/") -> dict[str, dict[str, float]]:
    """End-of-run view of every layer-averaged ``moe/`` metric: first, last, mean and max over steps."""
    names = sorted({k for h in history for k in h if k.startswith(prefix) and "/layer" not in k})
    out = {}
    for name in names:
        values = [float(h[name]) for h in history if name in h]
        out[name] = {"first": values[0], "last": values[-1], "mean": sum(values) / len(values), "max": max(values)}
    return out
