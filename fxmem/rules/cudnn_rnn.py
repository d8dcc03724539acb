"""Recurrent layers on the cuda target: the ``_cudnn_rnn`` call ATen makes, and what cuDNN adds to it.

On CUDA, ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` call ``_VF.lstm`` / ``gru`` / ``rnn_tanh`` /
``rnn_relu``, which ATen hands to cuDNN whenever ``use_cudnn`` holds (aten/src/ATen/native/RNN.cpp):
one ``aten._cudnn_rnn`` for all layers and directions (``_cudnn_impl`` in
aten/src/ATen/native/cudnn/RNN.cpp). ``rnn_kernel`` makes that call on fake CPU tensors, so autograd
itself records what ``CudnnRnnBackward0`` keeps (tools/autograd/derivatives.yaml: input, weights, hx,
cx, output, the reserve, the flat weight buffer, the dropout state). Three things the fake tensors
cannot know are supplied here: the reserve's size (its meta kernel makes 0 bytes), the workspaces of
the forward and backward kernels (``cudnnGetRNNTempSpaceSizes``), and a fake ``_cudnn_rnn_backward``
(torch has none). fxmem/rules/ops.py registers the rules; fxmem/gpu/target.py routes the calls here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Any, Protocol

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxmem.results import WorkspaceLines

__all__ = [
    "CudnnMode",
    "RnnAlgo",
    "RnnGeometry",
    "choose_algo",
    "cudnn_rnn_backward_workspace",
    "cudnn_rnn_reserve",
    "cudnn_rnn_workspace",
    "reserve_bytes",
    "rnn_kernel",
    "workspace_bytes",
]

aten = torch.ops.aten
_MiB = 2**20


class CudnnMode(IntEnum):
    """cudnnRNNMode_t, the ``mode`` argument of ``_cudnn_rnn``."""

    RNN_RELU = 0
    RNN_TANH = 1
    LSTM = 2
    GRU = 3


class RnnAlgo(StrEnum):
    """The cudnnRNNAlgo_t ``get_algo`` (cudnn/RNN.cpp) picks; the sizes below depend on it."""

    STANDARD = "standard"
    PERSIST_SMALL_H = "persist_static_small_h"


_MODES = {"rnn_relu": CudnnMode.RNN_RELU, "rnn_tanh": CudnnMode.RNN_TANH, "lstm": CudnnMode.LSTM, "gru": CudnnMode.GRU}


# Note [cuDNN RNN reserve]
#     The reserve ``_cudnn_rnn`` returns (output 3, uint8) is what cuDNN keeps from the forward for the
#     backward: per time step and sample, ``rows`` H-wide rows per layer and direction (LSTM 5: its four
#     gates and the cell; GRU 6) and the output of every layer but the last (D*H wide; the last one's
#     is the op's output), plus 256 bytes, in the input's dtype (float16 under autocast):
#         reserve = (rows * L * D + (L - 1) * D) * T * B * H * s + 256
#     Exact on all 192 cuDNN 9.19 calls an H200 measured (tests/data/h200: kernels_h200.json.gz's
#     saved uint8 tensors and trace_rnn.json.gz's allocations; LSTM and GRU, 1-3 layers, uni- and
#     bidirectional, H 128-1000, T 16/128, B 1-8, fp32 and fp16). RNN_TANH / RNN_RELU were not measured:
#     one row (the activation) is an estimate. In inference (``train`` false) there is no reserve.
#
# Note [cuDNN RNN workspace]
#     The workspace is allocated before the reserve and freed when the kernel returns; the backward
#     (``_cudnn_rnn_backward_input`` and ``_weight``, one after the other) asks for the same size in each
#     part, with its own algorithm. From the 96 traced calls (exact) and the 96 kernel records:
#         workspace = 8 MiB * L * D                       (per layer and direction, whatever the shapes)
#                   + s * (weight matrices, biases not)   (every layer and direction)
#                   + s * T * B * (G*H*D + (2D-1)*D*H + m*I)
#                   + B * (state rows per layer and direction) * L * D
#                   + 256 + 32 * ceil(B / 4)
#     with G the gates (LSTM 4, GRU 3) and m = 1 for LSTM, 2 for GRU. The state rows are, per sample,
#     LSTM: four H-wide rows each rounded up to 32 bytes (seen with H = 1000 in fp16 at B = 1 and 3)
#     and 6H more; GRU: five rounded H-wide rows; bidirectional layers add 2H per direction.
#     ``get_algo`` takes PERSIST_STATIC_SMALL_H (forward: LSTM/GRU H <= 192, RNN H <= 384; backward:
#     128 and 256) on sm60+: its per-step term has 2*G*H*D more, its state rows are 9H (LSTM) and 7H
#     (GRU), unrounded; measured at H = 128, one layer, bidirectional only. Exact on every traced call
#     but GRU(64, 256, 2 layers) at T = 128, where cuDNN keeps m = 1: T*B*I*s over (32 KiB per sample in
#     fp32: 0.2% of that workspace at B = 1, 1.1% at B = 8). Not measured, sized as STANDARD: PERSIST_STATIC (fp16, one layer,
#     H and I multiples of 128, B a multiple of 8), RNN_TANH/RNN_RELU (G = 1, m = 1, three state rows:
#     estimates), other GPUs than the H200 (the 8 MiB may scale with the SM count), inference mode.
#     With a symbolic batch, 32 * ceil(B / 4) and a row rounded to 32 bytes are not polynomials: their
#     upper bounds (8B + 24; + 31) are charged, a few bytes over.

_STATE_ROW_ALIGN = 32
_WORKSPACE_PER_LAYER = 8 * _MiB


@dataclass(frozen=True)
class _Cell:
    """What one cell kind puts in cuDNN's buffers, in H-wide rows. See the Notes above."""

    gates: int
    reserve_rows: int
    input_rows: int
    rounded_state_rows: int
    plain_state_rows: int
    persist_state_rows: int


