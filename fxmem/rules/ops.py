"""Per-op rules for storages whose fake (meta) kernels report a different size than the real kernel.

Most ops need no rule: autograd itself reports what it saves, and fake tensors have the right sizes.
A rule exists only where a real run and the fake run were seen to disagree, keyed by the aten op and
the device whose kernel is modelled. Each returns ``{output index: true nbytes}``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fxmem.rules import Registry
from fxmem.rules.onednn_rnn import lstm_workspace_bytes

__all__ = ["OP_RULES", "register_op_rule", "op_rules_for"]

OpKey = tuple[str, str]
"""(aten op packet, e.g. ``'aten.mkldnn_rnn_layer'``; device type, e.g. ``'cpu'``)."""

OP_RULES: Registry[OpKey, Any] = Registry("op rule")
register_op_rule = OP_RULES.register


def op_rules_for(device: str, rules: Registry[OpKey, Any] = OP_RULES) -> dict[str, Any]:
    """The rules for one device, keyed by op packet name, as capture.py applies them."""
    return {op: rule for (op, dev), rule in rules.rules().items() if dev == device}


@register_op_rule(("aten.mkldnn_rnn_layer", "cpu"))
def mkldnn_rnn_layer_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> dict[int, int]:
    """The CPU LSTM's oneDNN workspace (output 3): its meta kernel returns an empty uint8 tensor."""
    # ATen transposes batch-first input to (seq, batch, feature) before this op, whatever args[14] says.
    inp, hidden_size = args[0], int(args[10])
    seq_len, batch = inp.shape[0], inp.shape[1]
    nbytes = lstm_workspace_bytes(
        seq_len=int(seq_len), batch=int(batch), input_size=int(inp.shape[2]), hidden_size=hidden_size, dtype=inp.dtype
    )
    return {3: nbytes}
