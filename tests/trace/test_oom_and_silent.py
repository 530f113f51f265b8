"""OOM reports (real CPU allocator OOM, simulated CUDA OOM on capped virtual GPUs) and silent problems."""

import torch
import torch.nn as nn

from gpudoctor.trace.api import Probe
from gpudoctor.virtual import VirtualGPUs, fake_place
from trace_helpers import failure_of, tiny_llama


class Huge(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        buffer = torch.empty(10**12)  # 4 TB: the CPU allocator refuses at once
        return self.proj(x) + buffer[:8]


def test_real_cpu_allocator_oom():
    model = Huge()
    report, exc = failure_of(lambda: model(torch.randn(2, 8)), model)
    assert "DefaultCPUAllocator: can't allocate memory" in str(exc)
    failure = report["failure"]
    assert failure["kind"] == "oom" and failure["phase"] == "forward"
    assert failure["module"]["path"] == "" and failure["module"]["class"] == "Huge"
    oom = failure["oom"]
    assert oom["device"] == "cpu" and oom["message_fields"]["requested"] == 4 * 10**12
    assert oom["classification"][0]["id"] == "single_allocation_too_large"
    assert oom["memory_by_category"]["cpu"]["weights"] == (64 + 8) * 4


def test_simulated_cuda_oom_on_capped_virtual_gpu():
    model = tiny_llama(layers=4)
    model.train()
    ids_shape = (8, 256)

    def run():
        with VirtualGPUs(memory_cap="4MiB"):
            fake_place(model, "gpu:0")
            ids = torch.randint(0, 128, ids_shape, device="gpu:0")
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    report, exc = failure_of(run, model)
    assert isinstance(exc, torch.OutOfMemoryError) and "GPU 0 has a total capacity of 4.00 MiB" in str(exc)
    failure = report["failure"]
    assert failure["kind"] == "oom" and failure["phase"] == "forward"
    assert failure["module"]["path"].startswith("model.layers.")
    oom = failure["oom"]
    assert oom["device"] == "gpu:0"
    row = oom["memory_by_category"]["gpu:0"]
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert row["weights"] == weights and row["gradients"] == 0 and row["activations_and_other"] > 0
    # the failed 2 MiB request is half the device: the SDPA mask of one layer, named by shape
    dominant = oom["dominant_tensor"]
    assert dominant["shape"] == [8, 1, 256, 256] and dominant["bytes"] == oom["message_fields"]["requested"] == 2 * 2**20
    assert dominant["module"] == "model.layers.0.self_attn"
    assert failure["cause"]["id"] == "dominant_activation" and "8×1×256×256" in failure["cause"]["explanation"]
    options = {o["id"]: o for o in oom["options"]}
    assert "sdpa_attention" not in options  # it already is SDPA
    assert options["shorter_sequence"]["saving_bytes"] == 2 * 2**20 * 3 // 4  # two sequence dims
    assert options["smaller_micro_batch"]["saving_bytes"] == 2**20
    assert {"gradient_checkpointing", "device_map_sharding", "zero3_fsdp", "quantize_4bit"} <= set(options)
    assert options["zero3_fsdp"]["saving_bytes"] == int((weights + weights + 2 * weights) * 0.5)
    savings = [o["saving_bytes"] for o in oom["options"]]
    assert savings == sorted(savings, reverse=True) and min(savings) >= 0.01 * oom["message_fields"]["requested"]


def test_17b_optimizer_holds_replaced_parameters():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model[1].weight = nn.Parameter(torch.randn(1, 4))  # replaced after the optimizer was built
    with Probe(model, print_on_error=False) as probe:
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    findings = {f["id"]: f for f in probe.report()["findings"]}
    assert findings["optimizer_orphans"]["title"] == "the optimizer holds 1 tensor(s) the model no longer uses"
    assert findings["grads_not_stepped"]["items"] == ["1.weight"]


def test_3b_frozen_after_backward_is_still_updated():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Probe(model, print_on_error=False) as probe:
        model(torch.randn(3, 4)).sum().backward()
        model[0].requires_grad_(False)  # frozen, but its .grad stays
        opt.step()
    findings = {f["id"]: f for f in probe.report()["findings"]}
    assert findings["frozen_but_updated"]["items"] == ["0.weight", "0.bias"]


def test_clean_run_has_no_findings_and_a_placement_summary():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Probe(model, print_on_error=False) as probe:
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    report = probe.report()
    assert report["findings"] == []
    assert report["placement"] == [{"model": "Sequential", "hf_device_map": False, "devices": [
        {"device": "cpu", "params": 25, "bytes": 100, "trainable": 25, "modules": ["Sequential"]}]}]
    assert report["memory"]["devices"][-1]["device"] == "cpu" and report["memory"]["devices"][-1]["peak_rss"] > 0
    assert any("no CUDA" in note for note in report["memory"]["notes"])


def _train(lr: float, steps: int = 3, scale_loss: float = 1.0):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with Probe(model, print_on_error=False) as probe:
        for _ in range(steps):
            loss = model(torch.randn(16, 4)).pow(2).mean() * scale_loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {f["id"]: f for f in probe.report()["findings"]}


def test_stepped_parameters_that_never_change_are_reported():
    findings = _train(lr=0.0)  # e.g. a schedule stuck at 0
    assert findings["stepped_but_unchanged"]["items"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert "stepped_but_unchanged" not in _train(lr=0.1)
    assert "stepped_but_unchanged" not in _train(lr=0.0, steps=1)  # one step proves nothing


def _findings_of(main) -> dict:
    """Run ``main`` (which builds and frees its own model) under a probe; the report is built after it returned."""
    import gc

    with Probe(print_on_error=False) as probe:
        main()
    gc.collect()
    return {f["id"]: f for f in probe.report()["findings"]}


def test_silent_problem_survives_main_freeing_the_model():
    def main():
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        model[0].requires_grad_(False)
        opt = torch.optim.SGD(model[0].parameters(), lr=0.1)  # over the frozen part only
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()

    findings = _findings_of(main)
    missed = findings["optimizer_misses_trainable"]
    assert missed["items"] == ["2.weight", "2.bias"] and missed["severity"] == "error"
    assert missed["location"]["code"].startswith("opt = torch.optim.SGD(model[0].parameters()")


def test_k_fold_fresh_model_and_optimizer_per_fold_is_clean():
    def main():
        for fold in range(3):
            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for _ in range(2):
                model(torch.randn(3, 4)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()

    assert _findings_of(main) == {}


def test_offload_hooks_swapping_placeholders_are_not_orphans(tmp_path):
    from accelerate import dispatch_model
    from peft import LoraConfig, get_peft_model

    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "cpu", "lm_head": "cpu"}

    def main():
        model = dispatch_model(tiny_llama(), device_map=device_map, main_device="cpu", offload_dir=str(tmp_path))
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], layers_to_transform=[0]))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # frozen offloaded placeholders included
        for _ in range(2):
            ids = torch.randint(0, 128, (2, 6))
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad()

    findings = _findings_of(main)
    assert "optimizer_orphans" not in findings
    assert {f["severity"] for f in findings.values()} <= {"info"}


def test_zero_learning_rate_names_the_schedule_line():
    def main():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: step // 100)  # integer division: 0 for 100 steps
        for _ in range(3):
            model(torch.randn(16, 4)).pow(2).mean().backward()
            opt.step()
            schedule.step()
            opt.zero_grad()

    finding = _findings_of(main)["stepped_but_unchanged"]
    assert finding["items"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert "learning rate was 0 at every one of the 3 step(s)" in finding["detail"]
    assert finding["location"]["code"].startswith("schedule = torch.optim.lr_scheduler.LambdaLR(")


def test_freeze_line_is_named():
    def main():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(3, 4)).sum().backward()
        model[0].requires_grad_(False)  # frozen, but its .grad stays
        opt.step()

    finding = _findings_of(main)["frozen_but_updated"]
    assert finding["items"] == ["0.weight", "0.bias"]
    assert finding["location"]["code"] == "model[0].requires_grad_(False)  # frozen, but its .grad stays"
