"""Device-mismatch scenarios on virtual GPUs (ground truth rows 5a, 5e, 6a, 12b, 15b, 16b and the
placement-in-user-code causes). Each report must name module, tensor origins, user line and fix."""

import os
import traceback

import pytest
import torch
import torch.nn as nn

from gpudoctor.trace.frames import short_path
from gpudoctor.virtual import VirtualGPUs, dispatch, fake_place

from trace_helpers import cause_id, failure_of

THIS_FILE = os.path.abspath(__file__)


def test_5a_batch_left_on_cpu(llama):
    def run():
        with VirtualGPUs():
            fake_place(llama, "gpu:0")
            ids = torch.randint(0, 128, (2, 8))
            llama(input_ids=ids, use_cache=False)  # the user's line

    report, exc = failure_of(run)
    failure = report["failure"]
    assert str(exc).startswith("Expected all tensors to be on the same device, but found at least two devices, gpu:0 and cpu!")
    assert failure["kind"] == "device_mismatch" and failure["phase"] == "forward"
    assert failure["module"]["path"] == "model.embed_tokens" and failure["module"]["class"] == "Embedding"
    assert failure["op"]["name"] == "aten.embedding" and failure["op"]["argument"] == "indices"
    origins = {t["argument"]: (t["device"], t["origin"]["kind"], t["origin"].get("name")) for t in failure["tensors"]}
    assert origins == {"weight": ("gpu:0", "parameter", "model.embed_tokens.weight"), "indices": ("cpu", "module_input", "input_ids")}
    assert failure["user_frame"]["file"] == THIS_FILE and "the user's line" in failure["user_frame"]["code"]
    assert cause_id(report) == "batch_not_moved" and "model.device" in failure["cause"]["fix"]


def test_5e_manual_split_without_hooks(llama):
    def run():
        with VirtualGPUs():
            fake_place(llama, {"": "gpu:0", "model.layers.1": "gpu:1", "model.norm": "gpu:1", "lm_head": "gpu:1"})
            llama(input_ids=torch.randint(0, 128, (1, 4), device="gpu:0"), use_cache=False)

    report, exc = failure_of(run)
    failure = report["failure"]
    assert "gpu:1 and gpu:0" in str(exc) or "gpu:0 and gpu:1" in str(exc)
    assert failure["module"]["path"].startswith("model.layers.1")
    assert {t["device"] for t in failure["tensors"]} == {"gpu:0", "gpu:1"}
    assert any(t["origin"]["kind"] == "parameter" and t["origin"]["name"].startswith("model.layers.1") for t in failure["tensors"])
    assert cause_id(report) == "manual_split_without_hooks"
    assert failure["cause"]["rule"] is None and "dispatch_model" in failure["cause"]["fix"]


def test_12b_device_map_splits_a_decoder_layer(llama):
    device_map = {"model.embed_tokens": "gpu:0", "model.rotary_emb": "gpu:0", "model.layers.0.self_attn": "gpu:0",
                  "model.layers.0.input_layernorm": "gpu:0", "model.layers.0.post_attention_layernorm": "gpu:0",
                  "model.layers.0.mlp": "gpu:1", "model.layers.1": "gpu:1", "model.norm": "gpu:1", "lm_head": "gpu:1"}

    def run():
        with VirtualGPUs():
            dispatch(llama, device_map)
            llama(input_ids=torch.randint(0, 128, (1, 4)), use_cache=False)

    report, exc = failure_of(run)
    failure = report["failure"]
    assert "gpu:0 and gpu:1" in str(exc) or "gpu:1 and gpu:0" in str(exc)
    assert failure["module"]["path"] == "model.layers.0" and failure["module"]["class"] == "LlamaDecoderLayer"
    assert failure["op"]["name"] == "aten.add"
    assert cause_id(report) == "split_no_split_module" and failure["cause"]["rule"] == "GD108"
    assert "no_split_module_classes" in failure["cause"]["fix"]


