"""Optimizer rules against real optimizers: state after a real step, per implementation, and the
optimizers fxmem writes itself (fxmem/rules/extra_optimizers.py) against the algorithms they stand for."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from fxmem.errors import InputSpecError
from fxmem.rules.extra_optimizers import Adafactor, Adam8bit, Lion
from fxmem.rules.optimizers import OPTIMIZERS, OptimizerRule, default_impl
from fxmem.step.state import get_optimizer

COMBOS = [(name, impl) for name, rule in OPTIMIZERS.rules().items() for impl in (None, *rule.impls)]


def _model() -> nn.Sequential:
    # conv weight (4, 2, 3, 3): a 4-D parameter (Adafactor factors its last two dims);
    # linear weights 64*70 = 4480 (>= 4096: 8-bit state in Adam8bit, 4480/256 = 17.5 blocks) and 70*8 = 560 (< 4096: fp32)
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.Flatten(), nn.Linear(64, 70), nn.ReLU(), nn.Linear(70, 8))


def _stepped(name: str, impl: str | None, model: nn.Module | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = model if model is not None else _model()
    opt = get_optimizer(name).make(model.parameters(), impl)
    model(torch.randn(3, 2, 6, 6)).square().sum().backward()
    opt.step()
    return model, opt


def _state_nbytes(opt: torch.optim.Optimizer) -> int:
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)}
    return sum(storages.values())


@pytest.mark.parametrize(("name", "impl"), COMBOS, ids=[f"{n}-{i}" for n, i in COMBOS])
def test_rule_matches_the_real_state_for_each_implementation(name: str, impl: str | None) -> None:
    model, opt = _stepped(name, impl)
    rule = get_optimizer(name)
    predicted = sum(rule.state_bytes(p.shape, p.element_size(), impl=impl, target="cpu") for p in model.parameters())
    assert predicted == _state_nbytes(opt)


@pytest.mark.parametrize(("name", "impl"), COMBOS, ids=[f"{n}-{i}" for n, i in COMBOS])
def test_every_step_runs_on_fake_tensors(name: str, impl: str | None) -> None:
    # the timeline builds the optimizer and runs step() under FakeTensorMode with a ShapeEnv, as here
    with FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True):
        params = [nn.Parameter(torch.randn(s)) for s in [(64, 70), (70,), (4, 2, 3, 3)]]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = get_optimizer(name).make(params, impl)
        opt.step()
        opt.step()
        measured = _state_nbytes(opt)
    rule = get_optimizer(name)
    assert measured == sum(rule.state_bytes(p.shape, 4, impl=impl) for p in params)


def test_the_implementation_reaches_the_optimizer() -> None:
    params = list(_model().parameters())
    adam = get_optimizer("adam")
    assert adam.make(params, "foreach").param_groups[0]["foreach"] is True
    assert adam.make(params, "fused").param_groups[0]["fused"] is True
    assert adam.make(params, "for-loop").param_groups[0]["foreach"] is False
    assert adam.make(params).param_groups[0]["foreach"] is None  # None: torch decides at step()
    assert get_optimizer("lion").make(params, "foreach").param_groups[0]["foreach"] is True


@pytest.mark.parametrize(("name", "impl"), [("rmsprop", "fused"), ("adafactor", "fused"), ("lion", "fused"), ("adam8bit", "foreach"), ("adam8bit", "fused")])
def test_an_implementation_the_optimizer_lacks_is_an_input_error(name: str, impl: str) -> None:
    with pytest.raises(InputSpecError, match=rf"'{name}' has no {impl} implementation \(it offers: for-loop"):
        get_optimizer(name).make(_model().parameters(), impl)


def test_an_unknown_implementation_lists_the_choices() -> None:
    with pytest.raises(InputSpecError, match="for-loop, foreach, fused"):
        get_optimizer("adam").make(_model().parameters(), "fast")


def test_step_counter_bytes_by_target_and_implementation() -> None:
    # Note [Where step lives]: a non-fused step is a host tensor (4 bytes on the CPU, nothing on a GPU);
    # a fused one is a float32 on the parameter's device. 10 floats of state buffers per rule below.
    adam, adafactor, lion = get_optimizer("adam"), get_optimizer("adafactor"), get_optimizer("lion")
    assert adam.state_bytes(10, 4, impl="fused", target="cuda") == 2 * 10 * 4 + 4
    assert adam.state_bytes(10, 4, impl="foreach", target="cuda") == 2 * 10 * 4
    assert adam.state_bytes(10, 4, impl=None, target="cuda") == 2 * 10 * 4  # default on CUDA: foreach
    assert adam.state_bytes(10, 4, impl="for-loop", target="cpu") == 2 * 10 * 4 + 4
    assert adafactor.state_bytes(10, 4, target="cuda") == 10 * 4  # a 1-D parameter: a whole variance, host step
    assert lion.state_bytes(10, 2, impl="foreach", target="cuda") == 10 * 2


def test_a_float64_default_dtype_doubles_the_host_step_but_not_the_fused_one() -> None:
    # torch/optim/optimizer.py _get_scalar_dtype: float64 when the default dtype is, except when fused
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for impl, step_bytes in (("for-loop", 8), ("fused", 4)):
            model, opt = _stepped("adam", impl)  # float64 parameters and input, float64 moments
            steps = [s["step"] for s in opt.state.values()]
            assert {t.untyped_storage().nbytes() for t in steps} == {step_bytes}
            rule = get_optimizer("adam")
            assert _state_nbytes(opt) == sum(rule.state_bytes(p.shape, 8, impl=impl) for p in model.parameters())
    finally:
        torch.set_default_dtype(previous)


def test_default_implementation_per_target() -> None:
    rules = OPTIMIZERS.rules()
    assert {default_impl(r, "cpu") for r in rules.values()} == {"for-loop"}
    assert default_impl(rules["adamw"], "cuda") == "foreach"
    assert default_impl(rules["lion"], "cuda") == "foreach"
    assert default_impl(rules["adafactor"], "cuda") == "for-loop"  # torch's adafactor(): foreach only when asked
    assert default_impl(rules["adam8bit"], "cuda") == "for-loop"  # no foreach variant


def test_adam8bit_state_by_hand() -> None:
    model, opt = _stepped("adam8bit", None)
    big, small = opt.state[model[2].weight], opt.state[model[4].weight]
    # 4480 elements >= 4096: uint8 moments shaped like the weight, fp32 absmax per 256 elements (ceil(4480/256) = 18)
    assert big["state1"].dtype == big["state2"].dtype == torch.uint8 and big["state1"].shape == (70, 64)
    assert big["absmax1"].shape == big["absmax2"].shape == (18,) and big["absmax1"].dtype == torch.float32
    assert get_optimizer("adam8bit").state_bytes((70, 64), 4) == 2 * 4480 + 2 * 18 * 4
    # 560 elements < 4096: two fp32 moments, no absmax
    assert set(small) == {"step", "state1", "state2"} and small["state1"].dtype == torch.float32
    assert get_optimizer("adam8bit").state_bytes((8, 70), 2) == 2 * 560 * 4  # fp32 even for bf16 params
    assert big["step"] == 1  # a Python int, as in bitsandbytes


def test_adafactor_state_by_hand() -> None:
    rule = get_optimizer("adafactor")
    # (70, 64): a row factor of 70 and a column factor of 64 floats, plus a 4-byte step on the CPU
    assert rule.state_bytes((70, 64), 4) == (70 + 64) * 4 + 4
    # (4, 2, 3, 3): row (4, 2, 3, 1) = 24 and column (4, 2, 1, 3) = 24 floats
    assert rule.state_bytes((4, 2, 3, 3), 4) == (24 + 24) * 4 + 4
    assert rule.state_bytes((70,), 4) == 70 * 4 + 4


@pytest.mark.parametrize("foreach", [False, True])
def test_fxmem_adafactor_steps_like_torchs(foreach: bool) -> None:
    a, b = _model(), _model()
    ours, theirs = Adafactor(a.parameters(), foreach=foreach, weight_decay=0.1), torch.optim.Adafactor(b.parameters(), foreach=foreach, weight_decay=0.1)
    for _ in range(3):
        x = torch.randn(3, 2, 6, 6)
        for model, opt in ((a, ours), (b, theirs)):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
    # torch scales by Python doubles, we by float32 0-dim tensors: agreement to float32 rounding
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert {k: v.shape for k, v in ours.state[a[2].weight].items()} == {k: v.shape for k, v in theirs.state[b[2].weight].items()}


def test_lion_step_by_hand() -> None:
    # m = 0, so the interpolation is 0.1 * g and the step is -lr * sign(g); then m = (1 - 0.99) * g
    for foreach in (False, True):
        p = nn.Parameter(torch.tensor([1.0, -2.0]))
        p.grad = torch.tensor([0.5, -0.25])
        opt = Lion([p], lr=0.1, foreach=foreach)
        opt.step()
        torch.testing.assert_close(p.detach(), torch.tensor([0.9, -1.9]))
        torch.testing.assert_close(opt.state[p]["exp_avg"], torch.tensor([0.005, -0.0025]))


def test_lion_foreach_and_for_loop_agree() -> None:
    a, b = _model(), _model()
    loop, each = Lion(a.parameters(), weight_decay=0.1, foreach=False), Lion(b.parameters(), weight_decay=0.1, foreach=True)
    for _ in range(3):
        x = torch.randn(3, 2, 6, 6)
        for model, opt in ((a, loop), (b, each)):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q)


def test_adam8bit_small_params_step_exactly_like_adam() -> None:
    # below 4096 elements the state is fp32 and the update is Adam's own
    p, q = nn.Parameter(torch.randn(30, 20)), None
    q = nn.Parameter(p.detach().clone())
    ours, adam = Adam8bit([p], lr=0.01), torch.optim.Adam([q], lr=0.01)
    for _ in range(3):
        g = torch.randn(30, 20)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        adam.step()
    torch.testing.assert_close(p, q)


def test_adam8bit_quantized_step_stays_close_to_adam() -> None:
    # 8-bit moments cost precision: after 5 steps the parameter's change from its start differs from
    # 32-bit Adam's by 0.8% of that change (measured, this seed); a broken quantizer is off by far more.
    torch.manual_seed(1)
    p = nn.Parameter(torch.randn(64, 80))
    q = nn.Parameter(p.detach().clone())
    start = p.detach().clone()
    ours, adam = Adam8bit([p], lr=0.01), torch.optim.Adam([q], lr=0.01)
    for _ in range(5):
        g = torch.randn(64, 80)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        adam.step()
    ours_change, adam_change = (p - start).detach(), (q - start).detach()
    assert (ours_change - adam_change).norm() < 0.05 * adam_change.norm()


def test_a_third_party_rule_without_implementations_still_builds() -> None:
    # register_optimizer's contract before impls existed: build(params) -> optimizer
    rule = OptimizerRule("mine", "SGD again", 0, False, lambda p: torch.optim.SGD(p, lr=0.1))
    assert isinstance(rule.make(_model().parameters()), torch.optim.SGD)
    assert rule.make(_model().parameters(), "for-loop") is not None
    with pytest.raises(InputSpecError, match="'mine' has no foreach"):
        rule.make(_model().parameters(), "foreach")
    assert math.isclose(rule.state_bytes(7, 4), 0)
