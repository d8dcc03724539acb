"""fxmem's checkpointing plan against checkpointing every block, torchtitan's per-op recipe and torch's own SAC ILP, with times.

For each model (the zoo's GPT, a larger GPT, a Hugging Face Llama and a ViT), at three budgets for the
activations saved for backward (between "everything fits" and "the least any checkpointing keeps"),
this runs in one process:

- fxmem: ``plan_checkpointing(model, inputs, blocks, budget=...)``, the chosen policy applied by its own
  emitted code (``compile_plan``) to the real model;
- every block: each block checkpointed with nothing kept (a selective-checkpoint policy that recomputes
  every op, which keeps what ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` keeps: the
  block's inputs);
- torchtitan's per-op recipe: ``fxmem.planner.recipes.op_sac_plan(..., target="cpu")``, every block
  keeping the outputs of the ops on torchtitan's save list (every other ``aten.mm``, attention) and
  recomputing the rest (Note [torchtitan's per-op policy] in fxmem/planner/recipes.py). It has no
  budget: it is run once per model, and each row says whether it fits that row's budget;
- SAC ILP: torch's own pipeline, ``torch.distributed._tools``: ``MemTracker``, ``RuntimeEstimator`` and
  ``SACEstimator`` on a fake copy of the model, ``aggregate_stats`` -> ``parse_module_info`` ->
  ``sac_milp`` (which blocks to checkpoint and what share of their memory to discard) and, per chosen
  block, ``get_optimal_checkpointing_policy_per_module`` (which ops to save); the ops it saves are
  applied as a selective-checkpoint policy.

All four are then measured the same way, by ``fxmem.planner.measure_plan``: one real forward, loss and
backward on the CPU, counting the distinct storages saved for backward or cached by the policy, and the
FLOPs backward recomputes (``FlopCounterMode``: backward with checkpointing minus backward without).
Each chooser is timed in the same run, its measurement left out: ``plan_checkpointing`` per budget,
the ILP's solve per cut (``sac_milp`` and the per-module policies; its stats are collected once per
model and timed apart), ``op_sac_plan`` once per model. One markdown table per model, lines under it
comparing fxmem's choice with the recipe at each budget, and a last line saying whether fxmem's choice
stays under the budget and recomputes no more FLOPs than every block checkpointed and than the ILP's
choice, on every row, and how it compares with the recipe (where the recipe fits: FLOPs; where it does
not: whether fxmem's choice does).

Before the tables, the timing targets: benchmarks/plan_speed.py's cases (``plan_speed.time_case``:
``fxmem.planner.search.plan`` on Llama-3.1-8B on 8 x H100, gpt-7b on one, a 70B-class GPT on 64; targets
60 s, 10 s, 120 s), each with its wall time, its ratio to the target and whether it met it. They run
first, so that nothing the tables leave in the process is paid for in them.

    pip install pulp pwlf          # sac_ilp imports pulp (its CBC solver); aggregate_stats fits with pwlf (and scipy)
    python benchmarks/plan.py      # on 2 CPU cores: about 3 minutes of timing targets, then 3 to 5 of tables
    python benchmarks/plan.py --skip-speed --only 0   # one model's table (an index into CASES), no timings
    python benchmarks/plan.py --only-speed 1          # the timing targets only: all, or these indices into plan_speed.CASES

Measured on 2 cores: the zoo's GPT's table in 16 s, the ViT's in 50 s (most of either measuring the ILP's
choices); plan_speed.py's own docstring gives its 3 minutes.

fxmem's and the recipe's columns are the same on every run (the seconds aside). The ILP's can differ a
little between runs (seen once: a block keeping 16 ops instead of 19 at the same share discarded);
torch's solvers stop within 5% of the optimum or at a time limit (``PULP_CBC_CMD(gapRel=0.05,
timeLimit=...)`` in sac_ilp.py), the likely cause.

Note [Attention's FLOPs on the CPU]
    ``FlopCounterMode`` has formulas for the CUDA SDPA kernels but none for the CPU's
    ``aten._scaled_dot_product_flash_attention_for_cpu`` (torch 2.13's ``flop_registry``), so attention
    counts 0 FLOPs here, rerun or not: the recipe keeping attention's output lowers no FLOPs in these
    tables, and no chooser gains or loses FLOPs by recomputing attention. fxmem's predictions count with the
    same formulas, so they agree with the measurement here too. The bytes are counted in full.

Note [Running torch's SAC tools on the CPU]
    ``RuntimeEstimator`` and ``SACEstimator`` time ops by a roofline model or by benchmarking, and both
    need CUDA ("Roofline estimation needs to access CUDA capabilities to make estimations",
    runtime_estimator.py ``_roofline_estimate``). Here each op's "runtime" is its FLOPs by
    ``torch.utils.flop_counter.flop_registry`` (in MFLOP), so the ILP minimizes the quantity the
    table reports, recomputed FLOPs, and no GPU is needed. ``get_optimal_checkpointing_policy_per_module``
    (torch 2.13) fails with ``TypeError: type NoneType doesn't define __round__ method`` when some op
    costs 0 in both memory and runtime and no constraint names it: pulp leaves that variable out of the
    model, so its ``varValue`` is None. When it fails so, it is called again with one FLOP added to each
    op's runtime, which changes no choice that costs FLOPs; the table says where that happened. The
    ILP's choice is applied as fxmem's own plans are (a ``CheckpointPlan`` naming the ops kept, run by
    ``measure_plan``): torch offers no function that turns the per-op decisions into a policy.

Note [One budget for both]
    fxmem's budget bounds the bytes saved for backward. ``sac_milp``'s bounds its model of the step's
    peak (parameters, gradients, activations and their gradients, in GiB), in which a checkpointed
    block's activations are back while its own backward runs: checkpointing the last block lowers the
    end of forward but not that block's backward, so the ILP sees little use in it. Both are first
    asked to remove the same bytes ("same cut"): the ILP's budget is its own peak without checkpointing
    (``get_peak_memory_runtime_baseline``) less (saved without checkpointing - fxmem's budget). Whether
    its choice then fits fxmem's budget is measured, not assumed; "(over)" marks a choice that does not.

Note [The ILP tuned to the budget]
    As the same cut can leave the ILP's choice over fxmem's budget (or be infeasible in its model),
    the ILP is also asked for other cuts (``GRID`` times fxmem's), then bisected (``REFINE`` steps)
    between the largest cut whose measured choice does not fit and the smallest that does. "ILP
    fitted" is, of all the choices tried that fit the budget when measured, the one that recomputes
    the fewest FLOPs: the ILP's best answer to fxmem's question, found with the real step as oracle.
    The claim is checked against it; where no choice fits, the row says so and is checked only
    against the budget and against every block.

Note [Modules without a backward]
    Two things in a Hugging Face Llama stop ``aggregate_stats`` (torch 2.13): its rotary embedding
    runs under ``no_grad``, so MemTracker takes no backward snapshot of it (``KeyError:
    <_ModState.PRE_BW: 'Pre-Backward'>``); and the ``kernels`` package wraps ``apply_rotary_pos_emb``
    in an unregistered module, which ModTracker names ``Func`` in the module orders but which
    ``model.modules()`` does not list (``parse_module_info``'s bare ``AssertionError``). A module
    without a backward is given its end-of-forward snapshot as its backward ones (it holds no
    gradients), and unregistered modules are left out of the orders (their ops stay with their parents).

Note [The eager path on fake tensors]
    Under fake tensors transformers' ``find_packed_sequence_indices`` cannot read the position ids and
    reports packed sequences, so the causal mask is materialized and SDPA gets ``repeat_kv``'s copies
    of k and v: 9 more ops per Llama layer than the real step runs, which would shift the ops the
    per-module ILP names. fxmem's ``eager_code_paths`` (fxmem/frontends/hf_paths.py) makes the fake
    step take the eager path, so the estimator sees the ops the real step runs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import flop_registry

from fxmem.engine.losses import get_loss
from fxmem.frontends.hf_paths import eager_code_paths
from fxmem.inputs import InputSpecs, make_input, parse_inputs
from fxmem.planner import BlockChoice, CheckpointPlan, OpKey, PlanMeasurement, measure_plan, plan_checkpointing
from fxmem.planner.recipes import op_sac_plan
from fxmem.symbolic import ByteExpr

GIB = 2**30
FRACTIONS = (0.25, 0.5, 0.75)
"""Budgets, as fractions of the way from the least any checkpointing keeps to everything saved."""
GRID = (0.75, 1.25, 1.5, 2.0)
"""Cuts asked of the ILP besides fxmem's own, as multiples of it (Note [The ILP tuned to the budget])."""
REFINE = 3
"""Bisection steps between the largest cut tried that does not fit and the smallest that does."""


