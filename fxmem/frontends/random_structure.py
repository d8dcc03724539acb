"""Models whose structure is drawn at random in training (LayerDrop): refused, with the cause named.

Note [Random structure]
    LayerDrop (Fan et al. 2019; transformers' wav2vec2, HuBERT, WavLM, BART, Whisper encoders) skips each
    layer with probability ``config.layerdrop`` in every training step: ``if self.training and
    torch.rand([]) < layerdrop: continue`` (or ``np.random.random()``). The set of layers a step runs,
    and so its memory, is random; no single figure is the truth. Left alone, the trace draws once: torch.fx
    runs ``torch.rand([])`` for real (it takes no proxy), and a Python ``if`` on it bakes one random draw
    into the graph, so the layers skipped in that draw silently vanish from every figure; numpy's and
    Python's ``random`` do the same in torch.export.

    While the model is traced (``watching_random_decisions``), a random number drawn without a tensor
    input (``torch.rand([])``, ``np.random.random()``, ``random.random()``...) is marked, anything
    computed from it keeps the mark, and a Python branch on a marked value (``Tensor.__bool__``, or a
    comparison of the marked float) raises ``RandomStructure``: the model, the module, the line, the
    config field that sets the probability where one is found, and what to do. With the field at 0 every
    layer runs: the most any LayerDrop step holds, so those figures are LayerDrop's worst case. Random
    *values* (dropout masks, SpecAugment masks: the same sizes every step) are left alone.

Note [A random draw compared with a bound it cannot cross]
    Not every branch on a draw is random. PEFT's LyCORIS layers (peft 0.21, tuners/loha/layer.py and
    tuners/lokr/layer.py, ``forward``) run the adapter ``if (not self.training) or (self.training and
    torch.rand(1) > module_dropout)``, with ``module_dropout`` 0.0 by default: the adapter runs in every
    step. ``torch.rand`` draws from [0, 1) (on the CPU, ``uniform_real`` in
    aten/src/ATen/core/TransformationHelper.h makes a float32 from 24 random bits, ``(v & (2**24 - 1)) *
    2**-24``), so ``torch.rand(...) > 0`` is False only for a draw of exactly 0, once in 2**24 calls, and
    ``> p`` for p >= 1 never holds. Such a comparison (``>``, ``>=``, ``<``, ``<=`` of a ``rand`` or
    ``rand_like`` draw against a number at or beyond the ends of [0, 1)) is decided as the step decides it
    (the 2**-24 case taken as never), not refused; on torch.export's fake draw its ``bool()`` is answered
    without a guard on the value (which would stop the export on ``Eq(u0, 1)``). With ``module_dropout``
    above 0 the branch is random again, and refused.
"""

from __future__ import annotations

import contextlib
import inspect
import random
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary

from fxmem.errors import TraceError

__all__ = ["RandomStructure", "watching_random_decisions"]


class RandomStructure(TraceError):
    """A Python branch on a random draw in training: the step's structure is random (Note [Random structure])."""

    def __init__(self, message: str, owner: object = None) -> None:
        super().__init__(message)
        self.owner = owner

    def for_model(self, name: str, model: nn.Module) -> RandomStructure:
        """The refusal as the user reads it: the model's name first, the branching module by its path."""
        path = next((p for p, m in model.named_modules() if m is self.owner), None)
        text = str(self)
        if path is not None and isinstance(self.owner, nn.Module):
            kind = type(self.owner).__name__
            text = text.replace(f" in {kind} (", f" in module '{path or '(top level)'}' ({kind}) (", 1)
        return RandomStructure(f"model '{name}': {text}", self.owner)


_DRAWS = frozenset({"rand", "randn", "randint", "bernoulli", "normal", "uniform_", "rand_like", "randn_like"})
"""torch's random factories; marked only where no input is a traced tensor (a draw the trace makes for real)."""

_NOT_USERS = (f"{torch.__path__[0]}/", f"{__file__.rpartition('/frontends/')[0]}/", f"{inspect.getfile(contextlib).rpartition('/')[0]}/")


class _RandomNumber(float):
    """A Python float drawn at random while tracing: a comparison of it is a random decision."""

    def _decide(self, other: Any, op: Any) -> Any:
        return _RandomDecision(op(float(self), other))

    __lt__ = lambda self, other: self._decide(other, float.__lt__)  # noqa: E731
    __le__ = lambda self, other: self._decide(other, float.__le__)  # noqa: E731
    __gt__ = lambda self, other: self._decide(other, float.__gt__)  # noqa: E731
    __ge__ = lambda self, other: self._decide(other, float.__ge__)  # noqa: E731


class _RandomDecision:
    """The outcome of comparing a random draw: using it in a branch is refused (Note [Random structure])."""

    def __init__(self, value: bool) -> None:
        self.value = value

    def __bool__(self) -> bool:
        raise _refusal(sys._getframe(1))


