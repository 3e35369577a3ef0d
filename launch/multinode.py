"""Start ``hybridflow train`` on one node of several: torchrun with a c10d rendezvous.

    hybridflow launch CONFIG [k=v ...] --nnodes N --nproc-per-node G --rdzv-endpoint HOST:PORT
      │  checks first, in seconds: N*G = the actor layout's ranks (LaunchSpec.check_layout), the
      │  config, the graph and run.resume against the run directory (hybridflow.preflight), and
      │  the rendezvous endpoint (check_endpoint, see below)
      └─ python -m torch.distributed.run --nnodes N --nproc-per-node G --rdzv-backend c10d
             --rdzv-endpoint HOST:PORT --rdzv-id ID --rdzv-conf join_timeout=T --max-restarts K
             -m hybridflow.runtime.worker CONFIG [k=v ...]

The same command runs on every node. torchrun's c10d backend hosts the rendezvous store on the
node whose address is HOST and the others connect to it. A node that cannot reach HOST would
sit in torchrun's join wait (600 s by default) before failing; so a node that does not host
the endpoint first checks it with TCP connects for ``rdzv_wait_s`` (node 0 may start a few
seconds later), and the host checks that its port is free. On a single node without an
endpoint, torchrun's ``--standalone`` rendezvous is used, as by ``hybridflow train``.

With ``--max-restarts K`` torchrun stops every worker when one fails and starts them all again,
up to K times; each start continues from the newest complete checkpoint (``run.resume=auto``).
The workers get a fresh TCP store each start (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): with
the store torchrun's agent shares across starts by default, a restarted rank can read the
previous start's addresses and wait forever in ``init_process_group``.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from hfschema.layout import ParallelLayout
from launch.reaper import TORCHRUN_SHUTDOWN_S
from launch.torchrun import run_job
from launch.torchrun_entry import TORCHRUN

__all__ = [
    "LaunchSpec",
    "check_endpoint",
    "check_process_count",
    "hosts_rendezvous",
    "launch",
    "parse_endpoint",
    "torchrun_command",
]


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``[IPv6]:PORT``) -> (host, port); ValueError names ``--rdzv-endpoint``."""
    host, sep, port = endpoint.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--rdzv-endpoint={endpoint!r} must be HOST:PORT with a port in 1..65535, e.g. node001:29500")
    return host, int(port)


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """Where this node's processes sit in a multi-node job, and how torchrun meets the others."""

    nnodes: int
    """Nodes in the job."""
    nproc_per_node: int
    """Processes (ranks) started on each node; one per GPU."""
    node_rank: int | None = None
    """This node's index, 0 hosting the rendezvous; None: decided by whether HOST is this machine."""
    rdzv_endpoint: str | None = None
    """HOST:PORT of the c10d rendezvous store (on the first node); None only for one node."""
    rdzv_id: str = "hybridflow"
    """Job id shared by the nodes of one job (Slurm: the job id)."""
    max_restarts: int = 0
    """Times torchrun restarts all workers after one fails; each restart resumes."""
    rdzv_wait_s: float = 20.0
    """How long a non-host node waits for the endpoint to accept connections before failing."""
    join_timeout_s: float = 600.0
    """How long torchrun waits for all nodes to join once the store is reachable."""

    def __post_init__(self) -> None:
        for name in ("nnodes", "nproc_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be >= 1")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts={self.max_restarts} must be >= 0")
        if self.rdzv_wait_s < 0 or self.join_timeout_s <= 0:
            raise ValueError("--rdzv-wait-s must be >= 0 and --join-timeout-s > 0")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank={self.node_rank} must be in 0..{self.nnodes - 1} (--nnodes={self.nnodes})")
        if self.rdzv_endpoint is None and self.nnodes > 1:
            raise ValueError(f"--nnodes={self.nnodes} needs --rdzv-endpoint HOST:PORT (HOST: the first node)")
        if self.rdzv_endpoint is not None:
            parse_endpoint(self.rdzv_endpoint)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def check_layout(self, layout: ParallelLayout, more_ranks: int = 0) -> None:
        """The job must start exactly the ranks the actor's ``layout`` fills, and ``more_ranks``
        more (separate placement)."""
        check_process_count(
            layout, f"--nnodes={self.nnodes}", f"--nproc-per-node={self.nproc_per_node}", self.world_size, more_ranks
        )


