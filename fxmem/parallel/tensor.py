"""Tensor parallel (``parallelize_module``) from a plan of module paths and style names, applied the
same way to a traced graph's modules and to the real model a multi-process run measures.

Note [Tensor parallel plans]
    A plan maps module paths, where ``*`` stands for one path component (``layers.*.mlp.up_proj``),
    to the name of one of torch's parallel styles (torch/distributed/tensor/parallel/style.py). The
    names are Hugging Face's (``config.base_model_tp_plan``, a model's ``_tp_plan``), so a HF model
    brings its own plan; the zoo's transformers carry one in the same attribute. ``colwise`` shards a
    Linear's output features (``ColwiseParallel``: a replicated input, each rank's slice of the output
    as a plain tensor), ``rowwise`` its input features (``RowwiseParallel``: each rank's partial sum
    all-reduced into a replicated output), ``colwise_gather_output`` gathers the sliced output again
    (HF's LM head), ``embedding_rowwise`` shards an embedding's rows and all-reduces its lookups.
    What each rank computes in between is the model's own code on its local slices: attention that
    infers its heads from the projection (``view(B, S, -1, head_dim)``, as HF's and torchtitan's
    models do) runs ``heads / T`` of them on each rank. A model that writes its global head count into
    its code cannot run column-sharded projections at all, in eager or here; the heads must divide
    by T (checked, with the module named, before anything runs).

Note [Sequence parallel]
    Plain tensor parallel leaves every rank holding the whole sequence between the sharded layers:
    the residual stream, the norms' inputs (which they save) and the dropouts' noise. Sequence
    parallel (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
    https://arxiv.org/abs/2205.05198; torchtitan's Llama plan, torchtitan/models/llama3/infra/
    parallelize.py ``apply_tp``) splits the stream along the sequence (dimension 1) between the
    layers: a row-wise layer reduce-scatters its partial sums instead of all-reducing them
    (``rowwise_scatter_output``: ``RowwiseParallel(output_layouts=Shard(1))``), the norm runs on the
    rank's S/T positions (``SequenceParallel``, its weight replicated, its gradient all-reduced by
    DTensor), and the full sequence is all-gathered again where the column-wise projections read it.
    torchtitan gathers at the attention's and the MLP's input (``PrepareModuleInput``);
    ``sequence_parallel_gather_output`` gathers at the norm's output, which feeds only those
    projections, so the same tensor is gathered and the projections save it as they would; it hooks a
    norm (one tensor in, one out), which a flattened graph's module hooks and eager call alike, where
    HF's attention takes its input by keyword. ``sequence_parallel`` keeps the norm's output sharded
    and ``colwise_gather_input`` (``ColwiseParallel(input_layouts=Shard(1))``) gathers it at one
    projection's input instead, which suits a fused projection (the zoo GPT's qkv) and costs one
    gather per projection otherwise. The stream is split where it enters the first sharded layer,
    ``sequence_shard_input`` (each rank keeps its S/T positions of a replicated first argument, no
    communication; the gradient is all-gathered in backward): torchtitan splits it at the
    embedding (``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))``), which
    neither model here can run: HF's Llama derives its positions from the embedding's sequence
    length (``torch.arange(inputs_embeds.shape[1])`` in ``LlamaModel.forward``) and the zoo GPT adds a
    whole-sequence position embedding to it, so both split the stream after the embedding (HF: at
    the first decoder layer; the zoo GPT: at the dropout after the embeddings, which then keeps S/T
    of its noise). A sequence length the degree does not divide is refused where it is split.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from fxmem.engine.capture import node_fqn
from fxmem.errors import CaptureError, InputSpecError

__all__ = ["TpLayer", "apply_tp", "default_tp_plan", "fused_split_error", "resolve_tp_plan", "tp_layers"]


@dataclass(frozen=True)
class _Kind:
    """What a style shards: the class of module it is made for (``nn.Module``: any module, as
    ``SequenceParallel`` replicates whatever parameters it finds) and the attribute whose size the
    degree must divide (None: nothing is split by the module's width)."""

    module: type[nn.Module]
    split: str | None


_KINDS = {
    "colwise": _Kind(nn.Linear, "out_features"),
    "rowwise": _Kind(nn.Linear, "in_features"),
    "colwise_gather_output": _Kind(nn.Linear, "out_features"),
    "embedding_rowwise": _Kind(nn.Embedding, "num_embeddings"),
    "colwise_gather_input": _Kind(nn.Linear, "out_features"),
    "rowwise_scatter_output": _Kind(nn.Linear, "in_features"),
    "sequence_parallel": _Kind(nn.Module, None),
    "sequence_parallel_gather_output": _Kind(nn.Module, None),
    "sequence_shard_input": _Kind(nn.Module, None),
}
STYLES = tuple(_KINDS)
"""The style names a plan may use (Note [Tensor parallel plans], Note [Sequence parallel])."""
_COLWISE = ("colwise", "colwise_gather_input")
"""Styles that split an attention module's heads when the projection lies inside one."""
_HEAD_COUNTS = ("heads", "num_heads", "num_attention_heads", "num_key_value_heads")
"""Attributes of an attention module (or of its ``config``) that count heads a column-wise
projection splits among the ranks."""
_HF_NORMS = ("input_layernorm", "post_attention_layernorm")
"""The norms of a HF Llama-style decoder layer, each followed by column-wise projections only."""


@dataclass(frozen=True)
class TpLayer:
    """One module of a resolved plan: its path, its style, and the class the style was made for
    (``nn.Linear`` or ``nn.Embedding``, ``nn.Module`` for any; torch.export's graph holds the
    parameters in plain modules)."""

    path: str
    style: str
    kind: type[nn.Module]


def default_tp_plan(model: nn.Module, sequence_parallel: bool = False, name: str = "model") -> dict[str, str] | None:
    """The plan a model carries: a HF model's ``_tp_plan`` (its config's ``base_model_tp_plan``
    under the model's prefix), or a zoo model's attribute of the same name; None if it has none.
    ``sequence_parallel``: its sequence-parallel variant (Note [Sequence parallel]): a zoo model's
    ``_sp_plan``, else one derived from a HF Llama-style plan; a model with neither is refused.

    >>> from models_zoo.gpt2_small import build
    >>> default_tp_plan(build(test=True).model, sequence_parallel=True)["blocks.*.ln1"]
    'sequence_parallel_gather_output'
    """
    plan = getattr(model, "_sp_plan" if sequence_parallel else "_tp_plan", None)
    if isinstance(plan, Mapping) and plan:
        return dict(plan)
    if not sequence_parallel:
        return None
    return _hf_sequence_plan(model, default_tp_plan(model), name)


def _hf_sequence_plan(model: nn.Module, plan: Mapping[str, str] | None, name: str) -> dict[str, str]:
    """A HF Llama-style plan made sequence parallel: its row-wise layers reduce-scatter, the layers'
    two norms and the final norm run on S/T positions and gather their output, the first layer
    splits the stream (Note [Sequence parallel])."""
    modules = dict(model.named_modules())
    stack = _layer_stack(plan or {})
    norm = f"{stack.rpartition('.')[0]}.norm".lstrip(".") if stack else ""
    first = f"{stack}.0"
    if not stack or norm not in modules or first not in modules or any(f"{first}.{n}" not in modules for n in _HF_NORMS):
        raise InputSpecError(
            f"model '{name}' ({type(model).__name__}) has no sequence-parallel plan: fxmem derives one for HF Llama-style "
            f"models (a plan over 'model.layers.*', each layer's {' and '.join(_HF_NORMS)}, a final 'model.norm') and "
            "takes a zoo model's _sp_plan; pass tp_plan= with the styles of Note [Sequence parallel] "
            "(sequence_parallel_gather_output on the norms, rowwise_scatter_output, sequence_shard_input)."
        )
    others = [c for c, m in modules[first].named_children() if "norm" in type(m).__name__.lower() and c not in _HF_NORMS]
    if others:
        raise InputSpecError(
            f"model '{name}': its decoder layers hold norms besides {' and '.join(_HF_NORMS)} ('{first}.{others[0]}'), "
            "which fxmem's derived sequence-parallel plan does not place; pass tp_plan= with a style for each "
            "(Note [Sequence parallel])."
        )
    sequence = {k: "rowwise_scatter_output" if v == "rowwise" else v for k, v in (plan or {}).items()}
    sequence.update({f"{stack}.*.{n}": "sequence_parallel_gather_output" for n in _HF_NORMS})
    sequence.update({first: "sequence_shard_input", norm: "sequence_parallel_gather_output"})
    return sequence


def _layer_stack(plan: Mapping[str, str]) -> str:
    """The path of the repeated layers a plan's patterns run over (``model.layers``), or ""."""
    stacks = {pattern.partition(".*.")[0] for pattern in plan if ".*." in pattern}
    return stacks.pop() if len(stacks) == 1 else ""


def tp_layers(model: nn.Module, degree: int, plan: Mapping[str, str] | None = None, name: str = "model") -> tuple[TpLayer, ...]:
    """Tensor parallel's layers over ``degree`` ranks: ``plan``, else the model's own; a model with
    neither is refused with what to pass."""
    plan = plan if plan is not None else default_tp_plan(model)
    if plan is None:
        raise InputSpecError(
            f"model '{name}' ({type(model).__name__}) has no tensor-parallel plan: pass tp_plan= (--tp-plan PATH=STYLE, "
            "repeatable), mapping each Linear to shard to 'colwise' or 'rowwise' (e.g. attention's q/k/v and the MLP's first "
            "layer colwise, attention's output and the MLP's last rowwise; * stands for one path component, as in "
            "'layers.*.mlp.up_proj'), as a HF model's config.base_model_tp_plan does."
        )
    if not isinstance(plan, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in plan.items()):
        raise InputSpecError(f"model '{name}': tp_plan must map module paths to style names (strings); got {plan!r}.")
    return resolve_tp_plan(model, plan, degree, name)


def resolve_tp_plan(model: nn.Module, plan: Mapping[str, str], degree: int, name: str = "model") -> tuple[TpLayer, ...]:
    """Every module the plan names, each pattern matched against ``model``'s module paths, checked
    against what the style and ``degree`` ranks need (Note [Tensor parallel plans])."""
    modules = dict(model.named_modules())
    layers: list[TpLayer] = []
    for pattern, style in plan.items():
        if style not in STYLES:
            raise InputSpecError(
                f"model '{name}': the tensor-parallel plan gives '{pattern}' the style '{style}', which fxmem does not "
                f"apply; use one of {', '.join(STYLES)} (torch's ColwiseParallel / RowwiseParallel / SequenceParallel), or leave it out."
            )
        matched = [path for path in modules if _matches(pattern, path)]
        if not matched:
            raise InputSpecError(
                f"model '{name}': the tensor-parallel plan names '{pattern}', which matches no module of the model "
                f"(its modules are named like {', '.join(repr(p) for p in list(modules)[1:4])}); fix the path (* stands "
                "for one component, as in 'layers.*.mlp.up_proj')."
            )
        layers += [_layer(modules, path, style, degree, name) for path in matched]
    return tuple(sorted(layers, key=lambda layer: list(modules).index(layer.path)))


def _matches(pattern: str, path: str) -> bool:
    regex = r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split("."))
    return re.fullmatch(regex, path) is not None


