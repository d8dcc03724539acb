"""What the target GPU adds: its kernels' choices, its caching allocator, its fixed costs, its specs.

The kernels act inside the engine's passes (``target.CudaTargetMode``, chosen by the step's setup);
the allocator replays the step's timeline (``device.replay_step``). It serves ``fxmem.step``, which
imports it, so it sits below it in the layers. Read ``device.replay_step`` first.
"""
