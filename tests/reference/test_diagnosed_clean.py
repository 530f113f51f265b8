"""The reference trainer is what gpudoctor recommends: its own checks find nothing in it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpudoctor.check.config import Config
from gpudoctor.check.engine import check_paths

REFERENCE = Path(__file__).resolve().parents[2] / "src" / "gpudoctor" / "reference"


def test_check_reports_nothing_on_the_trainer_source():
    result = check_paths([str(REFERENCE)], Config(root=REFERENCE, preview=True))
    assert result.errors == []
    assert [(f.path, f.line, f.code) for f in result.findings] == []


def test_trace_reports_no_problem_on_a_short_run(tmp_path):
    report = tmp_path / "trace.json"
    completed = subprocess.run(
        [
            sys.executable, "-m", "gpudoctor", "trace", "--json", str(report),
            "-m", "gpudoctor", "reference-train", "--steps", "4", "--output", str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["exit_code"] == 0
    ranks = [r for r in data["ranks"] if r["stats"]["module_calls"]]
    assert ranks, "the probe saw no model"
    for rank in ranks:
        assert rank["status"] == "ok" and rank["failure"] is None
        assert rank["findings"] == [], rank["findings"]
        assert rank["probe_errors"] == []
        assert rank["stats"]["optimizer_steps"] >= 4