_CELLS = {
    CudnnMode.LSTM: _Cell(gates=4, reserve_rows=5, input_rows=1, rounded_state_rows=4, plain_state_rows=6, persist_state_rows=9),
    CudnnMode.GRU: _Cell(gates=3, reserve_rows=6, input_rows=2, rounded_state_rows=5, plain_state_rows=0, persist_state_rows=7),
    # not measured: estimates, see Note [cuDNN RNN reserve] and Note [cuDNN RNN workspace]
    CudnnMode.RNN_TANH: _Cell(gates=1, reserve_rows=1, input_rows=1, rounded_state_rows=3, plain_state_rows=0, persist_state_rows=3),
    CudnnMode.RNN_RELU: _Cell(gates=1, reserve_rows=1, input_rows=1, rounded_state_rows=3, plain_state_rows=0, persist_state_rows=3),
}


@dataclass(frozen=True)
class RnnGeometry:
    """One ``_cudnn_rnn`` call's sizes: ``seq`` and ``batch`` may be SymInts, the rest are ints."""

    mode: CudnnMode
    seq: Any
    batch: Any
    input_size: int
    hidden: int
    layers: int
    directions: int
    itemsize: int
    matrix_elems: int
    """Elements of the weight matrices (biases not) over all layers and directions."""

    @classmethod
    def of(
        cls, inp: Any, weights: Sequence[Any], stride0: int, mode: int, hidden: int, layers: int, batch_first: bool, bidirectional: bool
    ) -> RnnGeometry:
        """The geometry of an unpacked ``_cudnn_rnn`` (or ``_cudnn_rnn_backward``) call's arguments."""
        seq, batch = (inp.shape[1], inp.shape[0]) if batch_first else (inp.shape[0], inp.shape[1])
        biases = (2, 3) if stride0 in (4, 5) else ()  # per layer: w_ih, w_hh[, b_ih, b_hh][, w_hr]
        matrices = sum(w.numel() for i, w in enumerate(weights) if i % stride0 not in biases)
        directions = 2 if bidirectional else 1
        return cls(CudnnMode(mode), seq, batch, int(inp.shape[2]), hidden, layers, directions, inp.element_size(), int(matrices))


def reserve_bytes(g: RnnGeometry) -> Any:
    """The training reserve; see Note [cuDNN RNN reserve].

    >>> g = RnnGeometry(CudnnMode.LSTM, 128, 4, 64, 256, 2, 1, 4, 851968)
    >>> reserve_bytes(g)  # LastStepLSTM at B=4: 11 rows of 256 floats per step and sample
    5767424
    """
    rows = _CELLS[g.mode].reserve_rows * g.layers * g.directions + (g.layers - 1) * g.directions
    return rows * g.seq * g.batch * g.hidden * g.itemsize + 256


