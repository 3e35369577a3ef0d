"""Host memory of CPU runs: ``plan``'s estimate (``hybridflow/host_memory.py``) against what the
run's processes really held at their peak.

    PYTHONPATH=. .venv/bin/python benchmarks/host_memory.py [--json PATH] [--cases quickstart,mid]

Each case is one short ``hybridflow train`` run (a few SFT and RL steps: the phases whose memory
differs, not their length). Every 0.5 s the script sums the proportional set size (PSS: shared
pages split between the processes that map them, so the sum is what the job holds) of every
process under the command, and keeps the largest sum and each process's largest. Cases:

    quickstart  configs/quickstart_cpu.yaml (a 0.2M-parameter MoE: the processes are the run)
    mid         configs/my_model.yaml on a generated Qwen3 directory of ~60M parameters with a
                32k vocabulary (the trainer's state, logits and attention scores count)

Prints ``{"cases": [{"case", "estimate_gib", "peak_gib", "estimate_over_peak", "parts_gib",
"processes_gib"}]}``; ``--json`` also writes it (temporary file, then rename).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.output import emit  # noqa: E402

GIB = 1 << 30


def _parents() -> dict[int, int]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    out[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return out


def _tree(root: int, parents: dict[int, int]) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _pss(pid: int) -> tuple[int, str] | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            pss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            name = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, StopIteration):
        return None
    return pss, name


def _kind(name: str, parent_kind: str) -> str:
    """What a process is: SGLang's schedulers are forked from a trainer rank (its command line,
    until they rename themselves), the detokenizer from a rank or a scheduler."""
    if parent_kind == "trainer rank" or parent_kind.startswith("engine"):
        return "engine detokenizer" if "detokenizer" in name else "engine scheduler"
    for needle, kind in (
        ("torchrun_entry", "torchrun agent"),
        ("hybridflow train", "launcher"),
        ("hybridflow.runtime.worker", "trainer rank"),
    ):
        if needle in name:
            return kind
    return "other"


class Sampler(threading.Thread):
    """The largest sum of the tree's PSS, and each process's largest PSS with its kind."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root, self.peak, self.done = root, 0, threading.Event()
        self.processes: dict[int, tuple[int, str]] = {}
        self.kinds: dict[int, str] = {}

    def run(self) -> None:
        while not self.done.is_set():
            parents, total = _parents(), 0
            for pid in _tree(self.root, parents):  # parents before their children
                found = _pss(pid)
                if found:
                    total += found[0]
                    kind = self.kinds.setdefault(pid, _kind(found[1], self.kinds.get(parents.get(pid, 0), "")))
                    self.processes[pid] = (max(self.processes.get(pid, (0, ""))[0], found[0]), kind)
            self.peak = max(self.peak, total)
            time.sleep(0.5)


def _mid_case(root: Path) -> tuple[str, list[str]]:
    from hybridflow.data import write_parquet
    from hybridflow.rollout.tiny import make_tiny_model_dir

    model = make_tiny_model_dir(
        root / "mid", "qwen3", vocab_size=32768, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
    )  # fmt: skip
    rng = random.Random(0)
    rows = []
    for a, b in ((rng.randrange(100), rng.randrange(100)) for _ in range(256)):
        worked = f"{a} + {b} = {a + b}. #### {a + b}"
        rows.append({
            "data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {a} + {b}? " * 4}],
            "reward_model": {"ground_truth": str(a + b)}, "extra_info": {"answer": worked},
        })  # fmt: skip
    train = write_parquet(root / "train.parquet", rows)
    overrides = [
        f"model.path={model}", f"data.train_files=[{train}]", "data.max_response_length=192", "sft.steps=3",
        "sft.batch_size=16", "run.steps=2", "run.prompts_per_step=8", "run.heldout_prompts=0",
        "train.global_batch_size=64", "run.checkpoint_every=0",
    ]  # fmt: skip
    return str(ROOT / "configs" / "my_model.yaml"), overrides


CASES = {
    "quickstart": lambda root: (
        str(ROOT / "configs" / "quickstart_cpu.yaml"),
        ["sft.steps=20", "run.steps=2", "run.checkpoint_every=0"],
    ),
    "mid": _mid_case,
}


def measure(case: str, root: Path, extra: list[str]) -> dict:
    from hybridflow.config import load_config
    from hybridflow.host_memory import host_memory

    config, overrides = CASES[case](root)
    overrides = [*overrides, f"run.output_dir={root / 'run'}", "run.tracking.trackers=[]", *extra]
    estimate = host_memory(load_config(config, overrides))
    command = [str(ROOT / ".venv" / "bin" / "hybridflow"), "train", config, *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sampler = Sampler(process.pid)
    sampler.start()
    _, err = process.communicate()
    sampler.done.set()
    sampler.join()
    if process.returncode != 0:
        raise SystemExit(f"{case}: the run failed ({process.returncode}): {err.decode()[-2000:]}")
    by_kind: dict[str, float] = {}
    for size, kind in sampler.processes.values():
        by_kind[kind] = round(by_kind.get(kind, 0) + size / GIB, 3)
    return {
        "case": case,
        "overrides": extra,
        "estimate_gib": round(estimate.total / GIB, 3),
        "peak_gib": round(sampler.peak / GIB, 3),
        "estimate_over_peak": round(estimate.total / sampler.peak, 3),
        "parts_gib": {name: round(size / GIB, 3) for name, size in estimate.parts.items()},
        "processes_gib": by_kind,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("overrides", nargs="*", help="key=value settings added to every case")
    args = parser.parse_args()
    cases = []
    for case in args.cases.split(","):
        with tempfile.TemporaryDirectory(prefix=f"host-memory-{case}-") as root:
            cases.append(measure(case, Path(root), args.overrides))
    emit({"cases": cases}, args.json)


if __name__ == "__main__":
    main()
