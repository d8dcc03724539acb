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
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

from fxmem.engine.losses import Loss
from fxmem.gpu.target import CudaTargetMode
from fxmem.results import Timeline
from fxmem.rules import torch_release
from fxmem.rules.optimizers import OptimizerRule
from fxmem.rules.sdpa import SdpBackend, choose_sdp_backend
from fxmem.rules.sdpa_buffers import cudnn_attention_backward_workspace, efficient_attention_backward_workspace
from tests.h200_traces import H200, Marks, load, lone_graph, simulate_on_h200, timeline_marks, trace_marks

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
