"""Fake passes over the graph with the batch (and sequence) symbolic: what autograd saves, as polynomials.

``capture_saved`` runs the graph and the loss on fake tensors and records every saved storage;
``account_bytes`` turns the passes into per-node ``a*B + c``. The per-op cost (FLOPs, bytes moved)
is measured here too, in the same passes. Read ``capture.capture_saved`` first.
"""
