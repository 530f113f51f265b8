"""The issue's bar on field report 003's model and hardware (Llama-2-7B, six 8 GB RTX 3070 Ti)."""

import pytest

from gpudoctor.plan.planner import make_plan
from gpudoctor.plan.simulated import Workload
from gpudoctor.simulate import simulate_step

pytestmark = pytest.mark.slow
MODEL = "meta-llama/Llama-2-7b-hf"
WORKLOAD = Workload(batch=3, seq=512, lora_r=16, lora_alpha=32)


@pytest.fixture(scope="module")
def plan():
    return make_plan(MODEL, "6x3070Ti", WORKLOAD, search=False, methods=["full-amp", "lora"])


def _row(plan, method, placement, checkpointing=False):
    return next(r for r in plan.rows if r.method.key == method and r.placement == placement and r.checkpointing == checkpointing)


def test_full_finetune_with_a_copy_per_card_does_not_fit(plan):
    for method in ("full-amp",):
        ddp = _row(plan, method, "DDP")
        assert ddp.verdict == "no" and any(r.startswith("GD112") for r in ddp.rules)
        assert _row(plan, method, "1 GPU").verdict == "no"


def test_lora_with_a_device_map_fits_and_matches_the_engine(plan):
    row = _row(plan, "lora", "device_map")
    assert row.fits and plan.recommended is not None and plan.recommended.method.key == "lora"
    engine = simulate_step(MODEL, "6x3070Ti", batch=WORKLOAD.batch, seq=WORKLOAD.seq, dtype=row.method.dtype,
                           lora=WORKLOAD.lora_kwargs(), device_map="auto")
    assert engine["fits"]
    for ours, theirs in zip(row.devices, engine["devices"]):
        assert ours["peak_reserved"] == pytest.approx(theirs["peak_reserved"], rel=0.10)
        assert ours["peak_allocated"] == pytest.approx(theirs["peak_allocated"], rel=0.10)