def _layer(modules: Mapping[str, nn.Module], path: str, style: str, degree: int, name: str) -> TpLayer:
    module, kind = modules[path], _KINDS[style]
    if not isinstance(module, kind.module):
        raise InputSpecError(
            f"model '{name}': the tensor-parallel plan gives module '{path}' ({type(module).__name__}) the style "
            f"'{style}', which shards an {kind.module.__name__}; name the {kind.module.__name__} layers only."
        )
    size = int(getattr(module, kind.split)) if kind.split is not None else 0
    if size % degree:
        raise InputSpecError(
            f"model '{name}': tensor parallel over {degree} ranks splits the {kind.split} of '{path}' ({size}), which {degree} "
            f"does not divide; choose a --tp that divides {size}."
        )
    if style in _COLWISE:
        _check_heads(modules, path, degree, name)
    return TpLayer(path, style, kind.module)


def _check_heads(modules: Mapping[str, nn.Module], path: str, degree: int, name: str) -> None:
    """A column-wise projection inside an attention module splits its heads: each count must divide."""
    parent = path.rpartition(".")[0]
    owner = modules.get(parent)
    if owner is None:
        return
    config = getattr(owner, "config", None)
    for attribute in _HEAD_COUNTS:
        count = getattr(owner, attribute, getattr(config, attribute, None))
        if isinstance(count, int) and not isinstance(count, bool) and count % degree:
            raise InputSpecError(
                f"model '{name}': tensor parallel over {degree} ranks splits the heads of '{parent or 'the root'}' "
                f"({attribute} = {count}), which {degree} does not divide; choose a --tp that divides {count}."
            )