@dataclass(frozen=True)
class Case:
    """One model: how to build it (seeded; also called under FakeTensorMode), its inputs, blocks and batch."""

    name: str
    build: Callable[[], nn.Module]
    inputs: InputSpecs
    blocks: tuple[str, ...]
    batch: int
    loss: str = "lm_cross_entropy"


def _zoo_gpt_test() -> nn.Module:
    from models_zoo import gpt2_small

    return gpt2_small.build(test=True).model


def _gpt_4x128() -> nn.Module:
    from models_zoo.gpt2_small import GPT

    return GPT(512, 256, 128, 4, 4, dropout=0.0)


def _llama_4x128() -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _vit_4x128() -> nn.Module:
    from models_zoo.vit_b16 import ViT

    class FakeSafeViT(ViT):
        def reset_parameters(self) -> None:
            """The zoo's init, but for ``trunc_normal_``, which tests the values it drew (``mask.any()``: a
            ``DataDependentOutputException`` when built under FakeTensorMode for torch's tools). At
            std=0.02 its bounds of +-2 are 100 sigma away, so ``normal_`` draws the same distribution."""
            nn.init.zeros_(self.cls_token)
            nn.init.normal_(self.pos_embed, std=0.02)

    return FakeSafeViT(64, 8, 128, 4, 4, 256, 10, dropout=0.0)


