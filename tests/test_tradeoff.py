"""FLOPs per phase against torch's own counter on real tensors, the trade-off table, the batch-norm caveat."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import fxmem
from fxmem.cost.tradeoff import BN_THRESHOLD, batches_to_try, batchnorm_caveat
from fxmem.engine.losses import get_loss
from fxmem.inputs import make_tensor, parse_inputs
from models_zoo import ZOO
from tests.helpers import analyze_on_meta


def _real_flops(name: str, batch: int, seq: int | None) -> tuple[int, int]:
    """FlopCounterMode's forward (model and loss) and backward FLOPs of a real CPU step at ``batch``."""
    spec = fxmem.load_model(f"zoo:{name}:test", meta=False)
    model, specs, loss = spec.model.train(), parse_inputs(spec.inputs), get_loss(spec.loss)
    torch.manual_seed(0)
    tensors = [make_tensor(s, batch, seq) for s in specs]
    args = [t for s, t in zip(specs, tensors) if s.name is None]
    kwargs = {s.name: t for s, t in zip(specs, tensors) if s.name is not None}
    with FlopCounterMode(display=False) as forward:
        out = loss.select(model(*args, **kwargs), name)
        value = loss.compute(out, loss.make_target(out))
    with FlopCounterMode(display=False) as backward:
        value.backward()
    return forward.get_total_flops(), backward.get_total_flops()


@pytest.mark.parametrize("name", list(ZOO))
def test_flops_equal_torchs_counter_on_real_tensors(name: str) -> None:
    spec = fxmem.load_model(f"zoo:{name}:test")
    report = fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, name=name, batch=2, target="cpu")
    for batch in (2, 3):
        predicted = report.flops(batch)
        assert (predicted.forward, predicted.backward) == _real_flops(name, batch, report.seq_len)


def test_flops_are_a_polynomial_in_the_batch() -> None:
    # Linear(64, 32): forward 2*B*64*32 = 4096*B. Backward computes only grad_weight (32 x B @ B x 64,
    # again 4096*B): the input batch needs no gradient. The loss (sum) has no FLOP formula.
    report = analyze_on_meta(lambda: nn.Linear(64, 32), ["B,64"], optimizer="sgd")
    out = report.to_dict()["flops"]
    assert out["forward"]["per_sample"] == 4096 and out["forward"]["constant"] == 0
    assert out["backward"]["per_sample"] == 4096 and out["backward"]["constant"] == 0
    assert report.flops(5).forward == 5 * 4096
    assert "aten.sum" in out["without_formula"]


def test_the_step_time_is_labelled_a_lower_bound_and_grows_with_the_batch() -> None:
    report = analyze_on_meta(lambda: nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)), ["B,256"], batch=64)
    small, large = report.step_time(8), report.step_time(512)
    assert 0 < small.seconds < large.seconds
    # Per sample, a larger batch is never slower under the roofline: fixed costs (weights read once per
    # step, the optimizer step) are shared by more samples.
    assert large.samples_per_second(512) > small.samples_per_second(8)
    assert "roofline lower bound" in str(report) and "not a benchmark" in str(report)
    assert report.to_dict()["roofline"]["is_lower_bound"] is True


def test_batches_to_try_are_powers_of_two_and_the_largest() -> None:
    assert batches_to_try(100, 32) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert batches_to_try(64, 32) == [1, 2, 4, 8, 16, 32, 64]
    assert batches_to_try(None, 8) == [1, 2, 4, 8, 16]
    # A chosen batch past the largest that fits gets a row of its own (which says it does not fit).
    assert batches_to_try(100, 129) == [1, 2, 4, 8, 16, 32, 64, 100, 129]


def test_tradeoff_rows_follow_the_report() -> None:
    report = analyze_on_meta(lambda: nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)), ["B,64"], device_memory=2**20)
    rows = report.tradeoff()
    assert [r.batch for r in rows] == batches_to_try(report.max_batch(2**20), report.batch)
    for r in rows:
        assert r.peak == report.peak(r.batch).bytes and r.device == report.step_bytes(r.batch) <= 2**20
        assert r.activations == report.activation_bytes(r.batch)


