"""A 7B model's simulated training step (bundled Llama-2-7B config, no download)."""

import pytest

from gpudoctor.simulate import simulate_step

LLAMA2_7B_PARAMS = 6_738_415_616  # published parameter count of Llama-2-7B


@pytest.mark.slow
def test_llama2_7b_lora_step_weights_by_arithmetic():
    result = simulate_step("meta-llama/Llama-2-7b-hf", "1xA100-80GB", batch=1, seq=512, dtype="bfloat16",
                           lora={"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]})
    assert result["fits"] and result["optimizer_steps"] == 2
    device = result["devices"][0]
    lora_bytes = 32 * 2 * (4096 * 8 + 8 * 4096) * 4  # fp32 adapters on q and v of 32 layers
    expected = LLAMA2_7B_PARAMS * 2 + lora_bytes
    assert abs(device["breakdown_at_peak"]["weights"] - expected) < 1 << 20  # rotary buffers and rounding only
    assert device["peak_by_category"]["gradients"] == lora_bytes
    assert device["peak_by_category"]["optimizer_state"] >= 2 * lora_bytes
