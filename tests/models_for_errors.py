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


class _NeedsMode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        y = self.lin(x)
        if mode == "relu":
            return torch.relu(y)
        return y


def needs_mode() -> ModelSpec:
    """forward(x, mode) with a non-tensor 'mode' the default inputs do not give: --arg mode=relu."""
    return ModelSpec(_NeedsMode(), ("B,8",))


class _ExpectsRGB(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.shape[1] == 3, "expects RGB"
        return self.conv(x)


def expects_rgb() -> ModelSpec:
    """An assert on the input's channels: B,1,8,8 fails it, B,3,8,8 passes."""
    return ModelSpec(_ExpectsRGB(), ("B,3,8,8",))


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.wte(ids))


def tiny_lm() -> ModelSpec:
    """Embedding 'wte' of 32 ids: its input must be integer (B,16:int64)."""
    return ModelSpec(_TinyLM(), ("B,16:int64",))


class _FusedQKV(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, s, d))


def fused_qkv() -> ModelSpec:
    """One Linear 'qkv' makes q, k and v, split on the last dim: colwise TP on it splits across q/k/v."""
    return ModelSpec(_FusedQKV(), ("B,6,16",))


class _ReturnsDict(nn.Module):
    def __init__(self, with_loss: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.with_loss = with_loss

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.lin(x)
        out = {"logits": logits, "hidden": x * 2}
        if self.with_loss:
            out["loss"] = logits.float().pow(2).mean()
        return out


def returns_dict() -> ModelSpec:
    """forward() returns {'logits', 'hidden'}: the loss uses 'logits', and says so."""
    return ModelSpec(_ReturnsDict(False), ("B,8",))


def returns_dict_with_loss() -> ModelSpec:
    """forward() returns {'logits', 'hidden', 'loss'}: with the model's own loss, 'loss' is it."""
    return ModelSpec(_ReturnsDict(True), ("B,8",))


class _Select(nn.Module):
    """Keeps the rows whose first feature is positive, and special-cases an empty selection."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.nonzero(x[:, 0] > 0)
        if keep.numel() == 0:  # a count only the data fixes
            return self.lin(x)
        return self.lin(x[keep[:, 0]])


def count_branch() -> ModelSpec:
    """Branches on how many rows a nonzero selects, inside 'select' (_Select)."""
    return ModelSpec(nn.Sequential(nn.Linear(8, 8)).append(_Select()), ("B,8",))


class _LayerDropStack(nn.Module):
    """Three layers, each skipped in training with probability ``layerdrop`` (Fan et al. 2019), drawn with
    torch as transformers' wav2vec2 does, or with numpy as its WavLM does."""

    def __init__(self, draw: str) -> None:
        super().__init__()
        self.layers, self.layerdrop, self.draw = nn.ModuleList(nn.Linear(8, 8) for _ in range(3)), 0.1, draw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import numpy as np

        for layer in self.layers:
            chance = torch.rand([]) if self.draw == "torch" else np.random.random()
            if self.training and chance < self.layerdrop:
                continue
            x = layer(x)
        return x


class _Encoder(nn.Module):
    def __init__(self, draw: str) -> None:
        super().__init__()
        self.encoder = _LayerDropStack(draw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


def layerdrop_torch() -> ModelSpec:
    """LayerDrop drawn with torch.rand([]) inside 'encoder'."""
    return ModelSpec(_Encoder("torch"), ("B,8",))


def layerdrop_numpy() -> ModelSpec:
    """LayerDrop drawn with np.random.random() inside 'encoder'."""
    return ModelSpec(_Encoder("numpy"), ("B,8",))