def _bn_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))


def test_batchnorm_caveat_names_the_layers_at_a_small_batch() -> None:
    report = analyze_on_meta(_bn_net, ["B,3,8,8"], batch=4)
    caveat = report.batchnorm_caveat()
    assert "Batch-norm caveat" in caveat and "(1)" in caveat and "B=4" in caveat
    assert "GroupNorm" in caveat and "SyncBatchNorm" in caveat and "gradient accumulation does not help" in caveat
    assert caveat in str(report)
    assert report.to_dict()["batchnorm"] == {"layers": ["1"], "threshold": BN_THRESHOLD, "caveat": caveat}


def test_no_caveat_at_a_large_batch_or_without_batch_statistics() -> None:
    assert analyze_on_meta(_bn_net, ["B,3,8,8"], batch=32).batchnorm_caveat() == ""
    ln = lambda: nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    assert analyze_on_meta(ln, ["B,8"], batch=2).batchnorm_caveat() == ""


def test_the_threshold_is_an_option() -> None:
    assert analyze_on_meta(_bn_net, ["B,3,8,8"], batch=32, bn_threshold=64).batchnorm_caveat() != ""
    with pytest.raises(fxmem.errors.InputSpecError, match="bn_threshold"):
        analyze_on_meta(_bn_net, ["B,3,8,8"], bn_threshold=0)


def test_the_caveat_judges_the_largest_batch_that_fits_too() -> None:
    text = batchnorm_caveat(["bn1", "bn2"], [("chosen batch", 32), ("largest batch that fits", 6)], 16)
    assert "largest batch that fits B=6" in text and "chosen batch" not in text and "2 layers (bn1, bn2)" in text


def test_node_costs_by_hand() -> None:
    # One Linear(1024, 1024, bias=False) at B=64: forward x @ W.T is 2*64*1024*1024 FLOPs; backward only
    # grad_W = grad_out.T @ x (the input needs no gradient), the same again. Forward reads x (64*1024*4
    # = 256 KiB) and W (4 MiB) and writes out (256 KiB); backward reads x (256 KiB) and grad_out, which
    # the sum loss makes as one float expanded to 64 x 1024 (stride 0: 4 bytes read), and writes grad_W
    # (4 MiB). 8 MiB + 768 KiB + 4 B moved in all.
    from fxmem.cost.tradeoff import node_costs
    from fxmem.gpu.gpus import get_gpu

    report = analyze_on_meta(lambda: nn.Linear(1024, 1024, bias=False), ["B,1024"], optimizer="sgd", batch=64)
    (linear,) = [n for n in node_costs(report.timeline(64), 64, get_gpu("a100-80gb")) if n.node == "linear"]
    assert linear.flops == 2 * 2 * 64 * 1024 * 1024
    assert linear.moved_bytes == 8 * 2**20 + 768 * 2**10 + 4
    # Intensity 268.4M / 9.18 MB = 29.3 FLOP/B, above the A100's fp32 ridge point (19.5e12 FLOP/s /
    # 2.039e12 B/s = 9.6 FLOP/B): the node is compute-bound on the fp32 CUDA cores.
    assert linear.intensity == pytest.approx(2 * 2 * 64 * 2**20 / (8 * 2**20 + 768 * 2**10 + 4))
    assert linear.bound.value == "compute"


def test_json_nodes_carry_their_flops_as_polynomials() -> None:
    # Two Linears, 64 -> 32 -> 8: forward 2*64*32 = 4096 and 2*32*8 = 512 FLOPs per sample. Backward:
    # the first computes only its weight gradient (4096*B; its input needs none), the second its weight
    # and input gradients (2 * 512*B).
    report = analyze_on_meta(lambda: nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8)), ["B,64"], optimizer="sgd")
    nodes = {n["name"]: n["flops"] for n in report.to_dict()["nodes"]}
    assert nodes["_0"]["forward"] == {"per_sample": 4096, "constant": 0} and nodes["_0"]["backward"]["per_sample"] == 4096
    assert nodes["_1"]["forward"]["per_sample"] == 512 and nodes["_1"]["backward"]["per_sample"] == 1024
