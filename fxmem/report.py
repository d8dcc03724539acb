"""The answer ``analyze`` returns: a ``Report`` of one training step, and what it computes and renders on demand.

The report holds the stages' results (fxmem/results.py: data only) and, behind its methods, calls the
stages that evaluate them: the simulated step (fxmem/step/), time and throughput (fxmem/cost/) and
the renderers (fxmem/output/). It sits above them all, so that none of them imports it back; they
name it in annotations only (under ``TYPE_CHECKING``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fxmem.cost.tradeoff import TradeoffRow, batches_to_try, batchnorm_caveat, flop_count, padded_lengths, step_estimate
from fxmem.errors import InputSpecError, NotSimulatedError
from fxmem.gpu.gpus import get_gpu
from fxmem.inputs import InputSpec, check_batch
from fxmem.output.html_report import to_html
from fxmem.output.pipeline import render_pipeline
from fxmem.output.render import Depth, format_bytes, group_layers, render, to_dict
from fxmem.results import Accounting, EnvelopePiece, LayerRow, NodeRecord, Peak, StateBytes, Timeline, Verdict
from fxmem.symbolic import ByteExpr

__all__ = ["Report"]

SCAN = 24
"""Batches replayed one by one on each side of the bisection's answer (Note [The largest batch])."""

_REPR_INPUTS = 120
"""The most characters of the inputs ``repr(report)`` shows: a model with many inputs keeps its repr one line."""

_FAR_BATCH = 1 << 16
"""A batch far enough that anything growing with B has outgrown B=1's special cases."""


