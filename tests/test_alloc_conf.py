"""``PYTORCH_CUDA_ALLOC_CONF`` parsed as torch parses it (fxmem/gpu/alloc_conf.py).

The bounds are torch's own: ``AcceleratorAllocatorConfig::parseMaxSplitSize`` (c10/core/AllocatorConfig.cpp;
``CUDAAllocatorConfig::parseMaxSplitSize`` before it) refuses a ``max_split_size_mb`` of kLargeBuffer
(20 MiB) or less, ``parseGarbageCollectionThreshold`` a threshold outside (0.0, 1.0), and
``ConfigTokenizer::toBool`` anything but ``True`` or ``False``.
"""

from __future__ import annotations

import doctest

import pytest

import fxmem.gpu.alloc_conf
from fxmem.errors import InputSpecError
from fxmem.gpu.alloc_conf import DEFAULT_ALLOC_CONF, AllocatorConfig, parse_alloc_conf

MiB = 2**20


def test_docstring_examples() -> None:
    result = doctest.testmod(fxmem.gpu.alloc_conf, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_empty_text_is_torchs_defaults() -> None:
    # parseArgs resets max_split_size to SIZE_MAX and the threshold to 0 when a key is absent.
    assert parse_alloc_conf("") == DEFAULT_ALLOC_CONF == AllocatorConfig()
    assert (DEFAULT_ALLOC_CONF.expandable_segments, DEFAULT_ALLOC_CONF.max_split_size) == (False, None)
    assert (DEFAULT_ALLOC_CONF.garbage_collection_threshold, DEFAULT_ALLOC_CONF.memory_fraction) == (0.0, None)


def test_each_modelled_key_sets_its_field() -> None:
    conf = parse_alloc_conf("expandable_segments:True,max_split_size_mb:512,garbage_collection_threshold:0.6")
    # max_split_size_mb is in MiB: 512 * 2**20 bytes.
    assert conf == AllocatorConfig(expandable_segments=True, max_split_size=512 * MiB, garbage_collection_threshold=0.6)
    assert parse_alloc_conf("expandable_segments:False").expandable_segments is False


def test_spaces_empty_items_and_repeats() -> None:
    # Items are split on commas and stripped; an empty item is skipped; a key given twice keeps its last
    # value, as torch's parser, which sets the field once per occurrence, does.
    conf = parse_alloc_conf(" max_split_size_mb : 128 ,, max_split_size_mb:256 ,")
    assert conf.max_split_size == 256 * MiB


def test_memory_fraction_comes_from_its_own_argument() -> None:
    conf = parse_alloc_conf("expandable_segments:True", memory_fraction=0.5)
    assert (conf.expandable_segments, conf.memory_fraction) == (True, 0.5)
    assert parse_alloc_conf("", memory_fraction=1.0).memory_fraction == 1.0


@pytest.mark.parametrize("mb", [1, 19, 20])
def test_max_split_size_of_20_mib_or_less_is_refused(mb: int) -> None:
    # CUDAAllocatorConfig::parseMaxSplitSize: TORCH_CHECK(val1 > kLargeBuffer / (1024 * 1024)), i.e. > 20.
    # (torch's newer c10/core/AllocatorConfig.cpp checks val_env >= 20 and so accepts 20 itself.)
    with pytest.raises(InputSpecError, match=rf"max_split_size_mb:{mb}\b.*more than 20"):
        parse_alloc_conf(f"max_split_size_mb:{mb}")


def test_max_split_size_just_above_20_mib_is_accepted() -> None:
    assert parse_alloc_conf("max_split_size_mb:21").max_split_size == 21 * MiB


@pytest.mark.parametrize("value", ["0", "1", "1.5", "-0.2"])
def test_garbage_collection_threshold_outside_0_1_is_refused(value: str) -> None:
    # parseGarbageCollectionThreshold: TORCH_CHECK_VALUE(val_env > 0 && val_env < 1.0); 0 is refused by
    # torch too (leaving the key out is how one turns collection off).
    with pytest.raises(InputSpecError, match=r"garbage_collection_threshold.*\(0, 1\)"):
        parse_alloc_conf(f"garbage_collection_threshold:{value}")


def test_garbage_collection_threshold_inside_0_1_is_accepted() -> None:
    assert parse_alloc_conf("garbage_collection_threshold:0.01").garbage_collection_threshold == 0.01
    assert parse_alloc_conf("garbage_collection_threshold:0.99").garbage_collection_threshold == 0.99


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("expandable_segments:true", r"expandable_segments:true: torch accepts True or False"),
        ("expandable_segments:1", r"expandable_segments:1:"),
        ("max_split_size_mb:lots", r"max_split_size_mb:lots: give a number"),
        ("max_split_size_mb:512.5", r"max_split_size_mb:512.5: give a number"),
        ("garbage_collection_threshold:high", r"garbage_collection_threshold:high: give a number"),
        ("expandable_segments", r"'expandable_segments' is not key:value"),
        ("max_split_size_mb:", r"'max_split_size_mb:' is not key:value"),
    ],
)
def test_malformed_values_are_refused_by_name(text: str, match: str) -> None:
    with pytest.raises(InputSpecError, match=match):
        parse_alloc_conf(text)


