"""SDPA on the cuda target (fxmem/rules/sdpa.py) against what an H200 measured, and torch's choices by release.

The figures are tests/data/h200's (README.md there; torch 2.11.0+cu130, cuDNN 9.19, sm90), so every
comparison asks for 2.11's choice (``CudaTargetMode(..., release=(2, 11))``):

- ``kernels_h200.json.gz``'s 118 calls (B=2, S=256): the backend and every tensor autograd saved besides
  q, k, v and the mask, compared with those of a fake call through ``CudaTargetMode``.
- ``trace_sdpa.json.gz``'s 750 calls: the backend (its ``grad_fn``) and the caching allocator's trace of
  ``o = F.scaled_dot_product_attention(...)`` and ``o.backward(torch.ones_like(o))`` between marker
  blocks, in requested bytes. The timeline (``simulate_step``) replays each call with the cuda rules: what
  lives when the forward ends (the output and what autograd saved: the file's own lists of saved tensors
  are empty, as ``run_sdpa_case`` in tests/gpu/trace_h200.py clears the list after storing it), the
  forward's high mark and the backward's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils._python_dispatch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

import fxmem
from fxmem.engine.losses import Loss
from fxmem.gpu.target import CudaTargetMode
from fxmem.results import Timeline
from fxmem.rules import torch_release
from fxmem.rules.optimizers import OptimizerRule
from fxmem.rules.sdpa import SdpBackend, choose_sdp_backend
from fxmem.rules.sdpa_buffers import cudnn_attention_backward_workspace, efficient_attention_backward_workspace
from tests.h200_traces import H200, Marks, load, lone_graph, simulate_on_h200, timeline_marks, trace_marks
from tests import helpers

A100 = (8, 0)
MEASURED = (2, 11)

_GRAD_FNS = {
    "ScaledDotProductCudnnAttentionBackward0": SdpBackend.CUDNN,
    "ScaledDotProductEfficientAttentionBackward0": SdpBackend.EFFICIENT,
    "UnsafeViewBackward0": SdpBackend.MATH,  # fp32: the output is the matmul's
    "ToCopyBackward0": SdpBackend.MATH,  # fp16/bf16: the output is cast back from fp32
}
_FORWARD_OPS = {
    SdpBackend.CUDNN: "aten._scaled_dot_product_cudnn_attention",
    SdpBackend.EFFICIENT: "aten._scaled_dot_product_efficient_attention",
    SdpBackend.MATH: "aten._safe_softmax",
}


@dataclass(frozen=True)
class Case:
    """One measured call: q (2, heads[0], seq, head_dim), k and v (2, heads[1], seq, head_dim), and
    ``mask`` one of none, causal (``is_causal``), bool (S, S), bool_b (B, 1, S, S), float (B, 1, S, S)
    (the kernel records do not give the float mask's shape; no backend saves a float mask but as given)."""

    dtype: str
    head_dim: int
    mask: str
    heads: tuple[int, int]
    dropout: float
    seq: int = 256

    def __str__(self) -> str:
        return f"{self.dtype}-d{self.head_dim}-{self.mask}-h{self.heads[0]}/{self.heads[1]}-p{self.dropout}-s{self.seq}"

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    def tensors(self, grad: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        (hq, hk), dtype = self.heads, self.torch_dtype
        make = lambda heads: torch.empty(2, heads, self.seq, self.head_dim, dtype=dtype, requires_grad=grad)
        s = self.seq
        masks = {"bool": lambda: torch.ones(s, s, dtype=torch.bool), "bool_b": lambda: torch.ones(2, 1, s, s, dtype=torch.bool)}
        masks["float"] = lambda: torch.zeros(2, 1, s, s, dtype=dtype)
        return make(hq), make(hk), make(hk), masks[self.mask]() if self.mask in masks else None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        causal, gqa = self.mask == "causal", self.heads[0] != self.heads[1]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout, is_causal=causal, enable_gqa=gqa)

    def backend(self, version: tuple[int, int] = MEASURED, capability: tuple[int, int] = H200) -> SdpBackend:
        with torch.device("meta"):
            q, k, v, mask = self.tensors()
        causal, gqa = self.mask == "causal", self.heads[0] != self.heads[1]
        kw: dict[str, Any] = {"dropout_p": self.dropout, "is_causal": causal, "enable_gqa": gqa}
        return choose_sdp_backend(q, k, v, attn_mask=mask, capability=capability, version=version, **kw)


def _kernel_case(r: dict[str, Any]) -> Case:
    return Case(r["dtype"], r["head_dim"], r["mask"], tuple(r["heads_q_kv"]), r["dropout"])


def _trace_case(r: dict[str, Any]) -> Case:
    return Case(r["dtype"], r["head_dim"], r["mask"], tuple(r["heads"]), r["dropout"], r["seq"])


# --- the kernel records: backend and every saved tensor ---------------------------------------------


def _saved_by_fake_call(case: Case) -> tuple[str, list[tuple[Any, ...]]]:
    """The fake call's grad_fn and the tensors it saved besides q, k, v and the mask, as the records list
    them: a storage once, as the first tensor saved on it (the math path saves its softmax result twice,
    whole and as the batched matmul's (B*H, L, S) view)."""
    saved: list[tuple[Any, ...]] = []
    with FakeTensorMode():
        q, k, v, mask = case.tensors()
        seen = {StorageWeakRef(t.untyped_storage()) for t in (q, k, v, mask) if t is not None}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if StorageWeakRef(t.untyped_storage()) not in seen:
                seen.add(StorageWeakRef(t.untyped_storage()))
                saved.append((list(t.shape), str(t.dtype).removeprefix("torch."), t.untyped_storage().nbytes(), list(t.stride())))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), CudaTargetMode(compute_capability=H200, release=MEASURED):
            out = case.attend(q, k, v, mask)
        return type(out.grad_fn).__name__, sorted(saved)


