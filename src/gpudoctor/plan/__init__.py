"""``gpudoctor plan MODEL --gpus 6x3070Ti``: what fits on these GPUs, and the least change that makes it fit.

Every method (full fine-tune fp32 / bf16 / fp16 AMP, LoRA, QLoRA 8/4-bit), with and without gradient
checkpointing, on every placement (one GPU, a device_map pipeline, DDP, FSDP), from simulated training
steps of the real architecture (:mod:`gpudoctor.simulate`). ``make_plan`` is imported lazily (torch).
"""

from __future__ import annotations


def make_plan(*args, **kwargs):
    from gpudoctor.plan.planner import make_plan as run

    return run(*args, **kwargs)


__all__ = ["make_plan"]
