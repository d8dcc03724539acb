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

from fxmem.cost.tradeoff import TradeoffRow, batches_to_try, batchnorm_caveat, flop_count, step_estimate
from fxmem.errors import NotSimulatedError
from fxmem.gpu.gpus import get_gpu
from fxmem.inputs import InputSpec, check_batch
from fxmem.output.html_report import to_html
from fxmem.output.pipeline import render_pipeline
from fxmem.output.render import Depth, group_layers, render, to_dict
from fxmem.results import Accounting, EnvelopePiece, LayerRow, NodeRecord, Peak, StateBytes, Timeline, Verdict
from fxmem.symbolic import ByteExpr

__all__ = ["Report"]

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
    _cache: dict[int, Mapping[str, int]] = field(default_factory=dict, compare=False, repr=False)

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

    def total_bytes(self, batch: int) -> int:
        """Model state + activations + the input batch, at ``batch``. Temporaries and the backward peak are not in it."""
        return self.state.total + self.activation_bytes(batch) + self.input_bytes(batch)

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
        (allocator blocks, segments, fixed costs); for the CPU the steady step's peak; ``total_bytes``
        without a simulated step."""
        if self.steps is None:
            return self.total_bytes(batch)
        return int(self.steps.device_bytes(batch))

    def max_batch(self, budget_bytes: int) -> int | None:
        """The largest batch whose step peak fits in ``budget_bytes``; None if B=1 does not fit or nothing grows with B."""
        return self.verdict(budget_bytes).max_batch

    def verdict(self, budget_bytes: int) -> Verdict:
        basis = "total" if self.steps is None else ("device total" if self.steps.device is not None else "peak")
        floor = self.step_bytes(1)
        if floor > budget_bytes:
            return Verdict(budget_bytes, None, floor, basis=basis)
        if not self._grows():
            return Verdict(budget_bytes, None, floor, unbounded=True, basis=basis)
        return Verdict(budget_bytes, _largest_fitting(self.step_bytes, budget_bytes, self._upper_batch(budget_bytes)), floor, basis=basis)

    def _grows(self) -> bool:
        """Whether memory grows with B, judged on the tensors (a GPU's segments hide small growth). Not
        only from B=1 to 2: a kernel may choose another algorithm at B=1 alone (a oneDNN 3-D convolution's
        backward on AVX2 takes 35 MB of workspace at B=1 in a small U-Net, 19 MB at B=2), so a far batch
        is asked too."""
        measure = self.total_bytes if self.steps is None else self.steps.bytes
        return any(bool(measure(b) > measure(1)) for b in (2, _FAR_BATCH))

    def _upper_batch(self, budget_bytes: int) -> int | None:
        """On a GPU, the largest batch whose tensors alone fit: the device total (tensors plus rounding,
        caching and fixed costs) can only fit fewer, so the search for it starts below this bound."""
        if self.steps is None or self.steps.device is None:
            return None
        return _largest_fitting(lambda b: int(self.steps.bytes(b)), budget_bytes)

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
        state = self.state.total
        if self.setup is not None and self.setup.engine:  # one rank's state, the gathered weights (transient) aside
            state = self.per_gpu.total - self.per_gpu.gathered.nbytes
        for b in batches:
            t = self.step_time(b)
            rows.append(TradeoffRow(b, state, self.activation_bytes(b), self.peak(b).bytes, self.step_bytes(b), t.seconds, t.samples_per_second(b), t.peak_share))
        return tuple(rows)

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
        return to_dict(self)

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


def _largest_fitting(total: Callable[[int], int], budget: int, upper: int | None = None) -> int:
    """Largest B with total(B) <= budget, for a total that grows with B (exponential then binary
    search); ``upper``, when known, is a batch no smaller than the answer."""
    lo, hi = 1, 2
    if upper is not None:
        if total(upper) <= budget:
            return upper
        hi = max(upper, 2)
    while upper is None and total(hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if total(mid) <= budget else (lo, mid)
    return lo
