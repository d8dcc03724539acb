"""Small helpers shared by the tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

import fxmem
from fxmem.measure_ranks import RankMeasurement
from fxmem.report import Report
from fxmem.results import Phase

FLOAT = 4  # bytes per float32 element
INT64 = 8


def analyze_on_meta(factory: Callable[[], nn.Module], inputs: list[str], loss: str = "sum", **kw: object) -> Report:
    """Build the model on the meta device (as the CLI does) and analyze it."""
    with torch.device("meta"):
        model = factory()
    kw.setdefault("target", "cpu")  # the CPU is what the tests measure
    return fxmem.analyze(model, inputs, loss=loss, **kw)  # type: ignore[arg-type]


def saved(report: Report) -> dict[str, tuple[int, int]]:
    """{node: (per_sample, fixed)} for the nodes that are charged any activation bytes."""
    return {n.name: (n.saved.per_sample, n.saved.fixed) for n in report.nodes if not n.saved.is_zero}


def assert_matches_measurement(
    report: Report,
    factory: Callable[[], nn.Module],
    inputs: list[str],
    loss: str,
    batches: tuple[int, ...] = (1, 3),
    leaf_types: tuple[type, ...] = (),
) -> None:
    """Prediction == real CPU run, in total (eager, no fx) and per node, at each batch size."""
    for b in batches:
        torch.manual_seed(0)
        m = fxmem.measure(factory(), inputs, b, loss=loss, leaf_types=leaf_types)
        assert report.activation_bytes(b) == m.total, f"B={b}: predicted {report.activation_bytes(b)}, measured {m.total}"
        predicted = {k: v for k, v in report.node_bytes(b).items() if v}
        assert predicted == m.nodes, f"B={b}: per-node bytes differ"


CRUMBS = 64
"""Bytes a CPU step's peak may differ by: the CPU's scalar crumbs, 8-byte wrapped Python numbers and
their 4-byte casts alive for one op each, which fxmem does not model (Note [Scalar crumbs on the CPU]
in tests/fuzz_grammar.py)."""


def assert_step_peak(model: nn.Module, inputs: list[str], batch: int, *, loss: str, first_step: bool, phase: str = "same") -> None:
    """fxmem's AdamW step peak on the CPU equals a real step's (``measure_peak``) within CRUMBS bytes.
    ``phase``: "same" (the phases equal), "near" (the real run came within CRUMBS of its top in the
    predicted phase) or "any" (not checked)."""
    report = fxmem.analyze(model, inputs, loss=loss, optimizer="adamw", target="cpu")
    predicted = report.peak(batch, first_step=first_step)
    measured = fxmem.measure_peak(model, inputs, batch, loss=loss, optimizer="adamw", first_step=first_step)
    assert abs(predicted.bytes - measured.bytes) <= CRUMBS, (predicted.bytes, measured.bytes, predicted.phase, measured.phase)
    if phase == "same":
        assert predicted.phase == measured.phase
    elif phase == "near":
        assert measured.phases[predicted.phase] >= measured.bytes - CRUMBS


def tiny_llama(vocab_size: int = 97, *, use_cache: bool = True) -> nn.Module:
    """A HF Llama test config (2 layers, d=32, 4 heads sharing 2 key/value heads), seeded; callers
    skip first with ``pytest.importorskip("transformers")``. ``use_cache=False`` for a step whose
    layers a test checkpoints itself: transformers runs checkpointed layers without a cache, and a
    real checkpoint's recompute would update one again."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        use_cache=use_cache,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


# Note [Collective outputs a real rank holds longer]
#     A real gloo rank sometimes keeps a collective's output alive past its last use, and its profile
#     sometimes never shows the free: the backend's work object holds the output and drops it later,
#     on its own time. Measured 8 times on the GPT test config (B=4, four all-reduces of (B, S, D)
#     fp32 in forward), the lowest rank's peak was the simulated one to the byte 6 times and two of
#     those outputs above it twice, the highest rank up to three above; on the HF Llama test config
#     (five all-reduces and the LM head's all-gather in forward) the lowest rank one all-reduce
#     output above, the highest up to 22,912 B above. The simulated rank frees each output at its
#     last use, as the program's own references say. The real peak is never below it, and never
#     above it by more than every collective output of the forward held at once; saved activations
#     and the starting state are exact on every rank. A rank measured on NCCL would differ in the
#     same way: its work objects hold their tensors until the watchdog retires them.
#     The cause was found later: each of gloo's worker threads keeps the work it last ran until it
#     takes its queue's lock again (Note [Ranks of one real step] in fxmem/measure_ranks.py). The
#     real ranks now pause after every wait on a collective, which lets the worker go first; the
#     bounds here stay for a machine loaded enough to starve it longer.