@dataclass(frozen=True)
class Report:
    """Everything fxmem knows about one training step; ``str(report)`` is the table.

    Bytes are exact integers. Activations exclude the input batch and targets, which are reported on
    their own (``input_bytes``) and included in ``total_bytes``.
    """

    model: str
    inputs: tuple[InputSpec, ...]
    loss: str
    accounting: Accounting
    state: StateBytes
    batch: int = 32
    device_memory: int | None = None
    frontend: str = "fx"
    """How the graph was made: 'fx' (torch.fx.symbolic_trace) or 'export' (torch.export)."""
    seq_len: int | None = None
    """Where an input has a symbolic sequence axis S: the length every figure is evaluated at."""
    evaluate: Callable[[int], Mapping[str, int]] | None = field(default=None, compare=False, repr=False)
    steps: Any = field(default=None, compare=False, repr=False)
    """The simulated training step (a ``fxmem.step.peak.StepPeaks``), or None where analyze ran with ``peak=False``."""
    setup: Any = None
    """The ``fxmem.step.training.TrainingSetup`` the prediction is for (target, GPU, autocast, recipe, sharding)."""
    per_gpu: Any = None
    """One GPU's share of ``state`` (a ``fxmem.results.PerGpuState``); equal to it with one GPU."""
    bn_layers: tuple[str, ...] = ()
    """Layers that normalize with batch statistics (BatchNorm, SyncBatchNorm), for the batch-norm caveat."""
    bn_threshold: int = 16
    """Per-device batches below this get the batch-norm caveat."""
    checkpointed: int = 0
    """How many ``torch.utils.checkpoint`` calls the graph runs as such (Note [Checkpointed regions])."""
    fsdp_units: tuple[str, ...] = ()
    """With ``--fsdp``: the modules fully_shard wrapped as units before the root."""
    pipeline: Any = None
    """With ``--pp``: every rank of the pipeline (a ``fxmem.parallel.pipeline_report.PipelineRun``); ``steps`` is then the highest rank's."""
    graph: Any = field(default=None, compare=False, repr=False)
    """The traced graph module the analysis ran (a pipeline splits its stages from it rather than trace again)."""
    paths: tuple[str, ...] = ()
    """Which of a library's code paths the traced graph took, in words (Note [Eager code paths under torch.export] in fxmem/frontends/hf_paths.py)."""
    routed: tuple[str, ...] = ()
    """Counts that depend on a mixture-of-experts layer's routing, taken as an even split, in words (Note [Routed sizes] in fxmem/rules/routing.py)."""
    compiled: Any = field(default=None, compare=False, repr=False)
    """With ``Training(compile=True)``: the step under ``torch.compile(model)`` (a ``fxmem.step.compiled.CompiledStep``)."""
    _cache: dict[int, Mapping[str, int]] = field(default_factory=dict, compare=False, repr=False)
    _verdicts: dict[tuple[int, int], Verdict] = field(default_factory=dict, compare=False, repr=False)

    @property
    def nodes(self) -> tuple[NodeRecord, ...]:
        return self.accounting.nodes

    @property
    def activations(self) -> ByteExpr:
        """Activation bytes as ``per_sample * B + constant`` (exact for B >= 2 when ``linear``)."""
        return ByteExpr.total(n.saved for n in self.nodes)

    @property
    def batch_one_special(self) -> tuple[str, ...]:
        """Nodes whose exact bytes at B=1 differ from their line (see Note [Why B=1 is measured on its own])."""
        return tuple(n.name for n in self.nodes if 1 in n.exact and n.exact[1] != n.saved.at(1, self.seq_len))

    def node_bytes(self, batch: int) -> Mapping[str, int]:
        """Exact activation bytes per node at ``batch``."""
        check_batch(batch)
        if all(batch in n.exact for n in self.nodes) or self.accounting.linear or self.evaluate is None:
            return {n.name: n.at(batch, self.seq_len) for n in self.nodes}
        if batch not in self._cache:
            self._cache[batch] = self.evaluate(batch)
        return self._cache[batch]

    def activation_bytes(self, batch: int) -> int:
        return sum(self.node_bytes(batch).values())

    def input_bytes(self, batch: int) -> int:
        check_batch(batch)
        return self.accounting.inputs.at(batch, self.seq_len)

    @property
    def state_per_gpu(self) -> int:
        """The model state one GPU holds through the step: all of it on one GPU, its share when sharded
        (the transiently gathered parameters of ZeRO-3 and FSDP left out)."""
        if self.per_gpu is None or self.setup is None or not self.setup.distributed:
            return self.state.total
        return int(self.per_gpu.total - self.per_gpu.gathered.nbytes)

    def total_bytes(self, batch: int) -> int:
        """What one GPU holds from forward to backward at ``batch``: its model state (``state_per_gpu``),
        the saved activations and the input batch. Temporaries and the backward peak are not in it."""
        return self.state_per_gpu + self.activation_bytes(batch) + self.input_bytes(batch)

    def peak(self, batch: int | None = None, *, first_step: bool = False) -> Peak:
        """The training step's peak at ``batch`` (default: the report's): bytes, phase, node, and what is alive.

        A first step creates the optimizer state inside ``optimizer.step()``; a steady step (the
        default) starts with it.
        """
        batch = self.batch if batch is None else batch
        check_batch(batch)
        return self._steps().peak(batch, first_step=first_step)

    def timeline(self, batch: int | None = None, *, first_step: bool = False) -> Timeline:
        """Every allocation and release of the training step at ``batch``, in order."""
        batch = self.batch if batch is None else batch
        check_batch(batch)
        return self._steps().timeline(batch, first_step=first_step)

    def envelope(self, *, first_step: bool = False) -> tuple[EnvelopePiece, ...]:
        """The peak as pieces ``a*B + c`` for B >= 2 (empty where the peak is not linear in B)."""
        return tuple(self._steps().envelope(first_step=first_step))

    def _steps(self) -> Any:
        if self.steps is None:
            raise NotSimulatedError(f"the report of '{self.model}' was made with peak=False; call analyze() without it to get the step's peak.")
        return self.steps

    def step_bytes(self, batch: int) -> int:
        """What the device must hold at ``batch``: for a GPU, nvidia-smi's total for a steady step
        (allocator blocks, segments, fixed costs), replayed against ``device_memory``; for the CPU the
        steady step's peak; ``total_bytes`` without a simulated step."""
        if self.steps is None:
            return self.total_bytes(batch)
        return int(self.steps.device_bytes(batch, self.device_memory))

    def fits(self, batch: int | None = None, budget_bytes: int | None = None) -> bool:
        """Whether a steady step at ``batch`` (default the report's) fits in ``budget_bytes`` (default
        ``device_memory``): on a GPU, where torch's caching allocator would raise no out-of-memory error
        (it releases its cache and retries first; fxmem/gpu/device.py)."""
        batch = self.batch if batch is None else batch
        check_batch(batch)
        budget = self._budget(budget_bytes)
        if batch < self.least_batch:  # the step raises there (BatchNorm on one sample): nothing fits
            return False
        if self.steps is None:
            return self.total_bytes(batch) <= budget
        return bool(self.steps.fits(batch, budget))

    def _budget(self, budget_bytes: int | None) -> int:
        if budget_bytes is not None:
            return budget_bytes
        if self.device_memory is None:
            raise InputSpecError(f"the report of '{self.model}' has no device memory to fit in: pass budget_bytes, or analyze with device_memory=.")
        return self.device_memory

    def max_batch(self, budget_bytes: int | None = None, *, scan: int = SCAN) -> int | None:
        """The largest batch whose steady step fits in ``budget_bytes`` (default ``device_memory``); None
        if B=1 does not fit or nothing grows with B. ``verdict`` says how it was checked."""
        return self.verdict(budget_bytes, scan=scan).max_batch

    def verdict(self, budget_bytes: int | None = None, *, scan: int = SCAN) -> Verdict:
        """Which batches fit in ``budget_bytes`` (default ``device_memory``): Note [The largest batch].
        ``scan`` is how many batches each side of the bisection's answer are replayed one by one (the
        planner, which compares many configurations, asks for none: its batch fits, the next does not).
        Without ``budget_bytes`` or ``device_memory`` there is nothing to fit in: ``InputSpecError``."""
        budget = self._budget(budget_bytes)
        if (budget, scan) not in self._verdicts:
            self._verdicts[budget, scan] = self._judge(budget, scan)
        return self._verdicts[budget, scan]

    @property
    def least_batch(self) -> int:
        """The smallest batch a training step can run: 2 where it cannot train on one sample
        (``accounting.batch_one_error``: BatchNorm's "Expected more than 1 value per channel"), else 1."""
        return 2 if self.accounting.batch_one_error else 1

    def _judge(self, budget: int, scan: int) -> Verdict:
        basis = "total" if self.steps is None else ("device total" if self.steps.device is not None else "peak")
        exact, least = not self.accounting.unsupported, self.least_batch
        floor = self.total_bytes(least) if self.steps is None else int(self.steps.device_bytes(least, budget))
        fits = lambda b: self.fits(b, budget)
        if not fits(least):
            return Verdict(budget, None, floor, basis=basis, exact=exact, floor_fits=False, least=least)
        if not self._grows():
            return Verdict(budget, None, floor, unbounded=True, basis=basis, exact=exact, least=least)
        n, checked, gaps = largest_fitting(fits, scan, least)
        if self._monotonic():
            checked = (least, checked[1])
        return Verdict(budget, n, floor, basis=basis, checked=checked, gaps=gaps, exact=exact, least=least)

    def _monotonic(self) -> bool:
        """Whether what decides the fit never falls as B grows, so that the largest batch that fits
        speaks for every smaller one: a CPU target's peak where it is the envelope of lines that do not
        fall (Note [The largest batch]); never a GPU's replay."""
        if self.steps is None or self.steps.device is not None:
            return False
        symbolic = self.steps.symbolic_timeline()
        if symbolic is None or any(e.at_batch is not None for e in symbolic.events):  # a kernel that changes with B
            return False
        pieces = self.envelope()
        return bool(pieces) and all(p.per_sample >= 0 for p in pieces) and self.steps.bytes(self.least_batch) <= self.steps.bytes(2)

    def _grows(self) -> bool:
        """Whether memory grows with B, judged on the tensors (a GPU's segments hide small growth). Not
        only from B=1 to 2: a kernel may choose another algorithm at B=1 alone (a oneDNN 3-D convolution's
        backward on AVX2 takes 35 MB of workspace at B=1 in a small U-Net, 19 MB at B=2), so a far batch
        is asked too."""
        measure = self.total_bytes if self.steps is None else self.steps.bytes
        return any(bool(measure(b) > measure(1)) for b in (2, _FAR_BATCH))

    def flops(self, batch: int | None = None) -> Any:
        """The step's FLOPs at ``batch`` (default: the report's) by phase: a ``fxmem.cost.tradeoff.FlopCount``
        with ``forward`` (model and loss), ``backward``, ``optimizer`` and the ops without a formula."""
        batch = self.batch if batch is None else batch
        return flop_count(self.timeline(batch), batch, self.seq_len)

    def step_time(self, batch: int | None = None) -> Any:
        """A roofline lower bound on the step's time at ``batch`` on the setup's GPU (a ``fxmem.cost.roofline.StepTime``);
        not a benchmark."""
        batch = self.batch if batch is None else batch
        return step_estimate(self.timeline(batch), batch, self.gpu, self.seq_len)

    def tradeoff(self, batches: Sequence[int] | None = None) -> tuple[Any, ...]:
        """Memory and estimated throughput per batch size (``fxmem.cost.tradeoff.TradeoffRow``): by default powers
        of two up to the largest batch that fits the device, and that batch."""
        if batches is None:
            largest = self.max_batch(self.device_memory) if self.device_memory is not None else None
            batches = batches_to_try(largest, self.batch)
        rows = []
        state = self.state_per_gpu
        for b in batches:
            t = self.step_time(b)
            worst = max(self.length_peaks(b), key=lambda row: (row[1], row[0]), default=None)  # a tie: the longest
            rows.append(TradeoffRow(
                b, state, self.activation_bytes(b), self.peak(b).bytes, self.step_bytes(b), t.seconds, t.samples_per_second(b), t.peak_share,
                None if worst is None else (worst[1], worst[0]),
            ))  # fmt: skip
        return tuple(rows)

    def length_peaks(self, batch: int | None = None) -> tuple[tuple[int, int], ...]:
        """(length, what the device must hold) for batches padded to shorter lengths than ``seq_len``:
        Note [The longest padded batch]. Empty where no input has a symbolic sequence axis S, or below
        B=2, whose step was simulated at ``seq_len`` only."""
        batch = self.batch if batch is None else batch
        steps = self.steps
        if self.seq_len is None or steps is None or batch < 2 or steps.symbolic_timeline() is None:
            return ()
        return tuple((s, int(steps.at_length(s).device_bytes(batch, self.device_memory))) for s in padded_lengths(self.seq_len))

    def batchnorm_caveat(self) -> str:
        """The batch-norm caveat where batch-statistics layers meet a small per-device batch, else ""."""
        judged = [("chosen batch", self.batch)]
        largest = self.max_batch(self.device_memory) if self.device_memory is not None and self.steps is not None else None
        if largest is not None and largest < self.batch:
            judged.append(("largest batch that fits", largest))
        return batchnorm_caveat(self.bn_layers, judged, self.bn_threshold)

    @property
    def gpu(self) -> Any:
        """The ``fxmem.gpu.gpus.GpuSpec`` of the setup: the target GPU, or for a cpu target the GPU ``--gpu`` names
        (the roofline estimates time on it)."""
        return get_gpu(self.setup.gpu if self.setup is not None else "h100-80gb")

    def layers(self, depth: Depth = None) -> tuple[LayerRow, ...]:
        """Activation bytes per module path (None or "all": full paths; a number: paths cut to that many components)."""
        return group_layers(self, depth)

    def to_dict(self) -> dict[str, object]:
        """The JSON view (``fxmem analyze --format json``) as plain dicts, lists, strings and numbers.

        Every byte count is an exact integer (bytes, not KiB), and a size that grows with the batch is
        ``{"per_sample": a, "constant": c}`` for ``a*B + c``. The top-level keys: what was analyzed
        (``model``, ``loss``, ``method``, ``frontend``, ``inputs``, ``seq_len``, ``target``), the bytes as
        expressions (``input_bytes``, ``activations``, ``model_state``, ``per_gpu_state``, ``nodes``,
        ``layers``: every module path), the figures at the report's batch (``at_batch``, ``peak``,
        ``floor``), the answer (``device_memory``, ``fits``, ``max_batch``, ``max_batch_basis``,
        ``verdict``), cost (``flops``, ``roofline``, ``tradeoff``), and the caveats (``batch_one_special``,
        ``batch_one_error``, ``batchnorm``, ``unsupported``, ``checkpointed_regions``, ``linear_in_batch``,
        ``pipeline``, ``routing``: the even splits of mixture-of-experts loops, ``code_paths``: the library
        paths the traced graph took), and with ``Training(compile=True)`` the step under torch.compile (``compiled``: its
        saved bytes and their line, each saved value, its peak and largest batch). A key that does not apply holds None (``fits`` without ``device_memory``, ``peak``
        with ``peak=False``) rather than being left out. fxmem/output/render.py ``to_dict`` builds it.
        """
        return to_dict(self)

    def __repr__(self) -> str:
        """One line, as torchinfo's summary object gives: the model, its inputs, the batch, the target,
        whether the batch fits and the largest that does, and the peak; ``str(report)`` is the full report.

        For example ``<Report Sequential (B,8:float32) at B=4 on cuda: NVIDIA H100 80GB SXM, precision fp32:
        does not fit, no batch fits; peak 4.35 KiB>``.
        """
        inputs = ", ".join(str(s) for s in self.inputs)
        inputs = inputs if len(inputs) <= _REPR_INPUTS else inputs[: _REPR_INPUTS - 3] + "..."
        at = f"B={self.batch}" + (f", S={self.seq_len}" if self.seq_len is not None else "")
        target = f" on {self.setup.describe()}" if self.setup is not None else ""
        return f"<Report {self.model} ({inputs}) at {at}{target}: {self._brief_answer()}>"

    def _brief_answer(self) -> str:
        """The verdict and the peak in a few words, for ``__repr__``."""
        if self.steps is None:
            size = f"held {format_bytes(self.total_bytes(self.batch))} (step not simulated)"
        else:
            size = f"peak {format_bytes(self.peak().bytes)}"
        if self.device_memory is None:
            return f"no device memory to fit in; {size}"
        v = self.verdict()
        largest = "any batch fits" if v.unbounded else "no batch fits" if v.max_batch is None else f"largest batch {v.max_batch}"
        return f"{'fits' if self.fits() else 'does not fit'}, {largest}; {size}"

    def __str__(self) -> str:
        """The terminal's report: the answer first, then the layers grouped to fit a screen (fxmem/output/render.py)."""
        text = render(self)
        return text if self.pipeline is None else f"{text}\n{render_pipeline(self.pipeline, self.batch, self.seq_len)}"

    def _repr_html_(self) -> str:
        """What Jupyter shows for a bare ``report`` instead of the dataclass repr: the same report as ``str``,
        in plain HTML tables (no JavaScript, no stylesheet)."""
        return render(self, "html")

    def _repr_markdown_(self) -> str:
        """The same report as GitHub markdown, for frontends that show markdown but not HTML."""
        return render(self, "markdown")

    def to_html(self, batch: int | None = None) -> str:
        """One self-contained HTML page: the module tree's saved bytes as an icicle, the step's memory
        over time with its peak, the batch trade-off and the summary, evaluated at ``batch`` (the
        report's own when None); inline SVG, nothing fetched (fxmem/output/html_report.py)."""
        if batch is not None:
            check_batch(batch)
        return to_html(self, batch)


