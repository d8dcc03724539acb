"""The truth for a sharded step: the same step on N processes of this machine's CPU, for real.

``measure_ranks`` starts ``torchrun --standalone --nproc_per_node N`` on this module; each process
joins a gloo process group, applies ``fully_shard`` to the same units and then the root, as the
simulation does (fxmem/parallel), and measures its own rank as ``measure_peak`` measures one process
(Note [Reading the peak from the profiler] in fxmem/measure.py): the peak of one real training step,
and the bytes autograd saved for backward, sized when forward has ended (FSDP2 has freed the gathered
weights it saved by then; their storages are not activations and are left out, as are the shards,
buffers, batch and target).

Note [Ranks of one real step]
    The fake process group allocates nothing inside a collective, as NCCL allocates nothing from
    torch's caching allocator (its buffers are its own). gloo's collectives do allocate through the
    CPU allocator, and the profiler sees it (profiled on this machine, a HF Llama test config whose
    layer holds 37,120 B of fp32 weights): a full-size copy inside ``c10d::_allgather_base_``, freed
    within it; a full-size input copy inside ``c10d::_reduce_scatter_base_``, freed when
    ``reduce_scatter_tensor`` returns; transient buffers on gloo's worker threads. Those are the
    backend's, not the step's: a rank's ``peak`` leaves out every allocation made on another thread
    than the step's or inside a ``c10d::`` / ``gloo:`` op, and its free (the profiler gives both one
    ``allocation_id``); ``with_backend`` keeps them. What is left is the simulated rank's to the byte
    on most runs (the GPT and Llama test configs, both ranks, first and steady step; a rank with
    fewer rows of a parameter holds that many fewer bytes of optimizer state). On some runs a rank
    peaks higher by one unit's gathered weights (50,816 B, a GPT test block's; 15,360 B,
    its root's), and on a loaded machine by nearly two (399,360 B against a checkpointed GPT block's
    199,936 B, in one CI run). The cause is gloo's worker loop (``ProcessGroupGloo::runLoop``):
    a worker keeps the work it ran, and so its input and output tensors (an all-gather's gathered
    buffer, a reduce-scatter's unsharded gradients, both allocated by FSDP2 on the step's thread),
    in ``workInProgress_`` from the moment it marks the work complete until it takes the queue's
    lock again. When the step thread drops its own reference first, the free happens on the worker,
    later; a fake group completes at once and frees nothing late. gloo runs two workers by default
    (``options->threads = devices.size() * 2``, one device), so at most two works are held so
    per process group, and every group a device mesh makes has a backend and workers of its own:
    a rank may exceed the simulated one by two units' gathered weights (FSDP2's group), two
    collective outputs (tensor parallel's), and, in a pipeline, two sent tensors (the "pp" group's
    sends; seen: a pipeline x tensor-parallel rank 4 x 8,192 B over, the (B, S, D) activations of
    the GPT test config, in one of three runs on this machine's 2 cores).

    So that a rank measures what its step holds rather than when a worker thread is scheduled, each
    rank pauses ``SETTLE_S`` after every wait on a collective (``Work.wait`` and the functional
    collectives' ``wait_tensor``): the worker that completed the work is then, almost always, past
    the lock, and the pause changes no allocation, only lets the backend drop what the step dropped.
    With it, the pipeline x tensor-parallel ranks of the GPT test config, 1 to 5 (B, S, D) tensors
    over in every run before (never exact on three of four ranks), were the simulated ones to the
    byte; where a loaded machine starves the worker longer, the bound above still holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from fxmem.engine.binding import storage_of
from fxmem.engine.losses import get_loss
from fxmem.engine.recompute import selective_caches
from fxmem.errors import CaptureError, InputSpecError
from fxmem.frontends.huggingface import prepared_for_training
from fxmem.frontends.load import import_user_file, user_files
from fxmem.inputs import InputSpecs, call_arguments, check_batch, make_input, parse_inputs, tensors_of
from fxmem.measure import _highest, _name, _optimizer, _profiled, _profiler_range, _quiet_stderr, _real_step, materialize
from fxmem.parallel import ParallelPlan, apply_plan, plan_mesh, tp_layers
from fxmem.parallel.fsdp import gathered_weights
from fxmem.results import Phase
from fxmem.step.pipeline import PipelinePlan, pipeline_plan
from fxmem.step.state import get_optimizer

__all__ = ["RankMeasurement", "measure_ranks"]


@dataclass(frozen=True)
class RankMeasurement:
    """One rank's real step: its peak (baseline included), where it fell, and its saved activations."""

    rank: int
    peak: int
    phase: Phase
    baseline: int
    saved: int
    """Activation bytes autograd saved on this rank, sized when forward has ended."""
    phases: dict[Phase, int]
    with_backend: int
    """The peak with the process group backend's own buffers counted too (Note [Ranks of one real step])."""


