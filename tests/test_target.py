"""The cuda target's kernels on fake CPU tensors: SDPA backend, fused dropout, autocast (fxmem/gpu/target.py).

Each capture runs the real pipeline (fx trace, then ``capture_saved`` with a symbolic B) inside
``CudaTargetMode`` and sums the activation storages autograd saved: ``per_sample`` bytes per batch
element plus ``fixed`` bytes. The arithmetic is in the comments.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fxmem.engine.capture import capture_saved
from fxmem.engine.losses import get_loss
from fxmem.frontends.tracing import trace_model
from fxmem.gpu.target import CudaTargetMode, SdpBackend, choose_sdp_backend
from fxmem.inputs import parse_inputs
from fxmem.results import Capture, Kind
from fxmem.symbolic import ByteExpr

BF16, FP32, BOOL = 2, 4, 1  # bytes per element
H100 = (9, 0)


def capture(factory: Callable[[], nn.Module], inputs: list[str], *, kernels: Callable[[], object]) -> Capture:
    with torch.device("meta"):
        model = factory()
    specs = parse_inputs(inputs)
    gm = trace_model(model, specs).gm
    return capture_saved(gm, specs, loss=get_loss("sum"), batch=None, rules={}, kernels=kernels)  # type: ignore[arg-type]


def cuda(capability: tuple[int, int] = H100, amp: torch.dtype | None = None) -> Callable[[], CudaTargetMode]:
    return lambda: CudaTargetMode(compute_capability=capability, amp=amp)


def activations(c: Capture) -> ByteExpr:
    return ByteExpr.total(s.nbytes for s in c.saved if s.kind == Kind.ACTIVATION)


class Attention(nn.Module):
    """A fused qkv projection, 4 heads of 16 and causal SDPA, on (B, 40, 64) inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(64, 192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.unflatten(-1, (4, 16)).transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)


def test_flash_attention_under_bf16_autocast_keeps_a_log_sum_exp_not_the_scores() -> None:
    # sm90, bf16: cuDNN attention, which check_prefer_cudnn_attention puts before flash on sm90 (the H200
    # took it for every fp16/bf16 head dim <= 256, tests/test_sdpa.py; this test once expected flash and
    # its 24 bytes of seed (2,) and offset (), which sm90 does not run). Per sample:
    #   the linear's bf16 copy of x:               40 * 64 * 2 = 5120
    #   the qkv output (q, k, v are views of it):  40 * 192 * 2 = 15360
    #   cuDNN's output, bf16 (B, 4, 40, 16):       40 * 64 * 2 = 5120
    #   its fp32 log-sum-exp (B, 4, 40, 1):        4 * 40 * 4 = 640
    # and fixed: the int64 philox seed and offset, 16. The bf16 copy of the weight is not
    # kept: mm keeps its second operand only for its first's gradient, and x needs none. No (40 x 40)
    # score matrix per head (that would be 4 * 40 * 40 * 2 = 12800 more per sample).
    c = capture(Attention, ["B,40,64"], kernels=cuda(amp=torch.bfloat16))
    per_sample = 40 * 64 * BF16 + 40 * 192 * BF16 + 40 * 64 * BF16 + 4 * 40 * FP32
    assert activations(c) == ByteExpr(per_sample=per_sample, fixed=16)
    assert not any(s.shape[-2:] == (40, 40) for s in c.saved)


def test_fp32_attention_on_sm90_takes_the_memory_efficient_kernel() -> None:
    # fp32 rules out flash; memory-efficient takes fp32 (head dim 16 % 4 == 0). Per sample: the qkv
    # output 40 * 192 * 4 = 30720, the output 40 * 64 * 4 = 10240 and the log-sum-exp, whose sequence
    # axis the kernel pads to a multiple of 32: 4 * 64 * 4 = 1024. Fixed: int64 seed and offset, 16.
    # The linear's input is the batch itself (an input, not an activation).
    c = capture(Attention, ["B,40,64"], kernels=cuda())
    assert activations(c) == ByteExpr(per_sample=40 * 192 * FP32 + 40 * 64 * FP32 + 4 * 64 * FP32, fixed=16)


def test_attention_below_sm50_is_the_math_path_with_its_scores() -> None:
    # Neither fused kernel runs on sm3.7 (mem-efficient needs sm50), so it is the math composite
    # (_scaled_dot_product_attention_math): per sample, the scaled copies of q and k and a contiguous
    # copy of v for its batched matmuls, 3 * 40 * 64 * 4 = 30720, and the (40 x 40) softmax output per
    # head, 4 * 40 * 40 * 4 = 25600.
    c = capture(Attention, ["B,40,64"], kernels=cuda((3, 7)))
    assert activations(c) == ByteExpr(per_sample=3 * 40 * 64 * FP32 + 4 * 40 * 40 * FP32)


