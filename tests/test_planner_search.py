"""The planner (fxmem/planner/search.py, show.py): the levers it pulls, checked against fxmem's own
exact memory per batch, and a chosen plan applied to the real model and measured on the CPU."""

from __future__ import annotations

import contextlib
import runpy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import fxmem
from fxmem.cli import main
from fxmem.errors import InputSpecError
from fxmem.planner.search import plan, verify
from fxmem.planner.show import emit_plan, plan_table
from fxmem.planner.verify import measure_plan
from models_zoo.gpt2_small import GPT, build
from models_zoo.unet3d import UNet3D
from models_zoo.vit_b16 import ViT
from tests.helpers import assert_rank_peaks, tiny_llama

LOSS = "lm_cross_entropy"


def _gpt() -> tuple[torch.nn.Module, list[str]]:
    spec = build(test=True)
    return spec.model, list(spec.inputs)


def test_micro_batch_and_accumulation_reach_the_global_batch() -> None:
    """With room for 24 samples of the GPT test config on the CPU, a global batch of 64 is reached as
    16 x 4: 16 is the largest divisor of 64 that fits (24 does not divide it, 32 does not fit)."""
    model, inputs = _gpt()
    report = fxmem.analyze(model, inputs, loss=LOSS, batch=1, target="cpu")
    memory = report.step_bytes(24)  # B=24 fits exactly; 32 does not (memory grows with B)
    assert report.step_bytes(32) > memory
    found = plan(model, inputs, loss=LOSS, target="cpu", memory=memory, global_batch=64, allow=["batch"])
    best = found.best
    assert best is not None and (best.micro_batch, best.accumulation, best.global_batch) == (16, 4, 64)
    assert best.total == report.step_bytes(16) <= memory


def test_fitting_configurations_are_ranked_by_estimated_throughput() -> None:
    """On a GPU, bf16 autocast is simulated first; where it fits, fp32 of the same layout is ruled out
    unsimulated (the roofline runs its matmuls at the fp32 rate: H100 67 against 989.5 TFLOPS), and so
    is the fused implementation (it changes only the optimizer step's own allocations, and torch's
    default fits the whole global batch of 64). The plan says why for each. fp32 alone (precision not
    allowed) fits too, holds more than autocast at the same micro-batch, and ranks below it."""
    model, inputs = _gpt()
    found = plan(model, inputs, loss=LOSS, memory=2 * 2**30, global_batch=64, allow=["batch", "precision", "optimizer-impl"])
    assert [c.config.describe() for c in found.fitting] == ["amp (bf16 autocast), adamw"]
    outcomes = {e.config: e.outcome for e in found.evaluated}
    assert outcomes["fp32, adamw"].startswith("ruled out: a bf16 configuration of the same layout fits")
    assert outcomes["amp (bf16 autocast), adamw, fused"].startswith("ruled out: torch's default implementation")
    fp32 = plan(model, inputs, loss=LOSS, memory=2 * 2**30, global_batch=64, allow=["batch"]).best
    amp = found.best
    assert fp32 is not None and amp is not None and fp32.micro_batch == amp.micro_batch
    assert amp.peak < fp32.peak and amp.samples_per_second > fp32.samples_per_second
    table = plan_table(found)
    assert "Best: amp (bf16 autocast), adamw" in table


@pytest.fixture(scope="module")
def long_gpt() -> tuple[torch.nn.Module, list[str], fxmem.Report]:
    """A GPT whose activations outweigh its state at B=1 (256 tokens, d=64, 4 blocks)."""
    torch.manual_seed(0)
    model = GPT(101, 256, 64, 4, 4, dropout=0.0)
    inputs = ["B,256:int64"]
    return model, inputs, fxmem.analyze(model, inputs, loss=LOSS, batch=1, target="cpu")