CASES: tuple[Case, ...] = (
    Case("gpt2-small:test (2 x d=32, S=16, dropout 0.1)", _zoo_gpt_test, ["B,16:int64"], ("blocks.0", "blocks.1"), 4),
    Case("GPT 4 x d=128, S=256", _gpt_4x128, ["B,256:int64"], tuple(f"blocks.{i}" for i in range(4)), 4),
    Case(
        "HF Llama 4 x d=128 (4 heads, 2 kv), S=128",
        _llama_4x128,
        {"input_ids": "B,128:int64"},
        tuple(f"model.layers.{i}" for i in range(4)),
        4,
    ),
    Case(
        "ViT 4 x d=128, 64x64 images in 8x8 patches (S=65), no dropout",
        _vit_4x128,
        ["B,3,64,64"],
        tuple(f"blocks.{i}" for i in range(4)),
        4,
        loss="cross_entropy",
    ),
)


@dataclass(frozen=True)
class Ilp:
    """torch's SAC ILP asked to cut its peak by ``cut`` bytes: the blocks it checkpoints with the share of
    their memory discarded, the ops saved per block, notes, and the choice measured (None if it failed)."""

    cut: int
    discard: Mapping[str, float]
    kept: Mapping[str, tuple[OpKey, ...]]
    notes: tuple[str, ...] = ()
    failed: str = ""
    measured: PlanMeasurement | None = None
    seconds: float = 0.0
    """Wall time of the solve: ``sac_milp`` and the per-module policies (not the measurement)."""

    def fits(self, budget: int) -> bool:
        return self.measured is not None and self.measured.saved <= budget


@dataclass(frozen=True)
class Row:
    """One budget of one model: fxmem's, every block's and the ILP's choices, measured, fxmem's prediction
    for its own, and how long each chooser took (the recipe, which has no budget, is in ``CaseResult``)."""

    budget: int
    fxmem: PlanMeasurement
    fxmem_predicted: tuple[int, int]
    fxmem_seconds: float
    """Wall time of ``plan_checkpointing`` at this budget (tracing included, measurement not)."""
    every: PlanMeasurement
    same_cut: Ilp
    """The ILP asked to remove the same bytes as fxmem (Note [One budget for both])."""
    best_fit: Ilp | None
    """Of every cut tried (Note [The ILP tuned to the budget]), the choice that fits with the fewest FLOPs."""
    least: Ilp | None
    """When none fits: the choice that kept the least, to show how close the ILP came."""
    tried: int
    ilp_seconds: float
    """Wall time of all the ILP's solves at this budget (``tried`` of them), its measurements left out."""


# --- torch's SAC pipeline -----------------------------------------------------------------------------


def _flop_runtime(func: Any, args: Any, kwargs: Any) -> tuple[Any, float]:
    """An op's output and its "runtime": MFLOPs by flop_counter's formula. See Note [Running torch's SAC tools on the CPU]."""
    kwargs = kwargs or {}
    out = func(*args, **kwargs)
    formula = flop_registry.get(func._overloadpacket)
    return out, (formula(*args, **kwargs, out_val=out) / 1e6 if formula else 0.0)


@dataclass
class _TorchStats:
    """What torch's tools found on one fake step: the module graph for ``sac_milp`` and the SAC estimator."""

    graph: Any
    estimator: Any
    root: str
    no_backward: tuple[str, ...]
    """Modules given their forward-end snapshot for backward (Note [Modules without a backward])."""


def collect_torch_stats(case: Case) -> _TorchStats:
    """MemTracker, RuntimeEstimator and SACEstimator on a fake copy of the model, each over its own step, as
    torch's sac_ilp tests run them, then ``aggregate_stats`` and ``parse_module_info``."""
    from torch.distributed._tools.ilp_utils import aggregate_stats, parse_module_info
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator
    from torch.distributed._tools.sac_estimator import SACEstimator

    with FakeTensorMode():
        model, forward = _fake_step(case)
        # See Note [The eager path on fake tensors]; a no-op unless transformers is imported.
        with eager_code_paths([s.name for s in parse_inputs(case.inputs) if s.name is not None]):
            tracker = MemTracker()
            tracker.track_external(model)
            with tracker:
                forward().backward()
            runtimes = RuntimeEstimator()
            with contextlib.redirect_stdout(io.StringIO()), runtimes("operator-level-cost-model"):
                runtimes._estimate = _flop_runtime  # See Note [Running torch's SAC tools on the CPU]
                forward().backward()
            sac = SACEstimator()
            with sac("operator-level-cost-model"):
                sac._estimate_runtime = _flop_runtime
                value = forward()
            value.backward()
        filled = _fill_backward_snapshots(tracker)
        _drop_unregistered(model, runtimes)
        # pwlf fits the trade-off curves by scipy's differential_evolution, which draws from numpy's global
        # generator unless seeded: seeded here so that the ILP gets the same curves, and answers, every run.
        numpy.random.seed(0)
        info = aggregate_stats(model, tracker, runtimes, sac, torch.device("cpu"))
    return _TorchStats(parse_module_info(info), sac, type(model).__name__, filled)


