"""Small megatron-core actions that fail on CPU without one of ``cpu_compat``'s patches.

``python compat_scenarios.py NAME [NAME ...]`` runs the scenarios one after another in a fresh
process (under torchrun for the two-process ones), printing a line as each one succeeds, and
exits 0 when all did; the test runs each with the patch it needs left out
(``HYBRIDFLOW_CPU_COMPAT_SKIP``), one process each, and checks the documented error appears, and
runs all of them with every patch applied, the one-process ones in one process and the
two-process ones in one launch (the imports, most of a scenario's time, paid once).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import torch  # noqa: E402

import megatron_adapters  # noqa: E402,F401  (blocks CUDA-only imports first)
from families import tiny  # noqa: E402
from hfschema.layout import ParallelLayout  # noqa: E402
from hfschema.train import TrainConfig  # noqa: E402
from megatron_adapters import checkpoint, cpu_compat, parallel  # noqa: E402


def _policy(family: str, layout: ParallelLayout):
    from megatron_adapters.policy import MegatronPolicy

    pg = parallel.initialize(layout, seed=1)
    return MegatronPolicy(tiny(family), layout, TrainConfig(micro_batch_size=1, global_batch_size=2), pg_collection=pg)


def _batch(rows: int = 2) -> dict:
    ids = torch.randint(0, 250, (rows, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "loss_mask": torch.ones(rows, 8)}


def _loss(logp, entropy, micro):
    return -(logp * micro["loss_mask"]).sum(), micro["loss_mask"].sum(), {}


def import_attention() -> None:
    """megatron's attention module imports with sglang's CUDA-only flash_mla installed."""
    import megatron.core.transformer.attention  # noqa: F401


def build_moe() -> None:
    """A Qwen3-MoE policy builds (streams, RNG tracker, optimizer type checks)."""
    _policy("qwen3_moe", ParallelLayout())


def build_mla() -> None:
    """A DeepSeek-V3 (MLA) policy builds without TransformerEngine."""
    _policy("deepseek_v3", ParallelLayout())


def train_moe() -> None:
    """A Qwen3-MoE train step runs (router GEMM without TE names)."""
    _policy("qwen3_moe", ParallelLayout()).train_step(_batch(), _loss)


def seq_parallel_norm() -> None:
    """megatron's torch norm accepts sequence parallelism and tags its weight for TP reduction."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    cpu_compat.apply()
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, normalization="RMSNorm")
    config.sequence_parallel = True  # set after validation, which wants TP > 1 for it
    norm = WrappedTorchNorm(config, 8)
    assert norm.weight.sequence_parallel is True


def resume_adam() -> None:
    """Adam state saved and loaded into a fresh distributed optimizer."""
    policy = _policy("llama", ParallelLayout())
    policy.train_step(_batch(), _loss)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint.save(policy, os.path.join(tmp, "ckpt"), with_optimizer=True)
        # megatron's writer would leave a spawned Manager process (a re-import of this script)
        assert multiprocessing.active_children() == [], multiprocessing.active_children()
        fresh = _policy("llama", ParallelLayout())
        checkpoint.load(fresh, os.path.join(tmp, "ckpt"), with_optimizer=True)


def ep2_step() -> None:
    """Two processes, EP=2: uneven token counts through the alltoall dispatcher on gloo."""
    policy = _policy("qwen3_moe", ParallelLayout(ep=2, dp=2))
    policy.train_step(_batch(4), _loss)


def etp2_step() -> None:
    """Two processes, ETP=2: expert inputs gathered over the expert-TP group, uneven sizes."""
    policy = _policy("qwen3_moe", ParallelLayout(etp=2, dp=2))
    policy.train_step(_batch(4), _loss)


def etp2_uneven_step() -> None:
    """Two processes, ETP=2 over DP=2, each data-parallel rank with rows of its own length (as the
    runtime's rollouts): the etp ranks hand the dispatcher different token counts."""
    length = 8 + int(os.environ["RANK"])
    ids = torch.randint(0, 250, (2, length), generator=torch.Generator().manual_seed(length))
    local = {"input_ids": ids, "loss_mask": torch.ones(2, length)}
    expected = _policy("qwen3_moe", ParallelLayout(dp=2)).forward_logprobs(local, local_rows=True)[0]
    policy = _policy("qwen3_moe", ParallelLayout(etp=2, dp=2))  # the same weights (seeded init), split
    got = policy.forward_logprobs(local, local_rows=True)[0]
    assert (got - expected).abs().max() < 1e-5, (got - expected).abs().max()
    policy.train_step(local, _loss, local_rows=True)


def tp2_moe_step() -> None:
    """Two processes, TP=2 with MoE: sequence-parallel gathers of uneven expert inputs."""
    policy = _policy("mixtral", ParallelLayout(tp=2))
    policy.train_step(_batch(2), _loss)


SCENARIOS = {
    f.__name__: f
    for f in (
        import_attention,
        build_moe,
        build_mla,
        train_moe,
        seq_parallel_norm,
        resume_adam,
        ep2_step,
        etp2_step,
        etp2_uneven_step,
        tp2_moe_step,
    )
}
TWO_PROCESS = {"ep2_step", "etp2_step", "etp2_uneven_step", "tp2_moe_step"}


if __name__ == "__main__":
    for name in sys.argv[1:]:
        # import_attention must import megatron's attention before anything builds a group
        parallel.init_default_group() if name != "import_attention" else None
        SCENARIOS[name]()
        # One write() per rank: two torchrun ranks share the pipe, and print() issues
        # several writes that can interleave with the other rank's line.
        os.write(1, f"SCENARIO OK {name} rank {os.environ.get('RANK', '0')}\n".encode())
