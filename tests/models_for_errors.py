"""Small models that fail in one specific way each, for tests/test_errors.py.

Referenced from tests as ``tests/models_for_errors.py:FACTORY`` specs; every factory takes no
arguments unless its name says otherwise.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn

from fxmem.results import ModelSpec


def linear_8_4() -> ModelSpec:
    """Linear(8, 4): the right input is B,8."""
    return ModelSpec(nn.Sequential(nn.Linear(8, 4), nn.ReLU()), ("B,8",))


def no_inputs() -> nn.Module:
    """A bare module without default inputs: --input is required."""
    return nn.Sequential(nn.Linear(8, 4), nn.ReLU())


def raises() -> nn.Module:
    raise RuntimeError("config file 'weights.yaml' not found")


def returns_string() -> str:
    return "not a model"


def needs_arguments(hidden: int) -> nn.Module:
    return nn.Linear(hidden, hidden)


class _NoParams(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * 2


def no_parameters() -> ModelSpec:
    """No parameters at all: state is 0, and with nothing requiring grad autograd saves nothing."""
    return ModelSpec(_NoParams(), ("B,16",))


class _Returns(nn.Module):
    def __init__(self, what: object) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.what = what

    def forward(self, x: torch.Tensor) -> object:
        self.lin(x)
        return self.what


def returns_int() -> ModelSpec:
    return ModelSpec(_Returns(3), ("B,8",))


def returns_str() -> ModelSpec:
    return ModelSpec(_Returns("logits"), ("B,8",))


def returns_none() -> ModelSpec:
    return ModelSpec(_Returns(None), ("B,8",))


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * mask


def two_inputs() -> ModelSpec:
    return ModelSpec(_TwoInputs(), ("B,8", "B,4"))


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.gate = _Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.lin(x))


class _Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # control flow on a tensor value: fx cannot trace this
            return torch.relu(x)
        return x


def branchy() -> ModelSpec:
    """Branches on a tensor value inside submodule 'gate' (_Gate): untraceable unless --leaf."""
    return ModelSpec(_Branchy(), ("B,8",))


def attention() -> ModelSpec:
    """An nn.MultiheadAttention block, for --leaf MultiheadAttention."""
    return ModelSpec(_Attention(), ("B,6,16",))


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


NOT_CALLABLE = 42


class _ShapeGate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] > 2:  # control flow on a shape: fx cannot trace it, fake tensors can run it
            return torch.relu(x)
        return x


class _ShapeBranchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.gate = _ShapeGate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.lin(x))


def shape_branchy() -> ModelSpec:
    """Branches on a shape inside 'gate' (_ShapeGate): untraceable, but fine with --leaf _ShapeGate."""
    return ModelSpec(_ShapeBranchy(), ("B,8",))


def bad_default_inputs() -> ModelSpec:
    """Default inputs that do not parse: the error must name the model and suggest --input."""
    return ModelSpec(nn.Linear(8, 4), ["B,x"])


def unknown_default_loss() -> ModelSpec:
    return ModelSpec(nn.Linear(8, 4), ["B,8"], loss="hinge")


def tuple_inputs() -> tuple[nn.Module, tuple[str, ...]]:
    """(module, inputs) with the inputs as a tuple of spec strings, not one shape."""
    return nn.Linear(8, 4), ("B,8",)


class _Reentrant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre, self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.utils.checkpoint.checkpoint(self.a, self.pre(x), use_reentrant=True))


def reentrant_checkpoints() -> ModelSpec:
    """A reentrant checkpoint: fx runs it as such, torch.export cannot (the error says so)."""
    return ModelSpec(_Reentrant(), ("B,8",))


class _BadCheckpoint(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.a, x, use_reentrant=False, determinism_check="strict")


def bad_checkpoint_option() -> ModelSpec:
    """A checkpoint option torch rejects when the call runs (not while fx traces it)."""
    return ModelSpec(_BadCheckpoint(), ("B,8",))
