"""One rank of a torch.distributed run, simulated: the model as ``fully_shard`` leaves it, on a fake
process group of the run's size, driven through the flattened graph by the engine's own hooks.

``fake_world`` opens the process group, ``shard_graph`` applies FSDP2 to a private copy of the traced
graph's modules, and ``one_rank`` does both for one pass and says which modules' hooks the pass must
call where their code begins and ends in the graph (the graph has no module calls left to fire them:
``ModuleScopes`` in fxmem/engine/module_hooks.py). The capture and the step run as on one GPU; what
FSDP2 allocates (its all-gathers, the gathered weights, the reduce-scatter buffers) is what its own
code allocates there.
"""

from fxmem.parallel.fake_group import fake_world
from fxmem.parallel.fsdp import FsdpPlan, gathered_parameters, one_rank, shard_graph

__all__ = ["FsdpPlan", "fake_world", "gathered_parameters", "one_rank", "shard_graph"]
