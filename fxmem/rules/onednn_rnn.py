"""Exact size of the uint8 ``workspace`` that CPU LSTM training saves via oneDNN.

Why this module exists
----------------------
On CPU, ``nn.LSTM`` with grad mode on runs ``aten.mkldnn_rnn_layer`` once per layer and
direction. Each call returns a uint8 ``workspace`` tensor, and autograd keeps it for
``mkldnn_rnn_layer_backward``. The meta kernel in ``torch/_meta_registrations.py`` returns
``torch.empty(0, dtype=torch.uint8)`` for it, so a fake-tensor run counts it as 0 bytes. The real
size is the one below. It is exact (verified byte-for-byte against PyTorch 2.13.0+cpu, which
bundles oneDNN v3.12).

How PyTorch builds the primitive (``aten/src/ATen/native/mkldnn/RNN.cpp``)
----------------------------------------------------------------------------
``mkldnn_rnn`` makes the input contiguous in (seq, batch, feature) order first, so
``batch_first`` doesn't affect the size. It then calls ``mkldnn_rnn_layer`` separately for
every layer and direction. So each oneDNN primitive has ``n_layer = n_dir = 1``
(``reverse=True`` sets the right-to-left direction, which doesn't change the size).
``src_layer``/``dst_layer`` use ``tnc`` layout and the states use ``ldnc``. Each tensor keeps its
own dtype: ``nn.LSTM`` makes ``hx``/``cx`` in the input dtype. A caller may pass a float32 ``cx``
with bfloat16 data, which enlarges the cell-state buffer (``cell_state_dtype`` below). A float32
``hx`` with bfloat16 data is rejected by oneDNN. When
``GradMode`` is enabled, the layer asks ``ideep::lstm_forward_training`` (oneDNN
``forward_training``) for its primitive descriptor. It allocates
``workspace_desc().get_size()`` bytes as a uint8 tensor. When grad mode is off, it runs
inference and returns an undefined tensor, so no workspace exists.
The bias and the ``train``/dropout flags don't change the size. Without bias, zeros are passed
in its place.

Where the formula comes from (oneDNN ``src/cpu/rnn``)
-------------------------------------------------------
* ``rnn_utils.hpp``, ``init_conf``: picks the leading dimension (row pitch, in elements) of each
  workspace buffer. Buffers that take part in GEMMs get ``get_good_ld(dim, sizeof_dt)``
  (defined in ``rnn_utils.cpp``). It rounds ``dim`` up to a multiple of 64 bytes' worth of
  elements. If the result is a multiple of 256 elements, it adds one more 64-byte chunk to
  avoid 4K aliasing. The cell-state buffers (``ws_states_iter_c``, ``ws_diff_states_iter_c``)
  use the plain ``dhc`` (hidden size) as their pitch.
* ``rnn_utils.hpp``, ``set_workspace_sizes``: the byte size of each buffer. ``ref_rnn.hpp``
  gives the element types. The states, gates and ``ht`` use the data type (f32 or bf16).
  The accumulator type for the diff-state buffers is always f32. The ``iter_c`` buffer uses
  the dtype of ``src_iter_c``.
* ``rnn_utils.cpp``, ``set_offsets``: puts the buffers one after another, each starting on a
  4096-byte page boundary. The order is ``ws_gates``, ``ws_ht``, ``ws_states_layer`` (shared
  with ``ws_states_iter``, which gets no space of its own), ``ws_states_iter_c``,
  ``ws_diff_states_layer``, ``ws_diff_states_iter``, ``ws_diff_states_iter_c``, then
  ``ws_grid_comp``. ``ws_grid_comp`` is empty for LSTM, but registering it still rounds the
  running offset up to a page. The workspace size is that final offset. So it equals the sum of
  each buffer's size rounded up to a multiple of 4096.

With ``T = seq_len``, ``N = batch``, ``I = input_size``, ``H = hidden_size``,
``s = dtype itemsize`` (4 for f32, 2 for bf16), ``c = cell-state itemsize``,
``ld(d, b) = get_good_ld(d, b)`` and ``S = max(I, H)``::

    ws_gates              = T * N * ld(4H, s) * s
    ws_ht                 = T * N * ld(H, s) * s
    ws_states_layer       = 2 * (T+1) * N * ld(S, s) * s
    ws_states_iter_c      = 2 * (T+1) * N * H * c
    ws_diff_states_layer  = 2 * (T+1) * N * ld(S, 4) * 4
    ws_diff_states_iter   = 2 * (T+1) * N * ld(S, 4) * 4
    ws_diff_states_iter_c = 2 * (T+1) * N * H * 4
    workspace             = sum of round_up(each, 4096)

The factor 2 is ``n_layer + 1`` and ``T+1`` is ``n_iter + 1``: oneDNN keeps an extra row of
states for the initial state and the layer input. For layers after the first, ``I`` is the
previous layer's output width: ``H``, or ``2H`` when bidirectional.

When PyTorch takes this path (``aten/src/ATen/native/RNN.cpp``, ``use_mkldnn`` and ``lstm``)
-------------------------------------------------------------------------------------------
Only LSTM uses it. GRU, RNN_TANH and RNN_RELU always use the native ATen cell loop on CPU and
save no uint8 tensor. Every condition below must hold:

* ATen is built with mkldnn and ``torch.backends.mkldnn.enabled`` is on;
* input, weights and hidden states are all on CPU and dense, and the input is non-empty;
* dtype is float32; or bfloat16 when the CPU supports mkldnn bf16; or float16 only when grad mode
  is off, and then there is no workspace anyway;
* the LSTM has no projection (``proj_size == 0``, meaning hx and cx have the same size);
* the input is not a ``PackedSequence``, with one exception: a packed sequence whose
  ``batch_sizes`` are all equal is reshaped to a plain ``(T, N, I)`` tensor and takes this path.
  Verified on 2.13: uniform packed sequences save the workspace, ragged ones don't;
* the hidden state doesn't have symbolic sizes/strides (e.g. dynamic-shape tracing). Otherwise
  ATen warns and falls back.

Otherwise ``_lstm_impl`` runs the LSTM cell by cell with ordinary ATen ops (``linear``,
``sigmoid``, ``tanh``, ...). Autograd then saves those ops' ordinary float tensors, and no uint8
workspace appears.
"""