def test_15b_model_moved_after_dispatch(llama):
    device_map = {"model.embed_tokens": "gpu:0", "model.rotary_emb": "gpu:0", "model.layers.0": "gpu:0",
                  "model.layers.1": "gpu:1", "model.norm": "gpu:1", "lm_head": "gpu:1"}

    def run():
        with VirtualGPUs():
            dispatch(llama, device_map)
            fake_place(llama, "gpu:0")  # what `.to("cuda:0")` does to the weights; the hooks stay
            llama(input_ids=torch.randint(0, 128, (1, 4)), use_cache=False)

    report, _ = failure_of(run)
    failure = report["failure"]
    assert cause_id(report) == "moved_after_dispatch" and failure["cause"]["rule"] == "GD110"
    assert any("execution device gpu:1" in ev for ev in failure["cause"]["evidence"])
    assert "remove_hook_from_module" in failure["cause"]["fix"]
    assert failure["module"]["path"].startswith("model.layers.1")


def test_6a_dataparallel_over_split_model():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

    def run():
        with VirtualGPUs():
            fake_place(model, {"0": "gpu:0", "2": "gpu:1"})
            nn.DataParallel(model)(torch.randn(4, 8, device="gpu:0"))

    report, exc = failure_of(run)
    failure = report["failure"]
    assert "module must have its parameters and buffers on device gpu:0 (device_ids[0])" in str(exc)
    assert failure["kind"] == "dataparallel" and failure["module"]["class"] == "DataParallel"
    assert cause_id(report) == "dataparallel_split_model"
    assert failure["cause"]["rule"] is None  # not dispatched by accelerate: GD111 is about dispatched models


def test_6a_dataparallel_over_dispatched_model_cites_gd111(llama):
    device_map = {"model.embed_tokens": "gpu:0", "model.rotary_emb": "gpu:0", "model.layers.0": "gpu:0",
                  "model.layers.1": "gpu:1", "model.norm": "gpu:1", "lm_head": "gpu:1"}

    def run():
        with VirtualGPUs():
            dispatch(llama, device_map)
            nn.DataParallel(llama)(input_ids=torch.randint(0, 128, (2, 4), device="gpu:0"))

    report, _ = failure_of(run)
    assert cause_id(report) == "dataparallel_split_model" and report["failure"]["cause"]["rule"] == "GD111"


def test_16b_optimizer_state_on_another_device():
    model = nn.Linear(4, 4)

    def run():
        with VirtualGPUs():
            fake_place(model, "gpu:0")
            opt = torch.optim.Adam(model.parameters(), foreach=False)
            model(torch.randn(2, 4, device="gpu:0")).sum().backward()
            opt.step()
            for state in opt.state.values():  # e.g. a checkpoint loaded with map_location="cpu"
                state["exp_avg"] = state["exp_avg"].to("cpu")
            model(torch.randn(2, 4, device="gpu:0")).sum().backward()
            opt.step()

    report, exc = failure_of(run, model)
    failure = report["failure"]
    assert "cpu and gpu:0" in str(exc)
    assert failure["phase"] == "optimizer_step"
    assert cause_id(report) == "optimizer_state_device"
    assert any("state['exp_avg'] on cpu" in ev and "parameter on gpu:0" in ev for ev in failure["cause"]["evidence"])
    assert "load_state_dict" in failure["cause"]["fix"]


class WithPlainAttribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.scale = torch.ones(4)  # bug: not a buffer

    def forward(self, x):
        return self.proj(x) * self.scale


class WithPythonList(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 4)
        self.blocks = [nn.Linear(4, 4), nn.Linear(4, 4)]  # bug: not an nn.ModuleList

    def forward(self, x):
        x = self.head(x)
        for block in self.blocks:
            x = block(x)
        return x


class CreatesMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        mask = torch.ones(x.shape[0], 4)  # bug: no device=
        return self.proj(x) * mask


