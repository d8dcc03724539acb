"""The three registries of per-op rules, keyed by (aten op packet, device type), built here alone.

A leaf of the rules: the modules that hold rules (fxmem/rules/ops.py, cpu_layouts.py, cpu_norms.py,
cuda_norms.py) import their ``register_*`` decorator from here, and fxmem/rules/ops.py imports those
modules so that importing it registers every rule. Read the registries through fxmem/rules/ops.py
(it re-exports every name here): importing this module alone gives them empty.

- op rules: ``{output index: true nbytes}`` where a fake kernel sizes an output otherwise than the real one;
- layout rules: ``{output index: strides}`` where a fake kernel lays an output out otherwise;
- workspace rules: the bytes a kernel allocates and frees inside one op, owned by no output.
"""

from __future__ import annotations

from typing import Any

from fxmem.rules import Registry

__all__ = [
    "LAYOUT_RULES",
    "OP_RULES",
    "WORKSPACE_RULES",
    "OpKey",
    "layout_rules_for",
    "op_rules_for",
    "register_layout_rule",
    "register_op_rule",
    "register_workspace_rule",
    "workspace_rules_for",
]

OpKey = tuple[str, str]
"""(aten op packet, e.g. ``'aten.mkldnn_rnn_layer'``; device type, e.g. ``'cpu'``)."""

OP_RULES: Registry[OpKey, Any] = Registry("op rule")
register_op_rule = OP_RULES.register

LAYOUT_RULES: Registry[OpKey, Any] = Registry("layout rule")
register_layout_rule = LAYOUT_RULES.register

WORKSPACE_RULES: Registry[OpKey, Any] = Registry("workspace rule")
register_workspace_rule = WORKSPACE_RULES.register


def _for_device(rules: Registry[OpKey, Any], device: str) -> dict[str, Any]:
    return {op: rule for (op, dev), rule in rules.rules().items() if dev == device}


def op_rules_for(device: str, rules: Registry[OpKey, Any] = OP_RULES) -> dict[str, Any]:
    """The rules for one device, keyed by op packet name, as capture.py applies them."""
    return _for_device(rules, device)


def layout_rules_for(device: str, rules: Registry[OpKey, Any] = LAYOUT_RULES) -> dict[str, Any]:
    """The layout rules for one device, keyed by op packet name, as dispatch.py applies them."""
    return _for_device(rules, device)


def workspace_rules_for(device: str, rules: Registry[OpKey, Any] = WORKSPACE_RULES) -> dict[str, Any]:
    """The workspace rules for one device, keyed by op packet name, as timeline.py applies them."""
    return _for_device(rules, device)
