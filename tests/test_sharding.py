"""Per-GPU model state under ZeRO and FSDP, against the ZeRO paper's own numbers and by hand."""

from __future__ import annotations

import doctest

import pytest
import torch
from torch import nn

import fxmem.step.sharding
from fxmem.errors import InputSpecError
from fxmem.results import StateBytes
from fxmem.step.sharding import STAGES, shard_state, units_of
from fxmem.step.state import get_optimizer, state_bytes

PSI = 7_500_000_000
"""The ZeRO paper's example model (Rajbhandari et al. 2020, figure 1 and section 5): 7.5B parameters."""


@pytest.fixture(scope="module")
def paper_state() -> StateBytes:
    # 7.5B parameters on the meta device (no storage): mixed-precision Adam on GPUs, 16 bytes each
    model = nn.Linear(75_000, 100_000, bias=False, device="meta")
    return state_bytes(model, optimizer=get_optimizer("adam"), precision="mixed", target="cuda")


def test_zero_paper_example_on_64_gpus(paper_state: StateBytes) -> None:
    n = 64
    per_gpu = {stage: shard_state(paper_state, world_size=n, stage=stage).total for stage in ("none", "zero1", "zero2", "zero3")}
    # none:  16 * 7.5e9                       = 120e9
    # zero1: 4 * 7.5e9 + 12 * 7.5e9 / 64      = 30e9 + 1.40625e9  = 31.40625e9
    # zero2: 2 * 7.5e9 + 14 * 7.5e9 / 64      = 15e9 + 1.640625e9 = 16.640625e9
    # zero3: 16 * 7.5e9 / 64                  = 1.875e9 (no units given: the gathered unit is tested apart)
    assert per_gpu == {"none": 120_000_000_000, "zero1": 31_406_250_000, "zero2": 16_640_625_000, "zero3": 1_875_000_000}
    # the paper's figure 1 rounds them to 120 GB, 31.4 GB, 16.6 GB and 1.9 GB
    assert [round(b / 1e9, 1) for b in per_gpu.values()] == [120.0, 31.4, 16.6, 1.9]