def check_process_count(
    layout: ParallelLayout, nodes_flag: str, per_node_flag: str, started: int, more_ranks: int = 0
) -> None:
    """ValueError naming both flags and ``actor.parallel`` unless ``started`` fills the actor's
    ``layout`` and the ``more_ranks`` of their own (separate engines, frozen models' own GPUs)."""
    want = layout.world_size + more_ranks
    if started != want:
        engines = f" + {more_ranks} ranks of their own (separate engines, frozen models' gpus)" if more_ranks else ""
        raise ValueError(
            f"{nodes_flag} x {per_node_flag} = {started} processes, but actor.parallel fills "
            f"{layout.world_size} ranks (tp*pp*cp*dp = {layout.tp}*{layout.pp}*{layout.cp}*{layout.dp}){engines}; "
            f"start {want} processes in all, or change actor.parallel.dp (or tp/pp/cp) "
            f"so that the ranks add up to {started}"
        )


def torchrun_command(spec: LaunchSpec, config_path: str, overrides: Sequence[str]) -> list[str]:
    """The torchrun command line of this node."""
    cmd = [
        sys.executable,
        "-m",
        TORCHRUN,
        f"--nnodes={spec.nnodes}",
        f"--nproc-per-node={spec.nproc_per_node}",
        f"--max-restarts={spec.max_restarts}",
        f"--shutdown-timeout={TORCHRUN_SHUTDOWN_S}",
    ]
    if spec.rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        cmd += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={spec.rdzv_endpoint}",
            f"--rdzv-id={spec.rdzv_id}",
            f"--rdzv-conf=join_timeout={spec.join_timeout_s:g}",
        ]
    return cmd + ["-m", "hybridflow.runtime.worker", config_path, *overrides]


def _is_this_machine(host: str) -> bool:
    """Whether ``host`` names an address of this machine (only then can a socket bind to it)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    for family, _, _, _, address in infos:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address[0], 0))
                return True
            except OSError:
                continue
    return False


def _check_port_free(host: str, port: int) -> None:
    # torchrun would connect to whatever already listens there and wait for a job that is not ours
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore does
        try:
            probe.bind(("", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(
                    f"--rdzv-endpoint={host}:{port}: port {port} is already in use on this node "
                    "(another job's rendezvous?); pick another port"
                ) from None
            raise


def _resolve(host: str, port: int) -> None:
    """ValueError naming the flag unless ``host`` resolves."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(
            f"--rdzv-endpoint={host}:{port}: cannot resolve host {host!r} ({e.strerror}); "
            "use the first node's host name or IP address"
        ) from None


def _connect_error(host: str, port: int, timeout_s: float) -> str | None:
    """None if a TCP connection to host:port succeeds, else why not."""
    _resolve(host, port)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as e:
        return e.strerror or type(e).__name__


_STORE_PROBE = """
import datetime, sys
import torch.distributed as dist
try:
    timeout = datetime.timedelta(seconds=float(sys.argv[3]))
    dist.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, timeout=timeout)
except Exception as error:
    sys.stdout.write(str(error).splitlines()[0])
    sys.exit(1)
"""


def _store_error(host: str, port: int, timeout_s: float) -> str | None:
    """None if a torch TCPStore answers at host:port, else what did. A TCP connect alone proves
    little: a proxy or another service may accept it, and torchrun would then wait out its join
    timeout. The client runs in its own process, whose C++ retry warnings stay out of the user's
    terminal."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _STORE_PROBE, host, str(port), f"{timeout_s:g}"],
            capture_output=True,
            text=True,
            timeout=timeout_s + 60,
        )
    except subprocess.TimeoutExpired:
        return f"no TCPStore handshake within {timeout_s:g} s"
    return None if done.returncode == 0 else (done.stdout.strip() or f"probe exit {done.returncode}")


def hosts_rendezvous(spec: LaunchSpec) -> bool:
    """Whether this node hosts the rendezvous: node rank 0, or (ranks assigned at the rendezvous,
    as under Slurm) the endpoint's own machine; a single node always does."""
    if spec.node_rank is not None or spec.rdzv_endpoint is None:
        return spec.node_rank in (None, 0)
    return _is_this_machine(parse_endpoint(spec.rdzv_endpoint)[0])


