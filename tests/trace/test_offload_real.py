"""Real accelerate cpu+disk offload on CPU (ground truth rows 1d, 3d, 5d, 14b)."""

import torch
from accelerate import dispatch_model

from gpudoctor.trace.api import Probe
from trace_helpers import cause_id, failure_of, tiny_llama

RESIDENT_LAYER0 = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                   "model.layers.1": "disk", "model.norm": "cpu", "lm_head": "cpu"}


def offloaded(tmp_path, device_map=RESIDENT_LAYER0, model=None):
    model = model or tiny_llama()
    return dispatch_model(model, device_map=device_map, main_device="cpu", offload_dir=str(tmp_path))


def test_1d_offloaded_weights_never_train(tmp_path):
    model = offloaded(tmp_path)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 128, (2, 8))
    with Probe(model, print_on_error=False) as probe:
        for _ in range(2):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    report = probe.report()
    assert report["status"] == "ok"
    findings = {f["id"]: f for f in report["findings"]}
    never = findings["offloaded_weights_never_train"]
    assert never["rule"] == "GD102" and never["severity"] == "error"
    assert never["items"] == ["model.layers.1.input_layernorm", "model.layers.1.mlp.down_proj", "model.layers.1.mlp.gate_proj",
                              "model.layers.1.mlp.up_proj", "model.layers.1.post_attention_layernorm",
                              "model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.o_proj",
                              "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]
    assert "trainable_without_grad" not in findings  # resident layers did train
    traffic = findings["offload_traffic"]
    assert traffic["items"] and all(item.startswith("model.layers.1") for item in traffic["items"])
    placement = report["placement"][0]
    devices = {row["device"]: row for row in placement["devices"]}
    assert placement["hf_device_map"] and set(devices) == {"cpu", "offloaded (meta)"}
    assert any("model.layers.1" in m for m in devices["offloaded (meta)"]["modules"])


def test_3d_lora_on_offloaded_module_fails_at_backward(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = offloaded(tmp_path)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(0, 128, (1, 6))

    def run():
        peft_model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    report, exc = failure_of(run, peft_model)
    failure = report["failure"]
    assert "returned an invalid gradient at index 1 - expected device meta but got cpu" in str(exc)
    assert failure["phase"] == "backward" and failure["kind"] == "meta_tensor"
    assert cause_id(report) == "trainable_offloaded" and failure["cause"]["rule"] == "GD102"
    assert any("layers.1.self_attn.q_proj.lora_A" in ev for ev in failure["cause"]["evidence"])
    assert failure["module"] and "layers.1" in failure["module"]["path"]


def test_5d_inputs_sent_to_meta_model_device(tmp_path):
    device_map = dict(RESIDENT_LAYER0, **{"model.embed_tokens": "disk"})
    model = offloaded(tmp_path, device_map)
    assert model.device.type == "meta"

    def run():
        model(input_ids=torch.randint(0, 128, (1, 4)).to(model.device), use_cache=False)

    report, exc = failure_of(run, model)
    assert "Cannot copy out of meta tensor" in str(exc)
    assert cause_id(report) == "inputs_to_meta_device"
    assert "model.device" in report["failure"]["cause"]["explanation"]


def test_14b_resident_and_offloaded_dtypes_differ(tmp_path):
    model = offloaded(tmp_path)  # disk copy of layer 1 written in float32
    for name, param in model.named_parameters():
        if param.device.type != "meta":
            param.data = param.data.half()  # resident part cast afterwards, as .half() before dispatch ends up
    ids = torch.randint(0, 128, (1, 4))

    report, exc = failure_of(lambda: model(input_ids=ids, use_cache=False), model)
    assert "dtype" in str(exc)
    failure = report["failure"]
    assert failure["kind"] == "dtype_mismatch"
    assert cause_id(report) == "offload_dtype_mismatch"
    assert failure["cause"]["evidence"] == ["resident weights: float16", "offloaded weights (loaded at each forward): float32"]
    # layer 1 (fp32 from disk) hands float activations to the fp16 lm_head
    assert (failure["module"]["path"], failure["module"]["class"]) == ("lm_head", "Linear")
