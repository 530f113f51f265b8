"""What ``plan`` compares: training methods, placements, card throughput, and the rules that bite."""

from __future__ import annotations

from gpudoctor.plan.simulated import Method

PLACEMENTS = ("1 GPU", "device_map", "DDP", "FSDP")


def methods_for(cards) -> list[Method]:
    """Full fine-tune fp32 / bf16 / fp16 AMP, LoRA and QLoRA 4/8-bit; 16-bit means bf16 where every card has it."""
    half = "bfloat16" if all(c.bf16 for c in cards) else "float16"
    short = "bf16" if half == "bfloat16" else "fp16"
    return [
        Method("full-fp32", "full fp32", "float32"),
        Method("full-bf16", "full bf16", "bfloat16"),
        Method("full-amp", "full fp16 AMP (fp32 master)", "float32", autocast="float16"),
        Method("lora", f"LoRA ({short} base)", half, lora=True),
        Method("qlora-8", "QLoRA 8-bit", half, lora=True, quant_bits=8),
        Method("qlora-4", "QLoRA 4-bit (NF4)", half, lora=True, quant_bits=4),
    ]


# How much a method changes what is trained, best first: the recommendation is the first that fits.
METHOD_RANK = {"full-fp32": 0, "full-amp": 1, "full-bf16": 2, "lora": 3, "qlora-8": 4, "qlora-4": 5}
# Among placements of one method: the simplest launch that fits.
PLACEMENT_RANK = {"1 GPU": 0, "DDP": 1, "device_map": 2, "FSDP": 3}

# Dense tensor-core 16-bit (fp32 accumulate) and fp32 TFLOPS from the vendors' spec sheets; only their
# ratios matter (relative step time). fp32 matmuls do not use TF32 by default in torch.
TFLOPS = {
    "T4": (65, 8.1), "P100": (18.7, 9.3), "V100-16GB": (112, 15.7), "V100-32GB": (112, 15.7), "A10G": (70, 31.2),
    "L4": (121, 30.3), "3060-12GB": (25.6, 12.7), "3070Ti": (43.5, 21.7), "3080": (59.5, 29.8), "3090": (71, 35.6),
    "4090": (165, 82.6), "A100-40GB": (312, 19.5), "A100-80GB": (312, 19.5), "H100": (989, 67), "H200": (989, 67),
}
_GENERIC_TFLOPS = (100, 25)


def flops_per_sample(method: Method, checkpointing: bool, num_params: int, tokens: int) -> float:
    """2 per parameter and token forward, 2 for the input gradients, 2 more for weight gradients when the
    base is trained, 2 more for the recomputed forward under gradient checkpointing (attention ignored)."""
    per_token = 2 + 2 + (0 if method.lora else 2) + (2 if checkpointing else 0)
    return per_token * num_params * tokens


def seconds_per_sample(method: Method, checkpointing: bool, placement: str, cards, num_params: int, tokens: int) -> float:
    card = cards[0]
    half, single = TFLOPS.get(card.name, _GENERIC_TFLOPS)
    if method.compute_dtype == "float32":
        rate = single
    elif method.compute_dtype == "bfloat16" and not card.bf16:
        rate = single / 2  # emulated bf16
    else:
        rate = half
    seconds = flops_per_sample(method, checkpointing, num_params, tokens) / (rate * 1e12)
    if placement in ("DDP", "FSDP"):
        seconds /= len(cards)  # every card works on its own batch at once (communication ignored)
    return seconds


def rules_for(method: Method, placement: str, fits: bool, offloaded: int, card) -> list[str]:
    """gpudoctor check rules a script of this shape would hit (see rules/*.md)."""
    rules = []
    if offloaded:
        rules.append("GD102 offloaded trainable weights")
    if placement == "DDP" and not fits:
        rules.append("GD112 DataParallel/DDP model too large")
    if placement == "1 GPU" and not fits and not method.lora:
        rules.append("GD506 full fine-tune exceeds GPU")
    if method.compute_dtype == "bfloat16" and not card.bf16:
        rules.append(f"no bf16 on {card.name} (emulated, slow)")
    return rules
