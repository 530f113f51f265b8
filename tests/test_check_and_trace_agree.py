"""The static check and the runtime probe name the same cause, and the same line, for the bundled demo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpudoctor.check.engine import check_source
from gpudoctor.check.registry import all_rules

SCRIPT = Path(__file__).resolve().parents[1] / "fixtures" / "trace" / "demo_device_mismatch.py"


def test_trace_cause_is_the_check_finding(tmp_path):
    report = tmp_path / "trace.json"
    completed = subprocess.run(
        [sys.executable, "-m", "gpudoctor", "trace", "--quiet", "--json", str(report), str(SCRIPT)],
        capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 1  # the program's own exit code: it fails
    assert "Expected all tensors to be on the same device" in completed.stderr  # its traceback is kept
    [rank] = [r for r in json.loads(report.read_text())["ranks"] if r["failure"]]
    cause = rank["failure"]["cause"]
    created = [t["origin"] for t in rank["failure"]["tensors"] if t["origin"]["kind"] == "created_in_forward"]
    assert cause["rule"] == "GD601" and created
    line = created[0]["location"]["line"]

    findings = check_source(SCRIPT.read_text(), str(SCRIPT), rules=all_rules())
    assert (line, cause["rule"]) in {(f.line, f.code) for f in findings}
    # and the trace report itself ends with that static finding
    static = json.loads(report.read_text())["static"]
    assert static["paths"] == [str(SCRIPT)]
    assert (line, cause["rule"]) in {(f["line"], f["code"]) for f in static["findings"]}
