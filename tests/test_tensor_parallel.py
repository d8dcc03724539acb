"""One rank of tensor parallel (``parallelize_module``), alone and under FSDP2, simulated on a fake
process group (fxmem/parallel/tensor.py), against the same step on real CPU processes (torchrun,
gloo), each rank measured with the profiler."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fxmem
from fxmem.cli import main
from fxmem.errors import InputSpecError
from fxmem.measure_ranks import measure_ranks
from fxmem.parallel import resolve_tp_plan, tp_layers
from models_zoo.gpt2_small import GPT, build
from tests.helpers import check_ranks, tiny_llama

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")

BATCH = 4


def _gpt() -> tuple[nn.Module, list[str]]:
    spec = build(test=True)  # 2 pre-LN blocks, d=32, 4 heads, context 16, vocab 101
    return spec.model, list(spec.inputs)


def test_plan_matches_each_block_and_checks_the_split() -> None:
    """The zoo GPT's plan names four Linears per block, ``*`` one path component; a degree that
    does not divide the heads (4 heads over 3 ranks, though 3 divides the fused projection's 96
    outputs) or a width is refused naming the module and the number."""
    model, _ = _gpt()
    layers = tp_layers(model, 2)
    assert [(t.path, t.style) for t in layers[:4]] == [
        ("blocks.0.attn.qkv", "colwise"), ("blocks.0.attn.proj", "rowwise"), ("blocks.0.mlp.0", "colwise"), ("blocks.0.mlp.2", "rowwise"),
    ]  # fmt: skip
    assert len(layers) == 8
    with pytest.raises(InputSpecError, match=r"heads of 'blocks\.0\.attn' \(heads = 4\), which 3 does not divide"):
        tp_layers(model, 3)
    with pytest.raises(InputSpecError, match=r"in_features of 'blocks\.0\.mlp\.2' \(128\), which 5 does not divide"):
        resolve_tp_plan(model, {"blocks.*.mlp.2": "rowwise"}, 5)
    with pytest.raises(InputSpecError, match=r"'blocks\.\*\.nope', which matches no module"):
        resolve_tp_plan(model, {"blocks.*.nope": "colwise"}, 2)
    with pytest.raises(InputSpecError, match="the style 'sideways'"):
        resolve_tp_plan(model, {"blocks.*.mlp.0": "sideways"}, 2)
    with pytest.raises(InputSpecError, match=r"'blocks\.0\.ln1' \(LayerNorm\) the style 'colwise', which shards an Linear"):
        resolve_tp_plan(model, {"blocks.0.ln1": "colwise"}, 2)


def test_a_model_without_a_plan_is_refused() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with pytest.raises(InputSpecError, match=r"has no tensor-parallel plan: pass tp_plan="):
        fxmem.analyze(model, ["B,8"], batch=2, target="cpu", tp=2)
    with pytest.raises(InputSpecError, match="only --tp T"):
        fxmem.analyze(model, ["B,8"], batch=2, target="cpu", tp_plan={"0": "colwise"})
    report = fxmem.analyze(model, ["B,8"], batch=2, target="cpu", tp=2, tp_plan={"0": "colwise", "2": "rowwise"})
    assert "tensor parallel over 2 (2 layers)" in report.steps.path


def test_foreach_optimizer_refuses_plain_beside_sharded_parameters() -> None:
    """On the cuda target torch's default AdamW is foreach, which refuses DTensors mixed with plain
    tensors; tensor parallel alone leaves the norms and embeddings plain: refused before simulating,
    as a real run would fail at its first optimizer step."""
    model, inputs = _gpt()
    with pytest.raises(InputSpecError, match=r"parameter 'tok\.weight' \(and \d+ more\) stays a plain tensor.*foreach optimizer"):
        fxmem.analyze(model, inputs, loss="lm_cross_entropy", batch=2, tp=2)


@pytest.fixture(scope="module")
def simulated() -> fxmem.Report:
    model, inputs = _gpt()
    return fxmem.analyze(model, inputs, loss="lm_cross_entropy", batch=BATCH, target="cpu", tp=2)


def test_rank_holds_its_slices(simulated: fxmem.Report) -> None:
    """Per rank, by hand: a column-wise Linear keeps half its weight's rows and half its bias, a
    row-wise one half its weight's columns and its whole bias; everything else is whole. Gradients
    are the same bytes; AdamW keeps two moments of each plus a 4-byte step per parameter."""
    model, _ = _gpt()
    whole = sum(p.numel() * 4 for p in model.parameters())  # the tied LM head's weight once
    halved = 0
    for block in model.blocks:
        for linear in (block.attn.qkv, block.mlp[0]):  # colwise: rows of the weight, the bias
            halved += (linear.weight.numel() + linear.bias.numel()) * 4 // 2
        for linear in (block.attn.proj, block.mlp[2]):  # rowwise: columns of the weight only
            halved += linear.weight.numel() * 4 // 2
    share = simulated.per_gpu
    assert share.weights.nbytes == share.gradients.nbytes == whole - halved
    assert share.optimizer.nbytes == 2 * (whole - halved) + 4 * len(list(model.parameters()))


@pytest.mark.parametrize("first_step", [False, True], ids=["steady", "first"])
def test_tp_rank_matches_real_ranks(simulated: fxmem.Report, first_step: bool) -> None:
    model, inputs = _gpt()
    ranks = measure_ranks(model, inputs, BATCH, tp=2, loss="lm_cross_entropy", first_step=first_step)
    timeline = simulated.timeline(BATCH, first_step=first_step)
    baseline = sum(v.at(BATCH) for v in timeline.baseline.values())
    assert [m.saved for m in ranks] == [simulated.activation_bytes(BATCH)] * 2
    assert [m.baseline for m in ranks] == [baseline] * 2
    check_ranks(ranks, simulated, BATCH, first_step)


def test_tp_hugging_face_llama_through_export() -> None:
    """A HF Llama test config with its own plan (config.base_model_tp_plan, the LM head gathered,
    the embedding's rows split), traced by torch.export, whose projections are inline aten.linear
    calls: the layers' hooks are called where their code runs in the flattened graph."""
    pytest.importorskip("transformers")
    model = tiny_llama(vocab_size=98)  # the LM head's 98 rows split over 2 ranks
    inputs = {"input_ids": "B,16:int64"}
    report = fxmem.analyze(model, inputs, loss="lm_cross_entropy", batch=2, target="cpu", tp=2)
    assert report.frontend == "export" and "tensor parallel over 2 (16 layers)" in report.steps.path
    ranks = measure_ranks(model, inputs, 2, tp=2, loss="lm_cross_entropy")
    assert [m.saved for m in ranks] == [report.activation_bytes(2)] * 2
    assert ranks[0].baseline == sum(v.at(2) for v in report.timeline(2).baseline.values())
    check_ranks(ranks, report, 2)


def test_fsdp_over_tp_on_a_two_by_two_mesh() -> None:
    """FSDP2 over 2 data-parallel ranks of 2 tensor-parallel ranks each (4 processes), composed as
    torchtitan composes them: every rank's saved activations are the simulated rank's; rank 0 starts
    with its state to the byte (a rank holding one row fewer of a parameter holds fewer bytes of it:
    ``spread``, 256 B of AdamW moments measured on ranks 2 and 3)."""
    model, inputs = _gpt()
    report = fxmem.analyze(model, inputs, loss="lm_cross_entropy", batch=BATCH, target="cpu", fsdp=2, tp=2)
    assert "FSDP2 over 2 (fully_shard on 2 units and the root) x tensor parallel over 2 (8 layers)" in report.steps.path
    ranks = measure_ranks(model, inputs, BATCH, fsdp=2, units=report.fsdp_units, tp=2, loss="lm_cross_entropy")
    assert [m.saved for m in ranks] == [report.activation_bytes(BATCH)] * 4
    assert ranks[0].baseline == sum(v.at(BATCH) for v in report.timeline(BATCH).baseline.values())
    check_ranks(ranks, report, BATCH, spread=256)


def test_cli_analyze_and_measure_with_tp(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", "zoo:gpt2-small:test", "--target", "cpu", "--tp", "2", "--batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "State per GPU (2 ranks, tensor parallel run)" in out
    assert "2 GPUs, tensor parallel 2, one rank simulated" in out  # the header names the engine that ran
    assert main(["measure", "zoo:gpt2-small:test", "--peak", "--target", "cpu", "--tp", "2", "--batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "rank 1" in out and "saved activations exact" in out
    assert main(["analyze", "zoo:gpt2-small:test", "--target", "cpu", "--tp", "2", "--tp-plan", "blocks.*.mlp.0"]) == 2
    assert "--tp-plan 'blocks.*.mlp.0': write PATH=STYLE" in capsys.readouterr().err


def test_zoo_gpt_heads_follow_the_projection() -> None:
    """The zoo's attention infers its head count from the projection's width (what a column-sliced
    rank needs): unchanged on one device, the same logits as counting heads from the config."""
    torch.manual_seed(0)
    model = GPT(101, 16, 32, 1, 4, dropout=0.0).eval()
    attn = model.blocks[0].attn
    x = torch.randn(2, 16, 32)
    q, k, v = attn.qkv(x).chunk(3, dim=-1)
    by_config = [t.unflatten(-1, (4, 8)).transpose(1, 2) for t in (q, k, v)]
    assert all(torch.equal(a, b) for a, b in zip(by_config, (attn._heads(q), attn._heads(k), attn._heads(v))))