@pytest.mark.parametrize("key", ["roundup_power2_divisions", "max_split_size", "expandable_segment", "large_segment_size_mb"])
def test_unknown_keys_are_refused_naming_the_key(key: str) -> None:
    with pytest.raises(InputSpecError, match=rf"unknown key '{key}'"):
        parse_alloc_conf(f"expandable_segments:True,{key}:4")


def test_cuda_malloc_async_backend_is_refused() -> None:
    # backend:cudaMallocAsync hands memory to CUDA's stream-ordered pool, not the caching allocator.
    with pytest.raises(InputSpecError, match=r"backend:cudaMallocAsync.*native caching allocator") as info:
        parse_alloc_conf("backend:cudaMallocAsync")
    assert "\n" not in str(info.value)
    assert parse_alloc_conf("backend:native") == DEFAULT_ALLOC_CONF


@pytest.mark.parametrize(
    "item",
    [
        "pinned_use_cuda_host_register:True",
        "pinned_num_register_threads:8",
        "pinned_use_background_threads:True",
        "release_lock_on_cudamalloc:True",
    ],
)
def test_keys_that_change_no_device_memory_are_ignored(item: str) -> None:
    assert parse_alloc_conf(item) == DEFAULT_ALLOC_CONF
    assert parse_alloc_conf(f"{item},max_split_size_mb:64") == AllocatorConfig(max_split_size=64 * MiB)


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5])
def test_memory_fraction_outside_0_1_is_refused(fraction: float) -> None:
    # set_per_process_memory_fraction takes [0, 1]; a share of 0 leaves nothing to allocate, so (0, 1].
    with pytest.raises(InputSpecError, match=r"memory fraction"):
        parse_alloc_conf("", memory_fraction=fraction)


@pytest.mark.parametrize(
    ("conf", "text"),
    [
        (AllocatorConfig(), "torch defaults"),
        (AllocatorConfig(expandable_segments=True), "expandable_segments:True"),
        (AllocatorConfig(max_split_size=512 * MiB), "max_split_size_mb:512"),
        (AllocatorConfig(garbage_collection_threshold=0.6), "garbage_collection_threshold:0.6"),
        (AllocatorConfig(memory_fraction=0.9), "memory fraction 0.9"),
        (
            AllocatorConfig(True, 128 * MiB, 0.5, 0.75),
            "expandable_segments:True,max_split_size_mb:128,garbage_collection_threshold:0.5,memory fraction 0.75",
        ),
    ],
)
def test_describe_speaks_alloc_conf(conf: AllocatorConfig, text: str) -> None:
    assert conf.describe() == text


def test_describe_round_trips_through_the_parser() -> None:
    text = "expandable_segments:True,max_split_size_mb:128,garbage_collection_threshold:0.5"
    assert parse_alloc_conf(text).describe() == text
