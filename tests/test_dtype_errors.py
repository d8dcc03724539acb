"""Operand dtypes a real run refuses are an error naming the layer and both dtypes, not a report.

Every claim is checked against eager CPU torch on the same model and dtypes: where torch raises, fxmem
raises a one-paragraph CaptureError; where torch runs (autocast casting the operands, a recipe's
weights matching the input), fxmem analyzes. See Note [Operand dtypes] in fxmem/engine/dispatch.py.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import pytest
import torch
from torch import nn

from fxmem import cli
from fxmem.api import analyze
from fxmem.engine.dispatch import DtypeMismatch, check_operand_dtypes
from fxmem.errors import CaptureError

pytestmark = pytest.mark.usefixtures("at_repo_root")

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))


def conv() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())


class Attention(nn.Module):
    """q @ k^T with torch.matmul: bmm after the projections."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, dim=-1)
        return torch.matmul(q, k.transpose(-1, -2))


def encoder() -> nn.Module:
    """The issue's model: a TransformerEncoderLayer stack, sequence first."""
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


MODELS: dict[str, tuple[Callable[[], nn.Module], str, tuple[int, ...]]] = {
    "linear": (mlp, "B,16", (2, 16)),
    "conv": (conv, "B,3,8,8", (2, 3, 8, 8)),
    "matmul": (Attention, "B,5,16", (2, 5, 16)),
    "encoder": (encoder, "6,B,16", (6, 2, 16)),
}


def real_step(model: nn.Module, x: torch.Tensor, autocast: AbstractContextManager[object]) -> None:
    """One real forward and backward on the CPU, as the step fxmem simulates."""
    with autocast:
        out = model(x)
    out.float().sum().backward()


def spec_with(spec: str, dtype: torch.dtype) -> str:
    return f"{spec}:{str(dtype).removeprefix('torch.')}"


# --- (a) no autocast: torch raises, so does fxmem --------------------------------------------------


@pytest.mark.parametrize("target", ["cpu", "cuda"])
@pytest.mark.parametrize("name", list(MODELS))
def test_half_input_into_fp32_weights_is_an_error(name: str, target: str) -> None:
    make, spec, shape = MODELS[name]
    with pytest.raises(RuntimeError, match=r"dtype|type"):
        real_step(make(), torch.randn(shape, dtype=F16), nullcontext())
    with pytest.raises(CaptureError) as caught:
        analyze(make(), [spec_with(spec, F16)], name=name, target=target, peak=False)
    message = str(caught.value)
    assert "float16" in message and "float32" in message
    assert f"model '{name}'" in message and "node '" in message and "module '" in message
    assert "--input" in message and "--amp" in message and "--param-dtype" in message
    assert "\n" not in message and "Traceback" not in message


def test_the_error_names_the_layer_and_the_way_out() -> None:
    with pytest.raises(CaptureError) as caught:
        analyze(mlp(), ["B,16:float16"], name="mlp", target="cpu", peak=False)
    message = str(caught.value)
    assert message.startswith("model 'mlp': node '_0' in module '0' calls aten.addmm on operands of two dtypes, float32 and float16")
    assert "The model's weights are float32 in this step" in message and "give --input in float32" in message


@pytest.mark.parametrize("name", ["linear", "conv"])
def test_a_recipe_with_bf16_weights_refuses_a_float16_input(name: str) -> None:
    """--precision bf16 holds the weights in bfloat16 (model.to(torch.bfloat16)): a float16 batch is
    refused as by the real bf16 model, a float32 one is fed as bfloat16 and runs."""
    make, spec, shape = MODELS[name]
    with pytest.raises(RuntimeError, match=r"dtype|type"):
        real_step(make().to(BF16), torch.randn(shape, dtype=F16), nullcontext())
    with pytest.raises(CaptureError, match=r"two dtypes, (bfloat16 and float16|float16 and bfloat16).*weights are bfloat16"):
        analyze(make(), [spec_with(spec, F16)], target="cpu", precision="bf16", peak=False)
    real_step(make().to(BF16), torch.randn(shape).to(BF16), nullcontext())
    assert analyze(make(), [spec], target="cpu", precision="bf16").activations.per_sample > 0


# --- (b) under autocast the op casts its operands: torch runs, fxmem analyzes ----------------------


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_mixed_dtypes_under_cpu_autocast_are_legal(name: str, amp: str) -> None:
    make, spec, shape = MODELS[name]
    dtype = {"bf16": BF16, "fp16": F16}[amp]
    real_step(make(), torch.randn(shape, dtype=F16), torch.autocast("cpu", dtype=dtype))
    report = analyze(make(), [spec_with(spec, F16)], target="cpu", amp=amp)
    assert report.activations.per_sample > 0 and report.step_bytes(2) > 0


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_mixed_dtypes_under_cuda_autocast_are_legal(name: str, amp: str) -> None:
    """CUDA autocast (emulated by the cuda target) casts matmul and convolution operands too; the real
    run this stands for needs a GPU, so CPU autocast, which lists the same ops, is the check here."""
    make, spec, _ = MODELS[name]
    report = analyze(make(), [spec_with(spec, F16)], target="cuda", amp=amp)
    assert report.activations.per_sample > 0 and report.step_bytes(2) > 0


def test_matching_dtypes_still_analyze() -> None:
    for make, spec, shape in MODELS.values():
        real_step(make(), torch.randn(shape), nullcontext())
        assert analyze(make(), [spec], target="cpu").activations.per_sample > 0


