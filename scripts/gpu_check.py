"""The GPU proof: what a CUDA device shows that the CPU tests cannot. World size 1.

    bash scripts/gpu_check.sh                                   # on a GPU machine; JSON under $OUT
    python scripts/gpu_check.py --json PATH [--small] [--only families,checkpoint]

Each check records its figures and ``ok``, or its error, and the next one still runs:

  families    every family's log-probs: a tiny HF model converted into a megatron-core policy (local
              spec) against the same transformers model on the same device, then again after the
              run's own weight sync (reshard plan, full route) pushed the policy into the engine;
              fp32 and bf16, tolerances in the output
  throughput  a mid-size MoE (about 1.6B parameters, bf16, DistributedOptimizer): 10 train steps
              through MegatronPolicy and through a plain megatron-core forward_backward_func loop
              (megatron_adapters/plain_loop.py) on the same batches: tokens/s, MFU, their ratio
  checkpoint  dist-checkpoint save and load on the device: log-probs equal after the load
  frozen      a reward model (transformers' sequence classification, an MoE) built on process
              groups of its own (``parallel.layout_groups``, NCCL on a GPU) beside megatron's
              global ones: its scores against transformers' on the device (fp32), then offloaded
              (``reward_model.offload``): on the host between uses, the device memory it frees,
              and the same scores after the move in
  ipc         a second process opens the trainer's shared tensors from their handles and checksums
              them: on a GPU a CUDA-IPC handle of a few hundred bytes (on a CPU the data itself)
  train       ``hybridflow train configs/quickstart_gpu.yaml`` for a few RL steps (hf engine, no
              MLflow): it runs and the held-out reward is logged
  efficiency  sequence packing and LoRA on the device, the CPU tests' one-rank cases: packed and
              token-budget passes (actor and critic) against the unpacked one, before and after
              an Adam step (TE's THD path where transformer-engine is installed, else the
              block-diagonal local path); a LoRA policy's two steps leave the base bit-identical,
              optimize the adapters alone, and the merged weights it pushes are W + s·B·A
  fsdp2       the FSDP2 trainer (``actor.backend=fsdp2``) at one rank: a tiny dense Qwen3
              directory read into FSDP2Policy, its log-probs against transformers' on the device
              (fp32), two train steps, its checkpoint saved and loaded back (log-probs equal), then
              ``hybridflow train configs/quickstart_cpu_fsdp2.yaml`` at dp=1 with the hf engine
              for a few RL steps

``--small`` shrinks every size so the whole script runs on a CPU in about a minute (a test does);
the figures are then only a smoke test. Exit status 1 when any check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from hfschema.files import write_atomic  # noqa: E402
from hfschema.model import ModelConfig  # noqa: E402
from hybridflow.config import HybridflowConfig, load_config  # noqa: E402
from hybridflow.model_size import count_parameters  # noqa: E402

CONFIG = ROOT / "configs" / "quickstart_gpu.yaml"
CHECKS = ("families", "throughput", "checkpoint", "frozen", "ipc", "train", "efficiency", "fsdp2")
TOLERANCE = {"float32": ("max", 2e-3), "bfloat16": ("mean", 0.1)}
"""|log-prob difference| per token allowed between megatron-core and transformers on the same
weights: fp32 differs by summation order only, so every token; bf16 rounds every activation and
a near-tied router can pick another expert for a token (seen on the CPU: max 0.27-1.8, mean
0.03-0.08 for the MoE families), so the mean over tokens, with the max reported."""
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
"""Dense bf16 peak per GPU (no sparsity), by device name; MFU is reported against it."""


def _device() -> torch.device:
    from megatron_adapters import parallel

    return parallel.device()


def _base_config(model: ModelConfig, dtype: str, out: Path) -> HybridflowConfig:
    cfg = load_config(str(CONFIG), [f"run.output_dir={out}", f"rollout.dtype={dtype}"])
    return dataclasses.replace(cfg, model=model)


def _policy(cfg: HybridflowConfig, dtype: torch.dtype, *, seed: int = 1, initialize: bool = True):
    from megatron_adapters import parallel
    from megatron_adapters.policy import MegatronPolicy

    pg = parallel.initialize(cfg.actor.parallel, seed=seed)
    return MegatronPolicy(
        cfg.model, cfg.actor.parallel, cfg.train, pg_collection=pg, params_dtype=dtype, initialize=initialize
    )


def _random_ids(vocab: int, rows: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------ families


def _engine_logprobs(engine, ids: torch.Tensor) -> torch.Tensor:
    """transformers' log-prob of each next token, ``[B, T - 1]``, on the host."""
    with torch.no_grad():
        logits = engine.model(ids.to(engine.device)).logits.float()
    return logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None].to(logits.device))[..., 0].cpu()


