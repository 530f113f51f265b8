"""Field report 000's script (ChatGLM-6B, remote code, LoRA on query_key_value, batch 1) through ``plan --script``.

The engine rebuilds ChatGLM-6B offline (gpudoctor.simulate.chatglm); ``trace --simulate 2xT4`` on the seed
fits with a few GiB left. The plan's LoRA fp16 row over a device map must agree: it fits, and its per-card
numbers are within 10 % of the engine's whole-model simulation of the same configuration.
"""

from pathlib import Path

import pytest

from gpudoctor.cli import main
from gpudoctor.plan.planner import make_plan
from gpudoctor.plan.simulated import Workload
from gpudoctor.simulate import simulate_step

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[2] / "fixtures" / "seeds" / "seed000_kaggle_chatglm_lora.py"
MODEL = "THUDM/chatglm-6b"
WORKLOAD = Workload(batch=1, seq=512, lora_r=32, lora_alpha=32, lora_targets=("query_key_value",))


def test_seed000_script_plans_chatglm_and_recommends_lora_over_a_device_map(capsys):
    assert main(["plan", "--script", str(SCRIPT), "--gpus", "2xT4", "--no-search", "--methods", "lora"]) == 0
    out = capsys.readouterr().out
    assert "lora_targets=('query_key_value',)" in out and "batch=1" in out and "model=THUDM/chatglm-6b" in out
    assert "Train LoRA (fp16 base)" in out and "trust_remote_code=True" in out and "AutoModel" in out


def test_lora_fp16_with_a_device_map_fits_2xT4_and_matches_the_engine():
    plan = make_plan(MODEL, "2xT4", WORKLOAD, search=False, methods=["lora"])
    row = next(r for r in plan.rows if r.method.key == "lora" and r.placement == "device_map" and not r.checkpointing)
    assert row.fits and row.method.dtype == "float16" and not row.offloaded
    engine = simulate_step(MODEL, "2xT4", batch=WORKLOAD.batch, seq=WORKLOAD.seq, dtype=row.method.dtype,
                           lora=WORKLOAD.lora_kwargs(), device_map="auto")
    assert engine["fits"]
    for ours, theirs in zip(row.devices, engine["devices"]):
        assert ours["peak_reserved"] == pytest.approx(theirs["peak_reserved"], rel=0.10)
        assert ours["peak_allocated"] == pytest.approx(theirs["peak_allocated"], rel=0.10)