def _qkv(
    dtype: torch.dtype, head_dim: int, heads: tuple[int, int] = (4, 4), seqs: tuple[int, int] = (16, 16), dims: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shape = lambda h, s: (2, h, s, head_dim)[4 - dims :]
    q = torch.empty(shape(heads[0], seqs[0]), dtype=dtype, device="meta", requires_grad=True)
    kv = torch.empty(shape(heads[1], seqs[1]), dtype=dtype, device="meta", requires_grad=True)
    return q, kv, kv


_CASES = [
    # dtype, capability, head dim, mask, expected: why (the sdp_utils.cpp check that decides)
    (torch.bfloat16, (9, 0), 64, False, SdpBackend.CUDNN),  # check_prefer_cudnn_attention: cuDNN before flash on sm90
    (torch.float16, (8, 0), 256, False, SdpBackend.FLASH),  # check_head_dim_size_flash: <= 256
    (torch.bfloat16, (9, 0), 60, False, SdpBackend.FLASH),  # flash pads the head dim to a multiple of 8 itself
    (torch.float32, (9, 0), 64, False, SdpBackend.EFFICIENT),  # check_dtypes_flash_attention: fp16/bf16 only
    (torch.bfloat16, (9, 0), 64, True, SdpBackend.CUDNN),  # cuDNN takes a mask (flash does not: check_for_attn_mask)
    (torch.bfloat16, (9, 0), 512, False, SdpBackend.EFFICIENT),  # > 256 for flash; no bound for mem-efficient
    (torch.float16, (7, 5), 64, False, SdpBackend.EFFICIENT),  # check_flash_attention_hardware_support: sm80+
    (torch.bfloat16, (7, 0), 64, False, SdpBackend.MATH),  # below sm80 mem-efficient takes fp16/fp32, not bf16
    (torch.bfloat16, (8, 6), 224, False, SdpBackend.EFFICIENT),  # sm86 training: flash only up to 192 (or > 224)
    (torch.bfloat16, (8, 6), 240, False, SdpBackend.FLASH),  # > 224 without dropout is allowed on sm86
    (torch.float32, (9, 0), 62, False, SdpBackend.MATH),  # check_head_dim_size_mem_efficient: fp32 needs % 4
    (torch.float16, (9, 0), 60, True, SdpBackend.MATH),  # and half types % 8 (minimum_gemm_alignment)
    (torch.float32, (7, 0), 62, False, SdpBackend.EFFICIENT),  # fp32 without tensor cores: alignment 1
]


@pytest.mark.parametrize(("dtype", "capability", "head_dim", "mask", "expected"), _CASES)
def test_sdp_backend_choice(dtype: torch.dtype, capability: tuple[int, int], head_dim: int, mask: bool, expected: SdpBackend) -> None:
    q, k, v = _qkv(dtype, head_dim)
    attn_mask = torch.zeros(16, 16, dtype=dtype, device="meta") if mask else None
    got = choose_sdp_backend(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=False, enable_gqa=False, capability=capability)
    assert got == expected


def test_sdp_backend_choice_on_shapes() -> None:
    choose = lambda q, k, v, **kw: choose_sdp_backend(
        q, k, v, **{"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "enable_gqa": False, "capability": H100, **kw}
    )
    assert choose(*_qkv(torch.bfloat16, 64, dims=3)) == SdpBackend.MATH  # check_tensor_shapes: 4-D only
    gqa = _qkv(torch.bfloat16, 64, heads=(8, 2))
    assert choose(*gqa, enable_gqa=True) == SdpBackend.CUDNN  # check_grouped_query_attention (cuDNN before flash on sm90)
    assert choose(*gqa) == SdpBackend.MATH  # unequal heads without enable_gqa
    # fp32 misses flash (check_dtypes_flash_attention); mem-efficient checks heads with supports_gqa=false,
    # so GQA it never takes, enable_gqa or not: math, which repeats k and v per query head.
    assert choose(*_qkv(torch.float32, 64, heads=(8, 2)), enable_gqa=True) == SdpBackend.MATH
    assert choose(*_qkv(torch.float32, 64, heads=(8, 8)), enable_gqa=True) == SdpBackend.EFFICIENT
    cross = _qkv(torch.bfloat16, 64, seqs=(16, 32))
    assert choose(*cross, is_causal=True) == SdpBackend.CUDNN  # cuDNN has no check_flash_causal_non_square_seqlens
    assert choose(*cross) == SdpBackend.CUDNN


def test_dropout_keeps_a_one_byte_mask() -> None:
    # CUDA's fused native_dropout keeps a bool mask: (B, 16) x 1 byte; the CPU keeps float noise, 4 bytes.
    factory = lambda: nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5))
    assert activations(capture(factory, ["B,8"], kernels=cuda())) == ByteExpr(per_sample=16 * BOOL)
    assert activations(capture(factory, ["B,8"], kernels=contextlib.nullcontext)) == ByteExpr(per_sample=16 * FP32)