def measure_ranks(
    model: nn.Module,
    inputs: InputSpecs,
    batch: int,
    *,
    fsdp: int = 1,
    units: tuple[str, ...] = (),
    tp: int = 1,
    tp_plan: Mapping[str, str] | None = None,
    loss: str = "sum",
    optimizer: str = "adamw",
    first_step: bool = False,
    seed: int = 0,
    seq_len: int | None = None,
    mixed: bool = False,
    timeout: float = 600.0,
    pp: int = 1,
    microbatches: int = 1,
    schedule: str = "1f1b",
    prepare: Callable[[nn.Module], nn.Module] | None = None,
    stages_per_rank: int | None = None,
    splits: Iterable[int] | None = None,
) -> tuple[RankMeasurement, ...]:
    """Run one real training step of ``model`` on ``fsdp x tp`` CPU processes: sharded by FSDP2 over
    ``fsdp`` data-parallel ranks (``units`` wrapped first, then the root) and by tensor parallel over
    ``tp`` (``tp_plan``, default the model's own), composed as the simulation composes them
    (``apply_plan`` in fxmem/parallel); ``batch`` samples on each data-parallel rank; each rank's
    measurement. ``mixed``: FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``.
    ``pp`` (P > 1): pipeline parallel over P stages instead, ``microbatches`` microbatches of ``batch``
    samples each in the order ``schedule`` gives (fxmem/measure_pipeline.py), with ``stages_per_rank``
    and ``splits`` as ``analyze`` takes them; with ``fsdp``, each stage sharded over ``fsdp`` ranks
    (P x N processes, Note [Data parallel inside pipeline stages] in fxmem/parallel/rank.py). ``prepare``
    (picklable: a module-level function or a ``functools.partial`` of one) is applied to each rank's
    model before it is sharded, as a user applies activation checkpointing before ``fully_shard``."""
    check_batch(batch)
    specs = parse_inputs(inputs)
    get_loss(loss), get_optimizer(optimizer)  # fail here, not in N processes
    name = type(model).__name__
    layers = tp_layers(model, tp, tp_plan, name) if isinstance(tp, int) and tp > 1 else ()
    plan = ParallelPlan(fsdp, tuple(units) if fsdp > 1 else (), mixed=mixed, tp=tp, tp_layers=layers)
    pipeline = _pipeline(model, plan, pp, microbatches, schedule, name, stages_per_rank, splits)
    world = plan.world_size * (pipeline.stages if pipeline is not None else 1)
    if world < 2:
        raise InputSpecError(
            f"measure_ranks needs 2 or more processes (--fsdp N, --tp T, --pp P); got fsdp={fsdp!r}, tp={tp!r}, pp={pp!r}."
        )
    torch.manual_seed(seed)
    real = materialize(model).train()
    config = {
        "model": real, "specs": specs, "batch": batch, "plan": plan, "loss": loss, "optimizer": optimizer, "first_step": first_step,
        "seed": seed, "seq_len": seq_len, "threads": torch.get_num_threads(), "name": name, "pipeline": pipeline, "prepare": prepare,
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="fxmem-ranks-") as where:
        folder = Path(where)
        _hand_user_files(folder)
        try:
            torch.save(config, folder / "step.pt")
        except Exception as e:  # the ranks are other processes: the model reaches them pickled
            raise InputSpecError(
                f"model '{name}' cannot be handed to the {world} rank processes ({type(e).__name__}: "
                f"{(str(e).strip().splitlines() or [''])[0][:200]}); define its class (and any function it holds) at "
                "module level of an importable file, so that pickle can find it."
            ) from e
        _launch(folder, world, timeout, name)
        return tuple(_read(folder / f"rank{r}.json") for r in range(world))