def test_checkpointing_makes_the_step_fit_and_the_real_step_agrees(long_gpt: tuple[torch.nn.Module, list[str], fxmem.Report]) -> None:
    """Two thirds of B=1's saved activations fit beside the rest of its step: only checkpointing makes
    micro-batch 1 fit. The chosen plan, applied to the real model through the emitted code and run
    on this CPU, peaks where the simulation said and saves what the plan said, to the byte."""
    model, inputs, report = long_gpt
    memory = report.step_bytes(1) - report.activation_bytes(1) // 3
    found = plan(model, inputs, loss=LOSS, target="cpu", memory=memory, allow=["batch", "checkpoint"])
    best = found.best
    assert best is not None and best.config.checkpoint is not None and best.recompute_flops > 0
    assert best.total <= memory
    proof = verify(best, model, inputs, loss=LOSS)
    assert proof.measured_peak == best.peak, (proof.measured_peak, best.peak)
    assert proof.measured_saved == best.config.checkpoint.saved_at_batch


def _vit() -> tuple[torch.nn.Module, list[str] | dict[str, str], str]:
    """A ViT whose 256 patches (64x64 images, 4x4 patches, d=32, 2 blocks) outweigh its state."""
    torch.manual_seed(0)
    return ViT(64, 4, 32, 2, 4, 64, 10, dropout=0.0), ["B,3,64,64"], "cross_entropy"


def _unet() -> tuple[torch.nn.Module, list[str] | dict[str, str], str]:
    """The zoo's 3-D U-Net test widths (4-8-16) on 32^3 volumes: its peak is a convolution's backward."""
    torch.manual_seed(0)
    return UNet3D(1, 3, (4, 8, 16)), ["B,1,32,32,32"], "cross_entropy"


def _llama() -> tuple[torch.nn.Module, list[str] | dict[str, str], str]:
    """A HF Llama test config (2 layers, d=32) on 64 tokens, its own loss."""
    pytest.importorskip("transformers")
    return tiny_llama(use_cache=False), {"input_ids": "B,64:int64", "labels": "B,64:int64"}, "model"  # checkpointed for real


@pytest.mark.parametrize(("build", "cut"), [(_vit, 3), (_unet, 20), (_llama, 10)], ids=["vit", "unet", "hf-llama"])
def test_checkpointing_plans_verified_on_other_models(build: Callable[[], tuple[torch.nn.Module, Any, str]], cut: int) -> None:
    """As for the GPT above: a budget that micro-batch 1 exceeds by a ``cut``-th of its saved
    activations, so that only checkpointing fits it; the plan, applied through its emitted code and run
    for real, saves what it said to the byte, recomputes the FLOPs it said (FlopCounterMode, backward
    with the plan minus without), and peaks within 1% of the simulated step. (The U-Net's plan runs at
    micro-batch 3: at B=1 its convolution's backward takes another oneDNN algorithm with more
    workspace than at B=2 or 3, which the planner's fit must not read as memory that stops growing.
    The HF model runs without its key/value cache, as fxmem traces it, which checkpointing needs:
    a cache filled in the forward makes the recomputation differ.)"""
    model, inputs, loss = build()
    report = fxmem.analyze(model, inputs, loss=loss, batch=1, target="cpu")
    memory = report.step_bytes(1) - report.activation_bytes(1) // cut
    best = plan(model, inputs, loss=loss, target="cpu", memory=memory, allow=["batch", "checkpoint"]).best
    assert best is not None and best.config.checkpoint is not None and best.total <= memory
    proof = verify(best, model, inputs, loss=loss)
    assert proof.measured_saved == best.config.checkpoint.saved_at_batch
    assert abs(proof.measured_peak - best.peak) <= best.peak // 100, (proof.measured_peak, best.peak)
    real = measure_plan(model, inputs, best.config.checkpoint, loss=loss)
    assert real.recompute_flops == best.config.checkpoint.recompute_flops


