"""One rank of FSDP2, simulated on a fake process group (fxmem/parallel), against the same step run
for real on two CPU processes (torchrun, gloo), each rank measured with the profiler."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.distributed as dist

import fxmem
from fxmem.engine.module_hooks import ModuleScopes
from fxmem.errors import InputSpecError
from fxmem.frontends.tracing import trace_model
from fxmem.inputs import parse_inputs
from fxmem.measure_ranks import measure_ranks
from fxmem.parallel import fake_world
from fxmem.results import Category
from models_zoo.gpt2_small import build
from tests.helpers import assert_rank_peaks, cpu_computes_bf16, tiny_llama

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")

BATCH = 4


def _gpt() -> tuple[torch.nn.Module, list[str]]:
    spec = build(test=True)  # 2 pre-LN blocks, d=32, context 16
    return spec.model, list(spec.inputs)


def test_scope_of_a_block_is_its_call() -> None:
    """A GPT block's forward is ``x = x + attn(ln1(x)); x = x + mlp(ln2(x)); return x``: one argument
    (the embeddings after dropout for block 0, block 0's output for block 1), one output (the second
    residual add), its first node ``ln1`` and its last that add. The root's scope is the whole graph."""
    model, inputs = _gpt()
    gm = trace_model(model, parse_inputs(inputs)).gm
    scopes = ModuleScopes.of(gm, ["blocks.0", "blocks.1", ""])
    by_path = {s.path: s for group in scopes.opening.values() for s in group}
    first, second, root = by_path["blocks.0"], by_path["blocks.1"], by_path[""]
    assert first.first.name == "blocks_0_ln1" and [n.name for n in first.inputs] == ["drop"]
    assert [n.name for n in first.outputs] == [first.last.name] == [n.name for n in second.inputs]
    assert second.first.name == "blocks_1_ln1"
    assert [n.name for n in root.inputs] == ["idx"] and root.last.op == "output"
    assert scopes.closing[root.last] == (root,)


@pytest.fixture(scope="module")
def simulated() -> fxmem.Report:
    model, inputs = _gpt()
    return fxmem.analyze(model, inputs, batch=BATCH, target="cpu", fsdp=2)


