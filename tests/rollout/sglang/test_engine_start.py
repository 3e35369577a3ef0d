"""A start-up failure inside SGLang raises in the caller (SGLang's default SIGKILLs the caller's
process tree) and leaves no process behind."""

import gc
import threading

import pytest

from hybridflow.rollout import make_engine
from hybridflow.rollout.sglang.engine import SGLangStartError
from tests.rollout.sglang.reference import child_processes, tiny_model_dir

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


@pytest.mark.claim("engine-shutdown-own-processes")
def test_a_broken_checkpoint_raises_and_leaves_no_process(tmp_path):
    model_dir = tiny_model_dir(tmp_path, "qwen2", seed=0)
    (model_dir / "model.safetensors").write_bytes(b"not a safetensors file" * 10)
    before = {p.pid for p in child_processes()}
    with pytest.raises(SGLangStartError):
        make_engine("sglang", model_path=str(model_dir), tp=1, max_total_tokens=1024)
    assert not [p for p in child_processes() if p.pid not in before]
    # a failed start used to leave zmq contexts whose garbage collection blocked forever
    done = threading.Event()
    threading.Thread(target=lambda: (gc.collect(), done.set()), daemon=True).start()
    assert done.wait(timeout=60), "garbage collection hangs after a failed SGLang start"