def test_sharded_plan_verified_on_real_ranks() -> None:
    """Memory halfway between one GPU's step at micro-batch 1 and one FSDP2 rank's: only sharding fits
    (plain data parallel holds the whole state). verify runs the plan as two real gloo processes; each
    rank's peak lies within the bound tests/test_parallel.py holds FSDP2 ranks to (``assert_rank_peaks``:
    none below the plan by more than 1%, none above it by more than one block's gathered weights)."""
    model, inputs = _gpt()
    one = fxmem.analyze(model, inputs, loss=LOSS, batch=1, target="cpu")
    rank = fxmem.analyze(model, inputs, loss=LOSS, batch=1, target="cpu", fsdp=2)
    memory = (one.step_bytes(1) + rank.step_bytes(1)) // 2
    found = plan(model, inputs, loss=LOSS, target="cpu", gpus=2, memory=memory, global_batch=2, allow=["batch", "shard"])
    best = found.best
    assert best is not None and best.config.fsdp == 2 and [c.config.fsdp for c in found.fitting] == [2]
    assert best.peak == rank.peak(1).bytes
    proof = verify(best, model, inputs, loss=LOSS)
    assert len(proof.ranks) == 2 and proof.measured_peak == max(r.peak for r in proof.ranks)
    unit = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    assert_rank_peaks([r.peak for r in proof.ranks], best.peak, unit)


def test_checkpointing_under_fsdp2_verified_on_real_ranks(long_gpt: tuple[torch.nn.Module, list[str], fxmem.Report]) -> None:
    """Two GPUs, a budget a third of the saved activations below one FSDP2 rank's step at micro-batch 1:
    the planner checkpoints under FSDP2 too (the chooser's budget is in the activations, which FSDP2
    does not divide). Each real rank applies the plan itself before ``fully_shard``, as the emitted
    code does: its saved bytes are the plan's, and each rank's peak lies within ``assert_rank_peaks``'s
    bound (seen here: rank 0 199,936 B above the plan, one block's fp32 weights)."""
    model, inputs, _ = long_gpt
    rank = fxmem.analyze(model, inputs, loss=LOSS, batch=1, target="cpu", fsdp=2)
    memory = rank.step_bytes(1) - rank.activation_bytes(1) // 3
    found = plan(model, inputs, loss=LOSS, target="cpu", gpus=2, memory=memory, allow=["batch", "shard", "checkpoint"])
    sharded = next(c for c in found.fitting if c.config.fsdp == 2)
    assert sharded.config.checkpoint is not None and sharded.total <= memory
    proof = verify(sharded, model, inputs, loss=LOSS)
    assert [r.saved for r in proof.ranks] == [sharded.config.checkpoint.saved_at_batch] * 2
    unit = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    assert_rank_peaks([r.peak for r in proof.ranks], sharded.peak, unit)


def test_precision_lever_verified(long_gpt: tuple[torch.nn.Module, list[str], fxmem.Report]) -> None:
    """A budget halfway between micro-batch 1's step in bf16 autocast and in fp32: only autocast fits
    (with torch's default AdamW; the fused one is ruled out unsimulated, since the default fits and
    its next batch peaks outside the optimizer step). It, run for real on the CPU under autocast,
    peaks within 1% of its simulated step."""
    model, inputs, full = long_gpt
    amp = fxmem.analyze(model, inputs, loss=LOSS, batch=1, target="cpu", amp="bf16")
    memory = (amp.step_bytes(1) + full.step_bytes(1)) // 2
    found = plan(model, inputs, loss=LOSS, target="cpu", memory=memory, allow=["batch", "precision", "optimizer-impl"])
    assert {c.config.precision for c in found.fitting} == {"amp"} and len(found.fitting) == 1
    for candidate in found.fitting:
        proof = verify(candidate, model, inputs, loss=LOSS)
        assert abs(proof.measured_peak - candidate.peak) <= 0.01 * candidate.peak, (
            candidate.config.describe(),
            proof.measured_peak,
            candidate.peak,
        )


