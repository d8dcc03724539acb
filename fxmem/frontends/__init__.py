"""A model and its inputs in, an fx graph out: the first stage.

``load_model`` resolves a spec (zoo, module, file, ``hf:``) to a model and its inputs; ``trace_model``
makes the graph, with torch.fx or, failing that, torch.export, and finds the checkpointed regions.
Read ``tracing.trace_model`` first.
"""
