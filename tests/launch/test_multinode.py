"""``hybridflow launch``: the torchrun command line, and bad input failing within seconds.

Nothing here starts torchrun: every case fails in the checks before it (or only builds the
command). The end-to-end launch, with restarts, is in ``tests/test_faults.py``.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hybridflow.cli import main
from hybridflow.config import load_config
from launch.multinode import LaunchSpec, check_endpoint, parse_endpoint, torchrun_command

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "quickstart_cpu.yaml")


@pytest.fixture(scope="module")
def cfg():
    return load_config(CONFIG)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_multi_node_command_uses_c10d_with_a_join_timeout():
    spec = LaunchSpec(nnodes=4, nproc_per_node=8, rdzv_endpoint="node001:29500", rdzv_id="job7", max_restarts=3)
    cmd = torchrun_command(spec, "c.yaml", ["run.steps=2"])
    assert cmd[1:3] == ["-m", "launch.torchrun_entry"]
    for arg in (
        "--nnodes=4",
        "--nproc-per-node=8",
        "--max-restarts=3",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node001:29500",
        "--rdzv-id=job7",
        "--rdzv-conf=join_timeout=600",
    ):
        assert arg in cmd
    assert "--standalone" not in cmd
    assert cmd[-4:] == ["-m", "hybridflow.runtime.worker", "c.yaml", "run.steps=2"]


def test_single_node_without_endpoint_is_standalone():
    cmd = torchrun_command(LaunchSpec(nnodes=1, nproc_per_node=2, max_restarts=1), "c.yaml", [])
    assert "--standalone" in cmd and "--max-restarts=1" in cmd
    assert not any(a.startswith("--rdzv") for a in cmd)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(nnodes=2, nproc_per_node=1), "needs --rdzv-endpoint"),
        (dict(nnodes=0, nproc_per_node=1), "--nnodes=0 must be >= 1"),
        (dict(nnodes=2, nproc_per_node=1, rdzv_endpoint="h:1", node_rank=2), "--node-rank=2 must be in 0..1"),
        (dict(nnodes=1, nproc_per_node=1, max_restarts=-1), "--max-restarts=-1"),
        (dict(nnodes=2, nproc_per_node=1, rdzv_endpoint="node001"), "must be HOST:PORT"),
        (dict(nnodes=2, nproc_per_node=1, rdzv_endpoint="node001:99999"), "must be HOST:PORT"),
    ],
)
def test_spec_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LaunchSpec(**kwargs)


def test_endpoint_parsing():
    assert parse_endpoint("node001:29500") == ("node001", 29500)
    assert parse_endpoint("[fe80::1]:29500") == ("fe80::1", 29500)


@pytest.mark.claim("launch-process-count")
def test_more_processes_than_the_layout_names_numbers_and_keys(cfg):
    spec = LaunchSpec(nnodes=2, nproc_per_node=4, rdzv_endpoint="node001:29500")
    with pytest.raises(ValueError) as info:
        spec.check_layout(cfg.actor.parallel)
    message = str(info.value)
    for part in (
        "--nnodes=2",
        "--nproc-per-node=4",
        "= 8 processes",
        "actor.parallel fills 2 ranks",
        "actor.parallel.dp",
    ):
        assert part in message


@pytest.mark.claim("rendezvous-checks")
def test_unreachable_endpoint_fails_fast_with_the_reason():
    port = _free_port()  # nothing listens there
    spec = LaunchSpec(nnodes=2, nproc_per_node=1, node_rank=1, rdzv_endpoint=f"127.0.0.1:{port}", rdzv_wait_s=2)
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"nothing accepted a connection there within 2 s .*Connection refused"):
        check_endpoint(spec)
    assert time.monotonic() - started < 10


def test_the_default_wait_stays_well_under_half_a_minute():
    # a node whose endpoint never answers gives up after rdzv_wait_s plus one 2 s connect attempt
    assert LaunchSpec(nnodes=1, nproc_per_node=1).rdzv_wait_s + 2 < 30


@pytest.mark.claim("rendezvous-checks")
def test_unresolvable_host_fails_at_once():
    spec = LaunchSpec(nnodes=2, nproc_per_node=1, node_rank=1, rdzv_endpoint="no-such-node.invalid:29500")
    with pytest.raises(ValueError, match="cannot resolve host 'no-such-node.invalid'"):
        check_endpoint(spec)


@pytest.mark.claim("rendezvous-checks")
def test_node_0_refuses_an_endpoint_that_is_not_its_own_address():
    # 10.255.255.1 is not this machine: torchrun's c10d backend would try to join a store nobody
    # hosts and fail after its join timeout with a traceback (82 s, measured); a joiner that
    # reaches something else there is refused by the handshake (the next tests)
    spec = LaunchSpec(nnodes=2, nproc_per_node=1, node_rank=0, rdzv_endpoint="10.255.255.1:29500")
    with pytest.raises(ValueError, match="--node-rank=0 hosts the rendezvous, but '10.255.255.1' is not an address"):
        check_endpoint(spec)


def test_the_hosting_node_refuses_an_unresolvable_host_by_name():
    spec = LaunchSpec(nnodes=2, nproc_per_node=1, node_rank=0, rdzv_endpoint="no-such-node.invalid:29500")
    with pytest.raises(ValueError, match="cannot resolve host 'no-such-node.invalid'"):
        check_endpoint(spec)


@pytest.mark.claim("rendezvous-checks")
def test_the_hosting_node_refuses_a_busy_port():
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        spec = LaunchSpec(nnodes=2, nproc_per_node=1, rdzv_endpoint=f"127.0.0.1:{port}")  # this machine: host
        with pytest.raises(ValueError, match=f"port {port} is already in use"):
            check_endpoint(spec)


def test_a_reachable_rendezvous_store_passes():
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
    )
    check_endpoint(LaunchSpec(nnodes=2, nproc_per_node=1, node_rank=1, rdzv_endpoint=f"127.0.0.1:{store.port}"))


@pytest.mark.claim("rendezvous-checks")
def test_a_service_that_is_not_the_rendezvous_is_named_in_one_line():
    # it accepts the connection and answers in its own protocol, as a proxy or a web server would
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]

        def answer() -> None:
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return
                with conn:
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        threading.Thread(target=answer, daemon=True).start()
        spec = LaunchSpec(nnodes=2, nproc_per_node=1, node_rank=1, rdzv_endpoint=f"127.0.0.1:{port}", rdzv_wait_s=1)
        started = time.monotonic()
        with pytest.raises(ValueError, match="it is not torchrun's rendezvous") as info:
            check_endpoint(spec)
        assert "\n" not in str(info.value) and time.monotonic() - started < 30


def _cli(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli", "launch", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    return done, time.monotonic() - started


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", "127.0.0.1:29500"],
            "= 4 processes, but actor.parallel fills 2 ranks",
        ),
        (["--nnodes", "1", "--nproc-per-node", "1"], "= 1 processes, but actor.parallel fills 2 ranks"),
    ],
)
@pytest.mark.claim("separate-refused-shapes", "launch-process-count")
def test_cli_process_count_errors(args, message, tmp_path):
    done, seconds = _cli(CONFIG, f"run.output_dir={tmp_path}", *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert seconds < 30


def test_cli_missing_config(tmp_path):
    done, seconds = _cli(str(tmp_path / "nope.yaml"), "--nnodes", "1", "--nproc-per-node", "2")
    assert done.returncode == 2
    assert "config file not found" in done.stderr and "nope.yaml" in done.stderr
    assert seconds < 30


@pytest.mark.claim("launch-errors-within-seconds")
def test_cli_unreachable_endpoint_exits_2_within_seconds(tmp_path):
    # two nodes of one rank each fill the quickstart's 2 ranks; this is the second node
    done, seconds = _cli(
        CONFIG,
        f"run.output_dir={tmp_path}",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--node-rank",
        "1",
        "--rdzv-endpoint",
        f"127.0.0.1:{_free_port()}",
        "--rdzv-wait-s",
        "3",
    )
    assert done.returncode == 2, done.stderr
    assert "nothing accepted a connection there within 3 s" in done.stderr
    assert "start node rank 0" in done.stderr
    assert seconds < 30


def test_cli_reports_the_layout_error_before_touching_the_network(capsys):
    # a wrong process count is found before any connection attempt to an endpoint that would hang
    code = main(
        [
            "launch",
            CONFIG,
            "--nnodes",
            "2",
            "--nproc-per-node",
            "3",
            "--node-rank",
            "1",
            "--rdzv-endpoint",
            "192.0.2.1:29500",
        ]
    )
    assert code == 2
    assert "= 6 processes" in capsys.readouterr().err
