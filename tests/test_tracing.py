"""fxmem/frontends/tracing.py: the traced graph runs what eager runs."""

from __future__ import annotations

import operator

import pytest

import torch
import torch.nn.functional as F
from torch import nn

import fxmem
from fxmem.frontends.tracing import trace_model, unpacked
from tests.helpers import assert_matches_measurement, assert_step_peak


class UnpackedAttention(nn.Module):
    """Self-attention that unpacks its fused projection: ``q, k, v = qkv`` (iterating a tensor)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).reshape(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


def test_unpacking_a_tensor_unbinds_it() -> None:
    """Note [Unpacking a tensor]: one ``unpacked`` node, then getitems of what it returns, which on a
    tensor is its unbind(0) (three views whose backward is one stack), as Tensor.__iter__ gives."""
    graph = trace_model(UnpackedAttention(), frontend="fx").gm.graph
    unpack = [n for n in graph.nodes if n.target is unpacked]
    assert len(unpack) == 1
    assert [u.target for u in unpack[0].users] == [operator.getitem] * 3
    t = torch.randn(3, 2)
    assert [tuple(v.shape) for v in unpacked(t)] == [(2,)] * 3
    pair = (torch.ones(1), torch.zeros(1))
    assert unpacked(pair) is pair


def test_unpacked_attention_step_peak() -> None:
    """With q, k and v as three selects, their backward made three zero-filled gradients of the whole
    projection and summed them: the steady step's backward peak was 7.9% above the real step's at B=4
    (10% for the first step)."""
    for first_step in (True, False):
        assert_step_peak(UnpackedAttention(), ["B,16,32"], 4, loss="sum", first_step=first_step)


class Recurrent(nn.Module):
    """A module returning a tuple, unpacked into names: the tuple itself, not an unbind."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.GRU(6, 10, batch_first=True), nn.Linear(10, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, h = self.rnn(x)
        return self.head(out + h.transpose(0, 1))


def test_unpacking_a_tuple_is_unchanged() -> None:
    report = fxmem.analyze(Recurrent(), ["B,5,6"], loss="sum", target="cpu")
    assert_matches_measurement(report, Recurrent, ["B,5,6"], "sum", batches=(1, 3))


class _NumpyTimeMask(nn.Module):
    """SpecAugment-style masking drawn with numpy from the batch size (transformers' ``_compute_mask_indices``):
    torch.fx cannot take the proxy, torch.export fixes B to the example's size."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.out = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import numpy as np

        h = self.proj(x)
        mask = np.random.default_rng(0).random((h.shape[0], h.shape[1])) < 0.3
        # torch.tensor copies the mask into torch's allocator, as wav2vec2 does; torch.from_numpy would share
        # numpy's memory, which the profiler never sees and fxmem counts (the fuzzer's mask: within its 64 bytes)
        return self.out(h.masked_fill(torch.tensor(mask).unsqueeze(-1), 0.0).relu())


def test_a_model_that_fixes_its_batch_in_numpy_runs_whole_at_each_batch() -> None:
    """Note [A model that fixes its batch in Python]: the figures at each batch are a real step's."""
    from fxmem.frontends.tracing import WHOLE_MODEL

    report = fxmem.analyze(_NumpyTimeMask(), ["B,6,8"], batch=3, target="cpu")
    assert report.frontend == WHOLE_MODEL and report.accounting.method == "concrete"
    assert "ran whole, as one operation, at each batch" in str(report)
    for batch in (3, 5):
        assert report.activation_bytes(batch) == fxmem.measure(_NumpyTimeMask(), ["B,6,8"], batch).total
        assert report.peak(batch).bytes == fxmem.measure_peak(_NumpyTimeMask(), ["B,6,8"], batch).bytes


def test_wav2vec2s_time_mask_runs_whole() -> None:
    """wav2vec2's ``mask_time_prob`` (SpecAugment in training, numpy from the batch size), built on the meta
    device, where its ``masked_spec_embed`` alone is a CPU tensor (the legacy ``torch.Tensor(n)``)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
        conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, layerdrop=0.0, mask_time_prob=0.05,
        mask_time_length=2,
    )  # fmt: skip
    with torch.device("meta"):
        meta = transformers.Wav2Vec2Model(config)
    report = fxmem.analyze(meta, ["input_values=B,1600"], batch=2, target="cpu")
    torch.manual_seed(0)
    real = transformers.Wav2Vec2Model(config)
    assert report.activation_bytes(2) == fxmem.measure(real, ["input_values=B,1600"], 2).total
    assert report.peak(2).bytes == fxmem.measure_peak(real, ["input_values=B,1600"], 2).bytes
