import torch
import torch.nn as nn

from gpudoctor.plan.quantized import QuantizedLinear, packed_bytes, quantize_linears
from gpudoctor.simulate import Simulation


def test_packed_sizes_are_bitsandbytes_layouts():
    # NF4 + double quantization: 4 bits a weight, an 8-bit absmax per 64, a float32 per 256 blocks
    assert packed_bytes(4096 * 4096, 4, 4096) == 4096 * 4096 // 2 + 4096 * 4096 // 64 + 4 * (4096 * 4096 // 64 // 256)
    assert packed_bytes(4096 * 11008, 8, 11008) == 4096 * 11008 + 4 * 11008  # int8 + a float32 scale per row


def test_simulated_step_holds_the_packed_weight_and_frees_the_dequantized_copy():
    with Simulation("1x3070Ti") as sim:
        model = nn.Sequential(nn.Linear(4096, 4096, bias=False), nn.Linear(4096, 8, bias=False))
        quantize_linears(model, 4, torch.bfloat16)
        assert isinstance(model[0], QuantizedLinear)
        model.to("cuda")
        loaded = sim.allocators[0].allocated
        x = torch.zeros(2, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        model(x).float().sum().backward()
        peak = sim.allocators[0].peak_allocated
        after = sim.allocators[0].allocated
    weight = packed_bytes(4096 * 4096, 4, 4096)
    assert loaded >= weight and loaded < weight + (1 << 20)  # the packed weight (+ the small float32 last layer)
    assert peak - loaded >= 4096 * 4096 * 2  # the bf16 dequantized temporary exists during the matmul ...
    assert after - loaded < 4096 * 4096 * 2  # ... and is gone after the step