def apply_tp(root: nn.Module, layers: Iterable[TpLayer], mesh: DeviceMesh, name: str = "model") -> None:
    """``parallelize_module`` on each layer of the plan, in place (on a traced copy or a real model)."""
    from torch.distributed.tensor.parallel import parallelize_module

    for layer in layers:
        module = root.get_submodule(layer.path)
        if type(module) is nn.Module:  # torch.export keeps a layer's parameters in a plain module: the style checks the class
            module.__class__ = layer.kind
        try:
            parallelize_module(module, mesh, _style(layer, name))
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise CaptureError(
                f"model '{name}': parallelize_module refused '{layer.path}' ({layer.style}): {type(e).__name__}: {first}; "
                "change the tensor-parallel plan (tp_plan=...)."
            ) from e


def _style(layer: TpLayer, name: str) -> ParallelStyle:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {
        "colwise": lambda: ColwiseParallel(),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise": lambda: RowwiseParallel(),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "colwise_gather_input": lambda: ColwiseParallel(input_layouts=Shard(1)),
        "rowwise_scatter_output": lambda: RowwiseParallel(output_layouts=Shard(1)),
        "sequence_parallel": lambda: SequenceParallel(use_local_output=True),
        "sequence_parallel_gather_output": lambda: _GatheredSequenceParallel(),
        "sequence_shard_input": lambda: _ShardSequence(layer.path, name),
    }
    return styles[layer.style]()


