"""One rank of a torch.distributed run, simulated: the model as ``fully_shard`` and
``parallelize_module`` leave it, on a fake process group of the run's size, driven through the
flattened graph by the engine's own hooks.

``fake_world`` opens the process group; ``ParallelPlan`` says what runs on how many ranks
(FSDP2's units, tensor parallel's layers, from a plan of the model's own: ``default_tp_plan``);
``shard_graph`` applies it to a private copy of the traced graph's modules, and ``one_rank`` does
both for one pass and says which modules' hooks the pass must call where their code begins and
ends in the graph (the graph has no module calls left to fire them: ``ModuleScopes`` in
fxmem/engine/module_hooks.py). The capture and the step run as on one GPU; what the engine
allocates (FSDP2's all-gathers, gathered weights and reduce-scatter buffers, tensor parallel's
all-reduces) is what its own code allocates there. ``apply_plan`` applies the same plan to a real
model in a real process group (fxmem/measure_ranks.py). Pipeline parallel is planned and the traced
graph split into stages here (pipeline_split.py, Note [Pipeline stages]); each rank's step, torch's own
pipeline schedule run on a fake process group, is simulated a stage up, in fxmem/step/pipeline.py.
"""

from fxmem.parallel.fake_group import fake_world
from fxmem.parallel.fsdp import gathered_parameters
from fxmem.parallel.pipeline_report import PipelineRank, PipelineRun
from fxmem.parallel.pipeline_split import PipelinePlan, pipeline_plan, split_stages
from fxmem.parallel.rank import ParallelPlan, apply_plan, one_rank, pipeline_meshes, plan_mesh, shard_graph, shard_stage
from fxmem.parallel.tensor import TpLayer, default_tp_plan, resolve_tp_plan, tp_layers

__all__ = [
    "ParallelPlan", "PipelinePlan", "PipelineRank", "PipelineRun", "TpLayer", "apply_plan", "default_tp_plan", "fake_world", "gathered_parameters", "one_rank", "pipeline_meshes", "pipeline_plan", "plan_mesh",
    "resolve_tp_plan", "shard_graph", "shard_stage", "split_stages", "tp_layers",
]  # fmt: skip
