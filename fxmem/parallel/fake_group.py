"""A process group of any size inside this one process, for simulating one rank's step."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fxmem.errors import InputSpecError

__all__ = ["fake_world"]


# Note [A fake process group]
#     torch ships a process group whose collectives do nothing and return at once
#     (torch/testing/_internal/distributed/fake_pg.py: ``FakeProcessGroup``, registered as the "fake"
#     backend when the module is imported; its ``FakeStore`` needs no peers). With it rank 0 of a
#     world of any size runs the real ``fully_shard``: the parameters become DTensors holding this
#     rank's shard, and every all-gather and reduce-scatter allocates its buffers as on a real rank,
#     only their contents are never exchanged, which fake tensors do not have anyway. torchtitan's
#     memory estimation runs FSDP2 the same way (with FSDPMemTracker). The group is global state of
#     torch.distributed, so a simulation opens it for its length and closes it after, and refuses to
#     run inside a process that already has one (a real job's group must not be replaced).


@contextlib.contextmanager
def fake_world(world_size: int, model: str = "model") -> Iterator[DeviceMesh]:
    """A 1-D CPU device mesh over a fake process group of ``world_size`` ranks, this process rank 0."""
    if not dist.is_available():
        raise InputSpecError(f"model '{model}': simulating {world_size} ranks needs torch.distributed, which this torch build lacks.")
    if dist.is_initialized():
        raise InputSpecError(
            f"model '{model}': this process already has a torch.distributed process group, and simulating "
            f"{world_size} ranks needs its own fake one; run fxmem outside the distributed job (a plain python process)."
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    hook = sys.excepthook  # init_process_group prefixes every later traceback with "[rank0]:"; this process is no rank
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
