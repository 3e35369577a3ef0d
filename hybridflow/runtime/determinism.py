"""``run.deterministic``: the same config and seed give the same metrics, bit for bit.

Every rank switches it on before it builds anything (``apply``, first thing in
``runtime.worker.main``), so the processes it starts (SGLang's schedulers) inherit the
environment too:

- torch's deterministic algorithms (``torch.use_deterministic_algorithms``): ops with only a
  nondeterministic CUDA kernel (atomic-add scatters, some index_put / embedding backwards)
  raise instead of running; cuBLAS needs a fixed workspace for it (``CUBLAS_WORKSPACE_CONFIG``);
- megatron-core's ``deterministic_mode`` (``megatron_adapters.model.transformer_config`` reads
  torch's switch): its embedding takes a deterministic backward, and TransformerEngine's
  attention its deterministic kernels (``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``, which
  megatron-core checks);
- NCCL with one fixed algorithm (``NCCL_ALGO=Ring`` unless set): the reduction order of every
  all-reduce stays the same from run to run;
- SGLang's deterministic inference on GPUs (``rollout`` engines: batch-invariant kernels, and the
  per-request sampling seed taking effect); SGLang refuses it on CPU, where its kernels and our
  per-rank seeding (``rollout/sglang/rank_seed.py``) already reproduce.

On CPU gloo every collective already reduces in a fixed order: the switch changes no number
(``tests/test_train.py`` checks a deterministic run against the default one), and costs little.
On GPUs it costs speed (deterministic kernels, SGLang's batch-invariant ones, NCCL without its
faster algorithms); the README's "Deterministic mode" gives what was measured.
"""

from __future__ import annotations

import os

import torch

__all__ = ["ENVIRONMENT", "apply"]

ENVIRONMENT = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "NCCL_ALGO": "Ring"}
"""What deterministic mode sets in the environment where the user has not set it already."""


def apply(deterministic: bool) -> None:
    """Switch this process (and what it starts) to deterministic kernels, or leave it as it is."""
    if not deterministic:
        return
    for key, value in ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    torch.use_deterministic_algorithms(True)
