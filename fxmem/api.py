"""The pipeline on one screen: load -> trace -> capture -> account -> state -> report."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import fx, nn

from fxmem.collector import cycle_collector_paused
from fxmem.cost.tradeoff import BN_THRESHOLD, batchnorm_layers
from fxmem.engine.account import FIT_BATCHES, VERIFY_BATCH, account_bytes, node_bytes_at
from fxmem.engine.capture import BatchSpecialized, StepCapture, SymbolicUnsupported, capture_saved
from fxmem.engine.losses import Loss, get_loss
from fxmem.errors import CaptureError, FxmemError, InputSpecError
from fxmem.frontends.adapters import forward_module, is_peft_model
from fxmem.frontends.blocks import BlockStack
from fxmem.frontends.checkpointing import checkpoint_regions
from fxmem.frontends.deepen import compile_graphs, trace_blocks, weights_in
from fxmem.rules.ledger import code_paths_taken
from fxmem.gpu.device import DeviceModel, device_model
from fxmem.inputs import Constant, InputSpec, InputSpecs, check_batch, has_seq, parse_inputs
from fxmem.options import Hardware, Parallelism, Training, merge, spell, warn_at_caller
from fxmem.parallel import ParallelPlan, one_rank
from fxmem.report import Report
from fxmem.results import Accounting, Capture, Category, PerGpuState, StateBytes, Timeline
from fxmem.rules.ops import layout_rules_for, op_rules_for
from fxmem.rules.optimizers import OptimizerRule, default_impl
from fxmem.rules.routing import routed_sizes_seen, routing_ledger
from fxmem.step.passes import SHARED_BATCHES, SharedPasses, Simulate
from fxmem.step.peak import StepPeaks
from fxmem.step.pipeline import (
    OneGpu,
    PipelinePlan,
    PipelineRank,
    PipelineRun,
    StageGraphs,
    StageStep,
    pipeline_plan,
    simulate_stage,
    split_stages,
)
from fxmem.step.repeats import CAPTURED, NotRepeating, ShallowCaptures, ShallowSteps, names_for
from fxmem.step.sharding import engine_share, offloaded_state, shard_state, units_of
from fxmem.step.state import HeldState, get_optimizer, held_state, state_bytes
from fxmem.step.compiled import compiled_step
from fxmem.step.timeline import simulate_step
from fxmem.step.parallelism import check_tp_optimizer, parallel_plan, sequence_plan
from fxmem.step.training import TrainingSetup

__all__ = ["analyze"]


@cycle_collector_paused
def analyze(
    model: nn.Module,
    inputs: InputSpecs,
    *,
    batch: int = 32,
    training: Training | None = None,
    hardware: Hardware | None = None,
    parallel: Parallelism | None = None,
    seq_len: int | None = None,
    name: str | None = None,
    leaf_types: tuple[type, ...] = (),
    frontend: str = "auto",
    strict: bool = False,
    peak: bool = True,
    progress: Callable[[str], None] | None = None,
    bn_threshold: int = BN_THRESHOLD,
    loss: str | None = None,
    optimizer: str | None = None,
    optimizer_impl: str | None = None,
    precision: str | None = None,
    amp: str | None = None,
    param_dtype: torch.dtype | None = None,
    compile: bool | None = None,
    activation_memory_budget: float | None = None,
    clip_grad_norm: float | None = None,
    zero_grad: str | None = None,
    keep_outputs: bool | None = None,
    target: str | None = None,
    gpu: str | None = None,
    device_memory: int | None = None,
    torch_version: str | None = None,
    overheads: Mapping[str, int] | None = None,
    alloc_conf: str | None = None,
    memory_fraction: float | None = None,
    fsdp: int | None = None,
    fsdp_units: Iterable[str] | None = None,
    tp: int | None = None,
    tp_plan: Mapping[str, str] | None = None,
    sp: bool | None = None,
    pp: int | None = None,
    microbatches: int | None = None,
    schedule: str | None = None,
    pp_splits: Iterable[int] | None = None,
    stages_per_rank: int | None = None,
    world_size: int | None = None,
    shard: str | None = None,
    offload: bool | None = None,
    _flags: bool = False,
) -> Report:
    """Predict the training step's activation bytes per node as a*B + c, and the model state.

    >>> report = analyze(nn.Sequential(nn.Linear(8, 4), nn.ReLU()), ["B,8"])
    >>> report.activations   # Linear keeps its input (input batch, not counted); ReLU keeps its 4 outputs
    ByteExpr(per_sample=16, fixed=0)

    The call reads as the step: the model and its ``inputs``, the ``batch`` asked about, then one
    object for how it is trained (``training=Training(loss=..., optimizer=..., amp=...)``), one for
    what it runs on (``hardware=Hardware(gpu=..., device_memory=...)``) and one for how it is spread
    (``parallel=Parallelism(fsdp=..., tp=..., pp=...)``); each field is documented in fxmem/options.py.
    Every field is also a plain keyword (``analyze(model, inputs, loss="cross_entropy")``), which
    fills in its object's field; the same field given in both with two values is an InputSpecError.

    ``inputs`` mark the batch axis B (and optionally a sequence axis S, evaluated at ``seq_len``).
    ``frontend`` is "auto" (torch.fx, else torch.export), "fx" or "export"; ``strict`` turns saved
    sizes that depend on the data into an error instead of 0 B listed as unsupported. The step is
    traced and simulated in train mode, as it runs; each module's ``training`` flag is as it was when
    ``analyze`` returns or raises. ``progress``, if given, is called with a short phrase as each stage
    starts; the CLI shows these for stages that take long. The library never prints; a setting that
    changes nothing is an FxmemWarning at the caller's line.
    ``peak`` simulates the whole training step (forward, loss, backward, optimizer step) for its
    peak, which ``max_batch`` and ``Hardware.device_memory`` then use; ``peak=False`` skips it.
    ``bn_threshold``: per-device batches below it get the batch-norm caveat where the model has
    batch-statistics layers (``Report.batchnorm_caveat``). ``name`` titles the report (default the
    model's class); ``leaf_types`` are module classes traced as one node.

    ``Hardware.target`` "cuda" (the default; the GPU ``Hardware.gpu``, see ``fxmem.gpu.gpus.GPUS``):
    kernels save what CUDA's save, the caching allocator (set up by ``alloc_conf`` and
    ``memory_fraction``) replays every block against ``device_memory`` (default the GPU's) and fixed
    costs are added, so ``Report.fits`` says where torch would raise no out-of-memory error; "cpu" is
    what ``fxmem.measure`` checks exactly.

    ``Parallelism.fsdp`` (N > 1) simulates one rank of FSDP2 over N ranks by running ``fully_shard``
    itself on a fake process group (fxmem/parallel), and ``batch`` is the rank's micro-batch;
    ``tp`` (T > 1) adds tensor parallel by running ``parallelize_module`` itself (with both, one rank
    of a 2-D mesh of ``fsdp x tp`` ranks: Note [Tensor parallel plans] in fxmem/parallel/tensor.py);
    ``sp`` takes the model's sequence-parallel plan (Note [Sequence parallel]). ``pp`` (P > 1) splits
    the repeated blocks into pipeline stages and simulates every rank's step by running torch's own
    schedule over ``microbatches`` microbatches of ``batch`` samples on a fake process group (Note
    [Pipeline stages] in fxmem/parallel/pipeline_split.py): ``report.pipeline`` holds each rank, and
    ``report.peak`` is the highest rank's. With ``fsdp`` and ``tp``, each stage is sharded by them
    too (Note [Data parallel inside pipeline stages] in fxmem/parallel/rank.py).
    ``world_size`` and ``shard`` ("zero1", "zero2", "zero3", "fsdp") give instead the per-GPU share
    of a sharded run by DeepSpeed's formulas.
    """
    _check_model_args(model, leaf_types)
    name = name or type(model).__name__
    peft = is_peft_model(model)
    model = forward_module(model)  # Note [A bare PeftModel]
    training = merge(
        training, Training,
        {"loss": loss, "optimizer": optimizer, "optimizer_impl": optimizer_impl, "precision": precision, "amp": amp, "param_dtype": param_dtype,
         "compile": compile, "activation_memory_budget": activation_memory_budget, "clip_grad_norm": clip_grad_norm,
         "zero_grad": zero_grad, "keep_outputs": keep_outputs},
    )  # fmt: skip
    hardware = merge(
        hardware, Hardware,
        {"target": target, "gpu": gpu, "device_memory": device_memory, "torch_version": torch_version, "overheads": overheads,
         "alloc_conf": alloc_conf, "memory_fraction": memory_fraction},
    )  # fmt: skip
    parallel = merge(
        parallel, Parallelism,
        {"fsdp": fsdp, "fsdp_units": fsdp_units, "tp": tp, "tp_plan": tp_plan, "sp": sp, "pp": pp, "microbatches": microbatches,
         "schedule": schedule, "pp_splits": pp_splits, "stages_per_rank": stages_per_rank, "world_size": world_size, "shard": shard,
         "offload": offload},
    )  # fmt: skip
    modes = [(m, m.training) for m in model.modules()]
    as_built: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if peft and training.precision == "bf16":  # Note [A PEFT model under the bf16 recipe]
        training, as_built = replace(training, precision=""), weights_in(model, torch.bfloat16, frozen_only=True)
    try:
        with as_built:
            return _analyze(
                model, inputs, training, hardware, parallel, batch=batch, seq_len=seq_len, name=name,
                leaf_types=leaf_types, frontend=frontend, strict=strict, peak=peak, progress=progress, bn_threshold=bn_threshold, flags=_flags,
            )  # fmt: skip
    finally:
        for module, mode in modes:
            module.training = mode


def _with_ledgers(analyze: Callable[..., Report]) -> Callable[..., Report]:
    """``analyze`` with what its passes assumed and chose in words on the report: the routing of
    mixture-of-experts loops (Note [Routed sizes]), the code paths taken while exporting (Note [Eager
    code paths under torch.export]) and the 4-bit matmuls' kernels fxmem modelled rather than ran (Note
    [The forward's dequantized copies])."""

    @functools.wraps(analyze)
    def run(*args: Any, **kwargs: Any) -> Report:
        with routing_ledger() as routed, code_paths_taken() as paths:
            report = analyze(*args, **kwargs)
        return replace(report, routed=routed_sizes_seen(routed), paths=tuple(sorted(paths))) if routed or paths else report

    return run


@_with_ledgers
def _analyze(
    model: nn.Module,
    inputs: InputSpecs,
    training: Training,
    hardware: Hardware,
    parallel: Parallelism,
    *,
    batch: int,
    seq_len: int | None,
    name: str,
    leaf_types: tuple[type, ...],
    frontend: str,
    strict: bool,
    peak: bool,
    progress: Callable[[str], None] | None,
    bn_threshold: int,
    flags: bool,
    warn: bool = True,
) -> Report:
    """``analyze`` on the option objects; ``warn=False`` leaves the FxmemWarnings to the caller."""
    if parallel.pp != 1 and training.compile:
        raise InputSpecError(
            f"model '{name}': --compile is simulated on one GPU without pipeline, FSDP2 or tensor parallel so far; "
            "drop --pp to see what torch.compile keeps on one device."
        )
    if parallel.pp != 1:
        one_gpu = functools.partial(
            _analyze, model, inputs, training, hardware, Parallelism(world_size=parallel.world_size, shard=parallel.shard), batch=batch,
            seq_len=seq_len, name=name, leaf_types=leaf_types, frontend=frontend, strict=strict, peak=False, progress=progress,
            bn_threshold=bn_threshold, flags=flags, warn=False,
        )  # fmt: skip
        rank_setup = TrainingSetup.of(training, hardware, parallel)
        if warn:
            _warn_unused(rank_setup, parse_inputs(inputs), seq_len, (), flags)
        return _pipelined(model, one_gpu, rank_setup, parallel, training, name=name, peak=peak, progress=progress)
    setup = TrainingSetup.of(training, hardware, parallel)
    loss, optimizer, param_dtype, device_memory = training.loss, training.optimizer, training.param_dtype, hardware.device_memory
    specs, loss_fn, opt = _in_dtype(parse_inputs(inputs), setup.state_dtype), get_loss(loss), get_optimizer(optimizer)
    check_batch(batch)
    bn_threshold = _check_threshold(bn_threshold)
    if warn:
        _warn_unused(setup, specs, seq_len, _pipeline_options(parallel, flags), flags)
        if training.activation_memory_budget != 1.0 and not training.compile:
            warn_at_caller(
                f"{spell('activation_memory_budget', training.activation_memory_budget, flags=flags)} has no effect without "
                f"{spell('compile', True, flags=flags)}: it is the compiled step's partitioner budget; add it, or drop the budget."
            )
        if not peak and not setup.loop.plain:
            warn_at_caller(
                f"the training loop's settings ({setup.loop.describe()}) change only the simulated step, which "
                f"{spell('peak', False, flags=flags)} skips; drop them, or simulate the step."
            )
    seq = _seq_len(specs, seq_len)
    say = progress or _silent
    model.train()
    say("tracing the model")
    compute = setup.state_dtype or (torch.bfloat16 if setup.fsdp_mixed else None)  # Note [Tracing in the weights' compute dtype]
    traced, shallow = trace_blocks(model, _in_dtype(specs, compute), name=name, leaf_types=leaf_types, frontend=frontend, compute_dtype=compute)
    gm = traced.gm
    layers = sequence_plan(model, parallel.tp, parallel.tp_plan, parallel.sp, name)
    plan = parallel_plan(model, setup, parallel.fsdp_units, layers, peak, name)
    impl = setup.optimizer_impl or default_impl(opt, setup.target)
    simulate = _step_simulator(specs, loss_fn, opt, name, seq, setup, impl, plan, strict, training.activation_memory_budget)
    # Note [One pass for the capture and the step]; under a parallel plan only where the step is made from
    # the shallow copies: one rank's symbolic step of a whole deep model (a checkpointed one) costs more
    # than the capture pass it would replace, and a report asked only at its own batch never needs it.
    shared = SharedPasses(simulate) if peak and (plan is None or shallow is not None) else None
    accounting = _account(gm, specs, loss_fn, name, say, seq, strict, setup, shallow, plan, shared)
    say("counting model state")
    check_tp_optimizer(model, plan, impl, name)
    if device_memory is None and setup.cuda:
        device_memory = setup.device.memory_bytes
    state, per_gpu, device = _state(model, opt, param_dtype, setup, impl, device_memory)
    evaluate = None if accounting.linear else _concrete_evaluator(gm, specs, loss_fn, name, seq, strict, setup)
    steps = None
    if peak:
        step = shared.step if shared is not None else lambda graph, b: simulate(graph, b, None)
        held = _held_state(model, opt, param_dtype, setup, impl, per_gpu)
        steps = _simulate_steps(gm, step, say, seq, batch, device, held, shallow, plan)
        if plan is not None:
            host = offloaded_state(model, plan.world_size, opt, impl) if plan.offload else None  # Note [FSDP2's CPU offload]
            per_gpu = engine_share(steps.timeline(batch), steps.peak(batch), batch, seq, plan.world_size, setup.engine_name, host)
    compiled = None
    if training.compile:
        _check_compilable(gm, plan, peak, name, training.activation_memory_budget)  # peak: ``held`` and ``steps`` are made
        simulator = lambda graph: lambda b, made: simulate(graph, b, None, made)
        stack, copies = (shallow[0], shallow[1]) if shallow is not None and held.unchanged else (None, None)
        graphs = compile_graphs(
            model, _in_dtype(specs, compute), traced, stack, traced_copies=copies, name=name, leaf_types=leaf_types, compute_dtype=compute
        )
        overhead = (lambda b: int(steps.device_bytes(b) - steps.bytes(b))) if device is not None and steps is not None else None
        compiled = compiled_step(simulator, batch, seq, device, held, say, graphs, overhead=overhead)
    return Report(
        name, specs, loss, accounting, state, batch, device_memory, traced.frontend, seq, evaluate, steps, setup=setup, per_gpu=per_gpu,
        bn_layers=batchnorm_layers(model), bn_threshold=bn_threshold, checkpointed=len(checkpoint_regions(gm)),
        fsdp_units=plan.units if plan is not None else (), graph=gm, compiled=compiled,
    )  # fmt: skip


def _check_compilable(gm: fx.GraphModule, plan: ParallelPlan | None, peak: bool, name: str, budget: float = 1.0) -> None:
    """What a compiled step's simulation does not cover yet, said before any compile starts."""
    if not 0.0 <= budget <= 1.0:
        raise InputSpecError(f"model '{name}': activation_memory_budget {budget} is a share of the activations: give a number from 0 to 1 (1.0 is torch's default).")
    if not peak:
        raise InputSpecError(f"model '{name}': --compile simulates the compiled training step, which --no-peak (peak=False) skips; drop one.")
    if plan is not None:
        raise InputSpecError(
            f"model '{name}': --compile is simulated on one GPU without FSDP2, tensor or pipeline parallel so far; "
            "drop --fsdp/--tp to see what torch.compile keeps on one device."
        )
    if checkpoint_regions(gm):
        raise InputSpecError(
            f"model '{name}': --compile with activation checkpointing in the model is not simulated yet (AOTAutograd "
            "turns checkpointed regions into recompute tags for its partitioner); analyze the compiled step without "
            "checkpointing, or the checkpointed step without --compile."
        )


def _pipelined(
    model: nn.Module,
    one_gpu: Callable[[], Report],
    setup: TrainingSetup,
    parallel: Parallelism,
    training: Training,
    *,
    name: str,
    peak: bool,
    progress: Callable[[str], None] | None,
) -> Report:
    """``analyze`` with ``pp`` pipeline stages: the whole model's saved bytes per node (a pipeline
    moves no node's; ``one_gpu`` analyzes it without a step), and every rank's step simulated
    (fxmem/step/pipeline.py) on stages split from the graph ``one_gpu`` traced. ``setup`` is a rank's:
    with FSDP2 or tensor parallel in it, each stage is sharded by them too (Note [Data parallel inside
    pipeline stages] in fxmem/parallel/rank.py)."""
    pp, sp, optimizer, param_dtype = parallel.pp, parallel.sp, training.optimizer, training.param_dtype
    if not peak:
        raise InputSpecError(f"model '{name}': --pp {pp} simulates each rank's training step, which --no-peak (peak=False) skips; drop one.")
    if sp is True and setup.tp > 1:
        raise InputSpecError(
            f"model '{name}': --sp inside pipeline stages is not modelled yet (a stage would hand the next one the residual "
            "stream split along the sequence, which the stages' static shapes do not describe); use --tp without --sp with --pp."
        )
    plan = pipeline_plan(model, pp, parallel.microbatches, parallel.schedule, parallel.pp_splits, name, parallel.stages_per_rank)
    within = parallel_plan(model, setup, parallel.fsdp_units, sequence_plan(model, setup.tp, parallel.tp_plan, sp, name), peak, name)
    check_tp_optimizer(model, within, setup.optimizer_impl or default_impl(get_optimizer(optimizer), setup.target), name)
    whole = one_gpu()
    say = progress or _silent
    graphs = split_stages(whole.graph, plan, name)
    ranks = tuple(_pipeline_rank(graphs, r, plan, whole, setup, optimizer, param_dtype, say, within) for r in range(pp))
    highest = max(ranks, key=lambda r: r.steps.device_bytes(whole.batch))
    highest.steps.path = f"rank {highest.rank} of {PipelineRun(plan, ranks, None, within).describe()}, the highest at B={whole.batch}"
    state = whole.state
    held = OneGpu(state.weights + state.buffers + state.master + state.optimizer, whole.activation_bytes)
    units = within.units if within is not None else ()
    return replace(whole, steps=highest.steps, pipeline=PipelineRun(plan, ranks, held, within), fsdp_units=units)


def _pipeline_rank(
    graphs: StageGraphs,
    rank: int,
    plan: PipelinePlan,
    whole: Report,
    setup: TrainingSetup,
    optimizer: str,
    param_dtype: torch.dtype | None,
    say: Callable[[str], None],
    within: ParallelPlan | None = None,
) -> PipelineRank:
    """One rank's simulated steps: symbolic in B (its saved bytes per node from it), B=1, others on
    demand; on a cuda target each replayed through the caching allocator on top of the fixed costs,
    with the state of this rank's stages (Note [Per-GPU state in the replay] in fxmem/gpu/device.py)."""
    opt = get_optimizer(optimizer)
    impl = setup.optimizer_impl or default_impl(opt, setup.target)
    loss = get_loss(whole.loss)
    held = nn.ModuleList([graphs.stages[s] for s in plan.local(rank)])  # a weight two of its stages read, once
    _, per_gpu, device = _state(held, opt, param_dtype, setup, impl, whole.device_memory)
    beyond = _held_state(held, opt, param_dtype, setup, impl, per_gpu)

    marks: dict[int | None, tuple[tuple[int, int], ...]] = {}
    target = setup.step_target(impl)

    def simulate(b: int | None) -> StageStep:
        say(f"simulating pipeline rank {rank} at " + ("B symbolic" if b is None else f"B={b}"))
        with _train_mode(*graphs.stages):
            step = simulate_stage(
                graphs, rank, plan, whole.inputs, loss=loss, optimizer=opt, batch=b, target=target, model=whole.model,
                seq=whole.seq_len if b else None, parallel=within,
            )  # fmt: skip
        marks[b] = step.marks
        return step

    symbolic = simulate(None)
    steps = StepPeaks(
        symbolic.timeline, {}, lambda b: simulate(b).timeline, whole.seq_len, make_batch_one=lambda: simulate(1).timeline, device=device,
        held=beyond,
    )
    params = sum(v.fixed for c, v in symbolic.timeline.baseline.items() if c == Category.PARAMETER)
    return PipelineRank(rank, plan.role(rank), plan.blocks(rank), params, symbolic.saved, steps, marks)


def _state(
    model: nn.Module, opt: OptimizerRule, param_dtype: torch.dtype | None, setup: TrainingSetup, impl: str, budget: int | None = None
) -> tuple[StateBytes, PerGpuState, DeviceModel | None]:
    """The model state under the recipe, one GPU's share of it, and (cuda) how that GPU holds the step.

    The step is simulated with the model's own dtypes, or the recipe's weight dtype where that is
    low-precision; the device model scales its state to the recipe and the sharding stage (Note
    [Per-GPU state in the replay] in fxmem/gpu/device.py).
    """
    count = lambda precision, dtype: state_bytes(
        model, optimizer=opt, param_dtype=dtype, precision=precision, optimizer_impl=impl, target=setup.target
    )
    state = count(setup.precision or None, param_dtype)
    units = units_of(model, setup.shard) if setup.shard in ("zero3", "fsdp") else []
    if setup.engine:  # the simulated step is one rank's already: nothing to scale (engine_share says what it holds)
        per_gpu = shard_state(count(None, param_dtype), world_size=1, stage="none")
    else:
        per_gpu = shard_state(state, world_size=setup.world_size, stage=setup.shard, units=units)
    if not setup.cuda:
        return state, per_gpu, None
    fused = impl == "fused"
    return (
        state,
        per_gpu,
        device_model(
            setup.device,
            setup.overheads,
            fused=fused,
            simulated=count(None, setup.state_dtype or param_dtype),
            per_gpu=per_gpu,
            release=setup.release,
            budget=budget,
            alloc=setup.allocator,
        ),
    )


def _held_state(
    model: nn.Module, opt: OptimizerRule, param_dtype: torch.dtype | None, setup: TrainingSetup, impl: str, per_gpu: PerGpuState
) -> HeldState:
    """What one GPU holds of the state (``per_gpu``) beyond the state the step is simulated with: the
    step's peak counts it (Note [The state the peak holds] in fxmem/step/state.py), as the device
    model's replay does (Note [Per-GPU state in the replay] in fxmem/gpu/device.py)."""
    dtype = setup.state_dtype or param_dtype
    return held_state(state_bytes(model, optimizer=opt, param_dtype=dtype, optimizer_impl=impl, target=setup.target), per_gpu)


def _step_simulator(
    specs: tuple[InputSpec, ...],
    loss: Loss,
    opt: OptimizerRule,
    name: str,
    seq: int | None,
    setup: TrainingSetup,
    impl: str,
    plan: ParallelPlan | None,
    strict: bool,
    budget: float = 1.0,
) -> Simulate:
    """Simulates the step of a graph (the model, or its copy cut to fewer blocks) at a batch; with
    ``compiled``, the step under torch.compile, its partitioner held to ``budget`` (fxmem/step/compiled.py)."""
    target = setup.step_target(impl)

    def simulate(
        graph: fx.GraphModule,
        b: int | None,
        captured: Callable[[StepCapture], None] | None,
        compiled: Callable[[Any, int], None] | None = None,
    ) -> Timeline:
        with _train_mode(graph):
            return simulate_step(
                graph,
                specs,
                loss=loss,
                optimizer=opt,
                batch=b,
                target=target,
                model=name,
                seq=seq if b else None,
                parallel=plan.within(graph) if plan is not None else None,
                strict=strict,
                captured=captured,
                compiled=compiled,
                budget=budget,
            )

    return simulate


def _simulate_steps(
    gm: fx.GraphModule,
    simulate: Callable[[fx.GraphModule, int | None], Timeline],
    say: Callable[[str], None],
    seq: int | None,
    batch: int,
    device: DeviceModel | None,
    held: HeldState | None = None,
    shallow: tuple[BlockStack, dict[int, fx.GraphModule]] | None = None,
    plan: ParallelPlan | None = None,
) -> StepPeaks:
    """The training step's timelines: symbolic (every B >= 2) and B=1, each made when first needed,
    the report's own batch now (so that a failing step fails analyze), concrete ones on demand.
    With ``shallow`` (a block stack and the model cut to 3 and 4 blocks), each is made from the
    shallow steps where they extend exactly, else by simulating the whole model (Note [Repeated blocks])."""
    fast, path = _fast_path(gm, shallow, simulate)
    if plan is not None:
        path += f"; one rank of {plan.describe()}"

    def run(b: int | None) -> Timeline:
        nonlocal fast
        if b is not None:
            say(f"simulating the training step at B={b}")
        if fast is not None:
            try:
                return fast.timeline(b)
            except NotRepeating as e:
                steps.path = f"the whole model (its blocks do not repeat exactly: {e})"
                fast = None
            except (FxmemError, SymbolicUnsupported, BatchSpecialized):
                pass  # a step the shallow copies cannot take (BatchNorm at B=1): the whole model's own error says why
        return simulate(gm, b)

    def symbolic() -> tuple[Timeline | None, str]:
        say("simulating the training step (symbolic pass, batch B)")
        try:
            return run(None), ""
        except (SymbolicUnsupported, BatchSpecialized) as e:
            return None, f"the step is simulated at each batch size asked ({e})"

    steps = StepPeaks(None, {}, run, seq, make_symbolic=symbolic, make_batch_one=lambda: run(1), device=device, held=held, path=path)
    steps.peak(batch)
    return steps


def _fast_path(
    gm: fx.GraphModule,
    shallow: tuple[BlockStack, dict[int, fx.GraphModule]] | None,
    simulate: Callable[[fx.GraphModule, int | None], Timeline],
) -> tuple[ShallowSteps | None, str]:
    """The shallow steps that stand for the whole model's, and which path the step takes."""
    if shallow is None:
        return None, "the whole model"
    stack, graphs = shallow
    try:
        names = names_for(stack, graphs, gm)
    except NotRepeating as e:
        return None, f"the whole model (its blocks do not repeat exactly: {e})"
    path = _shallow_path(stack)
    return ShallowSteps(names, lambda depth, b: simulate(graphs[depth], b)), path


def _account(
    gm: fx.GraphModule,
    specs: tuple[InputSpec, ...],
    loss: Loss,
    name: str,
    say: Callable[[str], None],
    seq: int | None,
    strict: bool,
    setup: TrainingSetup,
    shallow: tuple[BlockStack, dict[int, fx.GraphModule]] | None = None,
    plan: ParallelPlan | None = None,
    shared: SharedPasses | None = None,
) -> Accounting:
    """One symbolic pass plus B=1; concrete passes when the symbolic one cannot stand for every B.

    Concrete passes (B=1 included) run at the sequence length ``seq`` where an input has a symbolic S.
    With ``shallow``, each pass is made from the model cut to 3 and 4 blocks where it extends exactly
    (Note [Saved tensors from three blocks]), else run on the whole model. With ``shared``, the
    symbolic and B=1 passes are the step's (Note [One pass for the capture and the step]).
    """

    def make(graph: fx.GraphModule) -> Callable[[int | None, int | None], Capture]:
        alone = _pass(graph, specs, loss, name, strict, setup, plan)
        if shared is None:
            return alone
        return lambda b, s: shared.capture(graph, b, lambda: alone(b, s)) if b in SHARED_BATCHES else alone(b, s)

    run, path = _fast_capture(gm, shallow, make, seq)
    return replace(_passes(run, say, seq, "simulating the training step and its saved tensors" if shared else ""), path=path())


def _passes(run: Callable[[int | None, int | None], Capture], say: Callable[[str], None], seq: int | None, what: str = "") -> Accounting:
    """The symbolic pass and B=1, or concrete passes where the symbolic one cannot stand for every B.
    ``what`` names the passes in the progress messages (the step's, where they are shared)."""
    what = what or "capturing saved tensors"
    try:
        say(f"{what} (symbolic pass, batch B)")
        symbolic = run(None, None)
    except (SymbolicUnsupported, BatchSpecialized) as e:
        batches = (1, *FIT_BATCHES, VERIFY_BATCH)
        say(f"capturing saved tensors (concrete passes at B={','.join(map(str, batches))})")
        one, why_not_one = _batch_one(run, seq)
        try:
            concrete = {b: run(b, seq) for b in batches if b != 1} | ({1: one} if one is not None else {})
        except CaptureError as concrete_error:
            raise _same_failure(e, concrete_error) from concrete_error
        at_seq = f" at S={seq}" if seq is not None else ""
        note = f"concrete passes at B={','.join(map(str, sorted(concrete)))}{at_seq} ({e})"
        return account_bytes(None, concrete, note=note, batch_one_error=why_not_one)
    say(f"{what} (concrete pass at B=1)")
    one, why_not_one = _batch_one(run, seq)
    return account_bytes(symbolic, {1: one} if one is not None else {}, batch_one_error=why_not_one)


def _fast_capture(
    gm: fx.GraphModule,
    shallow: tuple[BlockStack, dict[int, fx.GraphModule]] | None,
    make: Callable[[fx.GraphModule], Callable[[int | None, int | None], Capture]],
    seq: int | None = None,
) -> tuple[Callable[[int | None, int | None], Capture], Callable[[], str]]:
    """The capture pass at (batch, seq), from the shallow copies while they extend exactly, else on
    the whole model; and, once the passes have run, which of the two they took. ``seq``: the length
    the B=1 pass runs at."""
    whole = make(gm)
    if shallow is None:
        return whole, lambda: "the whole model"
    stack, graphs = shallow
    try:
        names = names_for(stack, graphs, gm, CAPTURED)
    except NotRepeating as e:
        why = f"the whole model ({e})"
        return whole, lambda: why
    passes = {depth: make(graph) for depth, graph in graphs.items()}
    fast: list[ShallowCaptures] = [ShallowCaptures(names, lambda d, b, s: passes[d](b, s), seq)]
    path = [_shallow_path(stack)]

    def run(batch: int | None, seq: int | None) -> Capture:
        if fast:
            try:
                return fast[0].at(batch, seq)
            except NotRepeating as e:
                fast.clear()
                path[0] = f"the whole model (its blocks do not repeat exactly: {e})"
            except (FxmemError, SymbolicUnsupported, BatchSpecialized):
                pass  # a pass the shallow copies cannot take: the whole model's own error says why
        return whole(batch, seq)

    return run, lambda: path[0]


def _shallow_path(stack: BlockStack) -> str:
    return f"{stack.depth} x {stack.kind} in '{stack.path}' from the model cut to 3 and 4 blocks (Note [Repeated blocks])"


def _same_failure(symbolic: Exception, concrete: CaptureError) -> CaptureError:
    """The symbolic pass's error (shapes written with B) when both passes failed at the same node."""
    if isinstance(symbolic, SymbolicUnsupported) and symbolic.error is not None and symbolic.node == getattr(concrete, "node", None):
        return symbolic.error
    return concrete


def _batch_one(run: Callable[[int | None, int | None], Capture], seq: int | None) -> tuple[Capture | None, str]:
    """The B=1 pass, or why a training step cannot run at B=1 at all.

    Some models cannot train on one sample (BatchNorm needs more than one value per channel); their
    other batch sizes are still exact, and B=1 figures then follow the line. If the failure is not
    specific to B=1, the passes at other batch sizes fail too, and that error is the one raised.
    """
    try:
        return run(1, seq), ""
    except CaptureError as e:
        return None, str(e)


def _pass(
    gm: fx.GraphModule,
    specs: tuple[InputSpec, ...],
    loss: Loss,
    name: str,
    strict: bool,
    setup: TrainingSetup,
    plan: ParallelPlan | None = None,
) -> Callable[[int | None, int | None], Capture]:
    """One fake pass at (batch, seq); None makes that axis symbolic. With ``plan``, on one rank of FSDP2:
    its gathered weights are state, and a MixedPrecisionPolicy decides the dtype of what is saved."""
    rules, layouts, kernels = op_rules_for(setup.target), layout_rules_for(setup.target), setup.kernels()
    rank = plan.within(gm) if plan is not None else None
    sharded = (lambda graph, mode: one_rank(rank, graph, mode, name)) if rank is not None else None

    def run(batch: int | None, seq: int | None) -> Capture:
        with _train_mode(gm):
            return capture_saved(
                gm,
                specs,
                loss=loss,
                batch=batch,
                seq=seq,
                rules=rules,
                model=name,
                strict=strict,
                kernels=kernels,
                state_dtype=setup.state_dtype,
                layouts=layouts,
                sharded=sharded,
            )

    return run


def _pipeline_options(parallel: Parallelism, flags: bool = False) -> list[str]:
    """The pipeline options given without ``pp``, as the caller spells them (the CLI's flags where ``flags``)."""
    given = [spell("microbatches", parallel.microbatches, flags=flags)] if parallel.microbatches != 1 else []
    given += [spell("schedule", parallel.schedule, flags=flags)] if parallel.schedule != "1f1b" else []
    if flags:
        given += [spell("pp_splits", s, flags=True) for s in parallel.pp_splits or ()]
    elif parallel.pp_splits:
        given.append(spell("pp_splits", parallel.pp_splits))
    stages = parallel.stages_per_rank
    return given + ([spell("stages_per_rank", stages, flags=flags)] if stages is not None else [])


def _warn_unused(
    setup: TrainingSetup, specs: tuple[InputSpec, ...], seq_len: int | None, pipeline: Sequence[str] = (), flags: bool = False
) -> None:
    """One FxmemWarning for each option given that changes nothing here (shown once by the CLI), at the
    caller's line, naming each option as the caller gave it (the CLI's flags where ``flags``)."""
    unused = list(setup.unused(flags=flags))
    if pipeline:
        pp, give = ("--pp P", "--pp") if flags else ("Parallelism.pp=P", "Parallelism.pp")
        unused.append(f"{', '.join(pipeline)}: pipeline options, with no effect without {pp}; pass {give}, or drop them.")
    if seq_len is not None and not has_seq(specs):
        unused.append(
            f"{spell('seq_len', seq_len, flags=flags)} has no effect: no input has a symbolic sequence axis S "
            f"({', '.join(map(str, specs))}); write S in the shape, e.g. B,S:int64, or drop {spell('seq_len', flags=flags)}."
        )
    for message in unused:
        warn_at_caller(message)


def _seq_len(specs: tuple[InputSpec, ...], seq_len: int | None) -> int | None:
    """The length S is evaluated at, where an input has a symbolic sequence axis; None otherwise."""
    if not has_seq(specs):
        return None
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise InputSpecError(
            f"inputs {', '.join(map(str, specs))} have a symbolic sequence axis S: give the length to evaluate "
            f"at (--seq-len N, seq_len=N in the API), got {seq_len!r}."
        )
    return seq_len


@contextlib.contextmanager
def _train_mode(*modules: nn.Module) -> Iterator[None]:
    """``modules`` in train mode while a pass runs, as the step does, and each one's ``training`` flag
    as it was after: a traced graph calls the caller's own modules, which ``analyze`` returns in the
    mode they came in, and a pass the report makes later (a batch asked for) still runs the training step."""
    modes = [(m, m.training) for module in modules for m in module.modules()]
    for m, _ in modes:
        m.training = True  # not ``train()``: an exported graph's module refuses it
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def _silent(_message: str) -> None:
    """The default progress callback: analyze() itself never prints."""


def _concrete_evaluator(
    gm: fx.GraphModule, specs: tuple[InputSpec, ...], loss: Loss, name: str, seq: int | None, strict: bool, setup: TrainingSetup
) -> Callable[[int], Mapping[str, int]]:
    """Exact bytes per node at any B by one more concrete fake pass (see Note [Concrete passes])."""
    run = _pass(gm, specs, loss, name, strict, setup)

    return lambda batch: node_bytes_at(run(batch, seq))


def _in_dtype(specs: tuple[InputSpec, ...], dtype: torch.dtype | None) -> tuple[InputSpec, ...]:
    """Float32 inputs in a recipe's low-precision dtype, as a bf16 model is fed (``x.to(dtype)``)."""
    if dtype is None:
        return specs
    return tuple(replace(s, dtype=dtype) if s.dtype == torch.float32 and not isinstance(s, Constant) else s for s in specs)


def _check_threshold(threshold: object) -> int:
    if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 1:
        raise InputSpecError(f"bn_threshold (--bn-threshold) is a batch size, 1 or more; got {threshold!r}.")
    return threshold


def _check_model_args(model: object, leaf_types: Iterable[object]) -> None:
    if not isinstance(model, nn.Module):
        raise InputSpecError(f"analyze() needs an nn.Module, got {type(model).__name__}; pass the model itself.")
    bad = [t for t in leaf_types if not (isinstance(t, type) and issubclass(t, nn.Module))]
    if bad:
        raise InputSpecError(
            f"leaf_types must hold nn.Module classes, got {bad[0]!r}; pass classes, e.g. leaf_types=(nn.MultiheadAttention,)."
        )