class Thrice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.lin(self.lin(x)))


def test_autocast_casts_a_weight_once_and_linears_keep_bf16_copies() -> None:
    # One Linear(8, 8) applied three times. Per sample: each call keeps its bf16 input, 3 * 8 * 2 = 48
    # (the first a bf16 copy of x). Fixed: the second and third calls keep the bf16 weight (their
    # inputs need gradients; the first's does not), one copy of 8 * 8 * 2 = 128 shared through
    # autocast's cast cache; a cast per call would make it 256.
    c = capture(Thrice, ["B,8"], kernels=cuda(amp=torch.bfloat16))
    assert activations(c) == ByteExpr(per_sample=3 * 8 * BF16, fixed=8 * 8 * BF16)
    assert {s.dtype for s in c.saved if s.kind == Kind.ACTIVATION} == {"bfloat16"}


def test_layer_norm_under_autocast_keeps_an_fp32_copy() -> None:
    # The linear keeps x in bf16 (8 * 2 = 16 per sample); layer_norm is on the fp32 list, so it keeps
    # an fp32 copy of the bf16 linear output (16 * 4 = 64) and fp32 mean and rstd per row (2 * 4 = 8).
    c = capture(lambda: nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16)), ["B,8"], kernels=cuda(amp=torch.bfloat16))
    assert activations(c) == ByteExpr(per_sample=8 * BF16 + 16 * FP32 + 2 * FP32)


def test_autocast_output_dtypes() -> None:
    with FakeTensorMode(), CudaTargetMode(compute_capability=H100, amp=torch.bfloat16):
        x = torch.empty(4, 8)
        w = torch.empty(8, 8, requires_grad=True)
        h = x @ w
        assert h.dtype == torch.bfloat16  # matmul: lower precision
        assert F.layer_norm(h, (8,)).dtype == torch.float32  # fp32 list
        assert h.softmax(-1).dtype == torch.float32  # fp32_set_opt_dtype
        assert torch.softmax(h, -1, dtype=torch.bfloat16).dtype == torch.bfloat16  # a dtype the call names
        assert torch.relu(h).dtype == torch.bfloat16  # unlisted: its input's dtype
        assert torch.addcmul(h, h, x).dtype == torch.float32  # promote: the widest input
        assert torch.empty(4, 8, dtype=torch.float64).matmul(torch.empty(8, 8, dtype=torch.float64)).dtype == torch.float64


def test_multi_head_attention_module_is_seen_inside() -> None:
    # nn.MultiheadAttention calls F.multi_head_attention_forward, a Python function handed to the mode
    # whole; its linears must still be cast (the out-projection's input is a bf16 copy).
    with FakeTensorMode(), CudaTargetMode(compute_capability=H100, amp=torch.bfloat16):
        mha = nn.MultiheadAttention(16, 2, batch_first=True)
        out, _ = mha(*(torch.empty(2, 5, 16),) * 3, need_weights=False)
        assert out.dtype == torch.bfloat16