def _fake_step(case: Case) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """The model built under the active FakeTensorMode, and its forward + loss on fake inputs."""
    specs, loss = parse_inputs(case.inputs), get_loss(case.loss)
    torch.manual_seed(0)
    model = case.build().train()
    values = [make_input(s, case.batch) for s in specs]
    args = [v for s, v in zip(specs, values) if s.name is None]
    kwargs = {s.name: v for s, v in zip(specs, values) if s.name is not None}

    def forward() -> torch.Tensor:
        out = loss.select(model(*args, **kwargs), case.name)
        return loss.compute(out, loss.make_target(out))

    return model, forward


def _drop_unregistered(model: nn.Module, runtimes: Any) -> None:
    """Keep in the module orders only the model's registered modules. See Note [Modules without a backward]."""
    root = type(model).__name__
    known = {f"{root}.{name}" if name else root for name, _ in model.named_modules()}
    for order in (runtimes.mod_fw_pre_order, runtimes.mod_bw_pre_order, runtimes.mod_fw_post_order, runtimes.mod_bw_post_order):
        order[:] = [fqn for fqn in order if fqn in known]


def _fill_backward_snapshots(tracker: Any) -> tuple[str, ...]:
    """Give a module that has no backward its forward-end snapshot as its backward ones. See Note [Modules without a backward]."""
    from torch.distributed._tools.mem_tracker import _ModState

    filled = []
    for stats in tracker.memory_tracking.values():
        end = stats.snapshots.get(_ModState.POST_FW)
        missing = [s for s in (_ModState.PRE_BW, _ModState.PEAK_BW, _ModState.POST_BW) if not stats.snapshots.get(s)]
        if end and missing:
            for state in missing:
                stats.snapshots[state] = [end[-1]]
            filled.append(stats.mod_fqn)
    return tuple(filled)


def solve_ilp(stats: _TorchStats, blocks: Sequence[str], cut: int) -> Ilp:
    """``sac_milp`` asked to cut its peak by ``cut`` bytes (Note [One budget for both]), then the ops each
    checkpointed block saves by ``get_optimal_checkpointing_policy_per_module``; timed."""
    start = time.perf_counter()
    ilp = _solve_ilp(stats, blocks, cut)
    return replace(ilp, seconds=time.perf_counter() - start)


def _solve_ilp(stats: _TorchStats, blocks: Sequence[str], cut: int) -> Ilp:
    from torch.distributed._tools.ilp_utils import get_peak_memory_runtime_baseline
    from torch.distributed._tools.sac_ilp import sac_milp

    peak, _ = get_peak_memory_runtime_baseline(stats.graph)
    units = [f"{stats.root}.{b}" for b in blocks]
    try:
        discard, _, ilp_peak = sac_milp(stats.graph, memory_budget=(peak - cut) / GIB, ac_units=units)
    except Exception as e:  # noqa: BLE001 - torch's ILP failing is a result to report
        return Ilp(cut, {}, {}, failed=f"sac_milp raised {type(e).__name__}: {e}")
    if ilp_peak == -1:
        return Ilp(cut, {}, {}, failed=f"sac_milp: infeasible at a peak of {peak - cut:,} B (its peak without checkpointing: {peak:,} B)")
    kept, notes = {}, []
    for fqn, share in discard.items():
        try:
            ops, note = _saved_ops(stats.estimator, fqn, share)
        except Exception as e:  # noqa: BLE001 - as above
            return Ilp(cut, {}, {}, failed=f"{fqn}: get_optimal_checkpointing_policy_per_module raised {type(e).__name__}: {e}")
        kept[fqn.removeprefix(stats.root + ".")] = ops
        notes += [note] if note else []
    return Ilp(cut, {k.removeprefix(stats.root + "."): v for k, v in discard.items()}, kept, tuple(notes))