# --- (c) the command line ------------------------------------------------------------------


def encoder_spec() -> nn.Module:
    """Factory for the CLI test (tests/test_dtype_errors.py:encoder_spec)."""
    return encoder()


def test_param_dtype_does_not_make_a_half_input_legal(capsys: pytest.CaptureFixture[str]) -> None:
    """--param-dtype float16 counts the state in float16 but the step keeps the fp32 weights, as the
    real model the command describes would: exit 2 and one paragraph naming both dtypes."""
    argv = ["analyze", "tests/test_dtype_errors.py:encoder_spec", "--input", "6,B,16:float16", "--param-dtype", "float16"]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    message = err.strip()
    assert message.startswith("fxmem: error: model 'tests/test_dtype_errors.py:encoder_spec'")
    assert "float16" in message and "float32" in message and "--param-dtype only changes how the state is counted" in message
    assert "\n" not in message and "Traceback" not in message
    assert cli.main([*argv, "--amp", "bf16", "--format", "json", "--no-peak"]) == 0


def test_help_says_which_option_changes_the_step(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["analyze", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Accounting only" in text and "the step is simulated with the model's own weights" in text
    assert "also change what the step computes: the forward runs with the weights in bfloat16" in text


# --- the rule itself, op by op, against eager CPU --------------------------------------------------

aten = torch.ops.aten


def _convolution_args(dims: int, transposed: bool) -> tuple[Any, ...]:
    return ([1] * dims, [0] * dims, [1] * dims, transposed, [0] * dims, 1)


OPS: dict[str, tuple[Any, list[tuple[int, ...]], tuple[Any, ...]]] = {
    "mm": (aten.mm.default, [(2, 3), (3, 4)], ()),
    "addmm": (aten.addmm.default, [(4,), (2, 3), (3, 4)], ()),
    "_addmm_activation": (aten._addmm_activation.default, [(4,), (2, 3), (3, 4)], ()),
    "bmm": (aten.bmm.default, [(2, 2, 3), (2, 3, 4)], ()),
    "baddbmm": (aten.baddbmm.default, [(2, 2, 4), (2, 2, 3), (2, 3, 4)], ()),
    "addbmm": (aten.addbmm.default, [(2, 4), (2, 2, 3), (2, 3, 4)], ()),
    "mv": (aten.mv.default, [(2, 3), (3,)], ()),
    "addmv": (aten.addmv.default, [(2,), (2, 3), (3,)], ()),
    "matmul": (aten.matmul.default, [(2, 3), (3, 4)], ()),
    "dot": (aten.dot.default, [(3,), (3,)], ()),
    "linear": (aten.linear.default, [(2, 3), (4, 3), (4,)], ()),
    "convolution": (aten.convolution.default, [(1, 3, 6, 6), (4, 3, 3, 3), (4,)], _convolution_args(2, False)),
    "convolution-transposed-3d": (aten.convolution.default, [(1, 3, 4, 4, 4), (3, 4, 3, 3, 3), (4,)], _convolution_args(3, True)),
    "conv1d": (aten.conv1d.default, [(1, 3, 6), (4, 3, 3), (4,)], ()),
    "conv2d": (aten.conv2d.default, [(1, 3, 6, 6), (4, 3, 3, 3), (4,)], ()),
    "conv3d": (aten.conv3d.default, [(1, 3, 4, 4, 4), (4, 3, 3, 3, 3), (4,)], ()),
    "conv_transpose1d": (aten.conv_transpose1d.default, [(1, 3, 6), (3, 4, 3), (4,)], ()),
    "conv_transpose2d": (aten.conv_transpose2d.input, [(1, 3, 6, 6), (3, 4, 3, 3), (4,)], ()),
    "conv_transpose3d": (aten.conv_transpose3d.input, [(1, 3, 4, 4, 4), (3, 4, 3, 3, 3), (4,)], ()),
}
CASES = [(op, position, other) for op, (_, shapes, _) in OPS.items() for position in range(len(shapes)) for other in (F16, BF16)]


def _real_raises(func: Any, tensors: list[torch.Tensor], extra: tuple[Any, ...]) -> bool:
    try:
        func(*tensors, *extra)
    except RuntimeError:
        return True
    return False


def _fxmem_raises(func: Any, tensors: list[torch.Tensor], extra: tuple[Any, ...]) -> bool:
    try:
        check_operand_dtypes(func, [*tensors, *extra], {})
    except DtypeMismatch:
        return True
    return False


@pytest.mark.parametrize(("op", "position", "other"), CASES, ids=[f"{o}-{p}-{str(d)[6:]}" for o, p, d in CASES])
def test_the_rule_is_eager_cpus(op: str, position: int, other: torch.dtype) -> None:
    """One operand in another dtype: fxmem refuses exactly where eager CPU does (a bias of another dtype
    runs in some convolutions, so it is no error there); all in one dtype is never refused."""
    func, shapes, extra = OPS[op]
    tensors = [torch.randn(s, dtype=other if i == position else F32) for i, s in enumerate(shapes)]
    assert _fxmem_raises(func, tensors, extra) == _real_raises(func, tensors, extra)
    same = [t.to(other) for t in tensors]
    assert not _fxmem_raises(func, same, extra) and not _real_raises(func, same, extra)
