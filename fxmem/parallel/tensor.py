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
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from fxmem.errors import CaptureError, InputSpecError

__all__ = ["TpLayer", "apply_tp", "default_tp_plan", "resolve_tp_plan", "tp_layers"]

STYLES = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise")
"""The style names a plan may use (Note [Tensor parallel plans])."""
_HEAD_COUNTS = ("heads", "num_heads", "num_attention_heads", "num_key_value_heads")
"""Attributes of an attention module (or of its ``config``) that count heads a column-wise
projection splits among the ranks."""


@dataclass(frozen=True)
class TpLayer:
    """One module of a resolved plan: its path, its style, and the class the style was made for
    (``nn.Linear`` or ``nn.Embedding``; torch.export's graph holds the parameters in plain modules)."""

    path: str
    style: str
    kind: type[nn.Module]


def default_tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The plan a model carries: a HF model's ``_tp_plan`` (its config's ``base_model_tp_plan``
    under the model's prefix), or a zoo model's attribute of the same name; None if it has none."""
    plan = getattr(model, "_tp_plan", None)
    return dict(plan) if isinstance(plan, Mapping) and plan else None


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
                f"apply; use one of {', '.join(STYLES)} (torch's ColwiseParallel / RowwiseParallel), or leave it out."
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
    module = modules[path]
    kind: type[nn.Module] = nn.Embedding if style == "embedding_rowwise" else nn.Linear
    if not isinstance(module, kind):
        raise InputSpecError(
            f"model '{name}': the tensor-parallel plan gives module '{path}' ({type(module).__name__}) the style "
            f"'{style}', which shards an {kind.__name__}; name the {kind.__name__} layers only."
        )
    split = {"colwise": "out_features", "colwise_gather_output": "out_features", "rowwise": "in_features"}.get(style, "num_embeddings")
    size = int(getattr(module, split))
    if size % degree:
        raise InputSpecError(
            f"model '{name}': tensor parallel over {degree} ranks splits the {split} of '{path}' ({size}), which {degree} "
            f"does not divide; choose a --tp that divides {size}."
        )
    if style == "colwise":
        _check_heads(modules, path, degree, name)
    return TpLayer(path, style, kind)


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
            parallelize_module(module, mesh, _style(layer.style))
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise CaptureError(
                f"model '{name}': parallelize_module refused '{layer.path}' ({layer.style}): {type(e).__name__}: {first}; "
                "change the tensor-parallel plan (tp_plan=...)."
            ) from e


def _style(style: str) -> ParallelStyle:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style == "colwise":
        return ColwiseParallel()
    if style == "colwise_gather_output":
        return ColwiseParallel(output_layouts=Replicate())
    if style == "rowwise":
        return RowwiseParallel()
    return RowwiseParallel(input_layouts=Replicate())