def choose_algo(mode: CudnnMode, hidden: int, *, forward: bool) -> RnnAlgo:
    """``get_algo`` for an unpacked input on sm60+ without projections, PERSIST_STATIC left out
    (Note [cuDNN RNN workspace]): ``use_rnn_persist_small_h``'s hidden-size limits."""
    simple = mode in (CudnnMode.RNN_RELU, CudnnMode.RNN_TANH)
    limit = (384 if simple else 192) if forward else (256 if simple else 128)
    return RnnAlgo.PERSIST_SMALL_H if hidden <= limit else RnnAlgo.STANDARD


def workspace_bytes(g: RnnGeometry, algo: RnnAlgo) -> Any:
    """cuDNN's workspace for one forward or backward part; see Note [cuDNN RNN workspace].

    >>> g = RnnGeometry(CudnnMode.LSTM, 128, 4, 64, 256, 2, 1, 4, 851968)
    >>> workspace_bytes(g, RnnAlgo.STANDARD)  # LastStepLSTM at B=4
    23019808
    """
    cell, h, d, s = _CELLS[g.mode], g.hidden, g.directions, g.itemsize
    per_step = cell.gates * h * d + (2 * d - 1) * d * h + cell.input_rows * g.input_size
    if algo == RnnAlgo.PERSIST_SMALL_H:
        per_step += 2 * cell.gates * h * d
    fixed = _WORKSPACE_PER_LAYER * g.layers * d + s * g.matrix_elems
    return fixed + s * g.seq * g.batch * per_step + g.layers * d * _state_rows(cell, algo, g) + _sequence_lengths(g.batch)


def _state_rows(cell: _Cell, algo: RnnAlgo, g: RnnGeometry) -> Any:
    """The per-sample state buffers of one layer and direction."""
    row = g.hidden * g.batch * g.itemsize
    if algo == RnnAlgo.PERSIST_SMALL_H:
        return cell.persist_state_rows * row
    bidirectional = 2 * (g.directions - 1) * row
    return cell.rounded_state_rows * _round_up(row, g.hidden * g.itemsize) + cell.plain_state_rows * row + bidirectional


