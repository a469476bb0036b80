"""A pretend GPU host, for the launch checks on a machine without one (imported at start-up where FAKE_GPUS is set:
sitecustomize.py beside it).

torch.cuda reports FAKE_GPUS devices, fewer where CUDA_VISIBLE_DEVICES hides some (CUDA stops at the first index
that is not a device). Nothing can run on them: any real CUDA work fails with "Torch not compiled with CUDA", so
a process that should have stayed on the CPU fails loudly. What the checks decide from the device count is tested
here; the real thing runs in tests/test_gpu.py on a host with a GPU.
"""

import os

import torch


def _visible(installed: int) -> int:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return installed
    visible = 0
    for item in value.split(","):
        try:
            index = int(item)
        except ValueError:
            break
        if not 0 <= index < installed:
            break
        visible += 1
    return visible


_count = _visible(int(os.environ.get("FAKE_GPUS", "1")))
torch.cuda.is_available = lambda: _count > 0
torch.cuda.device_count = lambda: _count