class GroupedQueryAttention(nn.Module):
    """4 query heads over 2 key/value heads of 16, fp32, causal SDPA with ``enable_gqa``, on (B, 40, 64)."""

    def __init__(self, attend: Callable[..., torch.Tensor] | None = None) -> None:
        super().__init__()
        self.q, self.kv = nn.Linear(64, 64), nn.Linear(64, 64)
        self.attend = attend or (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x).unflatten(-1, (4, 16)).transpose(1, 2)
        k, v = (t.unflatten(-1, (2, 16)).transpose(1, 2) for t in self.kv(x).chunk(2, dim=-1))
        return self.attend(q, k, v).transpose(1, 2).flatten(2)


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The math composite itself (the same code on CPU and CUDA without dropout), called by name."""
    return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, None, 0.0, True, None, enable_gqa=True)[0]


def test_fp32_grouped_query_attention_takes_the_math_path_and_its_step_runs() -> None:
    # fp32 misses flash and mem-efficient refuses unequal heads, so CUDA runs the math composite. Its saved
    # bytes are measured for real on the CPU by a twin that calls that composite by name (the CPU's own
    # SDPA would pick its flash kernel, which takes GQA). The whole step, backward included, must simulate:
    # sending this call to mem-efficient (as fxmem once did) made its backward return 4-head gradients
    # for 2-head keys, and the Llama 3 benchmark failed that way.
    from fxmem.api import analyze
    from fxmem.measure import measure

    with torch.device("meta"):
        model = GroupedQueryAttention()
    report = analyze(model, ["B,40,64"], target="cuda", batch=2)
    assert report.activations.at(2) == measure(GroupedQueryAttention(_math), ["B,40,64"], batch=2).total
    assert report.peak(2).bytes > report.activations.at(2)


def test_cross_entropy_under_autocast_keeps_bf16_log_probabilities_and_their_fp32_copy() -> None:
    # Note [Cross-entropy under CUDA autocast]: log_softmax runs in the logits' bf16 (the composite names
    # its dtype) and keeps its result, 10 * 2 = 20 per sample; nll_loss is an fp32 op and keeps an fp32
    # copy, 10 * 4 = 40. Besides: the linear's bf16 copy of x, 8 * 2 = 16. Fixed: nll_loss's total
    # weight, a 4-byte fp32 scalar. The H200 measured the same split (LogSoftmaxBackward0 2 bytes per
    # logit, NllLossBackward0 4; tests/test_h200.py holds the totals).
    with torch.device("meta"):
        model = nn.Linear(8, 10)
    specs = parse_inputs(["B,8"])
    gm = trace_model(model, specs).gm
    c = capture_saved(gm, specs, loss=get_loss("cross_entropy"), batch=None, rules={}, kernels=cuda(amp=torch.bfloat16))  # type: ignore[arg-type]
    assert activations(c) == ByteExpr(per_sample=8 * BF16 + 10 * BF16 + 10 * FP32, fixed=FP32)


def test_batch_norm_statistics_under_autocast_are_fp32_on_cuda() -> None:
    # Note [Batch-norm statistics on CUDA]: a bf16 input's save_mean and save_invstd are fp32 on CUDA,
    # 2 x 16 channels x 4 = 128 fixed bytes (the fake CPU kernel makes them bf16: 64). Besides, fixed:
    # the convolution's bf16 weight copy, 16 * 3 * 3 * 3 * 2 = 864 (ConvolutionBackward0 keeps it even
    # for a layer whose input needs no gradient, as the H200's sweep shows). Per sample: the
    # convolution keeps its bf16 input copy 3 * 6 * 6 * 2 = 216; batch norm keeps its bf16 input,
    # 16 * 6 * 6 * 2 = 1152 (the fp32 weights are state). The rule applies through capture's op rules.
    from fxmem.rules.ops import op_rules_for

    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16))
    specs = parse_inputs(["B,3,6,6"])
    gm = trace_model(model, specs).gm
    c = capture_saved(gm, specs, loss=get_loss("sum"), batch=None, rules=op_rules_for("cuda"), kernels=cuda(amp=torch.bfloat16))
    assert activations(c) == ByteExpr(per_sample=3 * 36 * BF16 + 16 * 36 * BF16, fixed=16 * 27 * BF16 + 2 * 16 * FP32)


class GlobalResponseNorm(nn.Module):
    """ConvNeXt-V2's GRN on channels-last (B, 8, 8, 32) after a Linear: the L2 norm over H and W per channel."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.gamma, self.beta = nn.Parameter(torch.zeros(32)), nn.Parameter(torch.zeros(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(x)
        gx = torch.norm(x, p=2, dim=(1, 2), keepdim=True)
        nx = gx / (gx.mean(dim=-1, keepdim=True) + 1e-6)
        return self.gamma * (x * nx) + self.beta + x


def test_norm_under_autocast_computes_in_fp32_without_an_fp32_copy() -> None:
    # torch.norm runs linalg.vector_norm, fp32_set_opt_dtype: autocast passes dtype=float32 and casts no
    # tensor, so autograd keeps the bf16 input (already kept for nothing else here: 64 * 32 * 2 = 4096
    # per sample, charged to fc, which made it) and the fp32 norms (32 * 4 = 128), not an fp32 copy of
    # the input (64 * 32 * 4 = 8192 more). Per sample in all: fc's bf16 copy of x 4096 + its output
    # 4096; the norms 128; the divisor gx.mean + eps, 4; nx = gx / it, 128 (fp32, kept by the product);
    # x * nx promoted to fp32 and kept by gamma's product, 64 * 32 * 4 = 8192.
    c = capture(GlobalResponseNorm, ["B,8,8,32"], kernels=cuda(amp=torch.bfloat16))
    assert activations(c) == ByteExpr(per_sample=4096 + 4096 + 128 + 4 + 128 + 8192)
    assert not any(s.dtype == "float32" and s.shape[1:] == (8, 8, 32) and s.node == "norm" for s in c.saved)
