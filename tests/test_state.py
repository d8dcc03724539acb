"""Model state: each optimizer rule against the real optimizer's state after one real step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxmem.errors import InputSpecError
from fxmem.results import Category
from fxmem.rules.optimizers import OPTIMIZERS
from fxmem.step.state import get_optimizer, state_bytes


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    m[2].bias.requires_grad_(False)  # a frozen parameter: no gradient, no optimizer state
    return m


def _measured_optimizer_bytes(model: nn.Module, name: str) -> int:
    opt = OPTIMIZERS.rules()[name].make([p for p in model.parameters() if p.requires_grad])
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return sum(t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("name", list(OPTIMIZERS.rules()))
def test_optimizer_rule_matches_the_real_state(name: str) -> None:
    model = _model()
    predicted = state_bytes(model, optimizer=get_optimizer(name)).optimizer
    assert predicted == _measured_optimizer_bytes(model, name)


def test_weights_gradients_and_buffers_by_hand() -> None:
    # Parameters: 8*16+16 + 16+16 + 16*4+4 = 244 floats; the frozen bias (4) has no gradient.
    # Buffers: BatchNorm1d running_mean, running_var (16 floats each) + num_batches_tracked (int64).
    s = state_bytes(_model(), optimizer=get_optimizer("adamw"))
    assert s.parameters == 244 and s.trainable == 240
    assert s.weights == 244 * 4 and s.gradients == 240 * 4
    assert s.buffers == 32 * 4 + 8
    # AdamW: exp_avg + exp_avg_sq per trainable float, plus a 4-byte step per trainable tensor (5 of them).
    assert s.optimizer == 2 * 240 * 4 + 5 * 4
    assert s.total == s.weights + s.buffers + s.gradients + s.optimizer


def test_tied_weights_count_once_and_param_dtype_overrides() -> None:
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    s = state_bytes(nn.ModuleList([emb, head]), optimizer=get_optimizer("sgd"), param_dtype=torch.bfloat16)
    assert s.parameters == 40 and s.weights == 40 * 2 and s.weights_by_dtype == {"bfloat16": 80}


def test_unknown_optimizer_lists_the_choices() -> None:
    with pytest.raises(InputSpecError, match="adamw"):
        get_optimizer("adamx")


# The model above: 240 trainable floats in 5 tensors (the frozen bias adds 4 weights), buffers 32*4 + 8.
@pytest.mark.parametrize(
    ("recipe", "weights", "gradients", "master", "moments"),
    [
        ("fp32", 244 * 4, 240 * 4, 0, 2 * 240 * 4),
        ("amp", 244 * 4, 240 * 4, 0, 2 * 240 * 4),  # autocast's bf16 weight copies are activations, not state
        ("bf16", 244 * 2, 240 * 2, 0, 2 * 240 * 2),
        ("mixed", 244 * 2, 240 * 2, 240 * 4, 2 * 240 * 4),
        ("mixed-fp32-grads", 244 * 2, 240 * 4, 240 * 4, 2 * 240 * 4),
    ],
)
def test_precision_recipes_by_hand(recipe: str, weights: int, gradients: int, master: int, moments: int) -> None:
    s = state_bytes(_model(), optimizer=get_optimizer("adamw"), precision=recipe)
    assert (s.weights, s.gradients, s.master) == (weights, gradients, master)
    assert s.optimizer == moments + 5 * 4  # the CPU holds a 4-byte step per trainable tensor
    assert s.buffers == 32 * 4 + 8  # buffers keep their dtype under every recipe
    assert s.total == s.weights + s.buffers + s.gradients + s.master + s.optimizer
    assert s.precision == recipe


def test_bf16_recipe_matches_a_real_bf16_step() -> None:
    model = _model().to(torch.bfloat16)
    predicted = state_bytes(model, optimizer=get_optimizer("adamw"), precision="bf16")
    opt = get_optimizer("adamw").make([p for p in model.parameters() if p.requires_grad])
    model(torch.randn(4, 8, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    measured_state = sum(t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values())
    assert predicted.optimizer == measured_state
    assert predicted.gradients == sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
    assert predicted.weights == sum(p.untyped_storage().nbytes() for p in model.parameters())
    assert predicted.weights_by_dtype == {"bfloat16": 244 * 2}


def test_mixed_adam_is_16_bytes_per_parameter_on_a_gpu() -> None:
    # ZeRO paper, section 3.1: 2 (fp16 weights) + 2 (grads) + K = 12 (fp32 master, momentum, variance);
    # on CUDA Adam's default foreach step counters live on the host, so they add nothing.
    s = state_bytes(nn.Linear(1000, 1000), optimizer=get_optimizer("adam"), precision="mixed", target="cuda")
    assert s.total == 16 * 1_001_000


def test_step_counters_follow_the_implementation_on_a_gpu() -> None:
    adam = get_optimizer("adam")
    fused = state_bytes(_model(), optimizer=adam, optimizer_impl="fused", target="cuda")
    foreach = state_bytes(_model(), optimizer=adam, optimizer_impl="foreach", target="cuda")
    assert fused.optimizer - foreach.optimizer == 5 * 4  # fused: a float32 step on the GPU per trainable tensor
    with pytest.raises(InputSpecError, match="'rmsprop' has no fused"):
        state_bytes(_model(), optimizer=get_optimizer("rmsprop"), optimizer_impl="fused")


def test_new_optimizers_count_their_own_state() -> None:
    # Lion: one exp_avg per trainable float, no step; Adafactor on 1-D and 2-D params (see test_optimizers.py)
    assert state_bytes(_model(), optimizer=get_optimizer("lion")).optimizer == 240 * 4
    # Adafactor: weights (16, 8) -> 16 + 8, (4, 16) -> 4 + 16 floats; vectors 16 + 16 + 16 (bias, bn weight,
    # bn bias) whole; plus a 4-byte step per trainable tensor (5)
    assert state_bytes(_model(), optimizer=get_optimizer("adafactor")).optimizer == (24 + 20 + 48) * 4 + 5 * 4


def test_precision_and_param_dtype_must_agree() -> None:
    agreed = state_bytes(_model(), optimizer=get_optimizer("sgd"), precision="bf16", param_dtype=torch.bfloat16)
    assert agreed.weights == 244 * 2
    with pytest.raises(InputSpecError, match="param_dtype bfloat16 contradicts precision 'fp32'"):
        state_bytes(_model(), optimizer=get_optimizer("sgd"), precision="fp32", param_dtype=torch.bfloat16)


def test_bad_precision_and_target_are_input_errors() -> None:
    with pytest.raises(InputSpecError, match="fp32, amp, bf16, mixed, mixed-fp32-grads"):
        state_bytes(_model(), optimizer=get_optimizer("sgd"), precision="fp8")
    with pytest.raises(InputSpecError, match="unknown target 'tpu'"):
        state_bytes(_model(), optimizer=get_optimizer("sgd"), target="tpu")


def test_docstring_examples() -> None:
    import doctest

    import fxmem.step.precision
    import fxmem.step.state

    for module in (fxmem.step.precision, fxmem.step.state):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0


def _mixed_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 2))


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_the_peak_holds_the_mixed_recipes_master_copy_and_fp32_state(target: str) -> None:
    # Issue 35. Linear(64, 32) -> ReLU -> Linear(32, 2): P = 64*32 + 32 + 32*2 + 2 = 2,146 parameters.
    # Under mixed with SGD momentum the step runs as after model.to(bfloat16): weights 2P = 4,292 B,
    # gradients 2P = 4,292 B, and a bf16 momentum buffer of 2P. One GPU holds an fp32 master copy
    # (4P = 8,584 B) besides, and the momentum in fp32 (4P = 8,584 B). Both peaks (the steady step's in
    # backward, the first step's at the last parameter's update) hold every gradient and every
    # momentum buffer: state 2P + 2P + 4P + 4P = 12P = 25,752 B, the master copy counted as optimizer
    # state (ZeRO, section 3.1).
    import fxmem

    P = 64 * 32 + 32 + 32 * 2 + 2
    mixed = fxmem.analyze(_mixed_mlp(), ["B,64"], precision="mixed", optimizer="sgd-momentum", batch=4, target=target)
    bf16 = fxmem.analyze(_mixed_mlp(), ["B,64"], precision="bf16", optimizer="sgd-momentum", batch=4, target=target)
    for first in (False, True):
        p, same_step = mixed.peak(4, first_step=first), bf16.peak(4, first_step=first)
        assert (p.breakdown[Category.PARAMETER], p.breakdown[Category.GRADIENT]) == (2 * P, 2 * P)
        assert p.breakdown[Category.OPTIMIZER_STATE] == 4 * P + 4 * P
        assert p.state == 12 * P == 25_752
        # pure bf16 runs the same step with a 2P momentum: mixed adds 4P of master and 2P of momentum.
        assert (p.bytes - same_step.bytes, p.event, p.phase) == (6 * P, same_step.event, same_step.phase)
    assert "state 25.1 KiB" in str(mixed)  # 25,752 / 1024 = 25.15
    if target == "cuda":  # the replay scales the same categories by the same ratios
        assert (mixed.steps.device.scale, mixed.steps.device.extra) == (mixed.steps.held.scale, mixed.steps.held.extra)


def test_hold_state_scales_state_and_adds_the_extras_by_hand() -> None:
    # Baseline: 1,000 B of weights, 2,000 B of optimizer state. Then a 1,000 B gradient in backward and
    # a 1,000 B scratch tensor in the optimizer step. Held as ZeRO-3 over 3 GPUs with a 2x state recipe
    # would: weights and gradients 1/3 (ceil(1000/3) = 334 B each, as the replay rounds), optimizer
    # state and the optimizer's scratch 2x (4,000 and 2,000 B), and a 4,000 B master copy from the start.
    # Peak after the scratch: 334 + 4,000 + 4,000 + 334 + 2,000 = 10,668 B.
    from fractions import Fraction

    from fxmem.results import MemoryEvent, Phase, Timeline
    from fxmem.step.peak import StepPeaks
    from fxmem.step.state import HeldState, hold_state
    from fxmem.symbolic import ByteExpr

    def event(storage: int, nbytes: int, category: Category, phase: Phase) -> MemoryEvent:
        return MemoryEvent(phase, True, ByteExpr(fixed=nbytes), category, "n", "", "aten.empty", storage)

    storages = ((Category.PARAMETER, ByteExpr(fixed=1000)), (Category.OPTIMIZER_STATE, ByteExpr(fixed=2000)))
    baseline = {Category.PARAMETER: ByteExpr(fixed=1000), Category.OPTIMIZER_STATE: ByteExpr(fixed=2000)}
    events = (event(0, 1000, Category.GRADIENT, Phase.BACKWARD), event(1, 1000, Category.TEMPORARY, Phase.OPTIMIZER))
    timeline = Timeline(4, False, baseline, events, storages)
    third, two = Fraction(1, 3), Fraction(2)
    scale = {Category.PARAMETER: third, Category.GRADIENT: third, Category.OPTIMIZER_STATE: two}
    held = HeldState(scale, (("master weights", 4000, "fp32"),))
    p = StepPeaks(timeline, {}, held=held).peak(4)
    assert p.bytes == 10_668 and p.event == 1
    assert p.breakdown == {Category.PARAMETER: 334, Category.GRADIENT: 334, Category.OPTIMIZER_STATE: 8000, Category.TEMPORARY: 2000}
    assert hold_state(timeline, HeldState({Category.OPTIMIZER_STATE: Fraction(1)})) is timeline  # nothing held beyond: unchanged
    assert StepPeaks(timeline, {}).peak(4).bytes == 1000 + 2000 + 1000 + 1000