def check_endpoint(spec: LaunchSpec) -> None:
    """Fail within ``rdzv_wait_s`` (plus a connect timeout) if this node cannot reach the rendezvous."""
    if spec.rdzv_endpoint is None:
        return
    host, port = parse_endpoint(spec.rdzv_endpoint)
    local = _is_this_machine(host)
    if spec.node_rank == 0 and not local:
        _resolve(host, port)
        # torchrun's c10d backend would try to join a store nobody hosts and fail after its
        # join timeout with a traceback (82 s with an unrouted address, measured)
        raise ValueError(
            f"--rdzv-endpoint={spec.rdzv_endpoint}: --node-rank=0 hosts the rendezvous, but "
            f"{host!r} is not an address of this machine; give node 0's own host name or IP"
        )
    if local if spec.node_rank is None else spec.node_rank == 0:
        _check_port_free(host, port)
        return
    deadline = time.monotonic() + spec.rdzv_wait_s
    while (error := _connect_error(host, port, timeout_s=2.0)) is not None:
        if time.monotonic() >= deadline:
            raise ValueError(
                f"--rdzv-endpoint={spec.rdzv_endpoint}: nothing accepted a connection there within "
                f"{spec.rdzv_wait_s:g} s (last error: {error}); start node rank 0 (it hosts the rendezvous) "
                "and check the host and port, or wait longer with --rdzv-wait-s"
            )
        time.sleep(1.0)
    if (error := _store_error(host, port, timeout_s=max(deadline - time.monotonic(), 5.0))) is not None:
        raise ValueError(
            f"--rdzv-endpoint={spec.rdzv_endpoint}: something accepts connections there, but it is not "
            f"torchrun's rendezvous ({error}); give node rank 0's address and the port its launcher uses "
            "(a proxy or another service holds this one)"
        )


def launch(
    spec: LaunchSpec,
    layout: ParallelLayout,
    config_path: str,
    overrides: Sequence[str],
    *,
    output_dir: str | None = None,
) -> int:
    """Check the rendezvous, then run this node's torchrun to completion or a stop signal;
    returns the exit status (``launch.torchrun.run_job``: 128 + N after signal N; on failure
    this node's first failing rank is the last line and ``<output_dir>/error.txt``).

    The caller checked the run first (``spec.check_layout``, ``hybridflow.preflight``); ``layout``
    is the actor's, for the start line."""
    check_endpoint(spec)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # several ranks share a node's cores (see launch.torchrun)
    # torchrun's agent otherwise keeps one TCPStore for the workers across restarts, and the
    # restarted workers can read the previous round's gloo/NCCL addresses from it and wait for
    # peers that are gone (pytorch/pytorch#135712; seen here with torch 2.14: the first restart
    # hangs in init_process_group). Off, each round gets a fresh store on rank 0's node.
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    where = "" if spec.node_rank is None else f" node {spec.node_rank}"
    sys.stdout.write(
        f"hybridflow launch:{where} {spec.nproc_per_node} of {spec.world_size} process(es) "
        f"on {spec.nnodes} node(s) ({layout.describe()}), rendezvous "
        f"{spec.rdzv_endpoint or 'standalone'}, up to {spec.max_restarts} restart(s)\n"
    )
    sys.stdout.flush()
    # the node hosting the rendezvous holds the run directory (shared by the nodes) for the job
    return run_job(
        torchrun_command(spec, config_path, overrides),
        env,
        command="hybridflow launch",
        output_dir=output_dir,
        lock=hosts_rendezvous(spec),
    )  # no orphan outlives the job
