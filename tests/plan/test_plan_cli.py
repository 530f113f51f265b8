import json

from gpudoctor.cli import main


def test_json_plan_of_a_small_model(tiny_model, capsys):
    assert main(["plan", tiny_model, "--gpus", "2xT4", "--batch", "2", "--seq", "64", "--methods", "lora",
                 "--no-search", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    placements = [(r["placement"], r["gradient_checkpointing"]) for r in out["rows"]]
    assert placements == [(p, c) for c in (False, True) for p in ("1 GPU", "device_map", "DDP", "FSDP")]
    assert out["cards"] == ["T4", "T4"] and out["rows"][0]["method_label"] == "LoRA (fp16 base)"  # T4: no bf16
    assert all(r["fits"] for r in out["rows"])
    best = out["recommended"]
    assert (best["method"], best["placement"], best["gradient_checkpointing"]) == ("lora", "1 GPU", False)
    assert "get_peft_model" in out["code"] and out["recommendation"].startswith("Train LoRA (fp16 base) on one GPU")
    # FSDP rows are arithmetic on the 1-GPU simulation, not a sharded simulation: marked as estimates
    assert [r["estimate"] for r in out["rows"]] == [r["placement"] == "FSDP" for r in out["rows"]]


def test_plain_table_marks_fsdp_rows_as_estimates(tiny_model, capsys):
    assert main(["plan", tiny_model, "--gpus", "2xT4", "--batch", "2", "--seq", "64", "--methods", "lora",
                 "--no-search"]) == 0
    lines = capsys.readouterr().out.splitlines()
    fsdp = [line for line in lines if " FSDP x2 " in line]
    others = [line for line in lines if " DDP x2 " in line or " device_map " in line]
    assert len(fsdp) == 2 and all("estimate" in line for line in fsdp)
    assert others and not any("estimate" in line for line in others)
    assert any("FSDP 'estimate': not simulated sharded" in line for line in lines)


def test_unknown_card_and_unbuildable_model_are_clear_errors(capsys):
    assert main(["plan", "gpt2", "--gpus", "2xT5"]) == 2
    assert "unknown GPU" in capsys.readouterr().err
    assert main(["plan", "nobody-here/no-such-model-7b", "--gpus", "2xT4"]) == 2
    assert "not among the bundled configs" in capsys.readouterr().err
