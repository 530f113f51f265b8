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


def test_unknown_card_and_unbuildable_model_are_clear_errors(capsys):
    assert main(["plan", "gpt2", "--gpus", "2xT5"]) == 2
    assert "unknown GPU" in capsys.readouterr().err
    assert main(["plan", "someone/no-such-model-7b", "--gpus", "2xT4"]) == 2
    assert "not among the bundled configs" in capsys.readouterr().err


def test_seed000_script_runs_or_says_why_its_model_is_not_simulable(capsys):
    """ChatGLM-6B is remote code: until the engine can build it, --script on seed 000 stops with the reason."""
    from pathlib import Path

    import pytest

    from gpudoctor.simulate import hub

    try:
        hub.resolve_config("THUDM/chatglm-6b", None)
    except hub.NotSimulable:
        pass
    else:
        pytest.skip("ChatGLM-6B is simulable here: the README's seed 000 plan covers it")
    script = Path(__file__).resolve().parents[2] / "fixtures" / "seeds" / "seed000_kaggle_chatglm_lora.py"
    assert main(["plan", "--script", str(script), "--gpus", "2xT4", "--no-search"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpudoctor plan: THUDM/chatglm-6b") and "Traceback" not in err
