"""How a plan is shown (fxmem/planner/show.py): the table and JSON worded for the plan's target, and the
emitted module imported, applied to the real model and stepped on the CPU, run as a script, and (for
sharded CPU plans) run for real under torchrun on gloo processes."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from fxmem.measure import materialize
from fxmem.output.render import format_bytes
from fxmem.planner.search import Candidate, Config, Plan, plan
from fxmem.planner.show import emit_plan, plan_json, plan_table
from fxmem.step.sharding import fsdp_units
from models_zoo.gpt2_small import build

MEMORY = 506_000
"""Between the GPT test config's micro-batch-1 step checkpointed under bf16 autocast (504,920 B) and any
step without checkpointing (507,064 B at the least, fp32 with the fused AdamW): only checkpointing fits,
and the chooser keeps every matmul of the block it checkpoints (0 FLOPs recomputed)."""


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _batches(module: ModuleType) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """ACCUMULATION micro-batches of MICRO_BATCH token sequences of the GPT test config (vocabulary 101, context 16)."""
    shape = (module.MICRO_BATCH, 16)
    return [(torch.randint(0, 101, shape), torch.randint(0, 101, shape)) for _ in range(module.ACCUMULATION)]


def _best_row(table: str) -> list[str]:
    """The table's first row, cell by cell (columns are two or more spaces apart)."""
    return re.split(r"\s{2,}", next(line for line in table.splitlines() if line.startswith("1 ")).strip())


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cpu_plan() -> Plan:
    spec = build(test=True)
    levers = ["batch", "precision", "checkpoint"]
    found = plan(spec.model, spec.inputs, loss=spec.loss, target="cpu", memory=MEMORY, allow=levers, name="gpt")
    best = found.best
    assert best is not None and best.config.checkpoint is not None and best.recompute_flops == 0
    return found


def test_cpu_table_claims_no_gpu_and_no_speed(cpu_plan: Plan) -> None:
    """A CPU plan's table: its peak (the step's total on the CPU), no GPU column or samples/s; a checkpoint
    that recomputes no FLOPs reads "elementwise only", not "-"."""
    table = plan_table(cpu_plan)
    best = cpu_plan.best
    assert best is not None
    body = table  # the verdict line is search.py's (Plan.verdict)
    assert "GPU" not in body and "samples/s" not in body and "roofline" not in body
    assert "on this machine's CPU (494 KiB budget)" in table
    assert _best_row(table) == ["1", best.config.describe(), f"{best.micro_batch} x 1", format_bytes(best.peak), "elementwise only"]
    assert "fxmem predicts no speed on a CPU" in table