def _round_up(row: Any, per_sample: int) -> Any:
    """A row rounded up to 32 bytes: exact where the batch is known or each sample's row is aligned,
    else its upper bound."""
    if per_sample % _STATE_ROW_ALIGN == 0:
        return row
    if isinstance(row, torch.SymInt):
        return row + _STATE_ROW_ALIGN - 1  # not a polynomial in B: its bound
    return -(-row // _STATE_ROW_ALIGN) * _STATE_ROW_ALIGN


def _sequence_lengths(batch: Any) -> Any:
    """256 bytes and 32 per started group of four samples; with a symbolic batch, its bound."""
    if isinstance(batch, torch.SymInt):
        return 256 + 8 * batch + 24
    return 256 + 32 * math.ceil(batch / 4)


# Rules (registered in fxmem/rules/ops.py). _cudnn_rnn's arguments: input, weight, weight_stride0,
# weight_buf, hx, cx, mode, hidden_size, proj_size, num_layers, batch_first, dropout, train,
# bidirectional, batch_sizes, dropout_state; the backward's: input, weight, weight_stride0,
# weight_buf, hx, cx, output, grad_output, grad_hy, grad_cy, mode, hidden_size, proj_size,
# num_layers, batch_first, dropout, train, bidirectional, batch_sizes, dropout_state, reserve,
# output_mask.


def _forward_geometry(args: Sequence[Any]) -> RnnGeometry | None:
    if len(args[14]) != 0:
        return None  # packed input: not routed to cuDNN here (see rnn_kernel)
    return RnnGeometry.of(args[0], args[1], int(args[2]), int(args[6]), int(args[7]), int(args[9]), bool(args[10]), bool(args[13]))


def cudnn_rnn_reserve(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> dict[int, object]:
    """The reserve (output 3), which ``_cudnn_rnn``'s meta kernel makes empty. See Note [cuDNN RNN reserve]."""
    g = _forward_geometry(args)
    if g is None or not args[12]:
        return {}
    return {3: reserve_bytes(g)}


def cudnn_rnn_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """The forward's workspace and its contiguous copy of the input; see Note [cuDNN RNN workspace]."""
    g = _forward_geometry(args)
    if g is None:
        return 0
    algo = choose_algo(g.mode, g.hidden, forward=True)
    return _copy_bytes(args[0], bool(args[10])) + workspace_bytes(g, algo)


# Note [cuDNN RNN backward buffers]
#     ``_cudnn_rnn_backward`` (cudnn/RNN.cpp) makes, besides dx, dhx and dcx: zeros for each incoming
#     gradient autograd left undefined (output, hy, cy), the input made contiguous seq-major and, for
#     its input part, the output's gradient made so; then the workspace. Its weight part runs after
#     the input part has freed that gradient copy: the flat weight gradient (its views are the weights'
#     gradients), a fresh copy of the input and the workspace again. Seen in every trace of
#     trace_rnn.json.gz. The timeline records only the tensors an op returns at its top level, so the
#     flat weight gradient, returned inside the Tensor[] output, is charged here with the transients;
#     the timeline sees its storage later, when AccumulateGrad keeps the views as ``.grad`` (were the
#     timeline to record list outputs, the weight gradient would leave the line below; the traces in
#     tests/test_cudnn_rnn.py would show the double count). The op's high mark above dx, dhx and dcx
#     is then the larger of
#         zeros + input copy + workspace + grad_output copy     (input part)
#         zeros + input copy + workspace + weight gradient      (weight part)
#     both lines exact at every batch.


def cudnn_rnn_backward_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """The backward's transient buffers and its flat weight gradient; see Note [cuDNN RNN backward buffers]."""
    inp, weights, batch_first, mask = args[0], args[1], bool(args[14]), args[21]
    if len(args[18]) != 0:
        return 0
    g = RnnGeometry.of(inp, weights, int(args[2]), int(args[10]), int(args[11]), int(args[13]), batch_first, bool(args[17]))
    both = _undefined_grads(args) + _copy_bytes(inp, batch_first) + workspace_bytes(g, choose_algo(g.mode, g.hidden, forward=False))
    input_part = both + _grad_output_copy(args[6], args[7], batch_first)
    weight_part = both + (sum(w.numel() for w in weights) * args[3].element_size() if mask[3] else 0)
    if isinstance(input_part, torch.SymInt):
        return WorkspaceLines((input_part, weight_part))
    return max(input_part, weight_part)


def _undefined_grads(args: Sequence[Any]) -> Any:
    """The zeros ``_cudnn_rnn_backward`` makes for the output, hy and cy gradients autograd left undefined."""
    pairs = ((args[6], args[7]), (args[4], args[8]), (args[5], args[9]))
    return sum((_nbytes(t) for t, grad in pairs if t is not None and grad is None), 0)


def _grad_output_copy(output: Any, grad_output: Any, batch_first: bool) -> Any:
    """The seq-major contiguous copy of the output's gradient (of its zeros, contiguous as the output
    is shaped, where autograd gave none)."""
    if grad_output is not None:
        return _copy_bytes(grad_output, batch_first)
    return _nbytes(output) if batch_first and not _known_one(output.shape[0]) and not _known_one(output.shape[1]) else 0


def _known_one(size: Any) -> bool:
    return isinstance(size, int) and size == 1


def _nbytes(t: Any) -> Any:
    return t.numel() * t.element_size()


def _copy_bytes(t: Any, batch_first: bool) -> Any:
    """What ``.contiguous()`` allocates for the seq-major view cuDNN reads of ``t`` (none where it already is)."""
    seq_major = t.transpose(0, 1) if batch_first else t
    return 0 if _known_contiguous(seq_major) else _nbytes(t)


def _known_contiguous(t: Any) -> bool:
    """``is_contiguous`` without guards: a symbolic batch counts as more than one (B >= 2 in a symbolic pass)."""
    expected: Any = 1
    for size, stride in reversed(list(zip(t.shape, t.stride()))):
        if not statically_known_true(size == 1):
            if not statically_known_true(stride == expected):
                return False
            expected = expected * size
    return True


# Note [cuDNN RNN call on fake tensors]
#     ``rnn_kernel`` makes the call ``_cudnn_impl`` makes, with these choices:
#     * The flat weight buffer. On CUDA nn.RNNBase keeps its parameters as views of one flat buffer
#       (``flatten_parameters``); ``try_get_weight_buf`` hands it to ``_cudnn_rnn``, which returns it
#       as output 4, and autograd saves it: parameter memory. The fake parameters are separate
#       storages, so the first one stands for it (the meta kernel only returns it). Where a weight is
#       no parameter (computed in forward), cuDNN finds no flat buffer and copies the weights into a
#       new one (``WEIGHT_FORMAT_WARN``), saved: their concatenation stands for it.
#     * Autocast. ``_cudnn_rnn_cast_reflatten`` (aten/src/ATen/cudnn/AutocastRNN.cpp) casts input,
#       hx and cx to float16, whatever the autocast dtype, and copies the weights into a new float16
#       flat buffer (``copy_weights_to_flat_buf_views``): the weights it passes on alias the buffer
#       through ``set_``, so only they carry gradients, not the buffer. It is made at every call and
#       saved; an H200 measured both (kernels_h200.json.gz: float16 tensors under bf16 autocast).
#     * batch_first. The kernel works seq-major and returns its output as a transposed view; the meta
#       kernel lays a batch-first output out batch-major. Passing the transposed input with
#       batch_first=False and transposing the output back gives the GPU's layout, with the same bytes.
#     * Dropout between layers uses a dropout state cached per device (``get_dropout_state``, "slightly
#       over 2MB"), made once and kept: no step's memory, so none is passed.
#     Left to the CPU's kernels: packed sequences (their batch sizes are data, unknown to fake
#     tensors) and inputs ``use_cudnn`` refuses (bfloat16 below sm80, empty ones, integer dtypes).

_CUDNN_DTYPES = (torch.float32, torch.float16, torch.float64)
_ARGS = ("input", "hx", "params", "has_biases", "num_layers", "dropout", "train", "bidirectional", "batch_first")
"""``_VF.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu``'s unpacked overload, as nn.RNNBase calls it."""


class _Target(Protocol):
    """What a kernel needs of the cuda target (``CudaTargetMode``)."""

    amp: torch.dtype | None
    capability: tuple[int, int]


Kernel = Callable[[Any, Any, Sequence[Any], Mapping[str, Any]], Any]


def rnn_kernel(name: str) -> Kernel:
    """The cuda target's handler for ``_VF.<name>`` (lstm, gru, rnn_tanh, rnn_relu): cuDNN's call where
    ATen makes it, the CPU's kernels elsewhere. See Note [cuDNN RNN call on fake tensors]."""
    mode = _MODES[name]

    def kernel(target: _Target, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        if _packed(mode, args, kwargs):
            return func(*args, **kwargs)
        bound = {**dict(zip(_ARGS, args)), **kwargs}
        if not _cudnn_takes(bound["input"], target.capability):
            return func(*args, **kwargs)
        return _run(mode, bound, target.amp)

    return kernel


def _packed(mode: CudnnMode, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """The packed overload: (data, batch_sizes, hx, params, ...), where lstm's hx is a list and the others' a tensor."""
    if "batch_sizes" in kwargs or "data" in kwargs:
        return True
    second_is_tensor = len(args) > 1 and isinstance(args[1], torch.Tensor)
    return second_is_tensor and (mode == CudnnMode.LSTM or (len(args) > 2 and isinstance(args[2], torch.Tensor)))


def _cudnn_takes(x: torch.Tensor, capability: tuple[int, int]) -> bool:
    """``use_cudnn`` (native/RNN.cpp) with ``cudnn_is_acceptable``: bfloat16 from sm80 (cuDNN >= 9.13)."""
    dtype_ok = x.dtype in _CUDNN_DTYPES or (x.dtype == torch.bfloat16 and capability >= (8, 0))
    return dtype_ok and not (isinstance(x.numel(), int) and x.numel() == 0)


def _run(mode: CudnnMode, a: Mapping[str, Any], amp: torch.dtype | None) -> tuple[torch.Tensor, ...]:
    """``_cudnn_impl``, and under autocast ``_cudnn_rnn_cast_reflatten``, on fake tensors."""
    inp, params, batch_first = a["input"], list(a["params"]), bool(a["batch_first"])
    hx, cx = (a["hx"][0], a["hx"][1]) if mode == CudnnMode.LSTM else (a["hx"], None)
    hidden, proj = hx.shape[2], 0
    if cx is not None and cx.shape[2] != hx.shape[2]:  # an LSTM with projections
        hidden, proj = cx.shape[2], hx.shape[2]
    stride0 = (4 if a["has_biases"] else 2) + (1 if proj else 0)
    weights, buf = params, _flat_buffer(params)
    if amp is not None and params[0].is_floating_point() and params[0].dtype not in (torch.float16, torch.float64):
        weights, buf = _half_flat_weights(params)
        inp, hx, cx = _half(inp), _half(hx), None if cx is None else _half(cx)
    x = inp.transpose(0, 1) if batch_first else inp
    out = aten._cudnn_rnn(
        x, weights, stride0, buf, hx, cx, int(mode), hidden, proj, int(a["num_layers"]), False, float(a["dropout"]), bool(a["train"]),
        bool(a["bidirectional"]), [], None,
    )  # fmt: skip
    output = out[0].transpose(0, 1) if batch_first else out[0]
    return (output, out[1], out[2]) if mode == CudnnMode.LSTM else (output, out[1])


def _flat_buffer(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """What ``try_get_weight_buf`` finds: the parameters' flat buffer, or a new copy where a weight is no parameter."""
    if all(p.is_leaf for p in params):
        return params[0].detach()
    return torch.cat([p.detach().reshape(-1) for p in params])


def _half_flat_weights(params: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``copy_weights_to_flat_buf_views`` into float16: a zeroed flat buffer, each weight copied into
    an (n, 1) alias of its part, the aliases (which carry the gradients) and the buffer."""
    buf = torch.zeros(sum(p.numel() for p in params), dtype=torch.float16, device=params[0].device)
    views, offset = [], 0
    for p in params:
        n = p.numel()
        view = torch.empty(0, dtype=torch.float16, device=p.device).set_(buf.untyped_storage(), offset, (n, 1), (1, 1))
        view.copy_(p.reshape(n, 1))
        views.append(view)
        offset += n
    return views, buf


def _half(t: torch.Tensor) -> torch.Tensor:
    """``cached_cast(kHalf, t)`` for a tensor that is no parameter: floating and not double, to float16."""
    return t.to(torch.float16) if t.is_floating_point() and t.dtype not in (torch.float16, torch.float64) else t


# Note [A fake cuDNN RNN backward]
#     torch registers no meta kernel for ``_cudnn_rnn_backward``, so a fake backward through
#     CudnnRnnBackward0 would fail. This one allocates what the CUDA kernel returns (cudnn/RNN.cpp):
#     dx contiguous seq-major (for a batch-first input, returned transposed), dhx like hx, dcx like cx
#     where there is one, and, where the weights want gradients, one zeroed flat buffer of all weights
#     in the flat buffer's dtype whose views, shaped as the weights, are the gradients (``dw`` and
#     ``_viewParams``); AccumulateGrad then keeps those views as the parameters' ``.grad``, as on the GPU.
#     It is registered only where torch has no Meta kernel of its own.


def _cudnn_rnn_backward_meta(
    inp: torch.Tensor, weight: list[torch.Tensor], weight_stride0: int, weight_buf: torch.Tensor, hx: torch.Tensor, cx: torch.Tensor | None,
    output: torch.Tensor, grad_output: torch.Tensor | None, grad_hy: torch.Tensor | None, grad_cy: torch.Tensor | None, mode: int,
    hidden_size: int, proj_size: int, num_layers: int, batch_first: bool, dropout: float, train: bool, bidirectional: bool,
    batch_sizes: list[int], dropout_state: torch.Tensor | None, reserve: torch.Tensor, output_mask: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:  # fmt: skip
    """See Note [A fake cuDNN RNN backward]."""
    seq_major = batch_first and len(batch_sizes) == 0
    dx = torch.empty_like(inp.transpose(0, 1) if seq_major else inp, memory_format=torch.contiguous_format)
    dcx = None if cx is None else cx.new_empty(cx.shape)
    return dx.transpose(0, 1) if seq_major else dx, hx.new_empty(hx.shape), dcx, _weight_grads(weight, weight_buf) if output_mask[3] else []


def _weight_grads(weights: Sequence[torch.Tensor], weight_buf: torch.Tensor) -> list[torch.Tensor]:
    flat = weight_buf.new_zeros(sum(w.numel() for w in weights))
    grads, offset = [], 0
    for w in weights:
        grads.append(flat[offset : offset + w.numel()].view(w.shape))
        offset += w.numel()
    return grads


_ATEN_IMPL = torch.library.Library("aten", "IMPL")  # kept for the registration's lifetime
if not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_cudnn_rnn_backward", "Meta"):
    _ATEN_IMPL.impl("_cudnn_rnn_backward", _cudnn_rnn_backward_meta, "Meta")
