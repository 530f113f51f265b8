"""Every number ``plan`` prints agrees with the simulation engine on the same case."""

import pytest

from gpudoctor.plan import simulated
from gpudoctor.plan.planner import Planner, ddp_peaks, fsdp_peaks
from gpudoctor.plan.simulated import Workload
from gpudoctor.plan.strategies import methods_for
from gpudoctor.simulate import simulate_step
from gpudoctor.simulate.cards import parse_spec

WORKLOAD = Workload(batch=2, seq=128, lora_r=8, lora_alpha=16)


def _method(cards, key):
    return {m.key: m for m in methods_for(cards)}[key]


def _engine_peak(model, spec, method, checkpointing=False, workload=WORKLOAD, **kwargs):
    out = simulate_step(model, spec, batch=workload.batch, seq=workload.seq, dtype=method.dtype,
                        lora=workload.lora_kwargs() if method.lora else None, autocast=method.autocast,
                        gradient_checkpointing=checkpointing, **kwargs)
    return out


@pytest.mark.parametrize("key", ["lora", pytest.param("full-bf16", marks=pytest.mark.slow)])
def test_one_gpu_row_is_the_engines_peak(wide_model, key):
    cards = parse_spec("1x3070Ti")
    method = _method(cards, key)
    info = simulated.resolve(wide_model)
    row = Planner(info, cards, WORKLOAD).rows_for(method, False)[0]
    engine = _engine_peak(wide_model, "1xH200", method)["devices"][0]  # a card the step fits on: the whole peak
    assert row.source == "simulated, by layer"
    assert row.peak_allocated == pytest.approx(engine["peak_allocated"], rel=0.01)
    assert row.peak == pytest.approx(engine["peak_reserved"], rel=0.03)
    on_card = _engine_peak(wide_model, "1x3070Ti", method)
    assert row.fits == on_card["fits"]


def test_one_gpu_amp_row_follows_the_phase_that_peaks_at_the_models_depth(tmp_path):
    """Full fp16 AMP with a large tied vocabulary: the backward pass (the logits' fp32 temporaries) peaks in the
    shallow copies, the optimizer step (a layer's weights, gradients, AdamW state and foreach temporaries) grows
    faster and peaks in the whole model; the line through the copies' overall peaks is 10 % low here."""
    from plan_models import TIED_VOCAB, write_config

    model = write_config(tmp_path / "tied16", TIED_VOCAB)
    workload = Workload(batch=1, seq=512)
    cards = parse_spec("1x3070Ti")
    method = _method(cards, "full-amp")
    info = simulated.resolve(model)
    row = Planner(info, cards, workload).rows_for(method, False)[0]
    engine = _engine_peak(model, "1xH200", method, workload=workload)["devices"][0]
    assert row.source == "simulated, by layer"
    assert row.peak_allocated == pytest.approx(engine["peak_allocated"], rel=0.02)
    assert row.peak == pytest.approx(engine["peak_reserved"], rel=0.10)
    # the case is the one the test is for: the copies' peak phase is not the whole model's
    shallow = simulated.simulate(info, method, workload, False, cards[0], (simulated.depths(method)[0],))["devices"][0]
    assert max(shallow["phases"], key=lambda name: shallow["phases"][name]["peak_allocated"]) == "backward"
    assert max(engine["phase_peaks"], key=lambda name: engine["phase_peaks"][name]["allocated"]) == "optimizer_step"