def _family_case(family: str, dtype: str, work: Path) -> dict:
    """A tiny HF model of ``family`` converted into megatron-core and scored by both on the device;
    then the run's weight sync (reshard plan, full route) pushes the trainer's weights back into
    the engine and they are scored again. ``model.path``'s loader reads the same directory into a
    second policy on the device, scored against transformers within the same tolerance."""
    from hfschema.hf_config import read_model_config
    from hybridflow.rollout import make_engine
    from hybridflow.runtime.channel import colocated
    from hybridflow.runtime.engine_client import EngineClient
    from hybridflow.runtime.sync import EngineSync
    from megatron_adapters import checkpoint
    from megatron_adapters.convert import hf_to_mcore
    from megatron_adapters.export import global_named_parameters
    from tests.megatron_adapters.convert_models import make_hf_dir

    hf_dir = make_hf_dir(work / f"{family}_{dtype}", family, seed=1)
    mcore_dir = work / f"{family}_{dtype}" / "mcore"
    hf_to_mcore(hf_dir, mcore_dir, dtype=dtype)
    cfg = _base_config(read_model_config(hf_dir), dtype, work / family)
    policy = _policy(cfg, getattr(torch, dtype))
    checkpoint.load(policy, mcore_dir)
    engine = make_engine("hf", model_path=str(hf_dir), dtype=dtype, device=str(_device()))
    ids = _random_ids(cfg.model.vocab_size, 4, 32)
    trainer = policy.forward_logprobs({"input_ids": ids}, micro_batch_size=4)[0][:, 1:].float()
    reference = _engine_logprobs(engine, ids)  # transformers on the HF directory itself
    loaded = (trainer - reference).abs()
    pushed = EngineSync(
        cfg,
        channel=colocated(),
        device=_device(),
        source_params=lambda: global_named_parameters(policy),
        engines=EngineClient(cfg, hf_dir, 0, engine),
    ).push()
    synced = (trainer - _engine_logprobs(engine, ids)).abs()
    engine.shutdown()
    direct = _direct_load_diff(cfg, dtype, hf_dir, ids, reference)  # last: it sets the parallel state up again
    stat, bound = TOLERANCE[dtype]
    worst = max(float(getattr(loaded, stat)()), float(getattr(synced, stat)()), float(getattr(direct, stat)()))
    return {
        "family": family,
        "dtype": dtype,
        "max_abs_diff": float(loaded.max()),
        "mean_abs_diff": float(loaded.mean()),
        "max_abs_diff_after_push": float(synced.max()),
        "mean_abs_diff_after_push": float(synced.mean()),
        "tolerance": f"{stat} <= {bound}",
        "ok": worst <= bound,
        "direct_load_max_abs_diff": float(direct.max()),
        "direct_load_mean_abs_diff": float(direct.mean()),
        "push_plan_bytes": pushed["sync/plan_bytes"],
        "push_seconds": pushed["sync/seconds"],
    }


def _direct_load_diff(
    cfg: HybridflowConfig, dtype: str, hf_dir: Path, ids: torch.Tensor, reference: torch.Tensor
) -> torch.Tensor:
    """|log-prob difference| between transformers and a policy that ``megatron_adapters.pretrained``
    loaded from the HF directory onto the device (``model.path``'s loader: no converted checkpoint,
    so bf16 runs keep fp32 norms exactly as the directory has them)."""
    from megatron_adapters.pretrained import load_hf_weights

    direct = _policy(cfg, getattr(torch, dtype), initialize=False)
    load_hf_weights(direct, hf_dir)
    scored = direct.forward_logprobs({"input_ids": ids}, micro_batch_size=4)[0][:, 1:].float()
    return (scored - reference).abs()


