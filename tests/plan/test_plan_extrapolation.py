"""Layer extrapolation (:func:`gpudoctor.plan.simulated.extrapolate`) and the plan's model factory."""

import pytest
import torch

from gpudoctor.plan import simulated

MiB = 1 << 20


def _device(allocated, reserved):
    return {"peak_allocated": allocated, "peak_reserved": reserved,
            "breakdown": {c: allocated // len(simulated.CATEGORIES) for c in simulated.CATEGORIES}}


@pytest.mark.parametrize("n", [1, 2, 5, 32, 80])
def test_reserved_never_extrapolates_under_allocated(n):
    # the one-layer copy has a 20 MiB segment of slack, the two-layer copy 2 MiB: the reserved line grows
    # slower than the allocated one and crosses it a few layers on
    first = _device(1000 * MiB, 1020 * MiB)
    second = _device(1400 * MiB, 1402 * MiB)
    out = simulated.extrapolate(first, second, n)
    assert out["peak_allocated"] == 1000 * MiB + 400 * MiB * (n - 1)
    assert out["peak_reserved"] >= out["peak_allocated"] + 2 * MiB
    assert out["peak_reserved"] >= simulated.linear(1020 * MiB, 1402 * MiB, n)  # never below the line either


def test_extrapolation_is_the_line_when_slack_is_steady():
    out = simulated.extrapolate(_device(100 * MiB, 120 * MiB), _device(150 * MiB, 170 * MiB), 10)
    assert (out["peak_allocated"], out["peak_reserved"]) == (550 * MiB, 570 * MiB)


def test_each_phase_is_its_own_line_and_the_highest_at_the_depth_is_the_peak():
    # ChatGLM-6B under fp16 AMP (GiB): backward 12 + 3 L, optimizer step 10 + 3.75 L; the copies at 2 and 3
    # layers peak in different phases (18 backward, 21.25 optimizer step), and their overall line is low at 28
    def point(layers):
        phases = {"backward": _device(int((12 + 3 * layers) * 1024) * MiB, int((12.5 + 3 * layers) * 1024) * MiB),
                  "optimizer_step": _device(int((10 + 3.75 * layers) * 1024) * MiB, int((10.5 + 3.75 * layers) * 1024) * MiB)}
        top = max(phases.values(), key=lambda p: p["peak_allocated"])
        return {**top, "phases": phases}

    out = simulated.extrapolate(point(2), point(3), 28, 2, 3)
    assert out["peak_allocated"] == int(115 * 1024) * MiB
    assert out["peak_reserved"] == int(115.5 * 1024) * MiB
    assert out["breakdown"] == point(28)["phases"]["optimizer_step"]["breakdown"]
    assert out["phases"]["backward"]["peak_allocated"] == 96 * 1024 * MiB
    lone = simulated.extrapolate({**point(2), "phases": {}}, {**point(3), "phases": {}}, 28, 2, 3)
    assert lone["peak_allocated"] < out["peak_allocated"]  # without phases: the one line through both peaks


def test_factory_casts_pinned_parameters_to_the_strategys_dtype():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4).half(), torch.nn.LayerNorm(4))
    model.register_buffer("inv_freq", torch.ones(2, dtype=torch.float16))
    simulated.cast_floating(model, torch.float32)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.inv_freq.dtype == torch.float16  # buffers keep theirs (as from_pretrained leaves them)


def test_model_class_tries_seq2seq_then_causal_then_auto_model():
    from transformers import BertConfig, LlamaConfig, T5Config

    assert simulated._model_class(T5Config(num_layers=1)).__name__ == "T5ForConditionalGeneration"
    assert simulated._model_class(LlamaConfig(num_hidden_layers=1)).__name__ == "LlamaForCausalLM"
    # BERT has a causal-LM head class (BertLMHeadModel): that is what a causal-LM plan trains
    assert simulated._model_class(BertConfig(num_hidden_layers=1)).__name__ == "BertLMHeadModel"


def test_model_class_falls_back_to_auto_model_for_a_registered_remote_architecture():
    from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel

    class RemoteConfig(PretrainedConfig):
        model_type = "gpudoctor-test-remote"

    class RemoteModel(PreTrainedModel):
        config_class = RemoteConfig

    AutoConfig.register("gpudoctor-test-remote", RemoteConfig, exist_ok=True)
    AutoModel.register(RemoteConfig, RemoteModel, exist_ok=True)
    config = RemoteConfig(auto_map={"AutoModel": "modeling_remote.RemoteModel"})
    assert simulated._model_class(config) is RemoteModel
    assert simulated.is_remote_code(config)
    from transformers import LlamaConfig

    assert not simulated.is_remote_code(LlamaConfig())


def test_snippet_of_a_remote_code_model_loads_it_with_auto_model_and_trust_remote_code():
    from types import SimpleNamespace

    from gpudoctor.plan.advice import snippet
    from gpudoctor.plan.simulated import Method, Workload

    method = Method("lora", "LoRA (fp16 base)", "float16", lora=True)
    best = SimpleNamespace(method=method, placement="device_map", checkpointing=False)
    info = SimpleNamespace(name="THUDM/chatglm-6b", encoder_decoder=False, remote_code=True, config=None)
    plan = SimpleNamespace(recommended=best, info=info, workload=Workload(lora_targets=("query_key_value",)),
                           cards=[None, None])
    code = snippet(plan)
    assert "from transformers import AutoModel\n" in code
    assert "AutoModel.from_pretrained('THUDM/chatglm-6b', trust_remote_code=True, dtype=torch.float16, device_map=\"auto\")" in code
    info.remote_code = False
    info.config = __import__("transformers").LlamaConfig(num_hidden_layers=1)
    assert "AutoModelForCausalLM.from_pretrained('THUDM/chatglm-6b', dtype=torch.float16" in snippet(plan)


def test_quantized_bases_are_the_engines_bitsandbytes_layers():
    from gpudoctor.simulate.quant import SimulatedQuantLinear
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=100)
    meta = simulated._meta_model(config, "bfloat16", 4, fresh=True)
    linears = [m for m in meta.modules() if isinstance(m, SimulatedQuantLinear)]
    assert len(linears) == 7 and meta.lm_head.weight.dtype == torch.bfloat16  # the head stays 16-bit
    assert linears[0].absmax.dtype == torch.uint8  # NF4 with double quantization, as the printed code loads it
