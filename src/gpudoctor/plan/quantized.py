"""bitsandbytes-style 4-bit (NF4) and 8-bit (LLM.int8) linear layers for simulated QLoRA runs.

The simulation engine refuses bitsandbytes loads (it would have to invent their layout); ``plan`` needs
the memory of a QLoRA step, so this module states the layout explicitly, as bitsandbytes 0.4x stores it,
and nothing more:

* NF4 with double quantization (the QLoRA recipe): 4 bits per weight (``numel / 2`` bytes of uint8), one
  8-bit absmax per block of 64 weights, one float32 second-level constant per 256 blocks.
* LLM.int8: one int8 per weight plus one float32 scale per output row.
* Forward and backward dequantize the weight into a temporary of the compute dtype (freed right after
  the matmul), as ``MatMul4Bit`` / ``MatMul8bitLt`` do; the input is not saved (the base weight is
  frozen), so only the LoRA branch and the rest of the network keep activations.
* ``lm_head`` (the output embedding) stays in 16-bit, as transformers' bitsandbytes integration keeps it.

``quantize_linears`` swaps the layers of a model built with fake weights (no memory is touched). The
layers subclass ``nn.Linear`` so that peft wraps them with LoRA as it wraps bitsandbytes' own layers.
"""

from __future__ import annotations

import torch
import torch.nn as nn

NF4_BLOCK = 64
DOUBLE_QUANT_BLOCKS = 256


def packed_bytes(numel: int, bits: int, out_features: int) -> int:
    """Bytes bitsandbytes stores for a weight of ``numel`` elements (``bits`` = 4 or 8)."""
    if bits == 4:
        blocks = -(-numel // NF4_BLOCK)
        return numel // 2 + blocks + 4 * -(-blocks // DOUBLE_QUANT_BLOCKS)
    return numel + 4 * out_features


class _DequantizedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, packed, out_features, in_features, compute_dtype):
        weight = torch.empty((out_features, in_features), dtype=compute_dtype, device=x.device)  # dequantized temporary
        ctx.shape, ctx.dtype = (out_features, in_features), compute_dtype
        ctx.save_for_backward(packed)
        out = x.to(compute_dtype) @ weight.t()
        del weight
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (packed,) = ctx.saved_tensors
        weight = torch.empty(ctx.shape, dtype=ctx.dtype, device=grad_out.device)
        return grad_out @ weight, None, None, None, None


class QuantizedLinear(nn.Linear):
    """A frozen linear layer stored as bitsandbytes stores it (see the module docstring)."""

    def __init__(self, source: nn.Linear, bits: int, compute_dtype: torch.dtype):
        nn.Module.__init__(self)
        self.in_features, self.out_features = source.in_features, source.out_features
        self.bits, self.compute_dtype = bits, compute_dtype
        nbytes = packed_bytes(source.in_features * source.out_features, bits, source.out_features)
        device = source.weight.device
        self.weight = nn.Parameter(torch.empty((nbytes, 1), dtype=torch.uint8, device=device), requires_grad=False)
        self.bias = None if source.bias is None else nn.Parameter(source.bias.detach().to(compute_dtype), requires_grad=False)

    def forward(self, x):
        out = _DequantizedMatmul.apply(x, self.weight, self.out_features, self.in_features, self.compute_dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype)  # bitsandbytes returns the input's dtype


def quantize_linears(model: nn.Module, bits: int, compute_dtype: torch.dtype) -> nn.Module:
    """Replace every ``nn.Linear`` but the output embedding by a :class:`QuantizedLinear`; then upcast
    the remaining 16-bit parameters (norms, embeddings, ``lm_head``) to float32, as peft's
    ``prepare_model_for_kbit_training`` does."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child is not output:
                setattr(parent, name, QuantizedLinear(child, bits, compute_dtype))
    upcast: dict[int, nn.Parameter] = {}  # tied parameters stay tied
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            continue
        for key, param in list(module._parameters.items()):
            if param is not None and param.dtype in (torch.float16, torch.bfloat16):
                if id(param) not in upcast:
                    upcast[id(param)] = nn.Parameter(param.detach().float(), requires_grad=param.requires_grad)
                module._parameters[key] = upcast[id(param)]
    return model
