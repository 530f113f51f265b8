"""GD6xx: device placement in user code (tensors, buffers, submodules, optimizers, wrappers)."""