@pytest.mark.parametrize(("lever", "config"), [("optimizer-impl", "fp32, adamw, fused"), ("optimizer", "fp32, adafactor")])
def test_optimizer_levers_verified(lever: str, config: str) -> None:
    """The GPT test config peaks in AdamW's step at micro-batch 1 (its state outweighs its activations).
    A budget halfway between that step and the lever's own (torch's fused AdamW, which makes no
    per-parameter temporaries; Adafactor, which keeps factored moments) leaves the lever's setting the
    only fit, and its real step on the CPU peaks within 1% of the simulated one."""
    model, inputs = _gpt()
    default = fxmem.analyze(model, inputs, loss=LOSS, batch=1, target="cpu")
    assert default.peak(1).phase.value == "optimizer step"
    option = {"optimizer_impl": "fused"} if lever == "optimizer-impl" else {"optimizer": "adafactor"}
    alone = fxmem.analyze(model, inputs, loss=LOSS, batch=1, target="cpu", **option)  # type: ignore[arg-type]
    memory = (alone.step_bytes(1) + default.step_bytes(1)) // 2
    found = plan(model, inputs, loss=LOSS, target="cpu", memory=memory, global_batch=1, allow=["batch", lever])
    names = [c.config.describe() for c in found.fitting]
    assert config in names and "fp32, adamw" not in names  # SGD with momentum, the leanest, fits too where the optimizer may change
    chosen = found.fitting[names.index(config)]
    proof = verify(chosen, model, inputs, loss=LOSS)
    assert abs(proof.measured_peak - chosen.peak) <= 0.01 * chosen.peak


def test_nothing_fits_names_the_closest_and_its_shortfall(long_gpt: tuple[torch.nn.Module, list[str], fxmem.Report]) -> None:
    model, inputs, report = long_gpt
    memory = report.peak(1).state  # not even the state beside anything else
    found = plan(model, inputs, loss=LOSS, target="cpu", memory=memory, allow=["batch"])
    assert found.best is None and found.closest is not None and found.closest.micro_batch == 1
    short = found.closest.total - memory  # the closest's total at B=1 over the memory
    from fxmem.output.render import format_bytes

    assert f"{format_bytes(short)} short" in found.verdict() and "shard the state over more processes (--gpus)" in found.verdict()


def test_several_gpus_try_fsdp2_and_fsdp2_by_tensor_parallel() -> None:
    """On 4 GPUs the zoo GPT (which carries a tensor-parallel plan) is tried as plain data parallel,
    FSDP2 over 4, and FSDP2 over 2 x tensor parallel over 2; FSDP2 holds a quarter of the state."""
    model, inputs = _gpt()
    found = plan(model, inputs, loss=LOSS, gpus=4, memory=2 * 2**30, global_batch=64, allow=["batch", "shard"])
    layouts = {(c.config.fsdp, c.config.tp, c.config.data_parallel): c for c in found.fitting}
    assert set(layouts) == {(1, 1, 4), (4, 1, 4), (2, 2, 2)}
    assert layouts[(4, 1, 4)].state < layouts[(1, 1, 4)].state
    assert all(c.global_batch == 64 for c in found.fitting)
    code = emit_plan(found, layouts[(2, 2, 2)])
    assert 'parallelize_module(model, mesh["tp"]' in code and 'fully_shard(model, mesh=mesh["dp"]' in code
    compile(code, "plan.py", "exec")