def test_plain_tensor_attribute_instead_of_buffer():
    model = WithPlainAttribute()

    def run():
        with VirtualGPUs():
            fake_place(model, "gpu:0")
            model(torch.randn(2, 4, device="gpu:0"))

    report, _ = failure_of(run)
    failure = report["failure"]
    assert cause_id(report) == "plain_tensor_attribute"
    assert any(t["origin"]["kind"] == "attribute" and t["origin"]["name"] == "scale" for t in failure["tensors"])
    assert 'register_buffer("scale"' in failure["cause"]["fix"]


def test_submodules_in_a_python_list():
    model = WithPythonList()

    def run():
        with VirtualGPUs():
            fake_place(model, "gpu:0")
            model(torch.randn(2, 4, device="gpu:0"))

    report, _ = failure_of(run)
    failure = report["failure"]
    assert failure["module"]["path"] == "blocks[0]"
    assert cause_id(report) == "submodule_in_python_list" and "nn.ModuleList" in failure["cause"]["fix"]
    assert any(t["origin"]["kind"] == "unregistered_parameter" for t in failure["tensors"])


def test_tensor_created_in_forward_without_device():
    model = CreatesMask()

    def run():
        with VirtualGPUs():
            fake_place(model, "gpu:0")
            model(torch.randn(2, 4, device="gpu:0"))

    report, _ = failure_of(run)
    failure = report["failure"]
    created = [t for t in failure["tensors"] if t["origin"]["kind"] == "created_in_forward"]
    assert created and created[0]["device"] == "cpu" and created[0]["origin"]["op"] == "aten.ones"
    loc = created[0]["origin"]["location"]
    assert loc["file"] == THIS_FILE and "torch.ones(x.shape[0], 4)" in loc["code"]
    assert cause_id(report) == "tensor_created_in_forward"
    assert f"{short_path(THIS_FILE)}:{loc['line']}" in failure["cause"]["fix"]


def test_deep_mode_reports_meta_weight_cpu_kernels_accept_without_changing_the_run():
    from gpudoctor.trace.api import Probe

    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(torch.empty(4, 4, device="meta"))
    with Probe(model, deep=True, print_on_error=False) as probe:
        out = model(torch.randn(2, 4))  # runs as it would without gpudoctor (10.8: --deep never raises its own error)
    assert out.shape == (2, 4)
    findings = {f["id"]: f for f in probe.report()["findings"]}
    item = findings["device_mix_accepted"]["items"][0]
    assert "<root>" in item and "meta" in item and "cpu" in item


def test_deep_mode_reraises_the_programs_own_exception(llama):
    def run():
        with VirtualGPUs():
            fake_place(llama, "gpu:0")
            llama(input_ids=torch.randint(0, 128, (2, 8)), use_cache=False)

    with pytest.raises(Exception) as plain:
        run()
    report, exc = failure_of(run, deep=True)
    assert type(exc) is type(plain.value) and str(exc) == str(plain.value)  # the program's own error, not gpudoctor's
    assert "gpudoctor" not in "".join(traceback.format_exception(exc))
    failure = report["failure"]
    assert failure["op"]["name"] == "aten.embedding" and failure["module"]["path"] == "model.embed_tokens"
    assert cause_id(report) == "batch_not_moved"


def test_default_mode_lets_cpu_meta_run_and_reports_meta_at_forward():
    from gpudoctor.trace.api import Probe

    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(torch.empty(4, 4, device="meta"))
    with Probe(model, print_on_error=False) as probe:
        model(torch.randn(2, 4))  # CPU kernels don't check meta: no error, garbage out
    findings = {f["id"]: f for f in probe.report()["findings"]}
    assert findings["meta_at_forward"]["items"] == [f"{''}: weight"]


def test_backward_through_gpu1_works_with_the_harness():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with VirtualGPUs():
        fake_place(model, {"0": "gpu:0", "1": "gpu:1"})
        x = torch.randn(3, 4, device="gpu:0")
        hidden = model[0](x).to("gpu:1")
        model[1](hidden).sum().backward()
        assert model[0].weight.grad.device == torch.device("gpu:0")
        assert model[1].weight.grad.device == torch.device("gpu:1")