@pytest.mark.parametrize("n", [1, 2, 8, 64, 1024])
def test_zero_formulas_for_any_world_size(paper_state: StateBytes, n: int) -> None:
    # weights 2 Psi, gradients 2 Psi, master 4 Psi, Adam moments 8 Psi; each stage shards one more of them
    expect = {
        "none": 16 * PSI,
        "zero1": 4 * PSI + -(-12 * PSI // n),
        "zero2": 2 * PSI + -(-2 * PSI // n) + -(-12 * PSI // n),
        "zero3": -(-2 * PSI // n) * 2 + -(-12 * PSI // n),
    }
    for stage, total in expect.items():
        got = shard_state(paper_state, world_size=n, stage=stage)
        # ceil per line: master (4 Psi) and moments (8 Psi) are split apart; 7.5e9 * {4, 8} / n differs from
        # the joint ceil by at most a byte
        assert abs(got.total - total) <= 1, stage


def test_the_gathered_unit_under_zero3_and_fsdp() -> None:
    psi = 600
    mixed = StateBytes(psi, psi, 2 * psi, {"bfloat16": 2 * psi}, 0, 2 * psi, 8 * psi, "adam", 4 * psi, "mixed")
    units = [("a", 100), ("b", 300), ("c", 200)]
    # zero3: the largest unit (b, 300) and one prefetched (c, 200), in bf16: (300 + 200) * 2
    assert shard_state(mixed, world_size=4, stage="zero3", units=units).gathered.nbytes == 1000
    # fsdp BACKWARD_PRE: the same two units' parameters, plus b's unsharded bf16 gradient: 1000 + 300 * 2
    assert shard_state(mixed, world_size=4, stage="fsdp", units=units).gathered.nbytes == 1600
    # fp32 gradient accumulation: the unsharded gradient is fp32: 1000 + 300 * 4
    fp32_grads = StateBytes(psi, psi, 2 * psi, {"bfloat16": 2 * psi}, 0, 4 * psi, 8 * psi, "adam", 4 * psi, "mixed-fp32-grads")
    assert shard_state(fp32_grads, world_size=4, stage="fsdp", units=units).gathered.nbytes == 2200
    # one GPU has nothing to gather; stages below 3 never gather; a lone unit has no prefetched partner
    assert shard_state(mixed, world_size=1, stage="fsdp", units=units).gathered.nbytes == 0
    assert shard_state(mixed, world_size=4, stage="zero2", units=units).gathered.nbytes == 0
    assert shard_state(mixed, world_size=4, stage="zero3", units=[("only", 50)]).gathered.nbytes == 100
    assert "not counted" in shard_state(mixed, world_size=4, stage="zero3").gathered.why


def test_buffers_are_never_sharded_and_every_line_says_why() -> None:
    s = StateBytes(100, 100, 400, {"float32": 400}, 24, 400, 800, "adam")  # no recipe: fp32 as the model holds it
    per_gpu = shard_state(s, world_size=8, stage="zero3", units=[("x", 60), ("y", 40)])
    assert per_gpu.buffers.nbytes == 24
    # weights 400/8, grads 400/8, moments 800/8, gathered (60 + 40) * 4 bytes (the model's own fp32)
    assert (per_gpu.weights.nbytes, per_gpu.gradients.nbytes, per_gpu.optimizer.nbytes, per_gpu.gathered.nbytes) == (50, 50, 100, 400)
    assert per_gpu.total == 50 + 24 + 50 + 0 + 100 + 400
    assert all(line.why for _, line in per_gpu.lines())


def test_shares_round_up() -> None:
    s = StateBytes(10, 10, 40, {"float32": 40}, 0, 40, 80, "adam")
    assert shard_state(s, world_size=3, stage="zero3").weights.nbytes == 14  # ceil(40 / 3): partitions are padded


@pytest.mark.parametrize("world_size", [0, -2, 2.5, True, "8"])
def test_bad_world_size_is_an_input_error(world_size: object) -> None:
    s = StateBytes(1, 1, 4, {"float32": 4}, 0, 4, 8, "adam")
    with pytest.raises(InputSpecError, match="world_size must be a whole number of GPUs"):
        shard_state(s, world_size=world_size, stage="zero1")  # type: ignore[arg-type]


def test_bad_stage_is_an_input_error() -> None:
    s = StateBytes(1, 1, 4, {"float32": 4}, 0, 4, 8, "adam")
    with pytest.raises(InputSpecError, match="unknown shard stage 'zero4'; use one of: " + ", ".join(STAGES)):
        shard_state(s, world_size=2, stage="zero4")
    with pytest.raises(InputSpecError, match="unknown shard stage"):
        units_of(nn.Linear(2, 2), stage="ddp")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 24)  # 8*24 + 24 = 216
        self.mlp = nn.Linear(8, 8)  # 8*8 + 8 = 72

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x) + self.attn(x)[..., :8]


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)  # 400
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])  # 3 x 288
        self.norm = nn.LayerNorm(8)  # 16
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.emb.weight  # tied: counted with the embedding


def test_units_of_finds_the_repeated_blocks() -> None:
    assert units_of(_Tiny()) == [("blocks.0", 288), ("blocks.1", 288), ("blocks.2", 288), ("(rest)", 400 + 16)]


def test_units_of_for_zero3_is_each_modules_own_parameters() -> None:
    expected = [("emb", 400)] + [(f"blocks.{i}.{n}", k) for i in range(3) for n, k in (("attn", 216), ("mlp", 72))] + [("norm", 16)]
    assert units_of(_Tiny(), stage="zero3") == expected


def test_units_of_without_repeated_blocks_uses_the_top_level_children() -> None:
    mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert units_of(mlp) == [("0", 20), ("2", 10)]
    # a Sequential of one block type is a stack of repeated blocks, wherever it sits
    stack = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    assert units_of(stack) == [("1.0", 20), ("1.1", 20), ("(rest)", 12)]


def test_state_units_and_sharding_together() -> None:
    model = _Tiny()
    state = state_bytes(model, optimizer=get_optimizer("adam"), precision="mixed", target="cuda")
    assert state.total == 16 * 1280  # 400 + 3 * 288 + 16 parameters, 16 bytes each
    per_gpu = shard_state(state, world_size=4, stage="fsdp", units=units_of(model))
    # weights 2*1280/4 = 640, grads 640, master 4*1280/4 = 1280, moments 8*1280/4 = 2560;
    # gathered: (rest) 416 and a block 288 in bf16 = 1408, plus (rest)'s bf16 gradient 832
    assert per_gpu.total == 640 + 640 + 1280 + 2560 + 1408 + 832
    assert "(rest)" in per_gpu.gathered.why and "blocks.0" in per_gpu.gathered.why


def test_docstring_examples() -> None:
    result = doctest.testmod(fxmem.step.sharding)
    assert result.attempted > 0 and result.failed == 0