from __future__ import annotations

import torch

__all__ = [
    "PAGE_SIZE",
    "get_good_ld",
    "lstm_workspace_bytes",
    "lstm_workspace_components",
    "uses_onednn_workspace",
]

PAGE_SIZE = 4096
"""Page alignment oneDNN applies to each workspace buffer (``set_offsets``)."""

_LSTM_GATES = 4
_ACC_ITEMSIZE = 4  # gemm accumulator type is f32 for both the f32 and bf16 configurations
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def get_good_ld(dim: int, itemsize: int) -> int:
    """oneDNN's padded leading dimension (in elements) for a row of ``dim`` elements.

    Rounds up to a whole 64-byte line. If the result is a multiple of 256 elements, one more
    line is added (to avoid 4K aliasing).
    """
    per_line = 64 // itemsize
    ld = _round_up(dim, per_line)
    return ld + per_line if ld % 256 == 0 else ld


def _itemsize(dtype: torch.dtype) -> int:
    if dtype not in _ONEDNN_DTYPES:
        raise ValueError(
            f"oneDNN LSTM training workspace is only produced for float32/bfloat16, got {dtype}"
        )
    return torch.empty((), dtype=dtype).element_size()


def lstm_workspace_components(
    *,
    seq_len: int,
    batch: int,
    input_size: int,
    hidden_size: int,
    dtype: torch.dtype,
    cell_state_dtype: torch.dtype | None = None,
) -> dict[str, int]:
    """Unpadded byte size of each buffer in one layer/direction's workspace, in layout order."""
    for name, value in (
        ("seq_len", seq_len),
        ("batch", batch),
        ("input_size", input_size),
        ("hidden_size", hidden_size),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    s = _itemsize(dtype)
    c = _itemsize(cell_state_dtype if cell_state_dtype is not None else dtype)
    t, n, h = seq_len, batch, hidden_size
    state_width = max(input_size, h)
    # (n_layer + 1) * n_dir * (n_iter + 1) * mb with n_layer = n_dir = 1
    state_rows = 2 * (t + 1) * n
    diff_states = state_rows * get_good_ld(state_width, _ACC_ITEMSIZE) * _ACC_ITEMSIZE
    return {
        "ws_gates": t * n * get_good_ld(_LSTM_GATES * h, s) * s,
        "ws_ht": t * n * get_good_ld(h, s) * s,
        "ws_states_layer": state_rows * get_good_ld(state_width, s) * s,
        "ws_states_iter_c": state_rows * h * c,
        "ws_diff_states_layer": diff_states,
        "ws_diff_states_iter": diff_states,
        "ws_diff_states_iter_c": state_rows * h * _ACC_ITEMSIZE,
        "ws_grid_comp": 0,  # only non-empty for linear-before-reset GRU
    }


def lstm_workspace_bytes(
    *,
    seq_len: int,
    batch: int,
    input_size: int,
    hidden_size: int,
    dtype: torch.dtype,
    bias: bool = True,
    cell_state_dtype: torch.dtype | None = None,
) -> int:
    """Bytes of the uint8 workspace returned by one ``aten.mkldnn_rnn_layer`` call (grad mode on).

    Call it once per layer and direction. ``input_size`` is that layer's input width:
    ``hidden_size * (2 if bidirectional else 1)`` for layers after the first. Direction,
    ``bias``, ``batch_first`` and dropout don't change the size. ``bias`` is accepted only
    for call-site symmetry. ``cell_state_dtype`` defaults to ``dtype``, which is what
    ``nn.LSTM`` passes.
    """
    del bias  # absent biases are replaced by zeros of the same shape; size is unaffected
    parts = lstm_workspace_components(
        seq_len=seq_len,
        batch=batch,
        input_size=input_size,
        hidden_size=hidden_size,
        dtype=dtype,
        cell_state_dtype=cell_state_dtype,
    )
    return sum(_round_up(size, PAGE_SIZE) for size in parts.values())


def uses_onednn_workspace(
    dtype: torch.dtype,
    *,
    mode: str = "LSTM",
    proj_size: int = 0,
    packed: bool = False,
    packed_uniform: bool = False,
    grad_enabled: bool = True,
    device: torch.device | str = "cpu",
) -> bool:
    """Whether a CPU RNN forward leaves one uint8 oneDNN workspace per layer and direction.

    Follows ATen's ``use_mkldnn`` and ``lstm`` dispatch. The result is true only when all of
    these hold: LSTM without projection, float32 (or bfloat16 if this CPU supports mkldnn bf16),
    on CPU, oneDNN available and enabled, grad mode on, and not a packed sequence.
    For a ``PackedSequence`` input, set ``packed=True``. Set ``packed_uniform=True`` too when all
    its ``batch_sizes`` are equal. ATen 2.13 unpacks such a sequence to a plain
    ``(len(batch_sizes), batch_sizes[0], I)`` tensor and it takes the oneDNN path. Ragged packed
    sequences never do. Doesn't check symbolic shapes or empty inputs.
    """
    if torch.device(device).type != "cpu" or not grad_enabled:
        return False
    if mode.upper() != "LSTM" or proj_size != 0 or (packed and not packed_uniform):
        return False
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False
