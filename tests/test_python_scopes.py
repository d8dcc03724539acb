"""Values a Python name holds stay alive in the timeline until the name lets go
(Note [Python locals keep values alive] in fxmem/frontends/python_scopes.py).

Each model's forward ends with tensors that no op reads any more but a local still names, so the
forward is the step's peak only if those are counted; every peak is held to a real CPU step."""

from __future__ import annotations

import torch
from torch import nn

from fxmem.frontends.python_scopes import held_through
from fxmem.frontends.tracing import trace_model
from tests.helpers import assert_step_peak


class Chain(nn.Module):
    """``h``, ``y`` and ``z`` are named until ``forward`` returns: four (B, 1024) tensors at its end."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        y = h * 2.0
        z = y + 1.0
        return z - 3.0


class Gate(nn.Module):
    """Rebinds its argument: the caller's temporary stays alive in ``_call_impl``'s ``args`` anyway."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.sigmoid(self.a(x))
        x = x * g
        return x + 1.0


class Stack(nn.Module):
    """Blocks called in a loop from one line: each call's locals die when it returns, not with the loop's."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Gate() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(torch.exp(x))
        return x


class Pair(nn.Module):
    """Values named inside a tuple and a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.proj(x).chunk(2, dim=-1)
        out = {"q": q.exp(), "k": k.exp()}
        return out["q"] * 3.0 + out["k"]


def test_held_through_names_the_last_node_a_name_is_bound() -> None:
    # In Chain, h is last read by the multiplication but named until the final subtraction runs.
    gm = trace_model(Chain(), []).gm
    nodes = {n.name: n for n in gm.graph.nodes}
    held = {v.name: n.name for v, n in held_through(gm.graph).items()}
    assert held["up"] == "sub"
    assert held["mul"] == "sub"
    assert "sub" not in held  # returned: the output keeps it
    assert nodes["sub"].op == "call_function"


def test_a_forward_that_ends_with_named_values() -> None:
    # Real forward: h, y, z and the result, 4 x 512 x 1024 x 4 bytes, at the last op; dropping
    # each at its last use would give 2 of them.
    assert_step_peak(Chain(), ["B,8"], 512, loss="sum", first_step=True)


def test_blocks_in_a_loop_free_their_locals_on_return() -> None:
    assert_step_peak(Stack(), ["B,256"], 256, loss="sum", first_step=True)
    assert_step_peak(Stack(), ["B,256"], 256, loss="sum", first_step=False)


def test_values_named_inside_containers() -> None:
    assert_step_peak(Pair(), ["B,16"], 512, loss="sum", first_step=True)