def _saved_ops(estimator: Any, fqn: str, share: float) -> tuple[tuple[OpKey, ...], str]:
    """The ops of ``fqn`` the per-module ILP saves when ``share`` of its memory is discarded, named as a
    policy function sees them (fxmem/planner/emit.py, Note [Naming ops in a policy function])."""
    from torch.distributed._tools.sac_estimator import OPS_TO_ALWAYS_SKIP
    from torch.distributed._tools.sac_ilp import get_optimal_checkpointing_policy_per_module

    stats, keep, note = estimator.sac_mod_stats[fqn], min(1.0, max(0.0, 1.0 - share)), ""
    try:
        decisions = get_optimal_checkpointing_policy_per_module(stats, memory_budget=keep)
    except TypeError as e:  # See Note [Running torch's SAC tools on the CPU]
        note = f"{fqn}: get_optimal_checkpointing_policy_per_module raised `TypeError: {e}`; reran with +1 FLOP per op"
        stats = replace(stats, runtimes=[r + 1e-6 for r in stats.runtimes])
        decisions = get_optimal_checkpointing_policy_per_module(stats, memory_budget=keep)
    if len(decisions) != len(stats.func_names):  # it logs the solver's status and returns []
        raise RuntimeError(f"no solution at a memory budget of {keep:.4f}")
    # The estimator's own per-op records, in the order of SACStats (SACEstimator._get_sac_stats filters the same way).
    funcs = [m.func for m in estimator._sac_mod_metadata[fqn].sac_metadata if m.func not in OPS_TO_ALWAYS_SKIP]
    seen: dict[str, int] = {}
    kept = []
    for func, save in zip(funcs, decisions, strict=True):
        key = OpKey(str(func), seen.get(str(func), 0))
        seen[str(func)] = key.occurrence + 1
        kept += [key] if save else []
    return tuple(kept), note


# --- the four choices, measured ----------------------------------------------------------------------


def _hand_plan(case: Case, kept: Mapping[str, tuple[OpKey, ...]]) -> CheckpointPlan:
    """A plan that checkpoints the blocks in ``kept``, keeping those ops, for ``measure_plan`` to apply and
    measure; its predicted bytes and FLOPs are left at 0, as only the measurement is read."""
    zero = ByteExpr()
    blocks = tuple(BlockChoice(b, b in kept, kept.get(b, ()), (), zero, zero, case.batch) for b in case.blocks)
    return CheckpointPlan(case.name, case.batch, 0, blocks, zero, zero, zero)


def fit_ilp(
    stats: _TorchStats, case: Case, budget: int, unplanned: int, measure: Callable[[Ilp], Ilp]
) -> tuple[Ilp, Ilp | None, Ilp | None, int, float]:
    """The ILP at the same cut as fxmem; the fewest-FLOPs choice that fits among the cuts tried (Note [The
    ILP tuned to the budget]); the choice that kept the least, when none fits; how many cuts were tried,
    and the seconds their solves took."""
    same = unplanned - budget
    cuts = sorted({same, *(max(1, round(same * k)) for k in GRID)})
    tried = {c: measure(solve_ilp(stats, case.blocks, c)) for c in cuts}
    fitting = [c for c, ilp in tried.items() if ilp.fits(budget)]
    if fitting:
        low, high = max([0] + [c for c in tried if c < min(fitting)]), min(fitting)
        for _ in range(REFINE):
            mid = (low + high) // 2
            tried[mid] = ilp = measure(solve_ilp(stats, case.blocks, mid))
            low, high = (low, mid) if ilp.fits(budget) else (mid, high)
    fits = [ilp for ilp in tried.values() if ilp.fits(budget)]
    best = min(fits, key=lambda i: (i.measured.recompute_flops, i.measured.saved)) if fits else None  # type: ignore[union-attr]
    ran = [ilp for ilp in tried.values() if ilp.measured is not None]
    least = None if fits or not ran else min(ran, key=lambda i: i.measured.saved)  # type: ignore[union-attr]
    return tried[same], best, least, len(tried), sum(ilp.seconds for ilp in tried.values())


@dataclass(frozen=True)
class Recipe:
    """torchtitan's per-op recipe on one model (``op_sac_plan``, the CPU's save list): the ops it keeps
    per block, its choice measured and predicted, and how long ``op_sac_plan`` took. It has no budget."""

    kept: tuple[int, ...]
    kept_ops: tuple[str, ...]
    """The distinct ops whose outputs it keeps, in any block."""
    measured: PlanMeasurement
    predicted: tuple[int, int]
    seconds: float

    def fits(self, budget: int) -> bool:
        return self.measured.saved <= budget


def run_recipe(real: nn.Module, case: Case) -> Recipe:
    """torchtitan's per-op selective checkpointing of every block, timed, then measured as the others are."""
    start = time.perf_counter()
    plan = op_sac_plan(real, case.inputs, case.blocks, batch=case.batch, loss=case.loss, target="cpu")
    seconds = time.perf_counter() - start
    measured = measure_plan(real, case.inputs, plan, loss=case.loss)
    kept_ops = tuple(dict.fromkeys(k.op for b in plan.blocks for k in b.kept))
    predicted = (plan.saved_at_batch, plan.recompute_flops)
    return Recipe(tuple(len(b.kept) for b in plan.blocks), kept_ops, measured, predicted, seconds)