def check_families(args, work: Path) -> dict:
    from tests.megatron_adapters.families import FAMILIES

    cases = [_family_case(f, d, work) for d in ("float32", "bfloat16") for f in FAMILIES]
    return {"ok": all(c["ok"] for c in cases), "cases": cases}


# ------------------------------------------------------------------------------------ throughput


def _mid_moe(small: bool) -> ModelConfig:
    if small:
        return ModelConfig(
            family="qwen3_moe",
            hidden_size=64,
            num_layers=2,
            num_attention_heads=4,
            num_kv_heads=2,
            head_dim=16,
            ffn_hidden_size=128,
            vocab_size=256,
            num_experts=4,
            moe_top_k=2,
            moe_ffn_hidden_size=32,
            qk_layernorm=True,
            max_position_embeddings=64,
        )
    return ModelConfig(
        family="qwen3_moe",
        hidden_size=2048,
        num_layers=12,
        num_attention_heads=16,
        num_kv_heads=4,
        head_dim=128,
        ffn_hidden_size=6144,
        vocab_size=32000,
        num_experts=24,
        moe_top_k=4,
        moe_ffn_hidden_size=768,
        qk_layernorm=True,
        max_position_embeddings=4096,
    )


def _flops_per_token(model: ModelConfig, seq: int) -> float:
    """Training FLOPs per token: 6 x active parameters, plus causal attention's score and value
    matmuls (6 x layers x seq x heads x head_dim, half of the full square)."""
    active = count_parameters(model)["active"] - count_parameters(model)["embedding"]
    return 6.0 * active + 6.0 * model.num_layers * seq * model.num_attention_heads * model.kv_channels


def _peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def _timed(step, batches: list, warmup: int) -> list[float]:
    from megatron_adapters.plain_loop import synchronize

    times = []
    for i, batch in enumerate(batches):
        synchronize()
        started = time.perf_counter()
        step(batch)
        synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - started)
    return times