def test_ddp_is_one_gpu_plus_a_bucket_of_the_trainable_gradients(tiny_model):
    from peft import LoraConfig, get_peft_model

    cards = parse_spec("2x3070Ti")
    method = _method(cards, "lora")
    info = simulated.resolve(tiny_model)
    rows = {r.placement: r for r in Planner(info, cards, WORKLOAD).rows_for(method, False)}
    meta = simulated._meta_model(info.config, method.dtype, fresh=True)
    peft_model = get_peft_model(meta, LoraConfig(task_type="CAUSAL_LM", **WORKLOAD.lora_kwargs()))
    trainable = sum(p.numel() * p.element_size() for p in peft_model.parameters() if p.requires_grad)
    bucket = -(-trainable // (2 << 20)) * (2 << 20)
    assert rows["DDP"].peak - rows["1 GPU"].peak == bucket
    assert rows["DDP"].cpu_ram == 2 * info.num_params * 2  # each process loads a bf16 copy


def test_fsdp_shards_state_and_gathers_two_layers():
    one = {"peak_allocated": 1000, "peak_reserved": 1100,
           "breakdown": {"weights": 400, "gradients": 200, "optimizer_state": 300, "activations": 100}}
    sharded = fsdp_peaks(one, 4, layer_bytes=0, state_bytes=900)
    assert sharded["peak_allocated"] == 1000 - 900 + 225
    assert sharded["peak_reserved"] - sharded["peak_allocated"] == 100
    gathered = fsdp_peaks(one, 1, layer_bytes=3 << 20, state_bytes=900)
    assert gathered["peak_allocated"] == 1000 + (6 << 20)
    assert fsdp_peaks(one, 2, 0, state_bytes=5000)["peak_allocated"] == 500  # never more state than the peak
    assert ddp_peaks(one, 1)["peak_allocated"] == 1000 + (2 << 20)


def test_fsdp_row_is_the_highest_of_its_sharded_phases():
    mib = 1 << 20
    one = {"peak_allocated": 1728 * mib, "peak_reserved": 1800 * mib, "breakdown": {},
           "phases": {
               # the optimizer step: weights 384, gradients 384, moments 768, AdamW's temporaries 192 (MiB)
               "optimizer_step": {"peak_allocated": 1728 * mib, "peak_reserved": 1800 * mib, "breakdown": {
                   "weights": 384 * mib, "gradients": 384 * mib, "optimizer_state": 768 * mib, "temporaries": 192 * mib}},
               "backward": {"peak_allocated": 1600 * mib, "peak_reserved": 1700 * mib, "breakdown": {
                   "weights": 384 * mib, "gradients": 256 * mib, "optimizer_state": 768 * mib,
                   "activations": 64 * mib, "temporaries": 128 * mib}},
           }}
    card = fsdp_peaks(one, 2, layer_bytes=64 * mib, state_bytes=0)
    step = (384 + 384 + 768) // 2 + 192 // 2  # all sharded, no layer gathered
    backward = (384 + 256 + 768) // 2 + 64 + 128 + 2 * 64  # activations and their temporaries kept, two layers gathered
    assert card["phases"]["optimizer_step"]["peak_allocated"] == step * mib
    assert card["phases"]["backward"]["peak_allocated"] == backward * mib
    assert card["peak_allocated"] == max(step, backward) * mib
    assert card["peak_reserved"] >= card["peak_allocated"]
    assert card["phases"]["backward"]["peak_reserved"] - card["phases"]["backward"]["peak_allocated"] == 100 * mib


@pytest.mark.slow
@pytest.mark.parametrize("key", ["lora", "qlora-4"])
def test_pipeline_rows_are_the_engines_per_device_peaks(tmp_path, key):
    from plan_models import WIDE, write_config

    model = write_config(tmp_path / "wide8", {**WIDE, "num_hidden_layers": 8})
    cards = parse_spec("3x3070Ti")
    method = _method(cards, key)
    info = simulated.resolve(model)
    planner = Planner(info, cards, WORKLOAD)
    row = next(r for r in planner.rows_for(method, False) if r.placement == "device_map")
    assert row.source == "simulated per device, by layer"
    if method.quant_bits:  # the whole model, as the plan builds it (the engine's bitsandbytes storage model)
        engine = simulated.simulate(info, method, WORKLOAD, False, cards[0], None, planner.device_map(method))
        engine["fits"] = True
        resident = sorted({d for d in planner.device_map(method).values() if isinstance(d, int)})
        pairs = [(row.devices[d], engine["devices"][i]) for i, d in enumerate(resident)]
    else:
        engine = _engine_peak(model, "3x3070Ti", method, device_map="auto")
        pairs = list(zip(row.devices, engine["devices"]))
    assert engine["fits"] and row.fits
    for ours, theirs in pairs:
        assert ours["peak_allocated"] == pytest.approx(theirs["peak_allocated"], rel=0.05 if method.quant_bits else 0.02)
        # QLoRA's reserved figure on ~1 GiB cards moves by whole allocator segments: 5.1 % on the middle card here
        # (one copy on four devices; 3.8 % with two copies on three); the bar is 10 %
        assert ours["peak_reserved"] == pytest.approx(theirs["peak_reserved"], rel=0.10 if method.quant_bits else 0.05)
