"""The compiled step's stage: torch.compile (Dynamo, AOTAutograd, Inductor) run on fake tensors,
between the traced graph (fxmem/frontends) and the simulated step (fxmem/step). See
fxmem/compiling/inductor.py and docs/compile.md."""