@dataclass(frozen=True)
class CaseResult:
    """One model's rows, torchtitan's recipe, where the time went, and the modules Note [Modules without a
    backward] filled in."""

    case: Case
    rows: tuple[Row, ...]
    recipe: Recipe
    stats_seconds: float
    """Collecting torch's stats for the ILP (once per model, before any solve)."""
    measuring_seconds: float
    """Measuring the ILP's choices (each distinct one once)."""
    no_backward: tuple[str, ...]


def run_case(case: Case) -> CaseResult:
    """Every budget of one model; the real model is built once and copied by each measurement."""
    torch.manual_seed(0)
    real = case.build()
    measured: dict[tuple[tuple[str, tuple[OpKey, ...]], ...], PlanMeasurement | str] = {}

    def measure_ilp(ilp: Ilp) -> Ilp:
        """``ilp`` with its choice measured; each distinct choice is run once."""
        if ilp.failed:
            return ilp
        key = tuple(sorted(ilp.kept.items()))
        if key not in measured:
            try:
                measured[key] = measure_plan(real, case.inputs, _hand_plan(case, ilp.kept), loss=case.loss)
            except Exception as e:  # noqa: BLE001 - the policy failing for real is a result to report
                measured[key] = f"applying its policy raised {type(e).__name__}: {str(e).strip().splitlines()[0]}"
        m = measured[key]
        return replace(ilp, failed=m) if isinstance(m, str) else replace(ilp, measured=m)

    every = measure_plan(real, case.inputs, _hand_plan(case, {b: () for b in case.blocks}), loss=case.loss)
    start = time.perf_counter()
    stats = collect_torch_stats(case)
    stats_seconds, measuring = time.perf_counter() - start, 0.0
    rows = []
    for fraction in FRACTIONS:
        budget = round(every.saved + fraction * (every.unplanned - every.saved))
        start = time.perf_counter()
        plan = plan_checkpointing(real, case.inputs, list(case.blocks), budget=budget, batch=case.batch, loss=case.loss)
        ours_seconds = time.perf_counter() - start
        start = time.perf_counter()
        same, best, least, tried, solving = fit_ilp(stats, case, budget, every.unplanned, measure_ilp)
        measuring += time.perf_counter() - start - solving
        ours = measure_plan(real, case.inputs, plan, loss=case.loss)
        predicted = (plan.saved_at_batch, plan.recompute_flops)
        rows.append(Row(budget, ours, predicted, ours_seconds, every, same, best, least, tried, solving))
        print(f"  {case.name}: budget {budget} done", file=sys.stderr, flush=True)
    recipe = run_recipe(real, case)  # last, as the first chooser to run pays the process's warm-up
    return CaseResult(case, tuple(rows), recipe, stats_seconds, measuring, stats.no_backward)


# --- the table ----------------------------------------------------------------------------------------


def _saved(m: PlanMeasurement, budget: int) -> str:
    return f"{m.saved:,}" + ("" if m.saved <= budget else " (over)")


def _ilp_cells(ilp: Ilp | None, budget: int) -> list[str]:
    if ilp is None:
        return ["none fits", "-"]
    if ilp.measured is None:
        return [f"n/a ({ilp.failed})", "-"]
    return [_saved(ilp.measured, budget), f"{ilp.measured.recompute_flops:,}"]


def _holds(row: Row) -> tuple[bool | None, str]:
    """Whether fxmem's choice fits, reruns no more than every block and than the ILP's best fitting
    choice (None: there was no ILP choice to compare), and why not."""
    ours, why = row.fxmem, []
    if ours.saved > row.budget:
        why.append("over budget")
    if ours.recompute_flops > row.every.recompute_flops:
        why.append("more FLOPs than every block")
    ilp = row.best_fit.measured if row.best_fit else None
    if ilp is not None and ours.recompute_flops > ilp.recompute_flops:
        why.append("more FLOPs than the ILP")
    if why:
        return False, ", ".join(why)
    return (None, "no ILP choice fits") if ilp is None else (True, "")


def _ratio(row: Row) -> str:
    if row.best_fit is None or row.best_fit.measured is None:
        return "-"
    return _flops_ratio(row.fxmem.recompute_flops, row.best_fit.measured.recompute_flops)


def _choice(ilp: Ilp) -> str:
    if ilp.failed:
        return f"cut {ilp.cut:,} B: {ilp.failed}"
    blocks = ", ".join(f"{b} ({share:.2f}, keeps {len(ilp.kept.get(b, ()))} ops)" for b, share in ilp.discard.items())
    return f"cut {ilp.cut:,} B: " + (blocks or "no block")


