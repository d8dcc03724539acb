"""The dispatch mode under which fake passes run: faithful to what eager CPU kernels allocate.

It does three things, all in ``__torch_dispatch__``, below autograd: computes a few composite ops
with a SymInt-safe reference where their fake kernel would read concrete sizes, decomposes composite
ops exactly as eager CPU does, and applies op rules (``fxmem/rules/ops.py``) that record the true size
of storages whose fake kernels under-report them (the CPU LSTM's workspace).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch._refs
from torch._C import DispatchKey
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpRule", "OpRuleMode"]

OpRule = Callable[[Sequence[Any], Mapping[str, Any], Any], Mapping[int, object]]
"""An op rule gets an aten op's (args, kwargs, output) and returns {output index: true nbytes}
for outputs whose fake storage under-reports what the real kernel allocates."""


def _constant_pad_nd(x: torch.Tensor, pad: Sequence[Any], value: float = 0.0) -> Any:
    """constant_pad_nd through its Python reference, which keeps SymInt sizes symbolic."""
    return torch._refs.constant_pad_nd(x, list(pad), value)


_SYMBOLIC_REWRITES: dict[Any, Callable[..., Any]] = {torch.ops.aten.constant_pad_nd.default: _constant_pad_nd}
"""Ops whose fake kernel reads concrete sizes, so that it would fix B to its hint (HF pads labels with
constant_pad_nd), computed instead by torch's own SymInt-safe Python reference. Both allocate one
output of the padded size, so what autograd saves is unchanged."""


def _eager_decomposes(func: Any) -> bool:
    """True for an aten op that eager CPU runs as its C++ CompositeImplicitAutograd decomposition.

    Not ``func._can_decompose()``: that also holds for ops with a kernel of their own and a Python
    decomposition (upsample_nearest1d), which eager never uses and which can lay out its output
    differently (see test_interpolate_keeps_the_cpu_kernel_layout in tests/test_fuzz_regressions.py).
    Ops the dispatcher has no kernel for at all (aten.size.default, met in interpolate's symbolic
    pass) are run as they are, and so are the few that have a CPU kernel besides their decomposition
    (silu_backward, mish_backward, native_channel_shuffle): eager CPU runs that kernel, one output,
    where the decomposition makes four temporaries (SiLU's backward in every Llama layer).
    """
    name = func.name()
    return (
        func.namespace == "aten"
        and torch._C._dispatch_has_kernel(name)
        and torch._C._dispatch_has_kernel_for_dispatch_key(name, DispatchKey.CompositeImplicitAutograd)
        and not torch._C._dispatch_has_kernel_for_dispatch_key(name, DispatchKey.CPU)
    )


class OpRuleMode(TorchDispatchMode):
    """Applies op rules: records the true size of storages whose fake kernels under-report them."""

    def __init__(self, rules: Mapping[str, OpRule], overrides: dict[StorageWeakRef, object]) -> None:
        super().__init__()
        self.rules = rules
        self.overrides = overrides

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _SYMBOLIC_REWRITES:
            rewritten = _SYMBOLIC_REWRITES[func](*args, **kwargs)
            if rewritten is not NotImplemented:
                return rewritten
        if _eager_decomposes(func):
            # A Python mode receives some composite ops (aten.pad) whole; decomposing them here, with
            # the C++ decomposition eager uses, keeps SymInt sizes symbolic (as make_fx's mode does).
            return func._op_dk(DispatchKey.CompositeImplicitAutograd, *args, **kwargs)
        out = func(*args, **kwargs)
        rule = self.rules.get(str(func.overloadpacket))
        if rule is not None:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for index, nbytes in rule(args, kwargs, out).items():
                self.overrides[StorageWeakRef(outs[index].untyped_storage())] = nbytes
        return out
