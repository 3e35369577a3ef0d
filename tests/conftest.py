"""Session-wide test settings.

Every process the tests start (torchrun ranks, ``hybridflow train`` jobs) runs under the device
guard (``hybridflow/device_guard.py``): a tensor a GPU run would leave on the host that reaches
a collective or the trainer fails the test, although on this CPU it is on the right device.
"""

import os

from hybridflow import device_guard

os.environ.setdefault(device_guard.ENV, "1")