def _hand_user_files(folder: Path) -> None:
    """Name the .py files that file specs imported here, for the ranks to import under the same
    module names before they unpickle the step: a class such a file defines is pickled by its module's
    name, ``fxmem_user_<hash>``, which another process cannot recompute (fxmem/frontends/load.py)."""
    files = {name: path for name, path in user_files().items() if Path(path).is_file()}
    (folder / "user_files.json").write_text(json.dumps(files))


def _import_user_files(folder: Path) -> None:
    """Import the files ``_hand_user_files`` named, under their names in the process that named them."""
    for name, path in json.loads((folder / "user_files.json").read_text()).items():
        import_user_file(name, path)


def _pipeline(
    model: nn.Module,
    plan: ParallelPlan,
    pp: int,
    microbatches: int,
    schedule: str,
    name: str,
    virtual: int | None,
    splits: Iterable[int] | None,
) -> PipelinePlan | None:
    """The pipeline plan of a ``pp > 1`` run (None otherwise); its stages sharded by ``plan``."""
    if pp == 1:
        return None
    if any(layer.style.startswith("sequence_") for layer in plan.tp_layers):
        raise InputSpecError(f"model '{name}': sequence parallel inside pipeline stages is not modelled yet; give a tp_plan without sequence styles.")
    return pipeline_plan(model, pp, microbatches, schedule, splits, name, virtual)


def _launch(folder: Path, ranks: int, timeout: float, name: str) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        "-m",
        "fxmem.measure_ranks",
        str(folder),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    # a session of its own, so that a step that hangs is killed with every rank torchrun started
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True) as run:
        try:
            out, err = run.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            os.killpg(run.pid, signal.SIGKILL)
            run.communicate()
            raise CaptureError(
                f"model '{name}': the real {ranks}-process step did not finish within {timeout:.0f} s; try a smaller model or batch."
            ) from e
    if run.returncode != 0 and not all((folder / f"rank{r}.json").exists() for r in range(ranks)):
        errors = sorted(folder.glob("rank*.error"))
        why = errors[0].read_text() if errors else " ".join((err or out).strip().splitlines()[-3:])[:600]
        raise CaptureError(f"model '{name}': the real {ranks}-process step failed (torchrun exit {run.returncode}): {why}")


def _read(path: Path) -> RankMeasurement:
    data = json.loads(path.read_text())
    phases = {Phase(k): v for k, v in data["phases"].items()}
    return RankMeasurement(data["rank"], data["peak"], Phase(data["phase"]), data["baseline"], data["saved"], phases, data["with_backend"])


SETTLE_S = 0.002
"""Seconds a real rank pauses after each wait on a collective (Note [Ranks of one real step])."""


