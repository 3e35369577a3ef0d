"""A stand-in engine for multi-turn tests: each trajectory's turns are scripted token ids."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from hybridflow.rollout.base import FINISH_LENGTH, FINISH_STOP, RolloutBatch, RolloutSample, SamplingParams


class ScriptedEngine:
    """``generate`` answers each context with the next scripted turn of the trajectory whose
    prompt it starts with: (ids, log-probs); it records every call's contexts."""

    def __init__(
        self, scripts: dict[tuple[int, ...], list[tuple[list[int], list[float]]]], end_id: int, *, routes: bool = False
    ) -> None:
        self.scripts, self.end_id, self.routes = {k: list(v) for k, v in scripts.items()}, end_id, routes
        self.calls: list[list[list[int]]] = []
        self.on_call: Callable[[int], None] | None = None
        self._lock = threading.Lock()

    @staticmethod
    def _routes(fed: list[int]):
        """SGLang's layout, ``[fed tokens but the last, 2 layers, top-2]``: token id mod 4 and the
        next expert in layer 0, reversed in layer 1 (a function of the token, so a test can
        check which positions the routes belong to)."""
        import torch

        first = torch.tensor(fed[:-1]) % 4
        layer = torch.stack([first, (first + 1) % 4], dim=-1)
        return torch.stack([layer, layer.flip(-1)], dim=1)

    def shutdown(self) -> None:
        pass

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutBatch:
        with self._lock:
            self.calls.append([list(p) for p in prompts])
            if self.on_call is not None:
                self.on_call(len(self.calls))
            samples = []
            for index, context in enumerate(prompts):
                key = next(k for k in self.scripts if tuple(context[: len(k)]) == k)
                ids, logprobs = self.scripts[key].pop(0)
                ids, logprobs = ids[: params.max_new_tokens], logprobs[: params.max_new_tokens]
                ended = ids[-1] == self.end_id
                samples.append(
                    RolloutSample(
                        prompt_index=index,
                        sample_index=0,
                        prompt_ids=tuple(context),
                        response_ids=tuple(ids),
                        logprobs=tuple(logprobs),
                        finish_reason=FINISH_STOP if ended else FINISH_LENGTH,
                        routed_experts=self._routes(list(context) + list(ids)) if self.routes else None,
                    )
                )
            return RolloutBatch(samples=tuple(samples), seconds=0.0)
