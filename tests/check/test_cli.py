"""The command line: exit codes, output formats, rule docs, and no torch import."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from gpudoctor.cli import main

ROOT = Path(__file__).resolve().parents[2]
SEED000 = ROOT / "fixtures" / "seeds" / "seed000_kaggle_chatglm_lora.py"


def test_exit_codes(tmp_path, capsys):
    clean = tmp_path / "clean.py"
    clean.write_text("import torch\nprint(torch.ones(1))\n")
    assert main(["check", str(clean)]) == 0
    assert "All checks passed" in capsys.readouterr().out
    assert main(["check", str(SEED000)]) == 1
    assert main(["check", str(SEED000), "--exit-zero"]) == 0
    assert main(["check", str(tmp_path / "missing.py")]) == 2
    assert main(["check", str(clean), "--select", "XYZ9"]) == 2


def test_info_findings_do_not_fail(tmp_path):
    single = tmp_path / "single.py"
    single.write_text(
        textwrap.dedent(
            """\
            from accelerate import Accelerator
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained("m", device_map={"a": 0, "b": 1})
            model = Accelerator().prepare(model)
            """
        )
    )
    assert main(["check", str(single), "--output-format", "json", "-o", str(tmp_path / "out.json")]) == 0
    data = json.loads((tmp_path / "out.json").read_text())
    assert [(f["code"], f["severity"]) for f in data["findings"]] == [("GD101", "info")]


def test_json_schema_fields(capsys):
    main(["check", str(SEED000), "--output-format", "json"])
    data = json.loads(capsys.readouterr().out)
    assert data["version"] == 1 and data["errors"] == []
    keys = {"path", "line", "column", "end_line", "end_column", "code", "name", "severity", "message", "fix"}
    assert all(keys <= set(f) for f in data["findings"])
    lines = [f["line"] for f in data["findings"]]
    assert lines == sorted(lines)


def test_statistics(capsys):
    main(["check", str(SEED000), "--statistics"])
    out = capsys.readouterr().out
    assert "GD103" in out and "unprepared-object-used" in out


def test_rule_command(capsys):
    assert main(["rule", "GD101"]) == 0
    assert "distributed mode" in capsys.readouterr().out
    assert main(["rule", "--all", "--output-format", "json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {"GD101", "GD103"} <= {r["code"] for r in listed}
    assert main(["rule", "GD999"]) == 2


def test_check_never_imports_torch_or_hf():
    code = (
        "import sys; from gpudoctor.cli import main; "
        f"rc = main(['check', {str(SEED000)!r}, '--no-cache', '-q']); "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'torch', 'transformers', 'accelerate', 'peft', 'trl', 'numpy'}); "
        "print('HEAVY', heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out


def test_python_dash_m(tmp_path):
    out = subprocess.run([sys.executable, "-m", "gpudoctor", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("gpudoctor ")
