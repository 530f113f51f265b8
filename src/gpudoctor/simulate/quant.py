"""bitsandbytes 8-bit / 4-bit loads, simulated by their storage sizes (bitsandbytes itself is not needed).

Every ``nn.Linear`` except the output head (and ``llm_int8_skip_modules``) becomes a
:class:`SimulatedQuantLinear` holding what bitsandbytes keeps on the GPU:

* 4-bit (``Linear4bit``, NF4/FP4): the packed weight, ``ceil(n / 2)`` bytes, plus one absmax per 64
  weights: fp32 (4 bytes), or with ``bnb_4bit_use_double_quant`` 1 byte plus one fp32 per 256 blocks;
* 8-bit (``Linear8bitLt``): the int8 weight (``n`` bytes) plus one fp32 scale per output row.

The forward pass dequantizes the weight to the compute dtype for the matmul and frees it, and backward
dequantizes it again (``MatMul4Bit``); the int8 kernels' own temporaries are not modelled, so 8-bit
activation-side peaks are approximate.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class _DequantMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, packed, out_features, in_features, bias):
        ctx.shape = (out_features, in_features)
        ctx.has_bias = bias is not None
        weight = torch.empty(ctx.shape, dtype=x.dtype, device=x.device)  # dequantized, freed after the matmul
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        weight = torch.empty(ctx.shape, dtype=grad.dtype, device=grad.device)
        grad_bias = grad.sum(dim=tuple(range(grad.dim() - 1))) if ctx.has_bias and ctx.needs_input_grad[4] else None
        return grad @ weight, None, None, None, grad_bias


class SimulatedQuantLinear(nn.Linear):
    def __init__(self, linear: nn.Linear, bits: int, double_quant: bool, compute_dtype: torch.dtype):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bits = bits
        self.compute_dtype = compute_dtype
        n = linear.in_features * linear.out_features
        device = linear.weight.device
        if bits == 4:
            self.weight = nn.Parameter(torch.empty(((n + 1) // 2, 1), dtype=torch.uint8, device=device), requires_grad=False)
            blocks = (n + 63) // 64
            absmax = torch.empty(blocks, dtype=torch.uint8 if double_quant else torch.float32, device=device)
            self.register_buffer("absmax", absmax)
            if double_quant:
                self.register_buffer("absmax2", torch.empty((blocks + 255) // 256, dtype=torch.float32, device=device))
        else:
            self.weight = nn.Parameter(torch.empty((linear.out_features, linear.in_features), dtype=torch.int8, device=device),
                                       requires_grad=False)
            self.register_buffer("SCB", torch.empty(linear.out_features, dtype=torch.float32, device=device))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(compute_dtype), requires_grad=False)

    def forward(self, x):
        dtype = x.dtype  # bitsandbytes computes in compute_dtype and returns the input's dtype
        out = _DequantMatmul.apply(x.to(self.compute_dtype), self.weight, self.out_features, self.in_features, self.bias)
        return out.to(dtype)


def quantize(model: nn.Module, config) -> str:
    """Replace the Linear layers as ``from_pretrained(quantization_config=...)`` would; a one-line description."""
    bits = 4 if getattr(config, "load_in_4bit", False) else 8
    double = bool(getattr(config, "bnb_4bit_use_double_quant", False))
    compute = getattr(config, "bnb_4bit_compute_dtype", None) or torch.float32
    if isinstance(compute, str):
        compute = getattr(torch, compute)
    skip = set(getattr(config, "llm_int8_skip_modules", None) or [])
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    count = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is nn.Linear and child is not output and child_name not in skip and full not in skip:
                setattr(module, child_name, SimulatedQuantLinear(child, bits, double, compute if bits == 4 else torch.float16))
                count += 1
    model.is_loaded_in_4bit = bits == 4
    model.is_loaded_in_8bit = bits == 8
    model.is_quantized = True
    model.quantization_method = "bitsandbytes"
    return f"bitsandbytes {bits}-bit simulated by storage size ({count} Linear layers{', double quant' if double else ''})"