class _RandomDecisions(TorchFunctionMode):
    """Marks torch's random draws made for real during a trace, and refuses a branch on one."""

    def __init__(self) -> None:
        super().__init__()
        self.marked: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        """Each draw, and what is computed from it: True, or ``_UNIT`` for a draw in [0, 1) as drawn."""
        self.certain: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        """Comparisons of a unit draw whose outcome is certain: Note [A random draw compared with a bound it cannot cross]."""

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if name == "__bool__" and tensors and tensors[0] in self.certain:
            return self.certain[tensors[0]]
        if name == "__bool__" and tensors and tensors[0] in self.marked:
            raise _refusal(sys._getframe(1))
        out = func(*args, **kwargs)
        drawn = name in _DRAWS and not any(isinstance(a, torch.fx.Proxy) for a in (*args, *kwargs.values()))
        if not isinstance(out, torch.Tensor) or not (drawn or any(t in self.marked for t in tensors)):
            return out
        outcome = _certain(name, args, self.marked.get(args[0]) if args and isinstance(args[0], torch.Tensor) else None)
        if outcome is not None:
            self.certain[out] = outcome
        else:
            self.marked[out] = _UNIT if name in _UNIT_DRAWS and drawn else True
        return out


_UNIT = "[0, 1)"
_UNIT_DRAWS = frozenset({"rand", "rand_like"})
"""Draws uniform on [0, 1): Note [A random draw compared with a bound it cannot cross]."""


def _certain(name: str, args: Sequence[Any], mark: object) -> bool | None:
    """The outcome of comparing a unit draw with a number beyond its range, or None where the outcome is random
    (Note [A random draw compared with a bound it cannot cross])."""
    bound = args[1] if len(args) == 2 else None
    if mark != _UNIT or not isinstance(bound, (int, float)) or isinstance(bound, bool):
        return None
    op = name.strip("_")
    if op in ("gt", "ge"):  # draw > p: always for p at or below 0 (a draw of exactly 0 taken as never), never for p >= 1
        return True if bound <= 0 else False if bound >= 1 else None
    if op in ("lt", "le"):
        return True if bound >= 1 else False if bound <= 0 else None
    return None


def _drawing(draw: Any) -> Any:
    """``draw`` returning a marked float where it draws one number (no size given)."""

    def marked(*args: Any, **kwargs: Any) -> Any:
        value = draw(*args, **kwargs)
        return _RandomNumber(value) if isinstance(value, float) and not kwargs.get("size") else value

    return marked


@contextlib.contextmanager
def watching_random_decisions() -> Iterator[None]:
    """Refuse a Python branch on a random draw while tracing (Note [Random structure])."""
    patched: list[tuple[Any, str, Any]] = [(random, n, getattr(random, n)) for n in ("random", "uniform")]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        patched += [(numpy.random, n, getattr(numpy.random, n)) for n in ("random", "uniform", "rand", "random_sample")]
    for owner, attr, draw in patched:
        setattr(owner, attr, _drawing(draw))
    try:
        with _RandomDecisions():
            yield
    finally:
        for owner, attr, draw in patched:
            setattr(owner, attr, draw)


def _refusal(frame: Any) -> RandomStructure:
    """The refusal, told from the user's frame that branched on the draw."""
    while frame is not None and frame.f_code.co_filename.startswith(_NOT_USERS):
        frame = frame.f_back
    if frame is None:
        return RandomStructure("the model branches on a random number in training, so its structure (which layers run) is random; fxmem cannot give one figure for it.")
    code = frame.f_code
    owner = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None  # ``self``, by whatever name
    where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    line = (inspect.getframeinfo(frame).code_context or [""])[0].strip()
    module = f" in {type(owner).__name__}" if isinstance(owner, nn.Module) else ""
    field = _probability_field(owner, frame)
    drop = "LayerDrop: it skips layers at random" if field and "drop" in field[0].lower() else "it decides at random which code runs"
    off = (
        f"Set {field[0]} (now {field[1]:g}) to 0 for the analysis (--config {field[0].removeprefix('config.')}=0 for hf: specs)"
        if field
        else "Turn the random choice off for the analysis (its probability to 0)"
    )
    return RandomStructure(
        f"the model branches on a random number in training at {where}{module} ({line}): {drop}, so every step runs "
        f"a different set of layers and its memory is random, with no single figure to give. {off}: every layer then "
        "runs, the most any such step holds, so those figures are the worst case of every step.",
        owner,
    )


def _probability_field(owner: Any, frame: Any) -> tuple[str, float] | None:
    """The attribute of the module or its config, named in the branching function, that holds the probability."""
    try:
        source = inspect.getsource(frame.f_code)
    except (OSError, TypeError):
        source = ""
    words = set(re.findall(r"[A-Za-z_]\w*", source))
    found = []
    for holder, prefix in ((getattr(owner, "config", None), "config."), (owner, "")):
        for word in sorted(words):
            value = getattr(holder, word, None) if holder is not None and not word.startswith("_") else None
            if isinstance(value, float) and not isinstance(value, bool) and 0.0 < value <= 1.0:
                found.append((prefix + word, value))
    found.sort(key=lambda f: "drop" not in f[0].lower())
    return found[0] if found else None
