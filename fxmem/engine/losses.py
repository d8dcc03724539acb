"""The loss that turns a model's output into the scalar a training step needs.

Each loss is part of the step, so what it saves (cross-entropy's log-softmax, which for an LLM's
vocabulary is huge) is part of the activations. Targets are created beside the output with the
output's batch axis and are classified as input data, like the batch itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves

from fxmem.errors import FxmemWarning, InputSpecError

Shape = tuple["int | torch.SymInt", ...]

__all__ = ["LOSSES", "Loss", "get_loss"]


@dataclass(frozen=True)
class Loss:
    """A named loss: how to shape its target from the output, and how to compute it."""

    name: str
    summary: str
    target: Callable[[torch.Tensor], tuple[Shape, torch.dtype] | None]
    compute: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]

    own: bool | None = False
    """True for 'model': the model computed its loss itself (a Hugging Face model given labels);
    None for 'auto': the model's own loss where its output has one, else the sum of its output."""

    def select(self, out: object, model: str) -> torch.Tensor:
        """The tensor the loss applies to: the model's own scalar loss for 'model' (and 'auto' where there
        is one), else its first float output; a dict's entry taken for it is named in an FxmemWarning."""
        leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if self.own is not False:
            own = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
            scalars = [own] if isinstance(own, torch.Tensor) else [t for t in leaves if t.dim() == 0]
            if scalars:
                return scalars[0]
            if self.own:
                raise InputSpecError(
                    f"loss 'model': model '{model}' returned no scalar loss; give it its labels (e.g. --input "
                    "labels=B,S:int64) or choose another --loss."
                )
        chosen = self._first(leaves, out, model)
        if isinstance(out, Mapping):
            _say_which_entry(out, chosen, model)
        return chosen

    @staticmethod
    def _first(leaves: list[torch.Tensor], out: object, model: str) -> torch.Tensor:
        if not leaves:
            raise InputSpecError(
                f"model '{model}' returned {type(out).__name__} with no floating-point tensor in it; a training "
                "step needs a tensor output to put a loss on. Wrap the model so that forward() returns its logits."
            )
        return leaves[0]

    def make_target(self, output: torch.Tensor) -> torch.Tensor | None:
        """A target for ``output`` on its device (fake under FakeTensorMode): zero class indices, or random floats."""
        spec = self.target(output)
        if spec is None:
            return None
        shape, dtype = spec
        make = torch.randn if dtype.is_floating_point else torch.zeros
        return make(shape, dtype=dtype, device=output.device)


def _say_which_entry(out: Mapping[object, object], chosen: torch.Tensor, model: str) -> None:
    """One FxmemWarning naming the entry of a dict output the loss was put on (shown once by the CLI)."""
    key = next((k for k, v in out.items() if any(t is chosen for t in tree_leaves(v))), None)
    hint = " (--loss model takes its 'loss' entry)" if "loss" in out and key != "loss" else ""
    kind = "dict" if type(out).__name__ in ("dict", "immutable_dict") else type(out).__name__  # fx outputs an immutable_dict
    warnings.warn(
        f"forward() of model '{model}' returns a {kind}; the loss uses its {key!r} entry, the first floating-point one{hint}.",
        FxmemWarning,
        stacklevel=4,
    )


def _no_target(out: torch.Tensor) -> None:
    return None


def _like_output(out: torch.Tensor) -> tuple[Shape, torch.dtype]:
    return tuple(out.shape), out.dtype


def _class_dim1(out: torch.Tensor) -> tuple[Shape, torch.dtype]:
    if out.dim() < 2:
        raise InputSpecError(
            f"loss 'cross_entropy' needs an output of shape (B, classes, ...), got {out.dim()} dimension(s); "
            "use --loss sum or mse for this model."
        )
    return (out.shape[0], *out.shape[2:]), torch.int64


def _class_last(out: torch.Tensor) -> tuple[Shape, torch.dtype]:
    if out.dim() < 2:
        raise InputSpecError("loss 'lm_cross_entropy' needs logits of shape (B, ..., vocab); use --loss sum or mse.")
    return tuple(out.shape[:-1]), torch.int64


def _lm_cross_entropy(out: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    assert target is not None
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def _with_target(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    def compute(out: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        assert target is not None
        return fn(out, target)

    return compute


LOSSES: dict[str, Loss] = {
    loss.name: loss
    for loss in (
        Loss("sum", "output.sum(): saves nothing, the neutral choice", _no_target, lambda out, _t: out.sum()),
        Loss("mse", "F.mse_loss against a target shaped like the output", _like_output, _with_target(F.mse_loss)),
        Loss(
            "cross_entropy",
            "F.cross_entropy with classes on dim 1 and class-index targets (B, or B,H,W for segmentation)",
            _class_dim1,
            _with_target(F.cross_entropy),
        ),
        Loss(
            "lm_cross_entropy",
            "language-model cross-entropy: logits (B,S,V) flattened to (B*S,V), token targets (B,S)",
            _class_last,
            _lm_cross_entropy,
        ),
        Loss(
            "model",
            "the model's own loss (its .loss, or its scalar output): what it saves is in the graph",
            _no_target,
            lambda out, _t: out,
            own=True,
        ),
        Loss("auto", "the model's own loss where its output has one, else sum", _no_target, lambda out, _t: out.sum(), own=None),
    )
}


def get_loss(name: str) -> Loss:
    try:
        return LOSSES[name]
    except KeyError:
        raise InputSpecError(f"unknown loss '{name}'; use one of: {', '.join(LOSSES)}.") from None