def test_backend_and_saved_tensors_match_every_kernel_record() -> None:
    mismatches = []
    for record in load("kernels_h200.json.gz")["sdpa"]:
        case = _kernel_case(record)
        measured = sorted(tuple(t[f] for f in ("shape", "dtype", "storage_nbytes", "stride")) for t in record["saved_excluding_qkv_mask"])
        grad_fn, saved = _saved_by_fake_call(case)
        if case.backend() != record["backend"] or _GRAD_FNS.get(grad_fn) != record["backend"] or saved != measured:
            mismatches.append((str(case), record["backend"], case.backend(), grad_fn, saved, measured))
    assert not mismatches, mismatches[:5]


# --- the traces: backend, what the forward leaves, and both high marks -------------------------------


class _Attend(nn.Module):
    """The traced call with q, k and v as the parameters (they needed gradients; they live before the
    step, as the script's did) and the mask as a buffer; the step's input is not used."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        self.case = case
        q, k, v, mask = case.tensors(grad=False)
        self.q, self.k, self.v = (nn.Parameter(t) for t in (q, k, v))
        self.register_buffer("mask", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask: torch.Tensor | None = self.mask  # type: ignore[assignment]  # a buffer, or None
        return self.case.attend(self.q, self.k, self.v, mask)


class _OnesGrad(torch.autograd.Function):
    """``o.backward(torch.ones_like(o))``: a view of ``o`` as the step's scalar, whose backward hands on a
    gradient of ones in o's layout, kept until backward ends as the script's argument was."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x[(0,) * x.dim()]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        ctx.ones = torch.ones_like(x)
        return ctx.ones


_ONES = Loss("ones", "o.backward(torch.ones_like(o)), as the traced script did", lambda out: None, lambda out, _t: _OnesGrad.apply(out))


class _Idle(torch.optim.Optimizer):
    """No step: the traced script took none (the timeline's optimizer phases are not read)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params, {})

    def step(self, closure: Any = None) -> Any:
        return None


_NO_STEP = OptimizerRule("none", "no optimizer step", 0, False, build=lambda params: _Idle(params))


def _timeline(case: Case) -> Timeline:
    gm, specs = lone_graph(lambda: _Attend(case), ["B,1"])
    return simulate_on_h200(gm, specs, loss=_ONES, optimizer=_NO_STEP, batch=2, release=MEASURED)


def _predicted(case: Case, timeline: Timeline) -> Marks:
    """The timeline's marks. Its backward also holds autograd's 0-dim root gradient of the step's scalar,
    which ``o.backward(ones)`` does not make: one element of the call's dtype, taken off."""
    marks = timeline_marks(timeline, 2)
    return replace(marks, backward=marks.backward - case.torch_dtype.itemsize)


def _measured(record: dict[str, Any]) -> Marks:
    return trace_marks(record["trace"]["trace"])


