"""One rank of a torch.distributed run, simulated: the model as ``fully_shard`` leaves it, on a fake
process group of the run's size, driven through the flattened graph by the engine's own hooks.

``fake_world`` opens the process group, ``shard_graph`` applies FSDP2 to a private copy of the traced
graph's modules, and ``ModuleScopes`` calls each wrapped module's hooks where its code begins and ends
in the graph (the graph has no module calls left to fire them). The step itself is simulated by
fxmem/step/timeline.py as on one GPU; what FSDP2 allocates (its all-gathers, the unsharded weights,
the reduce-scatter buffers) is what its own code allocates there.
"""

from fxmem.parallel.fake_group import fake_world
from fxmem.parallel.fsdp import FsdpPlan, gathered_parameters, shard_graph
from fxmem.parallel.module_hooks import ModuleScopes, Scope

__all__ = ["FsdpPlan", "ModuleScopes", "Scope", "fake_world", "gathered_parameters", "shard_graph"]