def test_cli_plan_emits_runnable_code_and_verifies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``fxmem plan --emit`` writes a file that, run on the real model, applies the plan and takes a
    training step; ``--verify`` measures the best configuration on the CPU."""
    emitted = tmp_path / "plan.py"
    args = ["plan", "zoo:gpt2-small:test", "--target", "cpu", "--memory", "4MiB", "--global-batch", "8", "--emit", str(emitted), "--verify"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Verified: peak" in out and "(+0.00%)" in out
    code = runpy.run_path(str(emitted))
    model, _ = _gpt()
    model = code["apply_plan"](model)
    optimizer = code["make_optimizer"](model)
    batch = [(torch.randint(0, 101, (code["MICRO_BATCH"], 16)), torch.randint(0, 101, (code["MICRO_BATCH"], 16)))] * code["ACCUMULATION"]
    loss_fn = lambda logits, target: torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
    with contextlib.nullcontext():
        code["train_step"](model, optimizer, batch, loss_fn)


def test_bad_requests_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, inputs = _gpt()
    with pytest.raises(InputSpecError, match="--allow 'wings' is not a lever"):
        plan(model, inputs, allow=["wings"])
    with pytest.raises(InputSpecError, match=r"needs the memory to fit in \(--memory SIZE\)"):
        plan(model, inputs, target="cpu")
    assert main(["plan", "zoo:gpt2-small:test", "--verify"]) == 2
    emitted = str(tmp_path / "plan.py")
    argv = [
        "plan",
        "zoo:gpt2-small:test",
        "--target",
        "cpu",
        "--memory",
        "4MiB",
        "--optimizer",
        "lion",
        "--emit",
        emitted,
        "--allow",
        "batch",
    ]
    assert main(argv) == 2
    assert "optimizer 'lion' has none fxmem knows" in capsys.readouterr().err


def test_the_torchtitan_recipe_is_a_candidate_and_never_beats_the_best() -> None:
    """On 2 GPUs of a cuda target the zoo GPT's plan carries torchtitan's Llama 3 recipe (FSDP2 with
    bf16 weights and fp32 reduction, every block per-op checkpointed, fused AdamW, local batch 1)
    ranked beside the search's own configurations: the best is at least as fast by the same roofline.
    The GPT test config's linears have biases (aten.addmm, not in torchtitan's save list), so the
    recipe keeps no op's output and recomputes each block's forward: FLOPs recomputed > 0."""
    from fxmem.planner.search import TORCHTITAN

    model, inputs = _gpt()
    found = plan(model, inputs, loss=LOSS, gpus=2, allow=["batch", "precision", "shard"])
    recipe = next(c for c in found.fitting if c.recipe == TORCHTITAN)
    assert recipe.micro_batch == 1 and recipe.config.fsdp == 2 and recipe.config.precision == "mixed"
    assert recipe.config.optimizer_impl == "fused" and recipe.recompute_flops > 0
    assert found.best is not None and found.best.samples_per_second >= recipe.samples_per_second
    assert any(e.config == TORCHTITAN and e.outcome == "fits" for e in found.evaluated)


def test_plan_as_json_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    """``fxmem plan --format json`` prints one JSON object whose best candidate is the table's."""
    import json

    from fxmem.cli import main

    assert main(["plan", "zoo:gpt2-small:test", "--target", "cpu", "--memory", "64MiB", "--allow", "batch", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["best"]["micro_batch"] >= 1 and data["verdict"].startswith("Best: ")


def test_optimizer_implementations_are_offered_where_the_optimizer_has_them() -> None:
    """Adafactor and 8-bit Adam have no fused kernel (fxmem/rules/optimizers.py): with both levers
    allowed the search offers fused only to AdamW, and no configuration fails for it."""
    model, inputs = _gpt()
    found = plan(model, inputs, loss=LOSS, target="cpu", memory=64 * 2**20, allow=["batch", "optimizer-impl", "optimizer"])
    considered = [e.config for e in found.evaluated]
    assert "fp32, adamw, fused" in considered and not any(c.startswith("fp32, adafactor, fused") for c in considered)
    assert not found.skipped and found.best is not None


def test_compile_lever_plans_what_a_real_compiled_step_holds() -> None:
    """``--allow batch,compile`` on the CPU: a configuration under torch.compile (default budget and
    0.5) is ranked beside eager, its micro-batch from the compiled step's own largest batch; the best
    compiled one, applied to the real model and compiled for real, stays within 2% of its predicted
    peak and under the budget."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 10))
    p = plan(model, ["B,64"], loss="mse", optimizer="sgd", target="cpu", memory=3 * 2**20, allow=["batch", "compile"], max_micro_batch=512)
    compiled = [c for c in p.fitting if c.config.compile]
    assert {c.config.budget for c in compiled} == {1.0, 0.5}
    best = compiled[0]
    proof = verify(best, model, ["B,64"], loss="mse")
    assert proof.measured_peak <= p.memory
    assert abs(best.peak - proof.measured_peak) <= 0.02 * proof.measured_peak, (best.peak, proof.measured_peak)
    assert "model = torch.compile(model)" in emit_plan(p, best)