def _trace_mismatches(backends: set[SdpBackend]) -> list[tuple[Any, ...]]:
    mismatches: list[tuple[Any, ...]] = []
    for record in load("trace_sdpa.json.gz")["cases"]:
        case, measured = _trace_case(record), _GRAD_FNS[record["grad_fn"]]
        if measured not in backends:
            continue
        timeline = _timeline(case)
        ran = _FORWARD_OPS[measured] in {e.op for e in timeline.events}
        if case.backend() != measured or not ran or _predicted(case, timeline) != _measured(record):
            mismatches.append((str(case), measured, case.backend(), ran, _predicted(case, timeline), _measured(record)))
    return mismatches


def test_cudnn_traces_match_to_the_byte() -> None:
    # 400 calls, fp16/bf16 with head dims <= 256; each mark exact: the output, the converted bool mask,
    # the fp32 (B, H, S, 1) statistics and the int64 seed and offset; the 256-byte forward workspace; the
    # backward's dQ accumulator, softmax sum and, for 8/2 heads, per-query-head dK and dV
    assert not _trace_mismatches({SdpBackend.CUDNN})


def test_efficient_and_math_traces_match_to_the_byte() -> None:
    # 350 calls: memory-efficient (fp32, and fp16/bf16 above 256 with equal heads), its output
    # accumulator, delta and kernel workspace; math (GQA above cuDNN), with its fused dropout, the
    # _safe_softmax marks and the softmax backward's temporary
    assert not _trace_mismatches({SdpBackend.EFFICIENT, SdpBackend.MATH})


# --- the workspace formulas, one by one ----------------------------------------------------------------


def test_cudnn_backward_workspace_of_grouped_query_attention() -> None:
    # bf16, 8 query heads over 2 key heads of 64, B=2, S=256 (trace_sdpa.json.gz: 2113792): the fp32 dQ
    # accumulator 2*8*256*64*4, the fp32 softmax sum 2*8*256*4, 256, and dK and dV per query head in bf16
    with FakeTensorMode():
        q, k = torch.empty(2, 8, 256, 64, dtype=torch.bfloat16), torch.empty(2, 2, 256, 64, dtype=torch.bfloat16)
        got = cudnn_attention_backward_workspace((q, q, k, k), {}, None)
    assert got == 2 * 8 * 256 * 64 * 4 + 2 * 8 * 256 * 4 + 256 + 2 * 8 * 256 * (64 + 64) * 2 == 2113792


def test_efficient_backward_workspace() -> None:
    with FakeTensorMode():
        # fp32, head dim 80, S=1000: kernel 128x64 (k128); dQ's tiles, ceil(1000/128) * ceil(80/64) of
        # 128*64 + 4 floats per batch and head, after the product and row sum of delta are freed
        q = torch.empty(2, 8, 1000, 80)
        grad = q.transpose(1, 2).contiguous().transpose(1, 2)  # the layout of the kernel's own output
        delta, tiles = 2 * 8 * 1000 * 4, 2 * 8 * (8 * 2 * (128 * 64 + 4)) * 4
        assert tiles == 8392704  # trace_sdpa.json.gz
        assert (
            efficient_attention_backward_workspace((grad, q, q, q), {}, None)
            == max(2 * 1000 * 8 * 80 * 4 + 2 * 1000 * 8 * 4, tiles) + delta
        )
        # bf16, head dim 512: kernel 128x64 (k65536) keeps dK and dV in memory, over min(ceil(1000/64), 200 // 16) = 12 splits
        q = torch.empty(2, 8, 1000, 512, dtype=torch.bfloat16)
        grad = q.transpose(1, 2).contiguous().transpose(1, 2)
        per_head = 8 * 8 * (128 * 64 + 4) + 2 * 12 * 64 * 512
        assert 2 * 8 * per_head * 4 == 83902464  # trace_sdpa.json.gz
        assert efficient_attention_backward_workspace((grad, q, q, q), {}, None) == 2 * 8 * 1000 * 4 + 83902464
        # a gradient not laid out as (B, L, H, D) is copied first
        assert efficient_attention_backward_workspace((q.detach(), q, q, q), {}, None) == q.numel() * 2 + 2 * 8 * 1000 * 4 + 83902464


# --- choices ----------------------------------------------------------------------------------------------