def test_probe_restores_module_call_and_keeps_user_exception():
    original = nn.Module.__call__
    model = nn.Linear(2, 2)

    def run():
        raise KeyError("user error")

    report, exc = failure_of(run, model)
    assert isinstance(exc, KeyError) and nn.Module.__call__ is original
    assert report["failure"]["kind"] == "other"


def test_teacher_left_on_cpu_is_the_model_not_the_batch(llama):
    from trace_helpers import tiny_llama

    student = llama

    def run():
        teacher = tiny_llama(layers=1)  # built, never moved
        with VirtualGPUs():
            fake_place(student, "gpu:0")
            ids = torch.randint(0, 128, (2, 8), device="gpu:0")
            student(input_ids=ids, use_cache=False)
            teacher(input_ids=ids, use_cache=False)

    report, _ = failure_of(run)
    cause = report["failure"]["cause"]
    assert cause["id"] == "model_not_moved" and cause["rule"] == "GD609"
    assert "`teacher.to(\"gpu:0\")`" in cause["fix"]
    assert cause["location"]["code"] == "teacher = tiny_llama(layers=1)  # built, never moved"


def test_loss_weight_on_cpu_names_the_loss_and_its_line():
    model = nn.Linear(4, 3)

    def run():
        criterion = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0]))
        with VirtualGPUs():
            fake_place(model, "gpu:0")
            logits = model(torch.randn(5, 4, device="gpu:0"))
            criterion(logits, torch.randint(0, 3, (5,), device="gpu:0"))

    report, _ = failure_of(run)
    failure = report["failure"]
    assert failure["module"]["class"] == "CrossEntropyLoss"
    assert {(t["argument"], t["device"], t["origin"]["kind"]) for t in failure["tensors"]} >= {("weight", "cpu", "buffer")}
    cause = failure["cause"]
    assert cause["id"] == "loss_weight_on_cpu" and cause["rule"] == "GD604"
    assert "criterion = nn.CrossEntropyLoss(weight=...).to(\"gpu:0\")" in cause["fix"]
    assert cause["location"]["code"].startswith("criterion = nn.CrossEntropyLoss(weight=")


def test_mismatch_in_user_code_reads_the_operands_from_the_users_frame():
    head = nn.Linear(4, 6)

    def run():
        with VirtualGPUs():
            fake_place(head, "gpu:1")
            logits = head(torch.randn(3, 4, device="gpu:1"))
            labels = torch.randint(0, 6, (3,), device="gpu:0")
            return nn.functional.cross_entropy(logits, labels)  # no module call fails here

    report, _ = failure_of(run)
    failure = report["failure"]
    assert failure["module"] is None
    assert {(t["argument"], t["device"]) for t in failure["tensors"]} == {("logits", "gpu:1"), ("labels", "gpu:0")}
    assert failure["cause"]["id"] == "user_code_mismatch"
    assert "`labels = labels.to(logits.device)`" in failure["cause"]["fix"]


def test_t5_labels_are_followed_back_through_the_decoder_inputs_the_model_builds():
    from transformers import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4,
                                                decoder_start_token_id=0))

    def run():
        with VirtualGPUs():
            fake_place(model, "gpu:0")
            model(input_ids=torch.randint(0, 64, (2, 5), device="gpu:0"), labels=torch.randint(0, 64, (2, 4)), use_cache=False)

    report, _ = failure_of(run)
    failure = report["failure"]
    indices = next(t for t in failure["tensors"] if t["device"] == "cpu")
    assert indices["origin"]["kind"] == "module_input" and indices["origin"]["name"] == "labels" and indices["origin"]["via"]
    cause = failure["cause"]
    assert cause["id"] == "batch_not_moved" and "`labels = labels.to(model.device)`" in cause["fix"]
    assert "before any loss" in cause["explanation"] and "loss moves" not in cause["fix"]
