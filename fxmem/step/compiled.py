"""The training step under ``torch.compile(model)``: what it saves, its peak, the largest batch that fits.

Each batch is compiled as torch's default mode compiles the first call it sees (static shapes), by
Inductor itself on fake tensors (fxmem/compiling/inductor.py), and the step is simulated with the
compiled forward and backward in it (``simulate_step(compiled=...)``). See Note [A compiled step per batch].

Note [A compiled step per batch]
    AOTAutograd's min-cut partitioner prices each candidate value by its size, and Inductor's
    fusion and buffer reuse follow the sizes too, so what a compiled step keeps can change with B:
    with symbolic sizes the partitioner prices them at their hints (``_size_of`` in
    torch/_functorch/partitioners.py reads ``optimization_hint``), which is not what a static compile
    at another B chose. So no polynomial in B is claimed unseen: the step is compiled at the report's
    batch, and at two batches for the line (``_line_batches``: max(2, B) and twice it), and the saved
    bytes are given as ``a*B + c`` only where the partitioner saved the same values at both (their
    sizes scaled by B); else the report says the choice changed. Every other batch asked about (the
    largest batch's search) is compiled and simulated itself.

Note [Inductor on a cuda target]
    Inductor's CUDA backend (Triton) cannot run without a GPU, and fake tensors on "cuda" abort on a
    CPU build of torch. A cuda target's compiled step is therefore Inductor's CPU plan: the same
    joint graph, decompositions and partition (the partitioner's rules do not depend on the device,
    but for random ops, which it saves the seeds of on CUDA instead of the masks), the same fusion
    groups and buffer reuse, with every op run under the target's kernel rules (what cuDNN, cuBLAS
    and SDPA's CUDA kernels allocate), replayed through the target's caching allocator. The saved
    bytes are exact where the partition is the same; the peak is an estimate: Triton's fusion can
    differ from the C++ backend's (it splits some reductions the C++ backend keeps whole), and a
    compiled step's own workspaces (Triton's autotuning, cudagraph pools: none in default mode) are
    not counted. The report says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from fxmem.compiling.inductor import CompiledModel, SavedValue, saved_values
from fxmem.gpu.device import DeviceModel
from fxmem.results import Peak, Timeline
from fxmem.step.peak import StepPeaks
from fxmem.step.repeats import NotRepeating
from fxmem.step.state import HeldState
from fxmem.symbolic import ByteExpr

__all__ = ["CompiledPass", "CompiledStep", "DeepSteps", "compiled_step"]


@dataclass(frozen=True)
class CompiledPass:
    """What one compiled step at a batch saved: the compiled model's partition and the bytes packed
    for backward (the compiled forward's activations and the eager loss's, each storage once)."""

    model: CompiledModel
    saved: int


SimulateCompiled = Callable[[int, Callable[[CompiledModel, int], None]], Timeline]
"""Simulates the step compiled at a batch, handing over what it saved."""


@dataclass
class CompiledStep:
    """The step as ``torch.compile(model)`` trains it, beside the eager one in a report."""

    batch: int
    saved: int
    """Bytes saved for backward at ``batch``: the compiled forward's and the eager loss's, as ``fxmem.measure(compile=True)`` counts them."""
    values: tuple[SavedValue, ...]
    """What the partitioner saved at ``batch``, parameters and inputs among them (``SavedValue.held``)."""
    line: ByteExpr | None
    """The saved bytes as ``a*B + c`` where the partitioner saved the same values at twice the batch; else None."""
    why_no_line: str
    steps: StepPeaks | DeepSteps
    estimate: str
    """What the figures assume where they are estimates: graph breaks (Note [Graph breaks of the traced
    graph] in fxmem/compiling/inductor.py), a cuda target (Note [Inductor on a cuda target]), and on the
    CPU convolutions, which run channels-last; "" where they are Inductor's own plan, exactly."""
    passes: dict[int, CompiledPass] = field(default_factory=dict, repr=False)
    path: str = "the whole model"
    """What was compiled: the whole model, or copies cut to 3 and 4 blocks (Note [A deep compiled model from its copies])."""
    _largest: dict[int, tuple[int | None, tuple[int, int]]] = field(default_factory=dict, repr=False)

    def peak(self, batch: int | None = None) -> Peak:
        return self.steps.peak(self.batch if batch is None else batch)

    def device_bytes(self, batch: int | None = None) -> int:
        return int(self.steps.device_bytes(self.batch if batch is None else batch))

    def value_lines(self) -> dict[str, ByteExpr]:
        """Each saved value's bytes as ``a*B + c``, from the two batches the line is drawn through, where
        the same value (by its forward node's name) is saved at both; the whole model's values only."""
        b1, b2 = _line_batches(self.batch)
        if self.path != "the whole model" or b1 not in self.passes or b2 not in self.passes:
            return {}
        second = {v.name: v.nbytes for v in saved_values(self.passes[b2].model)}
        lines = {v.name: _line_through(b1, v.nbytes, b2, second[v.name]) for v in saved_values(self.passes[b1].model) if v.name in second}
        return {name: line for name, line in lines.items() if line is not None}

    def kernels(self) -> int:
        """How many kernel calls Inductor's forward and backward wrappers make (fused groups and ATen calls)."""
        model = self.passes[self.batch].model
        return sum(code.count("cpp_fused_") // 2 + code.count("extern_kernels.") for code in model.wrappers)

    def max_batch(self, budget: int, least: int = 1) -> tuple[int | None, tuple[int, int]]:
        """The largest batch whose compiled steady step fits ``budget``, and the two batches that decide
        it (it fits, the next does not), each compiled and simulated: Note [The largest compiled batch]."""
        if budget not in self._largest:
            self._largest[budget] = _largest(lambda b: bool(self.steps.fits(b, budget)), self._guess(budget), least)
        return self._largest[budget]

    def _guess(self, budget: int) -> int:
        """Where the line through the two compiled batches' peaks reaches ``budget``: the tensors' peaks
        give the slope (a GPU's total moves in whole segments), the total at the first the start."""
        b1, b2 = self.batch, _line_batches(self.batch)[1]
        slope = (self.steps.bytes(b2) - self.steps.bytes(b1)) / (b2 - b1)
        if slope <= 0:
            return b1
        return max(1, b1 + int((budget - self.device_bytes(b1)) / slope))


# Note [The largest compiled batch]
#     Each batch costs a compile, so the search starts where the line through the two batches already
#     compiled (the report's and twice it) meets the budget, and gallops from there, by a 64th of the
#     guess and doubling, up while batches fit and down while they do not, then bisects the last gap. The answer is a
#     batch that fits with the next one failing, both replayed; unlike the eager verdict it does not
#     scan a window around it for batches that fail below it (Note [The largest batch] in
#     fxmem/report.py), which would compile a dozen more steps.


def _largest(fits: Callable[[int], bool], guess: int, least: int) -> tuple[int | None, tuple[int, int]]:
    if not fits(least):
        return None, (least, least)
    guess = max(guess, least)
    first = max(1, guess // 64)  # a guess within 1.5% is bracketed by the first step
    if fits(guess):
        lo, step = guess, first
        while fits(lo + step):
            lo, step = lo + step, step * 2
        hi = lo + step
    else:
        hi, step = guess, first
        while hi - step > least and not fits(hi - step):
            hi, step = hi - step, step * 2
        lo = max(least, hi - step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, (lo, hi)


def _line_batches(batch: int) -> tuple[int, int]:
    """The two batches the saved bytes' line is drawn through: the report's and twice it, from B=2
    (B=1 is special to torch's shape reasoning: a size-1 axis can make a view where B > 1 makes a copy)."""
    first = max(2, batch)
    return first, 2 * first


# Note [A deep compiled model from its copies]
#     Compiling a 32-block model at each batch takes minutes (Dynamo and Inductor over every block),
#     where the eager step is made from copies cut to 3 and 4 blocks (Note [Repeated blocks]). A
#     compiled step can be made so too, with less: Inductor's wrapper gives no module path to tell one
#     block's buffers from the next, so the copies' timelines cannot be spliced. What is extended is
#     each figure: the copies are compiled and simulated, and a figure of N blocks is
#     ``f(4) + (N - 4) * (f(4) - f(3))``: the saved bytes (each block saves what its partition saves,
#     the same in every block) and the peak, per category, where the peaks of both copies fall in the
#     same phase at the same op (the moment that repeats: the backward's start, the optimizer step).
#     Where they do not, the whole model is compiled instead. On a cuda target the GPU total adds to
#     the extended peak what the eager step's total adds to its own (the allocator's rounding and the
#     fixed costs), an estimate like the rest of a cuda target's compiled step.
#     tests/test_compiling.py holds a 6-block GPT-2 extended so to a real compiled run of all 6 blocks:
#     saved bytes exact, peak within 2%.


class DeepSteps:
    """A deep model's compiled step from its copies' (Note [A deep compiled model from its copies])."""

    def __init__(self, three: StepPeaks, four: StepPeaks, blocks: int, overhead: Callable[[int], int] | None) -> None:
        self.three, self.four, self.blocks, self.overhead = three, four, blocks, overhead
        self.device: DeviceModel | None = None

    def _extend(self, v3: int, v4: int) -> int:
        return v4 + (self.blocks - 4) * (v4 - v3)

    def peak(self, batch: int, *, first_step: bool = False) -> Peak:
        p3, p4 = self.three.peak(batch, first_step=first_step), self.four.peak(batch, first_step=first_step)
        if (p3.phase, p3.op) != (p4.phase, p4.op):
            raise NotRepeating(f"the copies peak at different moments ({p3.phase.value} {p3.op}, {p4.phase.value} {p4.op})")
        split = {c: self._extend(p3.breakdown.get(c, 0), n) for c, n in p4.breakdown.items()}
        return replace(p4, bytes=self._extend(p3.bytes, p4.bytes), breakdown=split, event=-1, device=None, estimated=(), upper=None)

    def bytes(self, batch: int, *, first_step: bool = False) -> int:
        return self.peak(batch, first_step=first_step).bytes

    def device_bytes(self, batch: int, budget: int | None = None) -> int:
        return self.bytes(batch) + (self.overhead(batch) if self.overhead is not None else 0)

    def fits(self, batch: int, budget: int) -> bool:
        return self.device_bytes(batch) <= budget


def compiled_step(
    simulate: Callable[[object], SimulateCompiled],
    batch: int,
    seq: int | None,
    device: DeviceModel | None,
    held: HeldState | None,
    say: Callable[[str], None],
    *,
    copies: tuple[object, object, int] | None = None,
    overhead: Callable[[int], int] | None = None,
    whole: object = None,
) -> CompiledStep:
    """The compiled step at ``batch``, and at two batches for the saved bytes' line (Note [A compiled
    step per batch]); other batches on demand. ``simulate(graph)`` simulates that graph compiled;
    ``whole`` is the model's graph, ``copies`` (the 3-block graph, the 4-block graph, the number of
    blocks) where the step may be extended from them (Note [A deep compiled model from its copies]),
    ``overhead(b)`` then what a GPU adds to the tensors' peak at ``b``."""
    if copies is not None:
        try:
            return _from_copies(simulate, batch, seq, say, copies, overhead, device)
        except NotRepeating as e:
            say(f"compiling the whole model ({e})")
    passes: dict[int, CompiledPass] = {}
    steps = StepPeaks(None, {}, _runner(simulate(whole), passes, say, "the model"), seq, device=device, held=held, path="the whole model")
    steps.peak(batch)
    b1, b2 = _line_batches(batch)
    steps.peak(b1), steps.peak(b2)
    line, why = _saved_line(passes[b1], passes[b2], b1, b2)
    values = saved_values(passes[batch].model)
    return CompiledStep(batch, passes[batch].saved, values, line, why, steps, _estimate(passes[batch], device), passes)


def _runner(simulate: SimulateCompiled, passes: dict[int, CompiledPass], say: Callable[[str], None], what: str) -> Callable[[int], Timeline]:
    def run(b: int) -> Timeline:
        say(f"compiling {what} with Inductor and simulating the step at B={b}")
        return simulate(b, lambda model, saved: passes.__setitem__(b, CompiledPass(model, saved)))

    return run


def _from_copies(
    simulate: Callable[[object], SimulateCompiled],
    batch: int,
    seq: int | None,
    say: Callable[[str], None],
    copies: tuple[object, object, int],
    overhead: Callable[[int], int] | None,
    device: DeviceModel | None,
) -> CompiledStep:
    three_graph, four_graph, blocks = copies
    three: dict[int, CompiledPass] = {}
    four: dict[int, CompiledPass] = {}
    s3 = StepPeaks(None, {}, _runner(simulate(three_graph), three, say, "the model cut to 3 blocks"), seq)
    s4 = StepPeaks(None, {}, _runner(simulate(four_graph), four, say, "the model cut to 4 blocks"), seq)
    steps = DeepSteps(s3, s4, blocks, overhead)
    steps.peak(batch)
    saved = lambda b: steps._extend(three[b].saved, four[b].saved)
    b1, b2 = _line_batches(batch)
    steps.peak(b1), steps.peak(b2)
    line, why = _saved_line(four[b1], four[b2], b1, b2)  # the same values saved at both batches...
    if line is not None:  # ...and the whole model's bytes through them
        line = _line_through(b1, saved(b1), b2, saved(b2))
    path = f"extended from the model cut to 3 and 4 of its {blocks} blocks"
    values = saved_values(four[batch].model)
    return CompiledStep(batch, saved(batch), values, line, why, steps, _estimate(four[batch], device), four, path)


def _estimate(compiled: CompiledPass, device: DeviceModel | None) -> str:
    """What the compiled figures assume where they are not exact ("" where they are)."""
    said = []
    if compiled.model.breaks:
        reasons = sorted({r.strip().splitlines()[0][:120] for r in compiled.model.breaks})
        said.append(
            f"Dynamo broke the graph {len(compiled.model.breaks)} time(s) ({'; '.join(reasons)}), and a break in the traced "
            "graph can split the model otherwise than in your code's frames, saved bytes included (Note [Graph breaks of the traced graph])"
        )
    if device is not None:
        said.append("Inductor's CPU plan under the GPU's kernel rules (Note [Inductor on a cuda target])")
    elif any("convolution" in code for code in compiled.model.wrappers):
        said.append(
            "Inductor runs convolutions channels-last, and the scratchpads of oneDNN's channels-last kernels are not "
            "modelled (Note [CPU oneDNN convolution buffers]); the ResNet-50 test config's peak was 6.7% below a real compiled step"
        )
    return "; ".join(said)


def _saved_line(first: CompiledPass, second: CompiledPass, b1: int, b2: int) -> tuple[ByteExpr | None, str]:
    """``a*B + c`` through the saved bytes at two batches, where the partitioner saved the same values."""
    names = lambda p: sorted(v.name for v in saved_values(p.model) if not v.held)
    if names(first) != names(second):
        return None, f"the partitioner saved other values at B={b2} than at B={b1}"
    line = _line_through(b1, first.saved, b2, second.saved)
    if line is None:
        return None, f"the saved bytes do not grow by whole bytes per sample between B={b1} and B={b2}"
    return line, ""


def _line_through(b1: int, bytes1: int, b2: int, bytes2: int) -> ByteExpr | None:
    """``a*B + c`` through (b1, bytes1) and (b2, bytes2), where ``a`` is a whole number of bytes."""
    per_sample, rest = divmod(bytes2 - bytes1, b2 - b1)
    return None if rest else ByteExpr(per_sample=per_sample, fixed=bytes1 - per_sample * b1)
