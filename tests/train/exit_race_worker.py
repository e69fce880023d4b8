"""A torchrun worker that ends while gloo's thread waits for the GIL to release a collective's tensor.

Rank 0 starts an all-reduce its peer joins late and keeps the tensor but not the work; it then
holds the GIL (long switch interval, busy loop) so that gloo's thread, done with the work, is
left waiting for it when the process ends. An object whose finalizer sleeps lets that thread take
the GIL during interpreter finalization, as gc and module teardown do in a real run.
`plain` returns normally; `leave` ends through fsdpkit.train.runtime.dist.leave.
"""

import sys
import time

import torch
import torch.distributed as tdist

from fsdpkit.train.runtime.dist import leave


class _SlowFinalizer:
    def __del__(self, sleep=time.sleep):
        sleep(0.5)


tdist.init_process_group("gloo")
if tdist.get_rank() == 1:
    time.sleep(1)
    tdist.all_reduce(torch.ones(1000))
    time.sleep(3)
else:
    slow = _SlowFinalizer()
    tensor = torch.ones(1000)
    tdist.all_reduce(tensor, async_op=True)
    sys.setswitchinterval(100)
    end = time.monotonic() + 2.5
    while time.monotonic() < end:
        pass
if sys.argv[1] == "leave":
    leave(0)