def test_fsdp_shards_state_and_keeps_activations(simulated: fxmem.Report) -> None:
    """Per rank: the weights, gradients and optimizer state are the rank's padded shards (each
    parameter's first dimension split in two, here evenly: half of the whole), the saved activations
    at the rank's batch those of one GPU, and the gathered weights are the engine's buffers."""
    model, inputs = _gpt()
    whole = fxmem.analyze(model, inputs, batch=BATCH, target="cpu")
    share = simulated.per_gpu
    params = list(model.parameters())  # the tied LM head's weight once
    # fully_shard splits each parameter's first dimension as torch.chunk does: rank 0 holds ceil(rows / 2) rows
    shard = sum(-(-p.shape[0] // 2) * (p.numel() // p.shape[0]) * p.element_size() for p in params)
    assert share.weights.nbytes == shard
    assert share.gradients.nbytes == shard
    assert share.optimizer.nbytes == 2 * shard + 4 * len(params)  # AdamW: two moments and a 4-byte step per parameter
    assert simulated.activation_bytes(BATCH) == whole.activation_bytes(BATCH)
    assert simulated.peak(BATCH).breakdown.get(Category.COMMUNICATION, 0) > 0


@pytest.mark.parametrize("first_step", [False, True], ids=["steady", "first"])
def test_fsdp_rank_matches_real_ranks(simulated: fxmem.Report, first_step: bool) -> None:
    """The same step on two real processes: each rank's saved activations and starting state are the
    simulated rank's to the byte, and its peak within ``assert_rank_peaks``'s bound (Note [Ranks of one
    real step] in fxmem/measure_ranks.py: on some runs a rank frees a unit's gathered weights later)."""
    model, inputs = _gpt()
    ranks = measure_ranks(model, inputs, BATCH, fsdp=2, units=simulated.fsdp_units, first_step=first_step)
    predicted = simulated.peak(BATCH, first_step=first_step)
    timeline = simulated.timeline(BATCH, first_step=first_step)
    baseline = sum(v.at(BATCH) for v in timeline.baseline.values())
    assert [m.saved for m in ranks] == [simulated.activation_bytes(BATCH)] * 2
    # rank 1 holds floor(rows / 2) rows of a parameter with odd rows; its padded shard storage is rank 0's
    # size, but the optimizer's moments (zeros_like of the shard) are one row smaller, each
    short = 0 if first_step else sum(2 * (p.numel() // p.shape[0]) * p.element_size() for p in model.parameters() if p.shape[0] % 2)
    assert [m.baseline for m in ranks] == [baseline, baseline - short]
    unit = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())  # one block's gathered weights
    assert_rank_peaks([m.peak for m in ranks], predicted.bytes, unit)
    assert predicted.phase == min(ranks, key=lambda m: m.peak).phase


def test_fsdp_refuses_what_it_cannot_do() -> None:
    model, inputs = _gpt()
    with pytest.raises(InputSpecError, match=r"'blocks\.9' is not a submodule"):
        fxmem.analyze(model, inputs, batch=2, target="cpu", fsdp=2, fsdp_units=["blocks.9"])
    with pytest.raises(InputSpecError, match="cannot be combined with --world-size 4"):
        fxmem.analyze(model, inputs, batch=2, target="cpu", fsdp=2, world_size=4, shard="zero2")
    with pytest.raises(InputSpecError, match="--no-peak"):
        fxmem.analyze(model, inputs, batch=2, target="cpu", fsdp=2, peak=False)
    with pytest.raises(InputSpecError, match="MixedPrecisionPolicy"):
        fxmem.analyze(model, inputs, batch=2, fsdp=2, precision="bf16")
    with pytest.raises(InputSpecError, match="only --fsdp N"):
        fxmem.analyze(model, inputs, batch=2, target="cpu", fsdp_units=["blocks.0"])


def test_fake_world_is_closed_and_not_nested() -> None:
    hook = sys.excepthook
    with fake_world(4) as mesh:
        assert mesh.size() == 4 and dist.get_world_size() == 4
        with pytest.raises(InputSpecError, match=r"already has a torch\.distributed process group"), fake_world(2):
            pass
    assert not dist.is_initialized() and sys.excepthook is hook  # no "[rank0]:" prefix on this process's tracebacks


@pytest.mark.parametrize("first_step", [False, True], ids=["steady", "first"])
def test_fsdp_hugging_face_llama_through_export(first_step: bool) -> None:
    """A HF Llama test config, traced by torch.export (its weights read at the top of the graph, before
    the inputs): each real rank's peak, starting state and saved activations are the simulated rank's."""
    pytest.importorskip("transformers")
    model = tiny_llama()
    inputs = {"input_ids": "B,16:int64"}
    report = fxmem.analyze(model, inputs, loss="lm_cross_entropy", batch=2, target="cpu", fsdp=2)
    assert report.frontend == "export" and report.fsdp_units == ("model.layers.0", "model.layers.1")
    ranks = measure_ranks(model, inputs, 2, fsdp=2, units=report.fsdp_units, loss="lm_cross_entropy", first_step=first_step)
    predicted = report.peak(2, first_step=first_step)
    baseline = sum(v.at(2) for v in report.timeline(2, first_step=first_step).baseline.values())
    assert [m.saved for m in ranks] == [report.activation_bytes(2)] * 2
    assert ranks[0].baseline == baseline
    unit = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())  # one layer's gathered weights
    assert_rank_peaks([m.peak for m in ranks], predicted.bytes, unit)  # 37,120 B: 9,280 fp32 parameters


def test_cli_analyze_and_measure_with_fsdp(capsys: pytest.CaptureFixture[str]) -> None:
    """``fxmem analyze --fsdp 2`` says what one rank holds; ``fxmem measure --peak --fsdp 2`` runs the
    ranks for real and prints each beside the simulated one."""
    from fxmem.cli import main

    assert main(["analyze", "zoo:gpt2-small:test", "--target", "cpu", "--fsdp", "2", "--batch", "4"]) == 0
    text = capsys.readouterr().out
    assert "2 GPUs, FSDP2 (fully_shard) 2, one rank simulated" in text and "State per GPU (2 ranks, FSDP2 run)" in text
    assert "FSDP2 buffers" in text and "one rank of FSDP2 over 2 (fully_shard on 2 units and the root)" in text
    assert main(["measure", "zoo:gpt2-small:test", "--peak", "--target", "cpu", "--fsdp", "2", "--batch", "4"]) == 0
    text = capsys.readouterr().out
    assert "rank 0" in text and "rank 1" in text and "fxmem (one rank)" in text and "saved activations exact" in text
    assert main(["measure", "zoo:gpt2-small:test", "--fsdp", "2"]) == 2  # one real forward has no ranks to shard
    assert "--fsdp" in capsys.readouterr().err


def test_fsdp_mixed_precision_policy() -> None:
    """``precision="mixed"`` runs FSDP2 with ``MixedPrecisionPolicy(param_dtype=bfloat16,
    reduce_dtype=float32)``: fp32 shards, weights gathered and computed in bf16, so what autograd saves
    is bf16. The simulated rank's saved bytes and steady peak against two real ranks with that policy."""
    model, inputs = _gpt()
    report = fxmem.analyze(model, inputs, batch=BATCH, target="cpu", fsdp=2, precision="mixed")
    fp32 = fxmem.analyze(model, inputs, batch=BATCH, target="cpu", fsdp=2)
    assert report.per_gpu.weights == fp32.per_gpu.weights  # FSDP2 keeps fp32 shards whatever the policy
    assert report.activation_bytes(BATCH) < fp32.activation_bytes(BATCH)
    ranks = measure_ranks(model, inputs, BATCH, fsdp=2, units=report.fsdp_units, mixed=True)
    assert [m.saved for m in ranks] == [report.activation_bytes(BATCH)] * 2
    if cpu_computes_bf16():
        # Open: on a CPU with bf16 units (the Xeon CI runs on since, AMX and AVX512-BF16) both real
        # ranks peak 34,240 B (6%) above the simulated one (558,452 B against 592,692 and 592,948 B);
        # which bf16 kernel holds the extra bytes is not found yet. The saved bytes above are exact.
        pytest.xfail("the bf16 step's peak on a CPU with bf16 units is not modelled yet")
    unit = sum(p.numel() * 2 for p in model.blocks[0].parameters())  # one block's weights gathered in bf16
    assert_rank_peaks([m.peak for m in ranks], report.peak(BATCH).bytes, unit)


def test_ranks_need_a_model_they_can_be_handed() -> None:
    class Local(torch.nn.Module):  # a class defined in a function: pickle cannot find it by name
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    with pytest.raises(InputSpecError, match=r"cannot be handed to the 2 rank processes"):
        measure_ranks(Local(), ["B,4"], 2, fsdp=2)


def test_hooks_that_fail_name_the_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """A module's hook that raises inside the simulated step: one error naming the module and the node."""
    import fxmem.parallel.rank as rank

    model, inputs = _gpt()
    original = rank.shard_graph

    def refuse(module: torch.nn.Module, args: tuple[object, ...]) -> None:
        raise RuntimeError("this unit cannot run")

    def shard_and_refuse(*args: object, **kwargs: object) -> torch.fx.GraphModule:
        sharded = original(*args, **kwargs)  # type: ignore[arg-type]
        sharded.get_submodule("blocks.1").register_forward_pre_hook(refuse)
        return sharded

    monkeypatch.setattr(rank, "shard_graph", shard_and_refuse)
    with pytest.raises(fxmem.CaptureError, match=r"forward pre-hooks of module 'blocks\.1' .* node 'blocks_1_ln1'"):
        fxmem.analyze(model, inputs, batch=2, target="cpu", fsdp=2)


def test_checkpointed_model_keeps_its_checkpoints_on_a_rank() -> None:
    """FSDP2 shards state, not activations: a rank of a checkpointed model saves what one GPU saves for
    the same checkpointed model (the rank's graph is a copy whose checkpointed regions must follow it;
    without that the rank ran unchecked, saving the plain model's bytes)."""
    from fxmem.planner.checkpoint import plan_checkpointing
    from fxmem.planner.emit import compile_plan
    from fxmem.step.sharding import fsdp_units

    model, inputs = _gpt()
    plain = fxmem.analyze(model, inputs, loss="lm_cross_entropy", batch=2, target="cpu")
    chosen = plan_checkpointing(model, inputs, list(fsdp_units(model)), budget=plain.activation_bytes(1) // 2, batch=1, loss="lm_cross_entropy")
    checkpointed = compile_plan(chosen)(copy.deepcopy(model))
    one = fxmem.analyze(checkpointed, inputs, loss="lm_cross_entropy", batch=2, target="cpu")
    rank = fxmem.analyze(checkpointed, inputs, loss="lm_cross_entropy", batch=2, target="cpu", fsdp=2)
    assert one.activation_bytes(2) < plain.activation_bytes(2)
    assert rank.activation_bytes(2) == one.activation_bytes(2)


def test_fsdp_mixed_precision_policy_on_a_hugging_face_llama() -> None:
    """The recipe most 8B runs use, on a HF Llama: ``LlamaRMSNorm`` reads its input's dtype and casts
    back to it, a constant in any trace. Traced with fp32 weights the graph would hand q_proj an
    fp32 activation against bf16 gathered weights (Note [Tracing in the weights' compute dtype] in
    fxmem/frontends/deepen.py); traced with bf16 weights it runs as two real ranks do, to the byte
    of what autograd saves, and the shards stay fp32."""
    pytest.importorskip("transformers")
    model, inputs = tiny_llama(), ["input_ids=B,16:int64"]
    report = fxmem.analyze(model, inputs, batch=2, target="cpu", fsdp=2, precision="mixed", loss="cross_entropy")
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the model is given back as it came
    assert {p.dtype for p in report.graph.parameters()} == {torch.float32}
    ranks = measure_ranks(model, inputs, 2, fsdp=2, units=report.fsdp_units, loss="cross_entropy", mixed=True)
    assert [m.saved for m in ranks] == [report.activation_bytes(2)] * 2
