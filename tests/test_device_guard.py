"""The device guard (megatron_adapters/device_guard.py) catches, on a CPU, tensors a GPU run would
hold on the host: in a collective, and as trainer input. Each case runs in a fresh process (the guard
patches torch.distributed and enters a torch-function mode for the life of the process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import DEVICE_GUARD_ENV

ROOT = Path(__file__).resolve().parents[1]

SCENARIOS = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    from megatron_adapters import device_guard as g
    g.install()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    dev = torch.device("cpu")
    def attempt(fn):
        try:
            fn()
        except g.DeviceGuardError as e:
            return "caught: " + str(e)
        return "ok"
    host = torch.zeros(1)                      # no device=: host on a GPU
    made = torch.zeros(1, device=dev)          # on the rank's device
    gloo = dist.new_group([0], backend="gloo")
    out = {
        "host_factory": attempt(lambda: dist.all_reduce(host)),
        "device_factory": attempt(lambda: dist.all_reduce(made)),
        "moved_to_device": attempt(lambda: dist.all_reduce(host.to(dev))),
        "cpu_call": attempt(lambda: dist.all_reduce(made.cpu())),
        "host_operand": attempt(lambda: dist.all_reduce(made + torch.ones(1))),
        "scalar_operand": attempt(lambda: dist.all_reduce(made * torch.tensor(2.0))),
        "stacked_scalar": attempt(lambda: dist.all_reduce(torch.stack([made[0], torch.tensor(1.0)]))),
        "in_place_copy": attempt(lambda: dist.all_reduce(made.copy_(host))),
        "gloo_group": attempt(lambda: dist.all_reduce(host, group=gloo)),
        "list_collective": attempt(lambda: dist.all_gather([torch.empty(1, device=dev)], host)),
        "check_on_device": attempt(lambda: g.check_on_device({"input_ids": host}, "trainer input")),
        "p2p_op_builds": type(dist.P2POp(dist.isend, made, 0)).__name__,
        "env": g.ENV,
    }
    guarded = dist.all_reduce
    g.uninstall()  # what a forked engine process does first (rollout/sglang/cpu.py)
    out["after_uninstall"] = {
        "host_factory": attempt(lambda: dist.all_reduce(torch.zeros(1))),
        "unmarked": not g.is_host(torch.zeros(1)),
        "originals_back": dist.all_reduce is not guarded and dist.all_reduce.__module__.endswith("distributed_c10d")
                          and dist.isend is dist.distributed_c10d.isend,
        "modes_left": torch._C._len_torch_function_stack(),
    }
    print(json.dumps(out))
""")


def _free_port() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


@pytest.mark.claim("device-guard")
def test_guard_marks_host_tensors_and_checks_collectives():
    proc = subprocess.run(
        [sys.executable, "-c", SCENARIOS, _free_port()],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for caught in ("host_factory", "cpu_call", "host_operand", "stacked_scalar", "list_collective"):
        assert out[caught].startswith("caught: torch.distributed."), (caught, out[caught])
    # the error names the line that made the tensor host, in the caller's file
    assert "<string>:" in out["host_factory"] and "all_reduce" in out["host_factory"]
    for fine in ("device_factory", "moved_to_device", "scalar_operand", "in_place_copy", "gloo_group"):
        assert out[fine] == "ok", (fine, out[fine])
    assert out["check_on_device"].startswith("caught: trainer input: tensor 'input_ids'")
    assert out["p2p_op_builds"] == "P2POp"  # P2POp still accepts the guarded isend
    assert out["env"] == DEVICE_GUARD_ENV  # the variable tests/conftest.py sets for every test process
    # uninstalled, the process is as it was before install: nothing tracked, c10d's own functions
    assert out["after_uninstall"] == {"host_factory": "ok", "unmarked": True, "originals_back": True, "modes_left": 0}


@pytest.mark.claim("device-guard")
@pytest.mark.distributed
def test_guard_catches_planted_host_tensors_in_the_policy(tmp_path):
    out = tmp_path / "guard.json"
    worker = ROOT / "tests" / "megatron_adapters" / "guard_worker.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYBRIDFLOW_DEVICE_GUARD": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(worker), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = json.loads(out.read_text())
    assert results["clean"] == "ok"  # the real policy: forward, train step, metrics, EP all-to-all
    assert results["host_flag_in_all_reduce"].startswith("DeviceGuardError: torch.distributed.all_reduce got a host")
    assert "guard_worker.py" in results["host_flag_in_all_reduce"]  # where the host tensor was made
    assert results["batch_not_moved"].startswith("DeviceGuardError: MegatronPolicy model input: tensor 'input_ids'")
