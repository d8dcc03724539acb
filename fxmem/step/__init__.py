"""The whole training step: forward, loss, backward, optimizer step, zero_grad, and its peak.

``simulate_step`` runs the step on fake tensors and records every allocation and release; ``StepPeaks``
finds its peak at any batch and replays it on the GPU; ``state_bytes`` counts the model state under a
precision recipe and a sharding stage. Read ``timeline.simulate_step`` first.
"""
