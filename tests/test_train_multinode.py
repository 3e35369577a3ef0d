"""A two-node job on one machine: two ``hybridflow launch`` agents (one rank each) rendezvous on
127.0.0.1, and the quickstart's SGLang engine (tp=2) spans both "nodes" (``rollout.gpus_per_node=1``):
rank 0 drives node 0 of the engine, rank 1 starts node 1 (SGLang's ``nnodes`` / ``node_rank`` /
``dist_init_addr``). Each node's scheduler maps its share of every push from the actor rank on
its own node, an engine killed mid-step is replaced on both nodes, and the run learns. A rank
that fails on one node is named by both nodes' launchers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.injection import environment
from tests.test_train import LOGPROB_TOL, WARM_UP, _history

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _two_agents(
    port: int, per_node: int, overrides: list[str], *, env: dict | None = None, succeed: bool = True
) -> list[str]:
    """Two ``hybridflow launch`` agents ("nodes" 0 and 1 of this machine) run the quickstart to the
    end, and (``succeed``) both exit 0; returns their output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hybridflow.cli",
                "launch",
                "--nnodes",
                "2",
                "--nproc-per-node",
                str(per_node),
                "--node-rank",
                str(node),
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                # node 0's launcher checks the whole run before it hosts the store:
                # seconds on an idle machine, over 20 s on a loaded 2-core one (seen)
                "--rdzv-wait-s",
                "180",
                "configs/quickstart_cpu.yaml",
                *overrides,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    logs = [agent.communicate(timeout=800)[0] for agent in agents]
    if succeed:
        assert [a.returncode for a in agents] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    else:
        assert 0 not in [a.returncode for a in agents], logs[0][-3000:] + logs[1][-3000:]
    return logs


@pytest.mark.claim("first-failure-across-nodes")
def test_both_nodes_name_the_rank_that_failed_first_even_on_the_other_node(tmp_path: Path) -> None:
    """Rank 1 (node 1) raises when RL starts; rank 0 (node 0) then fails too, later, on the
    closed connection. Node 0's launcher sees rank 1's record through the run directory."""
    out, port = tmp_path / "failing", _free_port()
    # the transformers engine, in the ranks' own processes: what fails here is a rank, not the
    # engine, and SGLang's start would be most of the test's time
    overrides = [
        f"run.output_dir={out}",
        "rollout.engine=hf",
        "rollout.tp=1",
        "rollout.sync_route=full",
        "sft.steps=1",
        "run.steps=2",
        "run.heldout_prompts=0",
    ]
    logs = _two_agents(port, 1, overrides, env=environment(RAISE_AT_STEP="0:1"), succeed=False)
    source = (Path(__file__).resolve().parent / "injection.py").read_text().splitlines()
    line_no = next(i for i, text in enumerate(source, 1) if "simulated failure in rank" in text)
    cause = (  # raised where the injection wraps the step, outside its stages
        f"hybridflow launch: rank 1 failed: RuntimeError (tests/injection.py:{line_no}): "
        "HYBRIDFLOW_INJECT_RAISE_AT_STEP=0:1: simulated failure in rank 1; traceback in logs/errors/rank1.json"
    )
    assert [log.strip().splitlines()[-1] for log in logs] == [cause, cause], logs[0][-3000:] + logs[1][-3000:]
    assert (out / "error.txt").read_text() == cause + "\n"


@pytest.mark.claim("engine-spanning-nodes")
def test_an_engine_spanning_the_two_nodes_of_a_launch_receives_every_push_survives_a_kill_and_learns(
    tmp_path: Path, seeded
) -> None:
    """One of node 0's schedulers is SIGKILLed while step 2 generates (generate call 3; call 1
    scored the held-out prompts): both nodes' parts of the engine are replaced, meet again at the
    driver's new address, receive the current weights, and the step runs again."""
    out, port = seeded(tmp_path / "two_nodes"), _free_port()
    overrides = [
        f"run.output_dir={out}",
        "rollout.gpus_per_node=1",
        WARM_UP,
        "run.steps=6",
        "run.checkpoint_every=3",
        "run.heldout_prompts=20",
    ]
    logs = _two_agents(port, 1, overrides, env=environment(KILL_ENGINE="0@3"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["engine_restarts"] == 1, logs[0][-3000:]
    assert summary["heldout_reward_after_rl"] > summary["heldout_reward_after_sft"], summary
    history = _history(out, "step_000006")
    assert [h.get("rollout/engine_restarts", 0.0) for h in history] == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    for h in history:
        # node 1's scheduler scores like the trainer: it received its shares of the pushed weights,
        # the restarted part too
        assert h["rollout/logprob_diff_max"] < LOGPROB_TOL, h
        assert h["rollout/replica0/samples"] == 128


@pytest.mark.slow
@pytest.mark.claim("separate-placement")
def test_separate_engine_ranks_on_their_own_node_of_a_launch_receive_every_push_and_learn(
    tmp_path: Path, seeded
) -> None:
    """Separate placement over two agents of two ranks: the actor's ranks 0-1 on "node" 0, the
    tp=2 engine's ranks 2-3 on "node" 1; pushes and samples cross between the nodes."""
    out, port = seeded(tmp_path / "separate_nodes"), _free_port()
    overrides = [
        f"run.output_dir={out}",
        "rollout.placement=separate",
        WARM_UP,
        "run.steps=4",
        "run.checkpoint_every=4",
        "run.heldout_prompts=20",
    ]
    _two_agents(port, 2, overrides)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["heldout_reward_after_rl"] > summary["heldout_reward_after_sft"], summary
    assert any("generate on rollout ranks 2-3" in line for line in summary["executed_stages"])
    for h in _history(out, "step_000004"):
        assert h["rollout/logprob_diff_max"] < LOGPROB_TOL, h  # the engine on node 1 holds the pushed weights
        assert h["rollout/replica0/samples"] == 128 and h["sync/replica0/engine_bytes"] > 0