def test_cpu_emitted_module_applies_steps_and_runs(cpu_plan: Plan, tmp_path: Path) -> None:
    """The emitted module, imported, applies the plan to a real CPU copy of the model (its checkpointed
    block's forward wrapped) and takes one real training step that changes the weights; run as a
    script it prints the plan for the CPU, without a GPU or torchrun in sight."""
    best = cpu_plan.best
    assert best is not None and best.config.checkpoint is not None
    path = tmp_path / "cpu_plan.py"
    path.write_text(emit_plan(cpu_plan))
    module = _import(path)
    torch.manual_seed(0)
    model = module.apply_plan(materialize(build(test=True).model))
    checkpointed = [b.fqn for b in best.config.checkpoint.blocks if b.checkpointed]
    assert checkpointed and all("forward" in vars(model.get_submodule(fqn)) for fqn in checkpointed)
    optimizer = module.make_optimizer(model)
    before = [p.detach().clone() for p in model.parameters()]
    module.train_step(model, optimizer, _batches(module), _lm_loss)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert (module.DEVICE, module.AMP, module.PROCESSES, module.PREDICTED["peak"]) == ("cpu", torch.bfloat16, 1, best.peak)

    run = subprocess.run([sys.executable, path.name], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    out = " ".join(run.stdout.split())  # the text is wrapped at 100 characters
    assert "The training setup fxmem plan chose for gpt on this machine's CPU." in out
    assert f"the step's tensors peak at {format_bytes(best.peak)}, within the 494 KiB budget" in out
    assert "backward reruns only ops without FLOPs, elementwise ones, norms and views (every matmul's output is kept)" in out
    assert "from cpu_plan import apply_plan, device, make_optimizer, train_step" in out
    assert "GPU" not in out and "torchrun" not in out


def test_cpu_plan_json_matches_the_table(cpu_plan: Plan) -> None:
    data = plan_json(cpu_plan)
    assert json.loads(json.dumps(data)) == data
    best, table = data["best"], plan_table(cpu_plan)
    assert best == data["fitting"][0] and cpu_plan.best is not None
    shown = [best["configuration"], f"{best['micro_batch']} x {best['accumulation']}", format_bytes(best["peak"]), best["recomputed"]]
    assert _best_row(table) == ["1", *shown]
    assert (best["peak"], best["total"], best["recompute_flops"]) == (cpu_plan.best.peak, cpu_plan.best.total, 0)
    assert best["samples_per_second"] is None and best["step_seconds"] is None and data["gpu"] is None
    checkpoint = cpu_plan.best.config.checkpoint
    assert checkpoint is not None and best["config"]["checkpoint"]["checkpointed"] == [b.fqn for b in checkpoint.blocks if b.checkpointed]
    assert best["config"]["tp_plan"] == {} and best["config"]["offload"] is False and best["recipe"] is None
    assert data["verdict"] == cpu_plan.verdict() and data["target"] == "cpu" and data["memory"] == MEMORY


def test_one_gpu_plan_emits_a_gpu_module_without_torchrun(tmp_path: Path) -> None:
    spec = build(test=True)
    found = plan(spec.model, spec.inputs, loss=spec.loss, gpu="h100-80gb", global_batch=64, allow=["batch"], name="gpt")
    table, code = plan_table(found), emit_plan(found)
    assert "GPU total" in table and "samples/s (roofline)" in table
    compile(code, "gpu_plan.py", "exec")
    assert "on one h100-80gb GPU" in code and 'DEVICE = "cuda"' in code and "model = model.to(device())" in code
    assert "torchrun" not in code and "init_device_mesh" not in code and "DistributedDataParallel(" not in code
    (tmp_path / "gpu_plan.py").write_text(code)
    run = subprocess.run([sys.executable, "gpu_plan.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "of GPU memory (nvidia-smi's view" in run.stdout, run.stderr
    data = plan_json(found)
    assert data["best"]["samples_per_second"] == found.fitting[0].samples_per_second and data["gpu"] == "h100-80gb"


def _hand_plan(target: str, config: Config, gpus: int, recipe: str = "") -> Plan:
    """A plan of one candidate, built from the dataclasses: what show.py reads, without a search."""
    candidate = Candidate(config, 2, 2, total=400_000, peak=300_000, recompute_flops=0, step_seconds=1e-6, state=200_000, recipe=recipe)
    return Plan("gpt", "h100-80gb", target, gpus, 80 * 2**30 if target == "cuda" else MEMORY, 16, (candidate,), None)


UNITS = ("blocks.0", "blocks.1")
TP_PLAN = (
    ("blocks.*.attn.qkv", "colwise"),
    ("blocks.*.attn.proj", "rowwise"),
    ("blocks.*.mlp.0", "colwise"),
    ("blocks.*.mlp.2", "rowwise"),
)


def test_sharded_gpu_plans_emit_meshes_and_torchrun() -> None:
    """FSDP2 over 4 GPUs: a 1-D CUDA mesh, every fully_shard with the mixed-precision and offload
    policies, torchrun with 4 processes; FSDP2 x TP: a 2-D mesh over 4; plain data parallel: DDP on 2."""
    fsdp = Config(precision="mixed", fsdp=4, units=UNITS, data_parallel=4, offload=True)
    code = emit_plan(_hand_plan("cuda", fsdp, 4, recipe="torchtitan Llama-3.1-8B"))
    compile(code, "plan.py", "exec")
    assert 'mesh = init_device_mesh("cuda", (4,), mesh_dim_names=("dp",))' in code
    assert "torchrun --nproc-per-node 4 train.py" in code and 'dist.init_process_group("nccl")' in code
    assert "from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard" in code
    policies = "mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), offload_policy=CPUOffloadPolicy())"
    assert code.count(policies) == 2 and f"fully_shard(model, mesh=mesh, {policies}" in code
    assert "recipe          torchtitan Llama-3.1-8B" in code

    code = emit_plan(_hand_plan("cuda", Config(fsdp=2, units=UNITS, tp=2, tp_plan=TP_PLAN, data_parallel=2), 4))
    compile(code, "plan.py", "exec")
    assert 'mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))' in code and "CPUOffloadPolicy" not in code
    assert 'parallelize_module(model, mesh["tp"], {' in code
    assert 'fully_shard(model, mesh=mesh["dp"], mp_policy=MixedPrecisionPolicy())' in code
    assert "torchrun --nproc-per-node 4 train.py" in code

    code = emit_plan(_hand_plan("cuda", Config(data_parallel=2), 2))
    compile(code, "plan.py", "exec")
    assert "model = DistributedDataParallel(model.to(device()), device_ids=[device().index])" in code
    assert "torchrun --nproc-per-node 2 train.py" in code and "init_device_mesh" not in code and "fully_shard" not in code


def test_recipe_and_recomputation_in_the_table() -> None:
    recipe = Config(precision="mixed", fsdp=4, units=UNITS, data_parallel=4)
    table = plan_table(_hand_plan("cuda", recipe, 4, recipe="torchtitan Llama-3.1-8B"))
    assert "recipe torchtitan Llama-3.1-8B: bf16 MixedPrecisionPolicy, adamw, FSDP2 4" in table
    data = plan_json(_hand_plan("cuda", Config(fsdp=2, units=UNITS, tp=2, tp_plan=TP_PLAN, data_parallel=2), 4))
    assert data["best"]["config"]["tp_plan"] == dict(TP_PLAN) and data["best"]["config"]["units"] == list(UNITS)
    assert data["best"]["recomputed"] == "-" and data["best"]["samples_per_second"] == 2 * 2 / 1e-6


_TRAIN = """\
import torch
import torch.distributed as dist
from fxmem.measure import materialize
from models_zoo.gpt2_small import build
import plan

torch.manual_seed(0)
model = plan.apply_plan(materialize(build(test=True).model))
optimizer = plan.make_optimizer(model)
shape = (plan.MICRO_BATCH, 16)
batches = [(torch.randint(0, 101, shape), torch.randint(0, 101, shape)) for _ in range(plan.ACCUMULATION)]
plan.train_step(model, optimizer, batches, lambda out, t: torch.nn.functional.cross_entropy(out.flatten(0, 1), t.flatten()))
open(f"rank{dist.get_rank()}.txt", "w").write(type(model).__name__)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("layout", ["fsdp2-checkpointed", "ddp"])
def test_sharded_cpu_plans_run_under_torchrun(cpu_plan: Plan, tmp_path: Path, layout: str) -> None:
    """A CPU plan over 2 processes, emitted and launched as its text says (torchrun, gloo): FSDP2 with
    the checkpointing above, or plain data parallel with 2 accumulation steps (DDP's no_sync); every
    rank applies the plan and takes one real step."""
    assert cpu_plan.best is not None
    model = build(test=True).model
    config = (
        Config(fsdp=2, units=fsdp_units(model), data_parallel=2, checkpoint=cpu_plan.best.config.checkpoint)
        if layout.startswith("fsdp2")
        else Config(data_parallel=2)
    )
    code = emit_plan(_hand_plan("cpu", config, 2))
    assert "torchrun --nproc-per-node 2 train.py" in code and "GPU" not in code
    (tmp_path / "plan.py").write_text(code)
    (tmp_path / "train.py").write_text(_TRAIN)
    root = str(Path(__file__).resolve().parent.parent)
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": f"{tmp_path}:{root}"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    wrapper = "FSDPGPT" if layout.startswith("fsdp2") else "DistributedDataParallel"
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == [wrapper, wrapper]
