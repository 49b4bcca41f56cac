"""Count what a piece of code dispatches: aten ops (TorchDispatchMode) and host syncs.

A host sync is a point where the host must wait for a device value: `_local_scalar_dense` (`.item()`,
`int(t)`, `bool(t)`), `nonzero` (a data-dependent shape), a copy from the device to the CPU, and
`Tensor.tolist()` (which on CPU tensors does not go through the dispatcher, so it is counted by a patch
of the method while the counter is active). On CPU nothing really waits; the count says where a device
step would.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero")


class OpCounter(TorchDispatchMode):
    """`with OpCounter() as c: ...` then `c.ops` (aten ops dispatched), `c.syncs` (host syncs), `c.by_op`."""

    def __init__(self):
        super().__init__()
        self.by_op: Counter = Counter()
        self.syncs = 0
        self.sync_sites: Counter = Counter()
        self._tolist = None
        self._inside_tolist = False

    @property
    def ops(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        self.by_op[name] += 1
        if name in SYNC_OPS:
            self._sync(name)
        elif (not self._inside_tolist and name in ("aten::_to_copy", "aten::copy_")
              and _device_to_cpu(func, args, kwargs)):
            self._sync("device->cpu copy")
        return func(*args, **kwargs)

    def _sync(self, what: str) -> None:
        self.syncs += 1
        self.sync_sites[what] += 1

    def __enter__(self):
        counter, orig = self, torch.Tensor.tolist
        self._tolist = orig

        def tolist(t):
            counter._sync("tolist")
            counter._inside_tolist = True  # its own device->cpu copy is the same sync
            try:
                return orig(t)
            finally:
                counter._inside_tolist = False
        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def _device_to_cpu(func, args, kwargs) -> bool:
    """A copy whose source is on an accelerator and whose result is on the CPU."""
    src = args[0] if func._schema.name == "aten::_to_copy" else args[1]
    if not isinstance(src, torch.Tensor) or src.device.type == "cpu":
        return False
    dev = kwargs.get("device")
    if func._schema.name == "aten::copy_":
        return args[0].device.type == "cpu"
    return dev is not None and torch.device(dev).type == "cpu"