def _flops_ratio(ours: int, theirs: int) -> str:
    if theirs == 0:
        return "0 / 0" if ours == 0 else "inf"
    return f"{ours / theirs:.3f}"


def _recipe_lines(result: CaseResult) -> list[str]:
    """What torchtitan's recipe keeps and costs, and how fxmem's choice compares with it at each budget."""
    recipe, m = result.recipe, result.recipe.measured
    ops = f" ({', '.join(recipe.kept_ops)})" if recipe.kept_ops else ""
    predicted = "the same" if recipe.predicted == (m.saved, m.recompute_flops) else str(recipe.predicted)
    lines = [
        f"torchtitan's per-op recipe (`op_sac_plan`, the CPU's save list; no budget) checkpoints every block, keeping "
        f"{', '.join(map(str, recipe.kept))} ops{ops}: it saves {m.saved:,} B and recomputes {m.recompute_flops:,} FLOPs; predicted {predicted}."
    ]
    for r in result.rows:
        ours = r.fxmem
        if recipe.fits(r.budget):
            lines.append(
                f"At {r.budget:,} B the recipe fits; fxmem's choice recomputes {ours.recompute_flops:,} FLOPs, "
                f"{_flops_ratio(ours.recompute_flops, m.recompute_flops)} x the recipe's, and saves {ours.saved:,} B."
            )
        else:
            mine = "fits" if ours.saved <= r.budget else "is over too"
            lines.append(f"At {r.budget:,} B the recipe is {m.saved - r.budget:,} B over; fxmem's choice {mine} ({ours.saved:,} B).")
    return lines


def _seconds_line(result: CaseResult) -> str:
    """The choosers' wall times side by side, then the rest of where the run's time went."""
    rows = result.rows
    fxmem = ", ".join(f"{r.fxmem_seconds:.2f}" for r in rows)
    same = ", ".join(f"{r.same_cut.seconds:.2f}" for r in rows)
    fitted = ", ".join(f"{r.ilp_seconds:.2f} ({r.tried} solves)" for r in rows)
    return (
        f"Seconds choosing, per budget: fxmem's plan_checkpointing {fxmem}; torch's ILP at the same cut {same}, "
        f"fitted {fitted}, after {result.stats_seconds:.2f} collecting its stats once; torchtitan's op_sac_plan "
        f"{result.recipe.seconds:.2f} once. Measuring the ILP's choices: {result.measuring_seconds:.1f}."
    )


