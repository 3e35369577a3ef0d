"""The engine's liveness watch on stand-in processes: a call waiting on its event loop returns
with EngineLost naming the process that died, or the timeout it ran past."""

import asyncio
import os
import signal
import subprocess
import sys
import threading

import psutil
import pytest

from hybridflow.rollout.base import EngineLost
from hybridflow.rollout.sglang.watch import ProcessWatch

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def child():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


def _waits_forever(loop):
    return lambda: loop.run_until_complete(asyncio.sleep(3600))  # a request the dead engine never answers


def test_a_killed_process_ends_the_call_with_its_exit():
    loop = asyncio.new_event_loop()
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watch = ProcessWatch([psutil.Process(process.pid)], loop)
    threading.Timer(0.3, os.kill, args=(process.pid, signal.SIGKILL)).start()
    with pytest.raises(EngineLost, match=rf"process {process.pid} \(python.*\) was killed by SIGKILL during generate"):
        watch.call(_waits_forever(loop), timeout_s=None, what="generate")
    with pytest.raises(EngineLost):  # lost for good: later calls refuse at once
        watch.call(lambda: 1, timeout_s=None, what="reseed")
    loop.close()


def test_a_call_past_the_timeout_is_a_hung_engine(child):
    loop = asyncio.new_event_loop()
    watch = ProcessWatch([psutil.Process(child.pid)], loop)
    assert watch.call(lambda: 7, timeout_s=5.0, what="generate") == 7
    with pytest.raises(EngineLost, match=r"generate hung: no answer within rollout.generate_timeout_s=0.5 s"):
        watch.call(_waits_forever(loop), timeout_s=0.5, what="generate")
    assert child.poll() is None  # the watch only reports; the restart kills what is left
    loop.close()
