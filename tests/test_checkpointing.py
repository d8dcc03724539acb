"""Activation checkpointing (fxmem/frontends/checkpointing.py): what a checkpointed step keeps, and its peak.

Each model below checkpoints in one of the ways users write it; each is analyzed on fake tensors and
compared with a real CPU run of the model itself (eager, no fx): its saved bytes exactly, its step's
peak within 1% and in the same phase, as tests/test_peak_zoo.py holds the zoo to.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
)

import fxmem
from fxmem.errors import TraceError
from fxmem.measure import measure, measure_peak
from fxmem.results import Category, Phase
from fxmem.symbolic import ByteExpr

D, T = 32, 8  # width and tokens: every block's input is (B, 8, 32) float32, 1 KiB per sample
INPUTS = [f"B,{T},{D}"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.f(x)


class PerBlock(nn.Module):
    """Four blocks, each under its own checkpoint (non-reentrant unless ``reentrant``), then a head."""

    def __init__(self, checkpointed: bool = True, reentrant: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(D, D)  # so that the first checkpoint's input requires grad, as reentrant needs
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(D, 10)
        self.checkpointed, self.reentrant = checkpointed, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant) if self.checkpointed else block(x)
        return self.head(x)


class Sequential(nn.Module):
    """``checkpoint_sequential`` over four blocks in two segments (the last segment runs plainly)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*(Block() for _ in range(4)))
        self.head = nn.Linear(D, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint_sequential(self.body, 2, x, use_reentrant=False))