def test_torch_2_13_checks_what_2_11_did_not() -> None:
    # check_cudnn_dropout: cuDNN only for multiples of 1/16; 0.1 went to cuDNN on the H200 (2.11)
    for mask, heads, after in (
        ("none", (8, 8), SdpBackend.FLASH),
        ("float", (8, 8), SdpBackend.EFFICIENT),
        ("bool", (8, 2), SdpBackend.MATH),
    ):
        case = Case("bfloat16", 64, mask, heads, 0.1)
        assert (case.backend(), case.backend((2, 13))) == (SdpBackend.CUDNN, after)
    assert Case("bfloat16", 64, "none", (8, 8), 0.125).backend((2, 13)) == SdpBackend.CUDNN
    # check_cudnn_tensor_shapes: batch and heads at most 65535
    q = torch.empty(65536, 1, 16, 64, dtype=torch.bfloat16, device="meta")
    kw: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "enable_gqa": False, "capability": H200}
    assert (choose_sdp_backend(q, q, q, version=(2, 11), **kw), choose_sdp_backend(q, q, q, version=(2, 13), **kw)) == (
        SdpBackend.CUDNN,
        SdpBackend.FLASH,
    )
    # check_data_ptr_alignment_mem_efficient: fp32 q one element into its storage
    q = torch.empty(2 * 8 * 16 * 64 + 1, device="meta")[1:].view(2, 8, 16, 64)
    versions = [choose_sdp_backend(q, q, q, version=v, **kw) for v in ((2, 11), (2, 13))]
    assert versions == [SdpBackend.EFFICIENT, SdpBackend.MATH]
    running = torch_release() >= (2, 13)  # the default is the torch fxmem runs with
    assert choose_sdp_backend(q, q, q, **kw) == (SdpBackend.MATH if running else SdpBackend.EFFICIENT)


def test_flash_where_cudnn_is_not_preferred() -> None:
    # sm80: priority order flash, efficient, math (cuDNN is preferred on sm90 and sm100 only)
    assert Case("bfloat16", 64, "none", (8, 2), 0.0).backend(capability=A100) == SdpBackend.FLASH  # takes GQA
    assert Case("bfloat16", 64, "bool", (8, 8), 0.0).backend(capability=A100) == SdpBackend.EFFICIENT  # flash takes no mask
    assert Case("bfloat16", 64, "none", (8, 8), 0.0).backend(capability=(12, 0)) == SdpBackend.FLASH
    assert Case("bfloat16", 320, "none", (8, 8), 0.0).backend() == SdpBackend.EFFICIENT  # above 256 for cuDNN and flash


