"""Field report 000's script (ChatGLM-6B, remote code) through ``plan --script``."""

from gpudoctor.cli import main


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