class Nested(nn.Module):
    """Attention whose MLP is checkpointed inside a checkpointed block that also reads a tensor from
    its closure and takes a keyword argument; dropout inside (its noise is recomputed, so the
    checkpoint keeps the CPU generator's state) and after."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out, self.norm, self.mlp = nn.Linear(D, 3 * D), nn.Linear(D, D), nn.LayerNorm(D), Block()

    def attend(self, x: torch.Tensor, *, scale: float) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).unflatten(-1, (3, 4, -1)).permute(2, 0, 3, 1, 4).unbind(0)
        weights = F.dropout(torch.softmax(q @ k.transpose(-1, -2) * scale, -1), 0.1)
        y = self.out((weights @ v).transpose(1, 2).flatten(2))
        return x + checkpoint(self.mlp, y, use_reentrant=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shift = x.mean(-1, keepdim=True)
        y = checkpoint(lambda t, scale: self.attend(t, scale=scale) + shift, x, use_reentrant=False, scale=0.25)
        return F.dropout(y, 0.1)


class SaveMatmuls:
    """A selective-checkpoint policy written by hand: keep every mm and addmm output, recompute the rest.

    With ``kept`` it also collects, in forward, the outputs it tells torch to keep (``ctx.op_output``):
    what a real run holds for backward outside any saved-tensor hook, counted without reading torch's cache.
    """

    def __init__(self, kept: list[torch.Tensor] | None = None) -> None:
        self.kept = kept

    def __call__(self, ctx: SelectiveCheckpointContext, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        if op not in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if self.kept is not None and not ctx.is_recompute:
            self.kept.append(ctx.op_output)
        return CheckpointPolicy.MUST_SAVE


class Selective(PerBlock):
    """Selective activation checkpointing: each block keeps its matmuls' outputs, recomputes the rest.
    Those outputs live in the checkpoint's own cache, not in saved tensors, until backward: they count as
    saved by the linear that made them, and in the peak (Note [What a selective checkpoint keeps])."""

    def __init__(self, policy: SaveMatmuls | None = None) -> None:
        super().__init__()
        self.policy = policy or SaveMatmuls()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        context = functools.partial(create_selective_checkpoint_contexts, self.policy)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False, context_fn=context)
        return self.head(x)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "per-block": PerBlock,
    "reentrant": lambda: PerBlock(reentrant=True),
    "sequential": Sequential,
    "nested": Nested,
    "selective": Selective,
}


def _analyze(make: Callable[[], nn.Module], frontend: str = "auto") -> fxmem.Report:
    with torch.device("meta"):
        model = make()
    return fxmem.analyze(model, INPUTS, target="cpu", batch=3, frontend=frontend)


def test_a_checkpoint_keeps_its_inputs_and_nothing_it_computes() -> None:
    # Checkpointed, each block keeps only its input, 1 KiB per sample (8 x 32 x 4 B): the inputs of the
    # four blocks (the embedding's output, then three block outputs), plus the head's input (the last
    # block's output) and the embedding's own input (the batch itself, counted as input, not here).
    assert _analyze(PerBlock).activations == ByteExpr(per_sample=5 * T * D * 4)
    # Without checkpoints each block keeps its input, the GELU's input and the second linear's input,
    # the last two (B, 8, 128): 1 + 4 + 4 KiB per sample; four blocks and the head's 1 KiB: 37 KiB.
    assert _analyze(lambda: PerBlock(checkpointed=False)).activations == ByteExpr(per_sample=(4 * 9 + 1) * 1024)


# (model, frontend): every model through torch.fx; through torch.export, those with one level of
# non-reentrant checkpoints (export cannot give back the others, and fxmem refuses them: see below)
CASES = [(name, "fx") for name in MODELS] + [(name, "export") for name in ("per-block", "sequential", "selective")]
IDS = [f"{name}-{frontend}" for name, frontend in CASES]
PLAIN = [(name, frontend) for name, frontend in CASES if name != "selective"]
"""The cases whose real run keeps nothing outside saved tensors: fxmem.measure's eager total sees it all
(the selective ones are compared with a count of their own below)."""


@pytest.mark.parametrize(("name", "frontend"), PLAIN, ids=[f"{name}-{frontend}" for name, frontend in PLAIN])
def test_saved_bytes_equal_a_real_run(name: str, frontend: str) -> None:
    report = _analyze(MODELS[name], frontend)
    assert report.frontend == frontend and report.checkpointed > 0
    for batch in (1, 3):
        torch.manual_seed(0)
        assert report.activation_bytes(batch) == measure(MODELS[name](), INPUTS, batch=batch).total


@pytest.mark.parametrize("first_step", [True, False], ids=["first", "steady"])
@pytest.mark.parametrize(("name", "frontend"), CASES, ids=IDS)
def test_the_step_peak_matches_the_profiler(name: str, frontend: str, first_step: bool) -> None:
    # The peak falls in backward, where the checkpoint recomputes its region: the prediction sees
    # that recomputation because torch's own checkpoint runs it on the fake tensors.
    report = _analyze(MODELS[name], frontend)
    for batch in (1, 4):
        torch.manual_seed(0)
        measured = measure_peak(MODELS[name](), INPUTS, batch, first_step=first_step)
        predicted = report.peak(batch, first_step=first_step)
        error = (predicted.bytes - measured.bytes) / measured.bytes
        assert abs(error) <= 0.01, f"{name} B={batch}: predicted {predicted.bytes}, measured {measured.bytes} ({error:+.2%})"
        assert predicted.phase == measured.phase


def _saved_by_selective(batch: int) -> int:
    """Bytes a real eager Selective forward and "sum" loss keep for backward: the distinct storages of what
    the saved-tensor hooks see and of what the policy told torch to keep, less weights and the batch."""
    held: list[torch.Tensor] = []
    torch.manual_seed(0)
    model = Selective(SaveMatmuls(held))
    x = torch.randn(batch, T, D)

    def pack(t: torch.Tensor) -> torch.Tensor:
        held.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum()
    left_out = {StorageWeakRef(t.untyped_storage()) for t in [*model.parameters(), x]}
    sizes = {StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes() for t in held}
    return sum(n for key, n in sizes.items() if key not in left_out)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_selective_checkpoint_keeps_what_its_policy_saves(frontend: str) -> None:
    # Each block's two linears run as addmm on (8B, 32) x (32, 128) and (8B, 128) x (128, 32); the policy
    # keeps both outputs, 8 x (128 + 32) x 4 B = 5 KiB per sample, charged to the linear that made it,
    # on top of the 5 KiB per sample of checkpoint inputs seen before (test above): 4 x 5 + 5 KiB.
    report = _analyze(Selective, frontend)
    assert report.activations == ByteExpr(per_sample=(4 * 5 + 5) * 1024)
    first, second = ("blocks_0_f_0", "blocks_0_f_2") if frontend == "fx" else ("linear_1", "linear_2")
    assert [report.node_bytes(2)[n] for n in (first, second)] == [2 * T * 4 * D * 4, 2 * T * D * 4]


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_selective_saved_bytes_equal_a_real_run(frontend: str) -> None:
    # Against the model run eagerly (_saved_by_selective), and node by node against fxmem's recorder
    # run on real CPU tensors over the same graph (measure's per-node split).
    report = _analyze(Selective, frontend)
    for batch in (1, 3):
        real = measure(Selective(), INPUTS, batch=batch, frontend=frontend)
        assert report.activation_bytes(batch) == _saved_by_selective(batch) == real.graph_total
        assert {n: b for n, b in report.node_bytes(batch).items() if b} == {n: b for n, b in real.nodes.items() if b}


def test_measure_eager_total_counts_the_selective_cache() -> None:
    # The eager total (no fx) watches each checkpoint call's caching mode (selective_caches in
    # fxmem/engine/recompute.py); the policy's own record of what it kept is the independent count.
    assert measure(Selective(), INPUTS, batch=3).total == _saved_by_selective(3)


def test_a_chosen_plan_is_counted_as_the_plan_measures_it() -> None:
    # The checkpointing plan fxmem.planner chooses for the zoo GPT at B=4 keeps matmul outputs in both
    # blocks (tests/test_plan_checkpoint.py); applied by its own emitted code, its saved bytes must be
    # those that measure_plan counts in a real step (hooks and the policy's cache).
    from fxmem.planner import compile_plan, measure_plan, plan_checkpointing
    from models_zoo import gpt2_small

    spec = gpt2_small.build(test=True)
    plan = plan_checkpointing(spec.model, spec.inputs, ["blocks.0", "blocks.1"], budget=120_000, batch=4, loss=spec.loss)
    assert any(b.kept for b in plan.blocks)
    model = compile_plan(plan)(copy.deepcopy(spec.model))
    report = fxmem.analyze(model, spec.inputs, loss=spec.loss, target="cpu", batch=4, peak=False)
    assert report.checkpointed == 2
    assert report.activation_bytes(4) == measure_plan(spec.model, spec.inputs, plan, loss=spec.loss).saved


def test_backward_recomputes_the_region() -> None:
    # GELU's forward op runs again in backward, once per checkpointed block, and only there; what it
    # makes is charged to the GELU node it recomputes, not to the gradient that asked for it.
    events = _analyze(PerBlock).timeline(2, first_step=True).events
    recomputed = [e for e in events if e.alloc and e.phase == Phase.BACKWARD and e.op == "aten.gelu (recomputed)"]
    assert [e.fqn for e in recomputed] == [f"blocks.{i}.f.1" for i in (3, 2, 1, 0)]
    plain = _analyze(lambda: PerBlock(checkpointed=False)).timeline(2, first_step=True).events
    assert not [e for e in plain if e.alloc and e.phase == Phase.BACKWARD and e.op in ("aten.gelu", "aten.gelu (recomputed)")]


def test_the_report_says_how_many_regions_it_ran() -> None:
    report = _analyze(Nested)
    assert "2 checkpointed regions" in str(report).splitlines()[0]
    assert report.to_dict()["checkpointed_regions"] == 2


@pytest.mark.parametrize("name", ["reentrant", "nested"])
def test_export_refuses_checkpoints_it_cannot_give_back(name: str) -> None:
    # A reentrant checkpoint is an autograd.Function whose forward runs under no_grad, and a nested one
    # comes out of export wrapped in a grad-mode submodule: neither region survives in the graph.
    with torch.device("meta"):
        model = MODELS[name]()
    with pytest.raises(TraceError, match=r"calls torch\.utils\.checkpoint in a way .* use_reentrant=False"):
        fxmem.analyze(model, INPUTS, target="cpu", frontend="export", peak=False)


def test_hugging_face_gradient_checkpointing() -> None:
    # transformers' own switch (non-reentrant checkpoints around each decoder layer, its other inputs
    # bound into the function), through torch.export: saved bytes equal, peak within 1%, against eager.
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=97, max_position_embeddings=64,
    )  # fmt: skip

    def build() -> nn.Module:
        model = transformers.LlamaForCausalLM(config)
        model.activation_checkpointing_enable()
        return model

    inputs = {"input_ids": "B,16:int64", "labels": "B,16:int64"}
    with torch.device("meta"):
        model = build()
    report = fxmem.analyze(model, inputs, loss="auto", target="cpu", batch=3)
    assert report.frontend == "export" and report.checkpointed == 2
    for batch in (1, 3):
        torch.manual_seed(0)
        # activation_bytes, not the line activations.at(): at B=1 the shifted labels' padded storage is
        # 17 int64 (136 B), where the line a*B + c from B >= 2 says 128 B; fxmem's own B=1 pass has it.
        assert report.activation_bytes(batch) == measure(build(), inputs, batch=batch, loss="auto").total
        torch.manual_seed(0)
        measured = measure_peak(build(), inputs, batch, loss="auto")
        assert abs(report.peak(batch).bytes - measured.bytes) <= 0.01 * measured.bytes
        assert report.peak(batch).phase == measured.phase


def test_a_model_file_imports_its_neighbours(tmp_path: Path) -> None:
    # As `python file.py` would: the file's folder comes first on sys.path, so a sibling module imports.
    (tmp_path / "blocks_for_fxmem_test.py").write_text("import torch.nn as nn\nWIDTH = 5\n")
    (tmp_path / "model.py").write_text("import blocks_for_fxmem_test as b\nimport torch.nn as nn\ndef build():\n    return nn.Linear(b.WIDTH, 2)\n")
    spec = fxmem.load_model(f"{tmp_path / 'model.py'}:build")
    assert spec.model.in_features == 5


@pytest.mark.usefixtures("at_repo_root")
def test_the_readme_example() -> None:
    # docs/examples/checkpointed.py: four checkpointed blocks on (B, 64, 256) float32, 64 KiB per sample
    # per block input. Kept: the inputs of blocks 1-3 and the head's (block 0's is the batch): 256 KiB.
    spec = fxmem.load_model("docs/examples/checkpointed.py:build")
    report = fxmem.analyze(spec.model, ["B,64,256"], target="cpu", peak=False)
    assert report.activations == ByteExpr(per_sample=4 * 64 * 256 * 4)


def test_on_the_cuda_target_backward_recomputes_with_cuda_kernels() -> None:
    # The dropout after the checkpoint keeps CUDA's 1-byte mask, 8 x 32 = 256 B per sample (the CPU keeps
    # 4-byte noise, 1 KiB). Inside the region the recomputation must run the same kernels as the forward
    # (native_dropout, not the CPU's): checkpoint compares what both saved and raises CheckpointError if
    # they differ, which the simulated step would report as a failed backward().
    with torch.device("meta"):
        model = Nested()
    report = fxmem.analyze(model, INPUTS, target="cuda", batch=4)
    assert report.activations == ByteExpr(per_sample=T * D)
    assert report.peak(4).phase == Phase.BACKWARD


def test_an_hf_spec_checkpoints_every_layer_when_asked(tmp_path: Path) -> None:
    # --checkpoint (load_model(checkpoint=True)) turns on transformers' own switch on an hf: spec: one
    # region per decoder layer, and the saved bytes a real checkpointed run keeps.
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        num_hidden_layers=3, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=97, max_position_embeddings=64,
    )  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path)
    name = f"hf:{tmp_path / 'config.json'}"
    spec = fxmem.load_model(name, seq_len=16, checkpoint=True)
    report = fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, target="cpu", peak=False)
    assert report.checkpointed == 3
    torch.manual_seed(0)
    real = fxmem.load_model(name, seq_len=16, checkpoint=True, meta=False).model
    assert report.activation_bytes(2) == measure(real, spec.inputs, batch=2, loss=spec.loss).total
    plain = fxmem.load_model(name, seq_len=16)
    assert report.activations.at(2) < fxmem.analyze(plain.model, plain.inputs, loss=plain.loss, target="cpu", peak=False).activations.at(2)


def test_what_a_selective_checkpoint_keeps_is_an_activation_in_the_step() -> None:
    # Every storage the forward allocates and backward needs is an activation in the step's timeline,
    # kept by autograd or by the policy's cache alike: those allocated in forward sum to the saved bytes
    # and the model's output (which the caller holds through the step, an activation too).
    report = fxmem.analyze(Selective(), INPUTS, batch=3, target="cpu")
    timeline = report.timeline(3)
    kept = sum(e.nbytes.at(3) for e in timeline.events if e.alloc and e.phase == Phase.FORWARD and e.category == Category.ACTIVATION)
    output = Selective()(torch.zeros(3, T, D)).numel() * 4  # float32
    assert kept == report.activation_bytes(3) + output == _saved_by_selective(3) + output
