"""Check ``fxmem.rules.onednn_rnn`` against the uint8 workspaces a real CPU LSTM saves."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fxmem.rules.onednn_rnn import (
    get_good_ld,
    lstm_workspace_bytes,
    uses_onednn_workspace,
)

F32, BF16 = torch.float32, torch.bfloat16

pytestmark = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled),
    reason="PyTorch build without oneDNN/mkldnn",
)


def _bf16_ok() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _saved_uint8_sizes(module: nn.Module, *args: object) -> list[int]:
    """Byte sizes of the uint8 tensors autograd saves during one forward, in save order."""
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.uint8:
            sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*args)
    return sizes


def _measure(
    I: int, H: int, T: int, N: int, bi: bool, dtype: torch.dtype, layers: int, batch_first: bool,
    bias: bool = True,
) -> list[int]:
    torch.manual_seed(0)
    m = nn.LSTM(I, H, num_layers=layers, bidirectional=bi, bias=bias, batch_first=batch_first)
    m = m.to(dtype)
    shape = (N, T, I) if batch_first else (T, N, I)
    return _saved_uint8_sizes(m, torch.randn(shape, dtype=dtype))


def _predict(
    I: int, H: int, T: int, N: int, bi: bool, dtype: torch.dtype, layers: int, bias: bool = True,
) -> list[int]:
    dirs = 2 if bi else 1
    out = []
    for layer in range(layers):
        layer_in = I if layer == 0 else H * dirs
        for _ in range(dirs):
            out.append(
                lstm_workspace_bytes(
                    seq_len=T, batch=N, input_size=layer_in, hidden_size=H, dtype=dtype, bias=bias
                )
            )
    return out


# (input_size, hidden_size, seq_len, batch, bidirectional, dtype, num_layers, batch_first)
GRID = [
    # reference points from the task description
    (16, 32, 7, 3, False, F32, 1, False),
    (16, 32, 7, 1, False, F32, 1, False),
    (16, 32, 7, 100, False, F32, 1, False),
    (16, 32, 7, 3, False, BF16, 1, False),
    # tiny sizes
    (1, 1, 1, 1, False, F32, 1, False),
    (1, 1, 1, 1, False, BF16, 1, False),
    (1, 300, 1, 2, False, F32, 1, False),
    (300, 1, 2, 2, False, F32, 1, True),
    (300, 1, 3, 1, True, BF16, 1, False),
    # get_good_ld boundaries: 4H a multiple of 256 elements gets an extra 64-byte line
    (10, 64, 5, 3, False, F32, 1, False),
    (10, 64, 5, 3, False, BF16, 1, False),
    (256, 16, 4, 17, False, F32, 1, False),
    (256, 16, 4, 17, False, BF16, 1, False),
    (257, 63, 6, 16, False, F32, 1, False),
    (255, 65, 6, 16, False, BF16, 1, True),
    (128, 128, 3, 2, False, F32, 1, False),
    (128, 128, 3, 2, False, BF16, 1, False),
    (64, 256, 2, 3, False, F32, 1, False),
    (64, 256, 2, 3, False, BF16, 1, False),
    (32, 192, 4, 5, False, F32, 1, False),
    (48, 15, 9, 17, False, BF16, 1, False),
    (33, 31, 9, 17, False, F32, 1, False),
    # long sequences, big and odd batches
    (20, 40, 64, 2, False, F32, 1, False),
    (20, 40, 64, 2, False, BF16, 1, True),
    (7, 9, 33, 130, False, F32, 1, False),
    (7, 9, 33, 130, False, BF16, 1, False),
    (100, 50, 12, 100, False, F32, 1, True),
    (100, 50, 12, 127, False, F32, 1, False),
    (100, 50, 12, 128, False, F32, 1, False),
    (100, 50, 12, 129, False, BF16, 1, False),
    (300, 300, 5, 16, False, F32, 1, False),
    (300, 300, 5, 16, False, BF16, 1, False),
    # bidirectional
    (16, 32, 7, 3, True, F32, 1, False),
    (16, 32, 7, 3, True, BF16, 1, True),
    (40, 100, 10, 17, True, F32, 1, True),
    (5, 129, 2, 1, True, F32, 1, False),
    # multi-layer (layer>0 input width is H, or 2H when bidirectional)
    (16, 32, 7, 3, False, F32, 2, False),
    (16, 32, 7, 3, True, F32, 2, False),
    (16, 32, 7, 3, True, BF16, 2, False),
    (3, 64, 5, 2, True, F32, 3, True),
    (3, 64, 5, 2, True, BF16, 3, False),
    (200, 128, 4, 16, True, F32, 2, False),
    (77, 150, 6, 17, False, BF16, 3, True),
    (9, 200, 3, 2, True, F32, 2, True),
    (250, 70, 8, 3, False, F32, 3, False),
    (1, 2, 50, 100, True, F32, 2, False),
    (60, 90, 20, 100, True, BF16, 2, True),
    (11, 260, 1, 1, True, BF16, 2, False),
]


@pytest.mark.parametrize("I,H,T,N,bi,dtype,layers,batch_first", GRID)
def test_workspace_matches_measurement(
    I: int, H: int, T: int, N: int, bi: bool, dtype: torch.dtype, layers: int, batch_first: bool
) -> None:
    if dtype == BF16 and not _bf16_ok():
        pytest.skip("CPU lacks mkldnn bf16 support")
    assert uses_onednn_workspace(dtype)
    got = _measure(I, H, T, N, bi, dtype, layers, batch_first)
    assert got == _predict(I, H, T, N, bi, dtype, layers)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_bias_and_batch_first_do_not_matter(dtype: torch.dtype) -> None:
    if dtype == BF16 and not _bf16_ok():
        pytest.skip("CPU lacks mkldnn bf16 support")
    expected = _predict(24, 48, 6, 5, True, dtype, 2)
    assert _measure(24, 48, 6, 5, True, dtype, 2, batch_first=False, bias=False) == expected
    assert _measure(24, 48, 6, 5, True, dtype, 2, batch_first=True, bias=False) == expected
    assert lstm_workspace_bytes(
        seq_len=6, batch=5, input_size=24, hidden_size=48, dtype=dtype, bias=False
    ) == expected[0]


def test_known_values() -> None:
    kw = dict(input_size=16, hidden_size=32, seq_len=7)
    assert lstm_workspace_bytes(batch=3, dtype=F32, **kw) == 57344
    assert lstm_workspace_bytes(batch=1, dtype=F32, **kw) == 28672
    assert lstm_workspace_bytes(batch=100, dtype=F32, **kw) == 1474560
    assert lstm_workspace_bytes(batch=3, dtype=BF16, **kw) == 45056


def test_get_good_ld() -> None:
    assert get_good_ld(1, 4) == 16
    assert get_good_ld(128, 4) == 128
    assert get_good_ld(256, 4) == 272
    assert get_good_ld(250, 4) == 256 + 16
    assert get_good_ld(256, 2) == 288
    assert get_good_ld(257, 2) == 288


def test_unbatched_input_is_batch_one() -> None:
    got = _saved_uint8_sizes(nn.LSTM(16, 32), torch.randn(7, 16))
    assert got == [lstm_workspace_bytes(seq_len=7, batch=1, input_size=16, hidden_size=32, dtype=F32)]


def test_float32_cell_state_with_bf16_data() -> None:
    if not _bf16_ok():
        pytest.skip("CPU lacks mkldnn bf16 support")
    m = nn.LSTM(16, 32).to(BF16)
    hx = torch.zeros(1, 3, 32, dtype=BF16)
    cx = torch.zeros(1, 3, 32, dtype=F32)
    got = _saved_uint8_sizes(m, torch.randn(7, 3, 16, dtype=BF16), (hx, cx))
    expected = lstm_workspace_bytes(
        seq_len=7, batch=3, input_size=16, hidden_size=32, dtype=BF16, cell_state_dtype=F32
    )
    assert got == [expected]
    assert expected != lstm_workspace_bytes(
        seq_len=7, batch=3, input_size=16, hidden_size=32, dtype=BF16
    )


@pytest.mark.filterwarnings("ignore:TF32 acceleration")
def test_uses_onednn_workspace_matches_dispatch() -> None:
    x = torch.randn(5, 3, 8)
    ws = lstm_workspace_bytes(seq_len=5, batch=3, input_size=8, hidden_size=12, dtype=F32)

    assert _saved_uint8_sizes(nn.GRU(8, 12), x) == []
    assert not uses_onednn_workspace(F32, mode="GRU")
    assert _saved_uint8_sizes(nn.RNN(8, 12), x) == []
    assert not uses_onednn_workspace(F32, mode="RNN_TANH")
    assert _saved_uint8_sizes(nn.RNN(8, 12, nonlinearity="relu"), x) == []
    assert not uses_onednn_workspace(F32, mode="RNN_RELU")

    with pytest.warns(UserWarning, match="projections"):
        assert _saved_uint8_sizes(nn.LSTM(8, 12, proj_size=4), x) == []
    assert not uses_onednn_workspace(F32, proj_size=4)

    assert _saved_uint8_sizes(nn.LSTM(8, 12).half(), x.half()) == []
    assert not uses_onednn_workspace(torch.float16)
    assert _saved_uint8_sizes(nn.LSTM(8, 12).double(), x.double()) == []
    assert not uses_onednn_workspace(torch.float64)

    with torch.backends.mkldnn.flags(enabled=False):
        assert _saved_uint8_sizes(nn.LSTM(8, 12), x) == []
        assert not uses_onednn_workspace(F32)

    with torch.no_grad():
        assert _saved_uint8_sizes(nn.LSTM(8, 12), x) == []
    assert not uses_onednn_workspace(F32, grad_enabled=False)

    ragged = pack_padded_sequence(x, [5, 4, 2])
    assert _saved_uint8_sizes(nn.LSTM(8, 12), ragged) == []
    assert not uses_onednn_workspace(F32, packed=True)
    uniform = pack_padded_sequence(x, [5, 5, 5])
    assert _saved_uint8_sizes(nn.LSTM(8, 12), uniform) == [ws]
    assert uses_onednn_workspace(F32, packed=True, packed_uniform=True)

    assert _saved_uint8_sizes(nn.LSTM(8, 12), x) == [ws]
    assert uses_onednn_workspace(F32)
    assert uses_onednn_workspace(BF16) == _bf16_ok()