# Note [The largest batch]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# Near the device's limit the total is not monotonic in B: the caching allocator packs blocks into
# segments differently at each batch (issue 19 saw 85.75 GB at B=137,748, 86.90 GB at 137,749, 85.47 GB
# at 141,055), a kernel may pick another algorithm, or a cuDNN workspace give way, at one batch and not
# the next, and far below the limit too a smaller batch can cost more than a larger one (a request under
# 10 MiB takes a 20 MiB segment, one above it a segment rounded to 2 MiB: get_allocation_size). A
# bisection alone can then answer a batch below one that fits. So the answer is found in two steps, each
# batch judged by the same replay as the per-batch verdict (``Report.fits``), so the two never disagree:
#   1. doubling, then bisection, finds a batch N that fits with N + 1 failing;
#   2. every batch from N - SCAN to N + SCAN is replayed one by one (from 1, where N - SCAN <= SCAN): a
#      fitting batch above N moves N up (and the window with it); those below N that fail are ``gaps``.
# The verdict claims only what was replayed: "every batch up to N fits" where the window reaches B=1,
# else the range it checked ("every batch from N - SCAN to N fits"). A batch asked about outside the
# window is replayed itself (``Report.fits``), so the answer for it is exact either way.

def largest_fitting(fits: Callable[[int], bool], scan: int = SCAN, least: int = 1) -> tuple[int, tuple[int, int], tuple[int, ...]]:
    """The largest B with ``fits(B)``, given ``fits(least)``; the window replayed one by one; and the
    batches below the answer inside it that do not fit (Note [The largest batch]).

    >>> largest_fitting(lambda b: b <= 40 and b != 37, scan=4)
    (40, (36, 44), (37,))
    >>> largest_fitting(lambda b: b <= 9 and b != 3, scan=4)
    (9, (1, 13), (3,))
    """
    lo, hi = least, 2 * least
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    top, b = lo, lo + 1
    while b <= top + scan:
        if fits(b):
            top = b
        b += 1
    first = top - scan if top - scan > scan + least else least
    gaps = tuple(b for b in range(first, top) if not fits(b))
    return top, (first, top + scan), gaps