def render_case(result: CaseResult) -> str:
    case, rows, recipe = result.case, result.rows, result.recipe
    head = (
        "| budget (B) | fxmem saved | fxmem FLOPs | fxmem s | every block saved | every block FLOPs | recipe saved | recipe FLOPs "
        "| ILP same cut saved | ILP same cut FLOPs | ILP same cut s | ILP fitted saved | ILP fitted FLOPs "
        "| fxmem / ILP fitted FLOPs | claim |"
    )
    lines = [f"### {case.name}, B={case.batch}, blocks {', '.join(case.blocks)}", "", head, "|" + "---|" * 15]
    for r in rows:
        holds, why = _holds(r)
        cells = [
            f"{r.budget:,}", _saved(r.fxmem, r.budget), f"{r.fxmem.recompute_flops:,}", f"{r.fxmem_seconds:.2f}",
            _saved(r.every, r.budget), f"{r.every.recompute_flops:,}",
            _saved(recipe.measured, r.budget), f"{recipe.measured.recompute_flops:,}",
            *_ilp_cells(r.same_cut, r.budget), f"{r.same_cut.seconds:.2f}", *_ilp_cells(r.best_fit, r.budget), _ratio(r),
            {True: "holds", False: f"FAILS: {why}", None: f"unchecked vs ILP: {why}"}[holds],
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Saved without checkpointing: {rows[0].every.unplanned:,} B; with every block checkpointed: {rows[0].every.saved:,} B."]
    for r in rows:
        fitted = _choice(r.best_fit) if r.best_fit else "none of its choices fits"
        if r.least is not None and r.least.measured is not None:
            fitted += f"; the least any kept: {r.least.measured.saved:,} B ({r.least.measured.recompute_flops:,} FLOPs), {_choice(r.least)}"
        lines.append(f"At {r.budget:,} B the ILP chose, at the same cut, {_choice(r.same_cut)}; fitted ({r.tried} cuts tried): {fitted}.")
    lines += _recipe_lines(result)
    mismatches = [r for r in rows if r.fxmem_predicted != (r.fxmem.saved, r.fxmem.recompute_flops)]
    lines.append(
        "fxmem's predicted saved bytes and recompute FLOPs equal the measured ones on every row."
        if not mismatches
        else "fxmem's prediction differs from the measurement: "
        + "; ".join(
            f"at {r.budget:,} B predicted {r.fxmem_predicted}, measured {(r.fxmem.saved, r.fxmem.recompute_flops)}" for r in mismatches
        )
    )
    notes = dict.fromkeys(n for r in rows for ilp in (r.same_cut, r.best_fit) if ilp for n in ilp.notes)
    lines += [f"Note: {n}" for n in notes]
    if result.no_backward:
        lines.append(f"Note: MemTracker saw no backward for {', '.join(result.no_backward)} (Note [Modules without a backward]).")
    lines.append(_seconds_line(result))
    return "\n".join(lines)


def _versus_recipe(results: Sequence[CaseResult]) -> str:
    """fxmem's choice beside torchtitan's recipe on every row: where the recipe fits, FLOPs compared; where
    it does not, whether fxmem's choice does."""
    rows = [(res, r) for res in results for r in res.rows]
    fits = [(res, r) for res, r in rows if res.recipe.fits(r.budget)]
    over = [(res, r) for res, r in rows if not res.recipe.fits(r.budget)]
    more = [
        f"{res.case.name} at {r.budget:,} B" for res, r in fits if r.fxmem.recompute_flops > res.recipe.measured.recompute_flops
    ]  # fmt: skip
    text = f" Against torchtitan's per-op recipe (no budget): it fits the budget on {len(fits)} of {len(rows)} rows"
    if fits:
        text += f", and there fxmem's choice recomputes no more FLOPs on {len(fits) - len(more)} of {len(fits)}"
        text += f" (more at: {'; '.join(more)})" if more else ""
    if over:
        text += f"; where it does not fit, fxmem's choice fits on {sum(r.fxmem.saved <= r.budget for _, r in over)} of {len(over)}"
    return text + "."


def verdict(results: Sequence[CaseResult]) -> str:
    checks = [(res.case.name, r.budget, *_holds(r)) for res in results for r in res.rows]
    failed = [f"{n} at {b:,} B ({why})" for n, b, ok, why in checks if ok is False]
    unchecked = [f"{n} at {b:,} B" for n, b, ok, _ in checks if ok is None]
    if failed:
        head = f"Claim FAILS on {len(failed)} of {len(checks)} rows: " + "; ".join(failed) + "."
    else:
        head = f"Claim holds on every row ({len(checks)} of {len(checks)})"
        head += f", checked against the ILP on {len(checks) - len(unchecked)}." if unchecked else "."
    tail = (
        f" No ILP choice fit the budget, so only the budget and every block were checked, at: {'; '.join(unchecked)}." if unchecked else ""
    )
    return (
        head + tail + " (Claim: fxmem's choice keeps the saved bytes under the budget and recomputes no more FLOPs "
        "than checkpointing every block and than torch's SAC ILP's fitted choice, all measured.)" + _versus_recipe(results)
    )


# --- the timing targets -------------------------------------------------------------------------------


def run_speed(indices: Sequence[int] | None) -> list[Any]:
    """benchmarks/plan_speed.py's cases (all, or these indices into its CASES), one after another: each a
    ``plan_speed.Timing``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import plan_speed

    chosen = range(len(plan_speed.CASES)) if not indices else indices
    timings = []
    for index in chosen:
        timings.append(plan_speed.time_case(index))
        print(f"  {timings[-1].label}: {timings[-1].wall:.1f} s", file=sys.stderr, flush=True)
    return timings


def render_speed(timings: Sequence[Any]) -> str:
    lines = [
        "### Timing targets: `fxmem.planner.search.plan` on this machine's CPU (benchmarks/plan_speed.py's cases)",
        "",
        "| case | wall (s) | target (s) | wall / target | met |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {t.label} | {t.wall:.1f} | {t.target:.0f} | {t.ratio:.2f} | {'met' if t.met else 'missed'} |" for t in timings]
    missed = [t.label for t in timings if not t.met]
    lines += ["", f"Timing targets met on {len(timings) - len(missed)} of {len(timings)}" + (f"; missed: {'; '.join(missed)}." if missed else ".")]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--only", type=int, nargs="+", metavar="N", help="run only these cases (0-based indices into CASES)")
    speed = parser.add_mutually_exclusive_group()
    speed.add_argument("--skip-speed", action="store_true", help="leave out the timing targets (benchmarks/plan_speed.py's cases)")
    speed.add_argument(
        "--only-speed", type=int, nargs="*", metavar="N", help="only the timing targets: all, or these indices into plan_speed.CASES"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if not args.skip_speed:  # first, in a fresh process: nothing the tables leave behind is paid for in the timings
        print(render_speed(run_speed(args.only_speed)) + "\n", flush=True)
    if args.only_speed is None:
        results = []
        for i, case in enumerate(CASES):
            if args.only is None or i in args.only:
                results.append(run_case(case))
                print(render_case(results[-1]) + "\n", flush=True)
        print(verdict(results))
    print(f"(whole run: {time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main(sys.argv[1:]))
