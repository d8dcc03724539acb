"""Sequence parallel on top of tensor parallel (Note [Sequence parallel] in fxmem/parallel/tensor.py):
the plans fxmem derives or a zoo model carries, one rank simulated against real CPU ranks (torchrun,
gloo), and what it saves compared with plain tensor parallel, worked out by hand."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch import nn

import fxmem
from fxmem.cli import main
from fxmem.errors import InputSpecError
from fxmem.measure_ranks import measure_ranks
from fxmem.parallel import default_tp_plan, resolve_tp_plan, tp_layers
from models_zoo.gpt2_small import build
from tests.helpers import check_ranks, tiny_llama

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")

BATCH = 4
LOSS = "lm_cross_entropy"


def _gpt() -> tuple[nn.Module, list[str]]:
    spec = build(test=True)  # 2 pre-LN blocks, d=32, 4 heads, context 16, vocab 101
    return spec.model, list(spec.inputs)


def _analyze(model: nn.Module, inputs: object, batch: int, plan: dict[str, str] | None) -> fxmem.Report:
    return fxmem.analyze(model, inputs, loss=LOSS, batch=batch, target="cpu", tp=2, tp_plan=plan)  # type: ignore[arg-type]


def test_the_plans() -> None:
    """The zoo GPT carries its plan (``_sp_plan``); a HF Llama's is its own plan with the row-wise
    layers reduce-scattering, the layers' norms and the final norm sequence parallel and the stream
    split where it enters the first layer; a model with neither, or a style on the wrong class of
    module, is refused."""
    gpt, _ = _gpt()
    styles = {t.path: t.style for t in tp_layers(gpt, 2, default_tp_plan(gpt, sequence_parallel=True))}
    assert styles["drop"] == "sequence_shard_input" and styles["ln_f"] == "sequence_parallel_gather_output"
    assert [styles[f"blocks.0.{p}"] for p in ("ln1", "attn.qkv", "attn.proj", "ln2", "mlp.0", "mlp.2")] == [
        "sequence_parallel_gather_output", "colwise", "rowwise_scatter_output", "sequence_parallel_gather_output", "colwise",
        "rowwise_scatter_output",
    ]  # fmt: skip
    pytest.importorskip("transformers")
    llama = tiny_llama(vocab_size=98)
    own = default_tp_plan(llama)
    assert own is not None
    assert default_tp_plan(llama, sequence_parallel=True) == {
        **{k: "rowwise_scatter_output" if v == "rowwise" else v for k, v in own.items()},
        "model.layers.*.input_layernorm": "sequence_parallel_gather_output",
        "model.layers.*.post_attention_layernorm": "sequence_parallel_gather_output",
        "model.norm": "sequence_parallel_gather_output",
        "model.layers.0": "sequence_shard_input",
    }
    import transformers

    gemma = transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(
            vocab_size=98,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
        )
    )  # its layers also norm the MLP's input and output
    with pytest.raises(
        InputSpecError, match=r"norms besides input_layernorm and post_attention_layernorm \('model\.layers\.0\.pre_feedforward"
    ):
        default_tp_plan(gemma, sequence_parallel=True)
    with pytest.raises(InputSpecError, match=r"model 'mlp' \(Sequential\) has no sequence-parallel plan"):
        default_tp_plan(nn.Sequential(nn.Linear(8, 8)), sequence_parallel=True, name="mlp")
    with pytest.raises(InputSpecError, match=r"'blocks\.0\.ln1' \(LayerNorm\) the style 'rowwise_scatter_output', which shards an Linear"):
        resolve_tp_plan(gpt, {"blocks.*.ln1": "rowwise_scatter_output"}, 2)


@pytest.fixture(scope="module")
def gpt_reports() -> tuple[fxmem.Report, fxmem.Report]:
    """(tensor parallel, tensor and sequence parallel) over 2 ranks, the GPT test config at B=4."""
    model, inputs = _gpt()
    return _analyze(model, inputs, BATCH, None), _analyze(model, inputs, BATCH, default_tp_plan(model, sequence_parallel=True))


def test_sequence_parallel_saves_the_stream_once_per_rank(gpt_reports: tuple[fxmem.Report, fxmem.Report]) -> None:
    """By hand, B=4, S=16, D=32, fp32, T=2. Between the sharded layers a rank holds S/T = 8
    positions: a (B, S, D) tensor of the stream is 4*16*32*4 = 8,192 B under tensor parallel and
    4*8*32*4 = 4,096 B under sequence parallel. ``add_1`` (block 0's residual after attention) is
    saved by ``ln2``, which keeps its input: 8,192 -> 4,096. ``blocks_0_ln1`` keeps a mean and an
    inverse std per position, 2*4*16*4 = 512 B, now 2*4*8*4 = 256 B, and hands out the whole
    normalized sequence that ``qkv`` saves, 8,192 B, all-gathered there under sequence parallel:
    8,704 -> 8,448. In all, each block keeps four stream tensors at half their size (its two
    dropouts' noise, its two residual sums: 4 * 4,096 B less) and two norms' statistics at half
    (2 * 256 B less); the embeddings' dropout keeps its noise and its output (ln1's input) at half
    (2 * 4,096 B less) and ``ln_f`` its statistics (256 B less)."""
    tp, sp = gpt_reports
    tp_nodes, sp_nodes = tp.node_bytes(BATCH), sp.node_bytes(BATCH)
    assert (tp_nodes["add_1"], sp_nodes["add_1"]) == (8192, 4096)
    assert (tp_nodes["blocks_0_ln1"], sp_nodes["blocks_0_ln1"]) == (8192 + 512, 8192 + 256)
    per_block = 4 * 4096 + 2 * 256
    assert tp.activation_bytes(BATCH) - sp.activation_bytes(BATCH) == 2 * per_block + 2 * 4096 + 256
    assert tp.per_gpu.weights.nbytes == sp.per_gpu.weights.nbytes  # the norms' weights stay whole on every rank


def test_gathering_at_the_projection_saves_the_same() -> None:
    """torchtitan's variant, the norm's output left sharded and gathered at the fused projection's
    input (``colwise_gather_input``): the same tensors are gathered and saved."""
    model, inputs = _gpt()
    plan = default_tp_plan(model, sequence_parallel=True)
    assert plan is not None
    variant = {**plan, "blocks.*.ln1": "sequence_parallel", "blocks.*.ln2": "sequence_parallel"}
    variant.update({"blocks.*.attn.qkv": "colwise_gather_input", "blocks.*.mlp.0": "colwise_gather_input"})
    at_norm, at_projection = _analyze(model, inputs, BATCH, plan), _analyze(model, inputs, BATCH, variant)
    assert at_projection.activation_bytes(BATCH) == at_norm.activation_bytes(BATCH)
    assert at_projection.peak(BATCH).bytes == at_norm.peak(BATCH).bytes


@pytest.mark.parametrize("first_step", [False, True], ids=["steady", "first"])
def test_sequence_parallel_rank_matches_real_ranks(gpt_reports: tuple[fxmem.Report, fxmem.Report], first_step: bool) -> None:
    """Every real rank saved what the simulated rank saves and starts with its state to the byte;
    the peak within Note [Collective outputs a real rank holds longer]."""
    model, inputs = _gpt()
    _, sp = gpt_reports
    ranks = measure_ranks(
        model, inputs, BATCH, tp=2, tp_plan=default_tp_plan(model, sequence_parallel=True), loss=LOSS, first_step=first_step
    )
    timeline = sp.timeline(BATCH, first_step=first_step)
    assert [m.saved for m in ranks] == [sp.activation_bytes(BATCH)] * 2
    assert [m.baseline for m in ranks] == [sum(v.at(BATCH) for v in timeline.baseline.values())] * 2
    check_ranks(ranks, sp, BATCH, first_step)


def test_sequence_parallel_hugging_face_llama() -> None:
    """HF's Llama through torch.export, its norms inline in the graph: the real ranks save what the
    simulated rank saves. By hand, B=2, S=16, D=32, fp32: the first norm's input (``to_4``, the cast
    that returns it) is 2*16*32*4 = 4,096 B under tensor parallel and 2*8*32*4 = 2,048 B under
    sequence parallel."""
    pytest.importorskip("transformers")
    model, inputs = tiny_llama(vocab_size=98), {"input_ids": "B,16:int64"}
    plan = default_tp_plan(model, sequence_parallel=True)
    tp, sp = _analyze(model, inputs, 2, None), _analyze(model, inputs, 2, plan)
    assert "tensor parallel over 2 (22 layers, sequence parallel)" in sp.steps.path
    assert (tp.node_bytes(2)["to_4"], sp.node_bytes(2)["to_4"]) == (4096, 2048)
    assert sp.activation_bytes(2) < tp.activation_bytes(2)
    ranks = measure_ranks(model, inputs, 2, tp=2, tp_plan=plan, loss=LOSS)
    assert [m.saved for m in ranks] == [sp.activation_bytes(2)] * 2
    assert [m.baseline for m in ranks] == [sum(v.at(2) for v in sp.timeline(2).baseline.values())] * 2
    check_ranks(ranks, sp, 2)


def test_a_sequence_the_degree_does_not_divide_is_refused() -> None:
    model, _ = _gpt()
    with pytest.raises(
        InputSpecError, match=r"model 'GPT': sequence parallel over 2 ranks splits the sequence entering 'drop' \(15 positions\)"
    ):
        _analyze(model, ["B,15:int64"], BATCH, default_tp_plan(model, sequence_parallel=True))


def test_fsdp_over_sequence_parallel_on_a_two_by_two_mesh() -> None:
    """FSDP2 over 2 data-parallel ranks of 2 tensor- and sequence-parallel ranks each (4 processes):
    every rank saves what the simulated rank saves; rank 0 starts with its state to the byte (ranks
    2 and 3 hold one row fewer of a parameter: ``spread``, as in test_tensor_parallel.py)."""
    model, inputs = _gpt()
    plan = default_tp_plan(model, sequence_parallel=True)
    report = fxmem.analyze(model, inputs, loss=LOSS, batch=BATCH, target="cpu", fsdp=2, tp=2, tp_plan=plan)
    ranks = measure_ranks(model, inputs, BATCH, fsdp=2, units=report.fsdp_units, tp=2, tp_plan=plan, loss=LOSS)
    assert [m.saved for m in ranks] == [report.activation_bytes(BATCH)] * 4
    assert ranks[0].baseline == sum(v.at(BATCH) for v in report.timeline(BATCH).baseline.values())
    check_ranks(ranks, report, BATCH, spread=256)


def test_sp_option_takes_the_models_sequence_plan(capsys: pytest.CaptureFixture[str]) -> None:
    model, inputs = _gpt()
    by_option = fxmem.analyze(model, inputs, loss=LOSS, batch=2, target="cpu", tp=2, sp=True)
    by_plan = _analyze(model, inputs, 2, default_tp_plan(model, sequence_parallel=True))
    assert by_option.activation_bytes(2) == by_plan.activation_bytes(2) and "sequence parallel" in by_option.steps.path
    with pytest.raises(InputSpecError, match=r"pass tp=T \(--tp T\)"):
        fxmem.analyze(model, inputs, loss=LOSS, batch=2, target="cpu", sp=True)
    assert main(["analyze", "zoo:gpt2-small:test", "--target", "cpu", "--tp", "2", "--sp", "--batch", "2"]) == 0
    assert "tensor parallel run" in capsys.readouterr().out