class _GatheredSequenceParallel(SequenceParallel):
    """``SequenceParallel`` on a norm, its output all-gathered to the whole sequence as a plain
    tensor for the column-wise projections that read it (Note [Sequence parallel])."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import Replicate

        module = super()._apply(module, device_mesh)
        module.register_forward_hook(lambda _m, _args, out: out.redistribute(placements=[Replicate()]).to_local())
        return module


class _ShardSequence(ParallelStyle):
    """A module's first argument, the same whole sequence on every rank, cut to this rank's S/T
    positions before the module runs (``Replicate`` to ``Shard(1)``: no communication in forward,
    an all-gather of the gradient in backward); the other arguments as they are. A sequence that
    the degree does not divide is refused (Note [Sequence parallel])."""

    def __init__(self, path: str, model: str) -> None:
        super().__init__()
        self.path, self.model = path, model

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(lambda _m, args: self._shard(args, device_mesh))
        return module

    def _shard(self, args: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() < 2:
            raise InputSpecError(
                f"model '{self.model}': sequence parallel splits the first argument of '{self.path}' along dimension 1, "
                "which needs a (batch, sequence, ...) tensor there; put sequence_shard_input on the module the residual stream enters."
            )
        length, degree = args[0].shape[1], mesh.size()
        if isinstance(length, int) and length % degree:
            raise InputSpecError(
                f"model '{self.model}': sequence parallel over {degree} ranks splits the sequence entering '{self.path}' "
                f"({length} positions), which {degree} does not divide; use a sequence length that is a multiple of "
                f"{degree}, or a --tp that divides {length}, or the plan without sequence parallel."
            )
        whole = DTensor.from_local(args[0], mesh, [Replicate()], run_check=False)
        return (whole.redistribute(placements=[Shard(1)]).to_local(), *args[1:])


# Note [A fused projection split after a column-wise shard]
#     One Linear that makes q, k and v together (``qkv(x).split(d, dim=-1)``, ``.chunk(3, -1)``) and is
#     planned ``colwise`` holds, on each rank, a contiguous 1/T of its output features: with T = 2 the
#     first rank's half is all of q and half of k, not half of each. The split after it then cuts that
#     slice where the whole output's pieces would be: ``split(d)`` of 3d/2 features makes two pieces
#     where the code unpacks three (an IndexError at the unpacking), ``chunk(3)`` makes three of d/2
#     that no longer view as the heads. It fails in eager the same way. Column-wise sharding of a fused
#     projection is right only where the model splits by heads first (each head's q, k and v next to
#     each other in the weight, ``view(B, S, heads, 3 * head_dim)``), so each rank holds whole heads.
#     fxmem cannot tell from the graph which the weights mean, so it explains the failure, not refuses
#     the plan.

_SPLITS = re.compile(r"split|chunk|unbind|unpacked")
"""Node targets that cut a tensor into pieces (fx methods, torch functions, ATen ops, fxmem's
``unpacked``: Note [Unpacking a tensor] in fxmem/frontends/tracing.py)."""
_NEAR = 3
"""How many nodes (views, casts) may lie between a projection and the split of its output."""


def fused_split_error(gm: fx.GraphModule, layers: Iterable[TpLayer], failed: str, cause: BaseException, degree: int, name: str = "model") -> CaptureError | None:
    """The failure at node ``failed`` explained as a column-wise layer whose output the model splits
    (Note [A fused projection split after a column-wise shard]); None where no such layer leads to it."""
    nodes = {n.name: n for n in gm.graph.nodes}
    bad = nodes.get(failed)
    if bad is None:
        return None
    for layer in (t for t in layers if t.style in _COLWISE):
        split = next((d for out in _outputs(gm, layer.path) for d in _near_splits(out) if d is bad or bad in _downstream(d)), None)
        if split is not None:
            return _fused_split_message(gm, layer, split, bad, cause, degree, name)
    return None


def _fused_split_message(gm: fx.GraphModule, layer: TpLayer, split: fx.Node, bad: fx.Node, cause: BaseException, degree: int, name: str) -> CaptureError:
    weight = getattr(gm.get_submodule(layer.path), "weight", None)
    width = int(weight.shape[0]) if isinstance(weight, torch.Tensor) else None
    features = f" {width} output features, {width // degree} on each rank," if isinstance(width, int) else " output features"
    first = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:200].rstrip(".")
    error = CaptureError(
        f"model '{name}': tensor parallel over {degree} ranks shards module '{layer.path}' ({layer.kind.__name__}, {layer.style}) by its"
        f"{features} and the model splits that output afterwards (node '{split.name}'), so each rank's slice cuts across the pieces "
        f"and the code after the split fails (node '{bad.name}': {type(cause).__name__}: {first}). A fused projection (q, k and v "
        f"from one Linear) can be planned colwise only if the model splits it by heads; otherwise leave '{layer.path}' out of the plan "
        "(--tp-plan with only the other layers, tp_plan= in Python), with the rowwise layer that reads its output's heads."
    )
    error.node = bad.name  # type: ignore[attr-defined]
    return error


def _outputs(gm: fx.GraphModule, path: str) -> list[fx.Node]:
    """The nodes that carry module ``path``'s result out of it: its call (torch.fx's leaf), or the nodes
    of its inlined code (torch.export's) that a node outside it reads."""
    inside = lambda n: node_fqn(n) == path or node_fqn(n).startswith(f"{path}.")
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and str(n.target) == path]
    return calls or [n for n in gm.graph.nodes if inside(n) and any(not inside(u) for u in n.users)]


def _near_splits(out: fx.Node) -> list[fx.Node]:
    """The nodes that split ``out`` within a few steps of it."""
    found, frontier = [], [out]
    for _ in range(_NEAR):
        frontier = [u for n in frontier for u in n.users]
        found += [n for n in frontier if _SPLITS.search(_target(n))]
    return found


def _downstream(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(node.users)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack += n.users
    return seen


def _target(n: fx.Node) -> str:
    return n.target if isinstance(n.target, str) else str(getattr(n.target, "__name__", n.target))
