"""Validating what the user typed, once, at the boundary: input shapes with the batch symbol B,
dtypes, and memory sizes such as ``80GiB``.

>>> parse_inputs(["B,3,32,32", "labels=B:int64"])
(InputSpec(name=None, dims=('B', 3, 32, 32), dtype=torch.float32), InputSpec(name='labels', dims=('B',), dtype=torch.int64))
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from fxmem.errors import InputSpecError

__all__ = [
    "BATCH",
    "SEQ",
    "Constant",
    "InputSpec",
    "InputSpecs",
    "check_batch",
    "format_dims",
    "has_seq",
    "looks_like_shape",
    "make_input",
    "make_tensor",
    "parse_inputs",
    "parse_size",
    "tensors_of",
]

SEQ = "S"
"""The symbol of a sequence axis whose length stays symbolic (attention then brings B*S^2 terms)."""
BATCH = "B"
"""The symbol that marks the batch axis in an input shape."""

DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64, "double": torch.float64,
    "int64": torch.int64, "long": torch.int64, "int32": torch.int32, "int": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}  # fmt: skip

_SIZE_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


@dataclass(frozen=True)
class InputSpec:
    """One model input: its shape with ``"B"`` on the batch axis, its dtype, and its keyword name (or None)."""

    name: str | None
    dims: tuple[int | str, ...]
    dtype: torch.dtype = torch.float32

    def shape_at(self, batch: int | torch.SymInt, seq: int | torch.SymInt | None = None) -> tuple[int | torch.SymInt, ...]:
        """The shape with B replaced by ``batch`` and S by ``seq`` (ints or SymInts)."""
        if seq is None and SEQ in self.dims:
            raise InputSpecError(f"input '{self}' has a symbolic sequence axis S: give a sequence length (--seq-len).")
        sizes: dict[str, int | torch.SymInt] = {BATCH: batch} | ({SEQ: seq} if seq is not None else {})
        return tuple(sizes[d] if isinstance(d, str) else d for d in self.dims)

    def __str__(self) -> str:
        prefix = f"{self.name}=" if self.name else ""
        return f"{prefix}{format_dims(self.dims)}:{dtype_name(self.dtype)}"


@dataclass(frozen=True)
class Constant(InputSpec):
    """A forward() argument that is not a tensor with a batch axis (``return_loss=True``, ``None``, a
    float, a list of ints): passed through to the model unchanged in every pass, never counted as input
    bytes. A subclass of InputSpec so that it keeps its place among the inputs (positional or keyword)
    everywhere specs travel; its ``dims`` are empty and never read.

    >>> Constant.of("return_loss", True)
    Constant(name='return_loss', dims=(), dtype=torch.float32, value=True)
    """

    value: object = None

    @classmethod
    def of(cls, name: str | None, value: object) -> Constant:
        return cls(name, (), torch.float32, value)

    def __str__(self) -> str:
        prefix = f"{self.name}=" if self.name else ""
        return f"{prefix}{self.value!r}"


InputSpecs = Sequence["str | tuple[int | str, ...] | InputSpec"] | Mapping[str, "str | tuple[int | str, ...] | InputSpec"]


def format_dims(dims: Sequence[object]) -> str:
    return ",".join(str(d) for d in dims)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_inputs(inputs: object) -> tuple[InputSpec, ...]:
    """Turn a list (positional) or dict (keyword) of specs into InputSpecs, validating each once."""
    if isinstance(inputs, (str, InputSpec)) or (isinstance(inputs, tuple) and _is_dims(inputs)):
        inputs = [inputs]
    if isinstance(inputs, Mapping):
        specs = tuple(_parse_one(v, name=str(k)) for k, v in inputs.items())
    elif isinstance(inputs, Sequence):
        specs = tuple(_parse_one(v, name=None) for v in inputs)
    else:
        raise InputSpecError(
            f"inputs must be a list (positional) or a dict (keyword) of shape specs such as 'B,3,224,224', got {type(inputs).__name__}."
        )
    if not specs:
        raise InputSpecError("no inputs given: pass at least one shape spec such as 'B,3,224,224'.")
    _check_order(specs)
    return specs


def _is_dims(value: tuple[object, ...]) -> bool:
    """('B', 3, 224) is one shape; ('B,3,224',) or ('B,8', 'B,4') are specs, one per input."""
    return all(_is_dim(d) for d in value)


def _is_dim(d: object) -> bool:
    if isinstance(d, str):
        return not any(c in d for c in ",:=")
    return isinstance(d, int) and not isinstance(d, bool)


def _check_order(specs: tuple[InputSpec, ...]) -> None:
    seen_keyword = False
    for spec in specs:
        if spec.name is None and seen_keyword:
            raise InputSpecError(f"positional input {spec} comes after a keyword input; list positional inputs first.")
        seen_keyword |= spec.name is not None


def _parse_one(value: object, *, name: str | None) -> InputSpec:
    """A shape spec (a string, or a tuple of dims) becomes an InputSpec; anything else is passed through
    as a Constant, except a structure that holds shape specs (see ``_nested_shapes``)."""
    if isinstance(value, InputSpec):
        return value if name is None else replace(value, name=name)
    if isinstance(value, str):
        return _parse_string(value, name=name)
    if isinstance(value, (tuple, list)) and value and _is_dims(tuple(value)) and any(isinstance(d, str) for d in value):
        return InputSpec(name, _check_dims(tuple(value), str(value)), torch.float32)
    _refuse_nested_shapes(value, name)
    return Constant.of(name, value)


def _refuse_nested_shapes(value: object, name: str | None) -> None:
    """A list or dict whose leaves are shape specs (a detection model's per-sample targets) would need
    tensors made per sample with B inside a Python structure, which the symbolic pass cannot size."""
    found = [leaf for leaf in _leaves(value) if isinstance(leaf, str) and looks_like_shape(leaf)]
    if found:
        label = f"input '{name}'" if name else "a positional input"
        raise InputSpecError(
            f"{label} is a nested structure holding shape specs ({', '.join(map(repr, found[:3]))}); fxmem makes "
            "tensors only for top-level inputs, whose batch axis B it keeps symbolic. Pass each tensor as its own "
            "input (e.g. {'boxes': 'B,4', 'labels': 'B:int64'}) and wrap the model in an nn.Module whose forward() "
            "builds the structure from them, or pass the structure built from real tensors as a constant "
            "(fxmem.Constant) at one batch size."
        )


def _leaves(value: object) -> list[object]:
    if isinstance(value, Mapping):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def looks_like_shape(text: str) -> bool:
    """A string written like a shape spec with the batch axis: 'B,4', 'labels=B:int64'."""
    return re.fullmatch(r"\s*(\w+=)?[\w\s]+(,[\w\s]+)*(:\w+)?\s*", text) is not None and BATCH in re.split(r"[,:=\s]", text)


def _parse_string(text: str, *, name: str | None) -> InputSpec:
    raw = text.strip()
    if "=" in raw:
        key, raw = (part.strip() for part in raw.split("=", 1))
        if not key.isidentifier():
            raise InputSpecError(f"input '{text}': '{key}' is not a valid keyword name.")
        name = key
    shape, colon, dtype = raw.partition(":")
    if colon and not dtype.strip():
        raise InputSpecError(f"input '{text}': nothing after ':'; name a dtype, e.g. 'B,1024:int64', or drop the ':' for float32.")
    dims = tuple(_parse_dim(d.strip(), text) for d in shape.split(","))
    return InputSpec(name, _check_dims(dims, text), parse_dtype(dtype.strip(), text) if colon else torch.float32)


def _parse_dim(token: str, text: str) -> int | str:
    if re.fullmatch(r"[-+]?\d+", token):
        return int(token)
    if re.fullmatch(r"[A-Za-z_]\w*", token):
        return token
    raise InputSpecError(
        f"input '{text}': '{token}' is not a dimension; write positive integers and the batch symbol B, "
        "separated by commas, e.g. 'B,3,224,224' or 'B,1024:int64'."
    )


def _check_dims(dims: tuple[int | str, ...], text: str) -> tuple[int | str, ...]:
    for d in dims:
        if isinstance(d, str) and d not in (BATCH, SEQ):
            raise InputSpecError(
                f"input '{text}': unknown symbol '{d}'; the batch axis is written 'B', a sequence axis whose "
                "length should stay symbolic 'S', and every other dimension must be a positive integer."
            )
        if isinstance(d, int) and d <= 0:
            raise InputSpecError(
                f"input '{text}': dimension {d} must be a positive integer; a fixed size is written as a number "
                "and the batch axis as B, e.g. 'B,3,224,224'."
            )
    if dims.count(BATCH) != 1:
        where = "has no batch axis" if BATCH not in dims else "names the batch axis B more than once"
        raise InputSpecError(
            f"input '{text}' {where}: mark exactly one axis with the symbol B, e.g. 'B,3,224,224' "
            "(or '128,B,512' for sequence-first models)."
        )
    return dims


def check_batch(batch: object) -> None:
    """A batch size given by the user (--batch, analyze(batch=), report.activation_bytes(B)) is a positive int."""
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise InputSpecError(f"batch must be a positive integer, got {batch!r}.")


def tensors_of(specs: Sequence[InputSpec], values: Sequence[object]) -> list[torch.Tensor]:
    """The tensors among ``values`` (made by ``make_input`` for ``specs``): the constants left out."""
    return [v for s, v in zip(specs, values) if not isinstance(s, Constant) and isinstance(v, torch.Tensor)]


def call_arguments(specs: Sequence[InputSpec], values: Sequence[Any]) -> tuple[list[Any], dict[str, Any]]:
    """The values as ``model(*args, **kwargs)`` takes them: positional inputs in order, named ones by name."""
    args = [v for s, v in zip(specs, values) if s.name is None]
    kwargs = {s.name: v for s, v in zip(specs, values) if s.name is not None}
    return args, kwargs


def has_seq(specs: Sequence[InputSpec]) -> bool:
    """True when some input has a symbolic sequence axis S."""
    return any(SEQ in s.dims for s in specs)


def make_input(spec: InputSpec, batch: int | torch.SymInt, seq: int | torch.SymInt | None = None) -> Any:
    """The value forward() receives for ``spec``: a Constant's own value, else ``make_tensor``'s tensor."""
    return spec.value if isinstance(spec, Constant) else make_tensor(spec, batch, seq)


def make_tensor(spec: InputSpec, batch: int | torch.SymInt, seq: int | torch.SymInt | None = None) -> torch.Tensor:
    """A tensor for ``spec`` at ``batch`` (fake under FakeTensorMode): random floats, integer zeros.

    Integer inputs are zeros so that token ids and class indices are valid for any vocabulary.
    """
    shape = spec.shape_at(batch, seq)
    if spec.dtype.is_floating_point or spec.dtype.is_complex:
        return torch.randn(shape, dtype=spec.dtype)
    return torch.zeros(shape, dtype=spec.dtype)


def parse_dtype(text: str, context: str = "", *, option: str = "") -> torch.dtype:
    """``'bf16'`` -> torch.bfloat16; ``context`` (an input spec) or ``option`` (a flag) names where it came from."""
    try:
        return DTYPES[text.lower()]
    except KeyError:
        where = f"input '{context}': " if context else f"{option}: " if option else ""
        raise InputSpecError(f"{where}unknown dtype '{text}'; use one of {', '.join(DTYPES)}.") from None


def parse_size(text: str | int, what: str = "size", *, allow_zero: bool = False) -> int:
    """``'80GiB'``, ``'80 GB'`` or ``'512MiB'`` -> bytes; an int is a number of bytes already.

    A string needs its unit: ``--device-memory 80`` once meant 80 bytes, never what was meant (issue 35).
    Only ``'0'`` may go without one, as 0 is 0 bytes in any unit; ``allow_zero`` accepts it (``--overhead
    cuda_context=0`` turns a fixed cost off), else a size is at least 1 byte.

    >>> parse_size("1.5GiB"), parse_size("24GB"), parse_size("0", allow_zero=True)
    (1610612736, 24000000000, 0)
    """
    from decimal import Decimal  # exact: float('0.3') * 10**9 truncates to 299,999,999 bytes

    units = "B, KiB, MiB, GiB, TiB, KB, MB, GB, TB"
    if isinstance(text, int) and not isinstance(text, bool):
        nbytes = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
        if not match or match.group(2).lower() not in _SIZE_UNITS | {"": 1}:
            raise InputSpecError(
                f"{what} '{text}' is not a size: write a positive number with a unit such as 80GiB, 80GB, 512MiB or 1024B (units: {units})."
            )
        number, unit = match.group(1), match.group(2).lower()
        if not unit and Decimal(number) != 0:
            raise InputSpecError(
                f"{what} '{text}' has no unit: a bare number would be {number} bytes, which is rarely what is meant. "
                f"Write {number}GiB or {number}GB (units: {units})."
            )
        nbytes = int(Decimal(number) * _SIZE_UNITS[unit or "b"])  # int() truncates: '0.5B' is 0 bytes
    if nbytes < (0 if allow_zero else 1):
        least = "0 or more bytes" if allow_zero else "a positive size such as 80GiB or 24GB"
        raise InputSpecError(f"{what} '{text}' is {nbytes} bytes; give {least}.")
    return nbytes