def _free() -> None:
    """Give the device memory of dropped models back (call after the last reference is gone)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_memory() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def check_throughput(args, work: Path) -> dict:
    from megatron_adapters import parallel
    from megatron_adapters.plain_loop import PlainTrainer
    from hybridflow.selftest import counting_batch, next_token_loss

    model = _mid_moe(args.small)
    seq, rows, micro, steps, warmup = (32, 4, 2, 2, 1) if args.small else (2048, 16, 4, 10, 2)
    cfg = _base_config(model, "bfloat16", work / "throughput")
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(
            cfg.train, micro_batch_size=micro, global_batch_size=rows, use_distributed_optimizer=True
        ),
    )
    batches = [counting_batch(rows, seq, model.vocab_size, i) for i in range(warmup + steps)]
    dtype = torch.bfloat16
    pg = parallel.initialize(cfg.actor.parallel, seed=1)
    plain = PlainTrainer(model, cfg.actor.parallel, cfg.train, pg_collection=pg, params_dtype=dtype)
    plain_times = _timed(plain.step, batches, warmup)
    memory_plain = _peak_memory()
    del plain
    _free()
    policy = _policy(cfg, dtype)
    policy_times = _timed(lambda b, trained=policy: trained.train_step(b, next_token_loss), batches, warmup)
    memory_policy = _peak_memory()
    tokens = rows * seq
    flops = _flops_per_token(model, seq) * tokens
    peak = _peak_flops()
    result = {
        "parameters": count_parameters(model),
        "tokens_per_step": tokens,
        "steps": steps,
        "plain_step_seconds": statistics.median(plain_times),
        "policy_step_seconds": statistics.median(policy_times),
    }
    result["policy_tokens_per_second"] = tokens / result["policy_step_seconds"]
    result["plain_tokens_per_second"] = tokens / result["plain_step_seconds"]
    result["policy_over_plain"] = result["policy_step_seconds"] / result["plain_step_seconds"]
    result["policy_mfu"] = flops / result["policy_step_seconds"] / peak if peak else None
    result["plain_mfu"] = flops / result["plain_step_seconds"] / peak if peak else None
    result["peak_flops"] = peak
    result["plain_peak_memory_bytes"], result["policy_peak_memory_bytes"] = memory_plain, memory_policy
    result["goal"] = "policy_over_plain <= 1.05"
    result["ok"] = True  # a measurement; the goal is reported, not enforced
    del policy
    _free()
    return result


# ------------------------------------------------------------------------------------ checkpoint


def check_checkpoint(args, work: Path) -> dict:
    from megatron_adapters import checkpoint
    from hybridflow.selftest import counting_batch, next_token_loss
    from tests.megatron_adapters.families import tiny

    cfg = _base_config(tiny("qwen3_moe"), "float32", work / "checkpoint")
    policy = _policy(cfg, torch.float32, seed=1)
    policy.train_step(counting_batch(cfg.train.global_batch_size, 16, cfg.model.vocab_size, 0), next_token_loss)
    ids = _random_ids(cfg.model.vocab_size, cfg.train.global_batch_size, 16)
    before, _ = policy.forward_logprobs({"input_ids": ids})
    path = checkpoint.save(policy, work / "checkpoint" / "actor", with_optimizer=True, step=1)
    fresh = _policy(cfg, torch.float32, seed=2)  # other initial weights: the load must replace them
    checkpoint.load(fresh, path, with_optimizer=True)
    after, _ = fresh.forward_logprobs({"input_ids": ids})
    diff = float((before - after).abs().max())
    return {"max_abs_diff_after_load": diff, "ok": diff == 0.0, "device": str(_device())}


# ------------------------------------------------------------------------------------ frozen


def check_frozen(args, work: Path) -> dict:
    from hfschema.hf_config import read_hf_config
    from hfschema.layout import ParallelLayout
    from hfschema.model_source import reward_model_source
    from hybridflow.runtime.frozen import _move, on_device
    from megatron_adapters import parallel
    from megatron_adapters.reward_model import MegatronRewardModel, load_reward_model
    from tests.reward.rm_models import make_rm_dir, padded_ids, transformers_scores

    rm_dir = make_rm_dir(work / "frozen", "qwen3_moe")
    source, model = reward_model_source(rm_dir)
    cfg = _base_config(model, "float32", work / "frozen")
    parallel.initialize(cfg.actor.parallel, seed=1)  # megatron's global groups: the actor's
    layout = ParallelLayout()
    train = dataclasses.replace(cfg.train, micro_batch_size=2, global_batch_size=4)
    net = MegatronRewardModel(model, layout, train, pg_collection=parallel.layout_groups(layout), trainable=False)
    load_reward_model(net, source)
    pad = read_hf_config(rm_dir)["pad_token_id"]
    ids = padded_ids(model.vocab_size, pad)
    expected = transformers_scores(rm_dir, ids)  # on the host, fp32
    resident = net.forward_scores({"input_ids": ids}, pad)
    held = _allocated()
    _move(net, torch.device("cpu"))
    freed = held - _allocated()
    on_host = all(t.device.type == "cpu" for chunk in net.chunks for t in chunk.parameters())
    with on_device(net, True):  # the mover every offloaded frozen model takes
        moved_in = all(t.device == _device() for chunk in net.chunks for t in chunk.parameters())
        offloaded = net.forward_scores({"input_ids": ids}, pad)
    back = all(t.device.type == "cpu" for chunk in net.chunks for t in chunk.parameters())
    diff = float((resident - expected).abs().max())
    return {
        "max_abs_diff": diff,
        "offloaded_equals_resident": bool(torch.equal(offloaded, resident)),
        "device_bytes_freed_by_offload": freed,
        "params_on_host_between_uses": on_host and back,
        "params_on_device_in_use": moved_in,
        "ok": diff <= TOLERANCE["float32"][1] and torch.equal(offloaded, resident) and on_host and back and moved_in,
        "device": str(_device()),
    }


def _allocated() -> int:
    """Device memory held by tensors (0 on a CPU)."""
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


# ------------------------------------------------------------------------------------ ipc

_IPC_CHILD = """
import sys, torch
from multiprocessing.reduction import ForkingPickler
sys.path.insert(0, sys.argv[2])
from hybridflow.rollout.sglang.handles import open_handle
tensor = open_handle(open(sys.argv[1], "rb").read())
print(repr(float(tensor.double().sum())), tensor.device)
"""


def check_ipc(args, work: Path) -> dict:
    from hybridflow.rollout.sglang.handles import share

    tensor = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(3)).to(_device())
    handle = work / "handle.bin"
    handle.write_bytes(share(tensor))
    proc = subprocess.run(
        [sys.executable, "-c", _IPC_CHILD, str(handle), str(ROOT)], capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the second process could not open the handle: {proc.stderr[-2000:]}")
    seen, device = proc.stdout.split()
    expected = float(tensor.double().sum())
    handle_bytes, tensor_bytes = handle.stat().st_size, tensor.numel() * tensor.element_size()
    return {
        "handle_bytes": handle_bytes,
        "tensor_bytes": tensor_bytes,
        "child_device": device,
        "checksum": expected,
        "child_checksum": float(seen),
        "ok": float(seen) == expected and (not tensor.is_cuda or handle_bytes < tensor_bytes / 100),
    }


# ------------------------------------------------------------------------------------ train


def check_train(args, work: Path) -> dict:
    out = work / "quickstart_gpu"
    steps = 2 if args.small else 3
    cmd = [
        sys.executable,
        "-m",
        "hybridflow.cli",
        "train",
        str(CONFIG),
        f"run.steps={steps}",
        f"sft.steps={20 if args.small else 100}",
        f"run.output_dir={out}",
        "run.heldout_every=1",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"hybridflow train exited {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {
        "seconds": time.perf_counter() - started,
        "summary": summary,
        "ok": summary.get("heldout_reward_after_rl") is not None,
    }


# ------------------------------------------------------------------------------------ fsdp2


def check_fsdp2(args, work: Path) -> dict:
    from fsdp_adapters import checkpoint
    from fsdp_adapters.policy import FSDP2Policy
    from hfschema.train import TrainConfig
    from hybridflow.rollout import make_engine
    from hybridflow.selftest import counting_batch, next_token_loss
    from tests.megatron_adapters.convert_models import make_hf_dir

    hf_dir = make_hf_dir(work / "fsdp2", "qwen3", seed=1)
    train = TrainConfig(lr=1e-4, clip_grad=1.0, micro_batch_size=4, global_batch_size=8)
    policy = FSDP2Policy(hf_dir, train)  # fp32 compute: the parity check
    ids = _random_ids(policy.model.config.vocab_size, 8, 32)
    engine = make_engine("hf", model_path=str(hf_dir), dtype="float32", device=str(_device()))
    trainer = policy.forward_logprobs({"input_ids": ids})[0][:, 1:]
    parity = float((trainer - _engine_logprobs(engine, ids)).abs().max())
    engine.shutdown()
    losses = [policy.train_step(counting_batch(8, 32, 320, step), next_token_loss).loss for step in range(2)]
    before = policy.forward_logprobs({"input_ids": ids})[0]
    path = checkpoint.save(policy, work / "fsdp2" / "actor", with_optimizer=True, step=2)
    fresh = FSDP2Policy(hf_dir, train)  # the directory's weights: the load must replace them
    checkpoint.load(fresh, path, with_optimizer=True)
    reload = float((fresh.forward_logprobs({"input_ids": ids})[0] - before).abs().max())
    run = work / "fsdp2_run"
    overrides = ["actor.parallel.dp=1", "rollout.engine=hf", "rollout.sync_route=full", "rollout.tp=1"]
    cmd = [sys.executable, "-m", "hybridflow.cli", "train", str(ROOT / "configs" / "quickstart_cpu_fsdp2.yaml")]
    cmd += [*overrides, "run.tracking.trackers=[]", f"run.output_dir={run}", "run.steps=2", "run.heldout_every=1"]
    cmd += [f"sft.steps={20 if args.small else 100}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"hybridflow train (fsdp2) exited {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}")
    summary = json.loads((run / "summary.json").read_text())
    return {
        "logprob_max_abs_diff_vs_transformers": parity,
        "losses": losses,
        "reload_max_abs_diff": reload,
        "train_first_step_logprob_diff_max": summary["first_step_logprob_diff_max"],
        "train_heldout": summary["heldout"],
        "ok": parity <= TOLERANCE["float32"][1] and reload == 0.0 and summary["first_step_logprob_diff_max"] <= 1e-3,
    }


# ------------------------------------------------------------------------------------ efficiency

PACKING_TOLERANCE = 1e-4
"""Packed vs unpacked, fp32: the CPU tests hold 1e-5; device kernels sum in other orders."""


def check_efficiency(args, work: Path) -> dict:
    import importlib.util

    from tests.megatron_adapters import lora_worker, packing_worker

    packed = packing_worker.packed("qwen3_moe", {})
    diffs = {mode: {k: v for k, v in packed[mode].items() if k != "tokens"} for mode in ("packed", "budget")}
    worst = max(v for mode in diffs.values() for v in mode.values())
    policy = lora_worker.make_policy("qwen3_moe", {}, ["linear_qkv", "linear_proj", "experts"])
    lora = lora_worker.train_two_steps(policy)
    moved = float((lora["logp_after"] - lora["logp_before"]).abs().max())
    lora_ok = (
        lora["base_identical"]
        and not lora["base_requires_grad"]
        and lora["merge_error"] <= 1e-6
        and lora["optimizer_numel"] == lora["adapter_numel"]
        and moved > 1e-4
    )
    return {
        "transformer_engine": importlib.util.find_spec("transformer_engine") is not None,
        "packing": diffs,
        "packing_worst": worst,
        "packing_tolerance": PACKING_TOLERANCE,
        "routes_follow_packing": packed["routes_equal"],
        "packing_moved": packed["moved"],
        "lora_base_identical": lora["base_identical"],
        "lora_merge_error": lora["merge_error"],
        "lora_optimizer_numel": lora["optimizer_numel"],
        "lora_adapter_numel": lora["adapter_numel"],
        "lora_logp_moved": moved,
        "ok": worst <= PACKING_TOLERANCE and all(packed["routes_equal"].values()) and lora_ok,
    }


# ------------------------------------------------------------------------------------ driver


def _environment() -> dict:
    import transformers

    env = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "device": str(_device()),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    try:
        env["megatron_core"] = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:  # reported; the checks then fail with the cause
        env["megatron_core"] = "not installed"
    return env


def _run(name: str, fn, args, work: Path) -> dict:
    started = time.perf_counter()
    try:
        result = fn(args, work)
    except Exception as error:
        result = {"ok": False, "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-4000:]}
    result["seconds"] = time.perf_counter() - started
    sys.stderr.write(
        f"gpu_check: {name}: {'ok' if result['ok'] else 'FAILED ' + result.get('error', '')} "
        f"({result['seconds']:.1f} s)\n"
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where the results go (written atomically)")
    parser.add_argument("--small", action="store_true", help="tiny sizes: a CPU smoke run of every check")
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    args = parser.parse_args(argv)
    chosen = [c for c in args.only.split(",") if c]
    unknown = sorted(set(chosen) - set(CHECKS))
    if unknown:
        parser.error(f"--only: unknown check(s) {unknown}; choose from {', '.join(CHECKS)}")
    from megatron_adapters import parallel

    parallel.init_default_group()
    report = {"date": time.strftime("%Y-%m-%d"), "environment": _environment(), "small": args.small, "checks": {}}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for name in chosen:
            report["checks"][name] = _run(name, globals()[f"check_{name}"], args, Path(tmp))
    report["ok"] = all(c["ok"] for c in report["checks"].values())
    write_atomic(args.json, json.dumps(report, indent=2, default=str))
    sys.stdout.write(
        json.dumps(
            {k: v for k, v in report.items() if k != "checks"}
            | {
                "checks": {
                    k: {kk: vv for kk, vv in v.items() if kk != "traceback"} for k, v in report["checks"].items()
                }
            },
            indent=2,
            default=str,
        )
        + "\n"
    )
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