def _saved_during(run: Callable[[], object]) -> list[tuple[Any, ...]]:
    """(shape, dtype, storage bytes) of each tensor autograd saves while ``run`` runs, in order."""
    saved: list[tuple[Any, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.dtype, t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return saved


_MATH_CASES = [
    Case("float32", 64, "causal", (8, 2), 0.0),
    Case("bfloat16", 96, "bool", (8, 2), 0.0),
    Case("float32", 32, "float", (4, 4), 0.0),
]


@pytest.mark.parametrize("case", _MATH_CASES, ids=str)
def test_math_path_saves_what_the_composite_saves(case: Case) -> None:
    # Note [The math path on the cuda target]: without dropout, the step-by-step copy saves what the
    # composite called by name saves (on the CPU, where the two run the same code)
    with FakeTensorMode():
        q, k, v, mask = case.tensors()
        with CudaTargetMode(compute_capability=(3, 7)):  # no fused kernel below sm50
            got = _saved_during(lambda: case.attend(q, k, v, mask))
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.where(mask, 0.0, torch.scalar_tensor(-float("inf"), dtype=q.dtype))
        composite = torch.ops.aten._scaled_dot_product_attention_math
        want = _saved_during(lambda: composite(q, k, v, mask, 0.0, case.mask == "causal", None, enable_gqa=True))
    assert got == want


# --- an attention bias that requires grad (Note [An attention bias that requires grad]) -----------------


def _bias_choice(dtype: torch.dtype, bias: torch.Tensor, version: tuple[int, int] = MEASURED) -> SdpBackend:
    """The backend for q, k, v (2, 4, 100, 64) of ``dtype`` with ``bias`` as the mask, on the H200."""
    q = torch.empty(2, 4, 100, 64, dtype=dtype, device="meta", requires_grad=True)
    kw: dict[str, Any] = {"dropout_p": 0.0, "is_causal": False, "enable_gqa": False, "capability": H200, "version": version}
    return choose_sdp_backend(q, q, q, attn_mask=bias, **kw)


def _t5_bias(dtype: torch.dtype, grad: bool = True) -> torch.Tensor:
    """T5's relative position bias: a (S, S, H) embedding lookup permuted to (1, H, S, S), last stride H = 4."""
    return torch.empty(100, 100, 4, dtype=dtype, device="meta", requires_grad=grad).permute(2, 0, 1).unsqueeze(0)


@pytest.mark.parametrize("version", [MEASURED, (2, 13)], ids=str)
def test_a_bias_that_requires_grad_leaves_cudnn(version: tuple[int, int]) -> None:
    # check_attn_mask_shape refuses a mask that requires grad; flash takes no mask; memory-efficient takes
    # it when its last stride is 1 (check_last_dim_stride_equals_1_dense), else math
    for dtype in (torch.bfloat16, torch.float16):
        contiguous = _t5_bias(dtype).contiguous()
        assert _bias_choice(dtype, contiguous.detach(), version) == SdpBackend.CUDNN  # untrained, as the H200 took a float mask
        assert _bias_choice(dtype, contiguous, version) == SdpBackend.EFFICIENT
    for dtype in (torch.float32, torch.bfloat16):
        assert _t5_bias(dtype).stride(-1) == 4
        assert _bias_choice(dtype, _t5_bias(dtype), version) == SdpBackend.MATH
        assert _bias_choice(dtype, _t5_bias(dtype, grad=False), version) == SdpBackend.MATH  # the stride alone decides
    assert _bias_choice(torch.float32, _t5_bias(torch.float32).contiguous(), version) == SdpBackend.EFFICIENT
    # the check reads requires_grad, not the grad mode: a trained leaf bias stays off cuDNN under no_grad
    leaf = nn.Parameter(torch.empty(1, 4, 100, 100, dtype=torch.bfloat16, device="meta"))
    with torch.no_grad():
        assert _bias_choice(torch.bfloat16, leaf, version) == SdpBackend.EFFICIENT


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """The outputs (shape, storage bytes) of each call of ``op`` while active."""

    def __init__(self, op: Any) -> None:
        super().__init__()
        self.op = op
        self.outputs: list[list[tuple[tuple[int, ...], int] | None]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func == self.op:
            self.outputs.append([(tuple(t.shape), t.untyped_storage().nbytes()) if t is not None else None for t in out])
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_efficient_keeps_a_trained_bias_and_returns_its_full_gradient(dtype: torch.dtype) -> None:
    # q, k, v (2, 8, 256, 64) and a float mask (2, 1, 256, 256) that requires grad: the kernel records'
    # fp32 float-mask case with the mask trained
    case = Case(str(dtype).removeprefix("torch."), 64, "float", (8, 8), 0.0)
    assert case.backend() == (SdpBackend.EFFICIENT if dtype == torch.float32 else SdpBackend.CUDNN)  # untrained, as measured
    size = dtype.itemsize
    with FakeTensorMode():
        q, k, v, mask = case.tensors()
        assert mask is not None
        mask.requires_grad_()
        seen = {StorageWeakRef(t.untyped_storage()) for t in (q, k, v, mask)}
        kept: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            if StorageWeakRef(t.untyped_storage()) not in seen:
                seen.add(StorageWeakRef(t.untyped_storage()))
                kept.append(t.untyped_storage().nbytes())
            return t

        recorder = _Recorder(torch.ops.aten._scaled_dot_product_efficient_attention_backward.default)
        with CudaTargetMode(compute_capability=H200, release=MEASURED):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = case.attend(q, k, v, mask)
            assert type(out.grad_fn).__name__ == "ScaledDotProductEfficientAttentionBackward0"
            with recorder:
                out.backward(torch.ones_like(out))
        assert mask.grad is not None and mask.grad.shape == mask.shape
    # the mask's strides (65536, 65536, 256, 1) are multiples of 8: no padding, the saved bias is the mask's
    # own storage; besides it and q, k, v: the output 2*8*256*64 elements, the fp32 log-sum-exp 2*8*256
    # (256 a multiple of 32) and the int64 seed and offset
    assert sum(kept) == 2 * 8 * 256 * 64 * size + 2 * 8 * 256 * 4 + 2 * 8
    if dtype == torch.float32:
        assert sum(kept) == 1064976  # kernels_h200.json.gz, float32 d64 float 8/8 p0: the same list, mask untrained
    # the backward's grad_bias: the expanded (B, H, L, S) = (2, 8, 256, 256), 256 already a multiple of 16,
    # 8 times the (2, 1, 256, 256) mask it is summed into
    (outputs,) = recorder.outputs
    assert outputs[3] == ((2, 8, 256, 256), 2 * 8 * 256 * 256 * size)


class _T5Attention(nn.Module):
    """One self-attention layer with a T5 relative position bias: 4 heads of 64 over S = 100, the bias an
    nn.Embedding of 32 buckets looked up per (query, key) pair, (S, S, H) permuted to (1, H, S, S) (last
    stride H), or made contiguous, and added as ``attn_mask``."""

    def __init__(self, contiguous: bool) -> None:
        super().__init__()
        self.contiguous = contiguous
        self.qkv, self.o, self.rel = nn.Linear(256, 768), nn.Linear(256, 256), nn.Embedding(32, 4)
        pos = torch.arange(100)
        self.register_buffer("buckets", (pos[None, :] - pos[:, None]).clamp(-16, 15) + 16, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 64).permute(2, 0, 3, 1, 4)
        bias = self.rel(self.buckets).permute(2, 0, 1).unsqueeze(0)
        bias = bias.contiguous() if self.contiguous else bias
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.o(y.transpose(1, 2).reshape(b, s, d))


_H, _S, _D = 4, 100, 64
_T5_SAVED = {
    # contiguous bias: memory-efficient. qkv: q, k and v are views of the linear's output, S*768 per sample.
    # SDPA: the output H*S*D, the fp32 log-sum-exp H*ceil(S/32)*32, and the bias (1, H, S, S) padded to a
    # last dim of 104 (strides 10000 and 100 are no multiples of 8), once for every batch. o: its input is a
    # view of the SDPA output.
    ("contiguous", None): {
        "qkv": (_S * 768 * 4, 0),
        "scaled_dot_product_attention": (_H * _S * _D * 4 + _H * 128 * 4, _H * _S * 104 * 4),
    },
    # bf16 autocast: qkv keeps its bf16 input (S*256) and output; o keeps its bf16 weight (256*256)
    ("contiguous", "bf16"): {
        "qkv": (_S * 256 * 2 + _S * 768 * 2, 0),
        "scaled_dot_product_attention": (_H * _S * _D * 2 + _H * 128 * 4, _H * _S * 104 * 2),
        "o": (0, 256 * 256 * 2),
    },
    # permuted bias: math, in fp32 also under autocast. SDPA: scaled q and k^T and v, each copied to
    # (B*H, ., .) for the batched matmuls, and the softmax (H, S, S); the in-place add of the bias saves
    # nothing. reshape: the output (B, H, S, D) transposed to (B, S, H*D) is copied for o.
    ("permuted", None): {
        "scaled_dot_product_attention": (3 * _H * _S * _D * 4 + _H * _S * _S * 4, 0),
        "reshape": (_S * 256 * 4, 0),
    },
    ("permuted", "bf16"): {
        "qkv": (_S * 256 * 2, 0),
        "scaled_dot_product_attention": (3 * _H * _S * _D * 4 + _H * _S * _S * 4, 0),
        "reshape": (_S * 256 * 2, 0),
        "o": (0, 256 * 256 * 2),
    },
}


@pytest.mark.parametrize(("layout", "amp"), list(_T5_SAVED), ids=str)
def test_t5_relative_bias_saved_bytes(layout: str, amp: str | None) -> None:
    report = fxmem.analyze(_T5Attention(layout == "contiguous"), ["B,100,256"], batch=2, precision=None, amp=amp)  # H100, cuda
    assert helpers.saved(report) == _T5_SAVED[(layout, amp)]
    if (layout, amp) == ("contiguous", None):
        # the backward's grad_bias: (B, H, S, S) with S rounded up to 112, for a bias of one batch
        backward = "aten._scaled_dot_product_efficient_attention_backward"
        grads = [e.nbytes.at(2, None) for e in report.timeline(2).events if e.alloc and e.op == backward]
        assert grads.count(2 * _H * _S * 112 * 4) == 1
