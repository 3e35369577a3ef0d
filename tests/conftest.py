"""Session-wide test settings.

Every process the tests start (torchrun ranks, ``hybridflow train`` jobs) runs under the device
guard (``megatron_adapters/device_guard.py``): a tensor a GPU run would leave on the host that
reaches a collective or the trainer fails the test, although on this CPU it is on the right device.
"""

import os

DEVICE_GUARD_ENV = "HYBRIDFLOW_DEVICE_GUARD"
"""``megatron_adapters.device_guard.ENV`` (tests/test_device_guard.py checks they agree); spelled
out because importing ``megatron_adapters`` loads megatron-core (seconds) into every test session."""

os.environ.setdefault(DEVICE_GUARD_ENV, "1")
