"""Runs inside each SGLang scheduler process: report the rank's parameter names, shapes, dtypes
(``report_params``), or a digest of each parameter's values (``report_digests``).

SGLang calls a registered ``custom_weight_loader`` as ``fn(model, named_tensors)`` on every
TP rank when ``update_weights_from_tensor(..., load_format="<module>.<fn>")`` names it. The
adapter registers ``report_params`` at engine start and calls it with one dummy tensor whose
*name* is the directory to write to; each rank writes ``rank<r>.json``. An exception in a
custom loader kills the scheduler, so this function never raises (it writes ``rank<r>.error``).
The model's weights are not touched.
"""

from __future__ import annotations

import json
import os
import traceback

from hfschema.files import write_atomic
from hybridflow.rollout.base import weight_digest

__all__ = ["DIGEST_LOADER", "LOADER", "report_digests", "report_params"]

LOADER = f"{__name__}.report_params"
"""The ``load_format`` / ``custom_weight_loader`` path of ``report_params``."""
DIGEST_LOADER = f"{__name__}.report_digests"
"""The same for ``report_digests`` (the refit verifier)."""


def _tp_rank() -> int:
    try:
        from sglang.srt.runtime_context import get_parallel

        return get_parallel().tp_rank
    except Exception:  # older layouts of sglang: the default group's rank is the TP rank
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else 0


def report_params(model, named_tensors) -> None:
    """Write ``{name: {"shape": [...], "dtype": "float32"}}`` of this rank to ``<dir>/rank<r>.json``."""
    try:
        out_dir, rank = named_tensors[0][0], _tp_rank()
        try:
            params = {
                name: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
                for name, p in model.named_parameters()
            }
            write_atomic(os.path.join(out_dir, f"rank{rank}.json"), json.dumps(params))
        except Exception:
            write_atomic(os.path.join(out_dir, f"rank{rank}.error"), traceback.format_exc())
    except Exception:  # nowhere to report to; the caller times out waiting for the file
        pass


def report_digests(model, named_tensors) -> None:
    """Write ``{name: digest(param)}`` of this rank to ``<dir>/rank<r>.json`` (never raises)."""
    try:
        out_dir, rank = named_tensors[0][0], _tp_rank()
        try:
            digests = {name: weight_digest(p) for name, p in model.named_parameters()}
            write_atomic(os.path.join(out_dir, f"rank{rank}.json"), json.dumps(digests))
        except Exception:
            write_atomic(os.path.join(out_dir, f"rank{rank}.error"), traceback.format_exc())
    except Exception:
        pass
