"""Time and throughput: a roofline bound on the step, and what each batch size costs.

Read ``tradeoff.step_estimate`` first.
"""
