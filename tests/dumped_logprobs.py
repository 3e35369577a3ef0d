"""The trainer's dumped log-probs (``hybridflow.runtime.ops.DUMP_ENV``) against transformers'.

Each rank of a run started with the dump hook writes ``rank<r>.pt`` at its first RL step: the
rows' token ids and masks and the trainer's log-probs. ``worst_difference`` scores every response
token of those rows with a transformers model and returns the largest gap.
"""

from __future__ import annotations

from pathlib import Path

import torch


def transformers_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """Log-prob of each token given the ones before it (position t scores token t + 1), fp64."""
    with torch.no_grad():
        logits = model(ids.unsqueeze(0)).logits[0].double()
    return torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:].unsqueeze(1)).squeeze(1)


def worst_difference(model, dump: Path) -> tuple[float, int]:
    """(largest |transformers - trainer| log-prob, response tokens scored) over the dumped rows."""
    worst, scored = 0.0, 0
    for part in sorted(dump.glob("rank*.pt")):
        rows = torch.load(part)
        for b in range(rows["input_ids"].shape[0]):
            real = rows["attention_mask"][b].bool()
            ids = rows["input_ids"][b][real]
            at = rows["response_mask"][b][real].bool().nonzero().flatten()
            got = rows["trainer_logprobs"][b][real][at].double()
            worst = max(worst, (got - transformers_logprobs(model, ids)[at - 1]).abs().max().item())
            scored += len(at)
    return worst, scored
