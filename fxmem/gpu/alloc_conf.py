"""The caching allocator's settings a user can change: ``PYTORCH_CUDA_ALLOC_CONF`` and the memory fraction.

``AllocatorConfig`` mirrors the options of ``PYTORCH_CUDA_ALLOC_CONF`` that change how much memory a
step needs (``c10/cuda/CUDAAllocatorConfig.cpp`` and ``c10/core/AllocatorConfig.cpp`` parse them), and
``torch.cuda.set_per_process_memory_fraction``'s share. The defaults are torch's: no expandable segments,
no split limit, no garbage collection, the whole device.

>>> parse_alloc_conf("expandable_segments:True,max_split_size_mb:512")
AllocatorConfig(expandable_segments=True, max_split_size=536870912, garbage_collection_threshold=0.0, memory_fraction=None)
>>> parse_alloc_conf("").describe()
'torch defaults'
"""

from __future__ import annotations

from dataclasses import dataclass

from fxmem.errors import InputSpecError

__all__ = ["DEFAULT_ALLOC_CONF", "AllocatorConfig", "parse_alloc_conf"]

_MiB = 2**20
_MIN_SPLIT_MB = 20
"""``max_split_size_mb`` must exceed kLargeBuffer (20 MiB): CUDAAllocatorConfig rejects smaller values."""
_IGNORED = frozenset({"pinned_use_cuda_host_register", "pinned_num_register_threads", "pinned_use_background_threads", "release_lock_on_cudamalloc"})
"""Keys torch accepts that change nothing a single stream's device memory shows (host pinned memory, locking)."""


@dataclass(frozen=True)
class AllocatorConfig:
    """How the CUDA caching allocator is set up for the run (see fxmem/gpu/allocator.py for the rules)."""

    expandable_segments: bool = False
    """``expandable_segments:True``: one growing segment per pool, mapped in 2 MiB (small) or 20 MiB (large)
    pages, instead of one ``cudaMalloc`` per segment."""
    max_split_size: int | None = None
    """``max_split_size_mb`` in bytes: blocks this large or larger are never split, and a smaller request
    never takes one; None is torch's default (no limit)."""
    garbage_collection_threshold: float = 0.0
    """``garbage_collection_threshold``: with a memory fraction set, once reserved memory passes this share
    of it, cached blocks unused for longest are released before a new ``cudaMalloc``. 0 is off."""
    memory_fraction: float | None = None
    """``torch.cuda.set_per_process_memory_fraction(f)``: reserved memory may not pass ``f`` x the device's
    memory (and garbage collection applies only then). None: the whole device."""

    def __post_init__(self) -> None:
        if self.max_split_size is not None and self.max_split_size <= _MIN_SPLIT_MB * _MiB:
            raise InputSpecError(
                f"--alloc-conf max_split_size_mb:{self.max_split_size // _MiB}: torch requires more than {_MIN_SPLIT_MB} (MiB); "
                "give e.g. max_split_size_mb:128, or leave it out for no limit."
            )
        if not 0.0 <= self.garbage_collection_threshold < 1.0:
            raise InputSpecError(
                f"--alloc-conf garbage_collection_threshold:{self.garbage_collection_threshold}: torch requires a value in (0, 1), "
                "e.g. garbage_collection_threshold:0.6."
            )
        if self.memory_fraction is not None and not 0.0 < self.memory_fraction <= 1.0:
            raise InputSpecError(
                f"memory fraction {self.memory_fraction}: set_per_process_memory_fraction takes a share in (0, 1], e.g. 0.9."
            )

    def describe(self) -> str:
        """The settings in ``PYTORCH_CUDA_ALLOC_CONF``'s own words, "torch defaults" when all are torch's."""
        parts = []
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size // _MiB}")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold:g}")
        if self.memory_fraction is not None:
            parts.append(f"memory fraction {self.memory_fraction:g}")
        return ",".join(parts) if parts else "torch defaults"


DEFAULT_ALLOC_CONF = AllocatorConfig()


def parse_alloc_conf(text: str, *, memory_fraction: float | None = None) -> AllocatorConfig:
    """``PYTORCH_CUDA_ALLOC_CONF``'s syntax, ``key:value`` pairs separated by commas, into a config.

    Unknown keys and ``backend:cudaMallocAsync`` (CUDA's own pool, not the caching allocator) are
    refused by name; keys that do not change device memory are accepted and ignored.
    """
    config: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = (s.strip() for s in item.partition(":"))
        if not sep or not value:
            raise InputSpecError(f"--alloc-conf {text!r}: {item!r} is not key:value; write e.g. expandable_segments:True,max_split_size_mb:512.")
        if key in _IGNORED:
            continue
        config.update(_one(key, value, text))
    return AllocatorConfig(**config, memory_fraction=memory_fraction)  # type: ignore[arg-type]


def _one(key: str, value: str, text: str) -> dict[str, object]:
    if key == "expandable_segments":
        if value not in ("True", "False"):
            raise InputSpecError(f"--alloc-conf expandable_segments:{value}: torch accepts True or False.")
        return {"expandable_segments": value == "True"}
    if key == "max_split_size_mb":
        return {"max_split_size": _number(key, value, int) * _MiB}
    if key == "garbage_collection_threshold":
        threshold = _number(key, value, float)
        if threshold == 0.0:  # 0 is the field's "off", but parseGarbageCollectionThreshold refuses it (val_env > 0)
            raise InputSpecError(
                f"--alloc-conf garbage_collection_threshold:{value}: torch requires a value in (0, 1), e.g. "
                "garbage_collection_threshold:0.6; leave the key out to turn collection off."
            )
        return {"garbage_collection_threshold": threshold}
    if key == "backend":
        if value == "native":
            return {}
        raise InputSpecError(
            f"--alloc-conf backend:{value}: fxmem replays PyTorch's native caching allocator; cudaMallocAsync is CUDA's own "
            "stream-ordered pool, whose reuse fxmem does not model. Leave backend out (native) to predict the default."
        )
    known = "expandable_segments, max_split_size_mb, garbage_collection_threshold, backend"
    raise InputSpecError(f"--alloc-conf {text!r}: unknown key {key!r}; fxmem models {known}; of torch's other keys, roundup_power2_divisions, max_non_split_rounding_mb and large_segment_size_mb change memory and are not modelled yet (leave them out), the rest change none.")


def _number(key: str, value: str, kind: type) -> object:
    try:
        return kind(value)
    except ValueError:
        raise InputSpecError(f"--alloc-conf {key}:{value}: give a number, e.g. {key}:{'512' if kind is int else '0.6'}.") from None