# Note [Collective inputs a real rank holds longer]
#     Note [Collective outputs a real rank holds longer] bounds a real
#     rank's peak by the simulated one plus every forward collective's output. Under sequence
#     parallel a real gloo rank was also seen above that: the GPT test config's first step (B=4),
#     whose peak both the simulated and the real ranks reach as backward begins, the highest rank
#     61,440 B above the simulated peak, 4,096 B above every forward collective output (57,344 B):
#     (B, S/T, D) fp32, the size of an all-gather's input, a norm's local output that nothing saves
#     (the lowest rank was the simulated one to the byte; 1 run of 5). gloo's work objects keep the
#     tensors a collective reads as well as those it writes (torch/csrc/distributed/c10d/
#     ProcessGroupGloo.cpp: ``AsyncAllgatherWork`` holds ``inputs`` and ``outputs``), so the bound
#     here counts both: an all-gather reads 1/T of what it writes, a reduce-scatter T times, an
#     all-reduce as much. Measured on the HF Llama test config too (B=2, steady step): 6,144 and
#     18,816 B above the simulated peak, within 45,312 B of forward collective outputs. Saved
#     activations and the starting state stay exact on every rank.
#     A steady step's real rank was also seen below the simulated peak, on the HF Llama test config
#     (2 runs of 12): by 2,048 and by 4,096 B, the sizes of a backward all-gather's input and output
#     there. The step before the profiled one ends with backward collectives, whose tensors a
#     work object can still hold when the profiled step begins; they are no state (not in the
#     baseline) and not allocated inside the profile, yet their free is in it and lowers the running
#     sum (``_highest`` in fxmem/measure.py counts every free). The lower bound of a steady step
#     allows the largest backward collective output for that (which covers its input here).


def _read_by(op: str, written: int, degree: int = 2) -> int:
    """Bytes a collective reads, from the bytes it writes (Note [Collective inputs a real rank holds longer])."""
    if "all_gather" in op:
        return written // degree
    return written * degree if "reduce_scatter" in op else written


def check_ranks(ranks: tuple[RankMeasurement, ...], report: Report, batch: int, first_step: bool = False, spread: int = 0) -> None:
    """Each rank's peak between the simulated one (less, in a steady step, a backward collective's
    output freed from the step before) and that plus every forward collective's output and input
    (Note [Collective inputs a real rank holds longer]); ``spread``: a rank holding fewer bytes of state."""
    predicted = report.peak(batch, first_step=first_step).bytes
    events = report.timeline(batch, first_step=first_step).events
    collectives = [e for e in events if e.alloc and e.phase == Phase.FORWARD and e.op.startswith("_c10d_functional.")]
    held = sum(e.nbytes.at(batch) + _read_by(e.op, e.nbytes.at(batch)) for e in collectives)
    backward = [e.nbytes.at(batch) for e in events if e.alloc and e.phase == Phase.BACKWARD and e.op.startswith("_c10d_functional.")]
    early = 0 if first_step else max(backward, default=0)
    assert held > 0
    lowest, highest = min(m.peak for m in ranks), max(m.peak for m in ranks)
    assert lowest >= predicted - spread - early, (predicted, early, [m.peak for m in ranks])
    assert highest <= predicted + held + spread, (predicted, held, [m.peak for m in ranks])


GLOO_WORKERS = 2
"""gloo's worker threads in each process group (``options->threads = devices.size() * 2``, one
device): the most collectives per group whose tensors a rank may free late (Note [Ranks of one real step])."""


def assert_rank_peaks(peaks: Sequence[int], predicted: int, unit: int, send: int = 0) -> None:
    """Real ranks against the simulated rank's peak ``predicted``: none below it by more than 1%, none
    above it by more than ``GLOO_WORKERS`` x (``unit`` + ``send``) and 1%. ``unit``: the largest tensor
    a collective of the sharding group holds (FSDP2: one unit's gathered weights; tensor parallel: one
    collective's output); ``send``: the largest tensor a pipeline stage sends, on the "pp" group's own
    workers (0 without a pipeline). A rank is the simulated one to the byte on most runs; on some, a
    rank frees a collective's tensors late, when the gloo worker that ran it lets go of it (Note [Ranks
    of one real step] in fxmem/measure_ranks.py: 15,360 B, the GPT test config's root, and 50,560 B on
    the other rank in one CI run here; 37,120 B, a Llama test layer, on both ranks in two; 399,360 B,
    nearly two checkpointed GPT blocks of 199,936 B, on one rank in a CI run on a loaded machine)."""
    slack = 0.01 * predicted
    high = predicted + GLOO_WORKERS * (unit + send) + slack
    assert all(predicted - slack <= p <= high for p in peaks), (predicted, unit, send, list(peaks))


def cpu_computes_bf16() -> bool:
    """Whether this CPU has bf16 units (AMX or AVX512-BF16), where oneDNN runs bf16 kernels of its own."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def scratch_of(op_name: str, run: Callable[[], object]) -> int:
    """The most bytes ``op_name`` had allocated at once less what it still holds when it returns (its
    outputs): its scratch, from the profiler's allocation events in a real CPU run."""
    with torch.profiler.profile(profile_memory=True) as prof:
        run()
    stack, inside = list(prof.profiler.kineto_results.experimental_event_tree()), []
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        parent = e.parent
        while parent is not None and parent.name != op_name:
            parent = parent.parent
        if e.typed[0] == torch._C._profiler._EventType.Allocation and parent is not None:
            inside.append((e.start_time_ns, e.typed[1].alloc_size))
    running, top = 0, 0
    for _, size in sorted(inside):
        running += size
        top = max(top, running)
    return top - running