@contextlib.contextmanager
def _settled_waits() -> Iterator[None]:
    """Pause ``SETTLE_S`` after every wait on a collective, so that gloo's worker lets go of the
    finished work before the step goes on (Note [Ranks of one real step])."""
    import time

    import torch.distributed as dist
    import torch.distributed._functional_collectives as functional

    wait, wait_tensor = dist.Work.wait, functional.wait_tensor

    def settled_wait(work: Any, *args: Any, **kwargs: Any) -> Any:
        done = wait(work, *args, **kwargs)
        time.sleep(SETTLE_S)
        return done

    def settled_wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
        done = wait_tensor(tensor)
        time.sleep(SETTLE_S)
        return done

    dist.Work.wait, functional.wait_tensor = settled_wait, settled_wait_tensor  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        dist.Work.wait, functional.wait_tensor = wait, wait_tensor  # type: ignore[method-assign]


def _rank_main(folder: Path) -> None:
    """One process of ``measure_ranks``: shard, take the step, write ``rank{N}.json``."""
    with _settled_waits():
        _rank_step(folder)


def _rank_step(folder: Path) -> None:
    """Shard, take the step, write ``rank{N}.json``."""
    import torch.distributed as dist

    _import_user_files(folder)
    config = torch.load(folder / "step.pt", weights_only=False)
    torch.set_num_threads(config["threads"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if config["pipeline"] is not None:
        (folder / f"rank{rank}.json").write_text(json.dumps(_pipeline_rank(config, rank)))
        dist.destroy_process_group()
        return
    model = config["model"].train()
    with prepared_for_training(model):  # the step fxmem simulates: a HF model without its key/value cache
        result = _measure_rank(config, model, rank)
    (folder / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _measure_rank(config: dict[str, Any], model: nn.Module, rank: int) -> dict[str, Any]:
    """This rank's real step, sharded as ``config`` says, measured."""
    if config["prepare"] is not None:
        model = config["prepare"](model)
    apply_plan(model, config["plan"], plan_mesh(config["plan"]), config["name"])
    specs, loss_fn, rule = config["specs"], get_loss(config["loss"]), get_optimizer(config["optimizer"])
    torch.manual_seed(config["seed"])
    tensors = [make_input(s, config["batch"], config["seq_len"]) for s in specs]
    args, kwargs = call_arguments(specs, tensors)
    name = config["name"]
    with torch.no_grad():
        target = loss_fn.make_target(loss_fn.select(model(*args, **kwargs), name))
    _reshard(model)  # the root keeps its gathered weights after a forward; a step starts sharded
    opt = _optimizer(model, rule)
    if not config["first_step"]:
        _real_step(model, args, kwargs, loss_fn, target, opt, name, lambda _: contextlib.nullcontext())
    held = [*model.parameters(), *model.buffers(), *tensors_of(specs, tensors), *([target] if target is not None else [])]
    held += [t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    baseline = sum(_storages(held).values())
    with _quiet_stderr(), _profiled() as prof:
        _real_step(model, args, kwargs, loss_fn, target, opt, name, _profiler_range)
    top, _, phase, tops = _highest(prof, _backend_allocations)
    everything, _, _, _ = _highest(prof)
    saved = _saved_bytes(model, args, kwargs, loss_fn, target, name, held)
    opt.zero_grad(set_to_none=True)
    return {
        "rank": rank, "peak": baseline + top, "phase": phase.value, "baseline": baseline, "saved": saved, "with_backend": baseline + everything,
        "phases": {p.value: baseline + t for p, t in tops.items()},
    }  # fmt: skip


def _pipeline_rank(config: dict[str, Any], rank: int) -> dict[str, Any]:
    """One pipeline rank's step measured as ``_rank_main`` measures a sharded one (fxmem/measure_pipeline.py)."""
    from fxmem.measure_pipeline import PipelineRankStep

    step = PipelineRankStep(config, rank)
    if not config["first_step"]:
        step.step(lambda _: contextlib.nullcontext())
    baseline = sum(_storages(step.held()).values())
    with _quiet_stderr(), _profiled() as prof:
        step.step(_profiler_range)
    top, _, phase, tops = _highest(prof, _backend_allocations)
    everything, _, _, _ = _highest(prof)
    saved = step.saved_bytes(config["batch"])
    return {
        "rank": rank, "peak": baseline + top, "phase": phase.value, "baseline": baseline, "saved": saved, "with_backend": baseline + everything,
        "phases": {p.value: baseline + t for p, t in tops.items()},
    }  # fmt: skip


def _backend_allocations(allocations: list[Any]) -> set[int]:
    """The allocation events (by ``id``) that are the process group backend's own, and their frees:
    made on another thread than the step's, or inside a collective's own op (``c10d::...``). Note
    [Ranks of one real step]. An allocation and its free share an ``allocation_id``, but a later
    allocation can share it too: the profiler gave a dropout mask of the step's the id of a
    reduce-scatter's copy that gloo had not yet freed at that address (seen on a sequence-parallel
    rank, which then peaked 4,096 B low). So a backend allocation is paired with the first free of
    its id and size after it, and only those two are left out."""
    main = Counter(e.start_tid for e in allocations).most_common(1)[0][0] if allocations else 0
    left_out: set[int] = set()
    waiting: Counter[tuple[int, int]] = Counter()
    for e in allocations:
        size, key = e.typed[1].alloc_size, e.typed[1].allocation_id
        if size > 0 and (e.start_tid != main or _inside_collective(e)):
            left_out.add(id(e))
            waiting[(key, size)] += 1
        elif size < 0 and waiting[(key, -size)] > 0:
            left_out.add(id(e))
            waiting[(key, -size)] -= 1
    return left_out


def _inside_collective(event: Any) -> bool:
    parent = event.parent
    while parent is not None:
        if _name(parent).startswith(("c10d::", "gloo:")):
            return True
        parent = parent.parent
    return False


def _reshard(model: nn.Module) -> None:
    """Free every gathered weight: the state a training step starts from (a forward without backward
    leaves the root's gathered, ``reshard_after_forward=False`` being the root's default)."""
    for module in model.modules():
        reshard = getattr(module, "reshard", None)
        if callable(reshard) and hasattr(module, "_get_fsdp_state"):
            reshard()


def _storages(tensors: list[Any]) -> dict[StorageWeakRef, int]:
    """Each distinct storage the tensors (a DTensor: its local shard) hold, with its bytes."""
    found: dict[StorageWeakRef, int] = {}
    for t in tensors:
        storage = storage_of(t)
        found.setdefault(StorageWeakRef(storage), storage.nbytes())
    return found


def _saved_bytes(model: nn.Module, args: list[Any], kwargs: dict[str, Any], loss: Any, target: Any, name: str, held: list[Any]) -> int:
    """Bytes autograd saved in one forward and loss, each storage once, sized when forward has ended,
    leaving out the state, the batch, the target and the weights FSDP2 gathered (Note [Ranks of one real step])."""
    saved: dict[StorageWeakRef, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = storage_of(t)
        saved.setdefault(StorageWeakRef(storage), storage)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), selective_caches() as caches:
        out = model(*args, **kwargs)
        value = loss.compute(loss.select(out, name), target)
    for t in (t for cache in caches for t in cache.new()):  # what a selective checkpoint's policy kept for backward
        pack(t)
    excluded = set(_storages(held)) | set(_storages(gathered_weights(model)))
    total = sum(s.nbytes() for key, s in saved.items() if key not in excluded)
    value.backward()
    return total


def _main(folder: Path) -> None:
    """A rank's failure written where ``measure_ranks`` reads it (torchrun's own report names no cause)."""
    try:
        _rank_main(folder)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:400]
        (folder / f"rank{os.environ.get('RANK', '0')}.error").write_text(f"rank {os.environ.get('RANK', '0')}: {type(e).__name__}: {first}")
        raise
    sys.stdout.flush()
    os._exit(0)  # the result is written: no interpreter teardown, where gloo's threads can abort the process


if __name__ == "__main__":
    _main(Path(sys.argv[1]))
