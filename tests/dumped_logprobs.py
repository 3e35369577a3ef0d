"""The trainer's dumped log-probs (``tests.injection``: ``DUMP_LOGPROBS``) against transformers'.

Each rank of a run started with the dump hook writes ``step_<k>/rank<r>.pt`` at each RL step: the
rows' token ids and masks and the trainer's log-probs. ``worst_difference`` scores every response
token of those rows with a transformers model and returns the largest gap; ``by_tokens`` and
``layout_difference`` compare two runs' dumps of one step row by row, whatever their layouts.
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
    """(largest |transformers - trainer| log-prob, response tokens scored) over the dumped rows:
    of every step under ``dump``, or of one step's folder."""
    worst, scored = 0.0, 0
    for part in sorted(dump.rglob("rank*.pt")):
        rows = torch.load(part)
        for b in range(rows["input_ids"].shape[0]):
            real = rows["attention_mask"][b].bool()
            ids = rows["input_ids"][b][real]
            at = rows["response_mask"][b][real].bool().nonzero().flatten()
            got = rows["trainer_logprobs"][b][real][at].double()
            worst = max(worst, (got - transformers_logprobs(model, ids)[at - 1]).abs().max().item())
            scored += len(at)
    return worst, scored


def by_tokens(step_dir: Path) -> dict[tuple[int, ...], torch.Tensor]:
    """The trainer's response-token log-probs of one step's dump, keyed by the row's real token ids
    (each data-parallel rank dumps its own rows and tensor-/pipeline-parallel peers the same ones)."""
    rows = {}
    for part in sorted(step_dir.glob("rank*.pt")):
        dumped = torch.load(part)
        for b in range(dumped["input_ids"].shape[0]):
            real = dumped["attention_mask"][b].bool()
            response = dumped["response_mask"][b][real].bool()
            rows[tuple(dumped["input_ids"][b][real].tolist())] = dumped["trainer_logprobs"][b][real][response].double()
    return rows


def layout_difference(before: Path, after: Path) -> tuple[float, int]:
    """(largest |after - before| log-prob, rows compared) over one step's rows dumped by two runs;
    AssertionError when the two runs did not score the same rows."""
    a, b = by_tokens(before), by_tokens(after)
    shared = len(a.keys() & b.keys())
    assert a.keys() == b.keys() and a, f"the runs scored different rows ({len(a)} and {len(b)}, {shared} shared)"
    return max(float((a[key] - b[key]).abs().max()) for key in a), len(a)
