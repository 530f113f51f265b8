"""Ways in: the CLI (script, -m, -- launcher) in real child processes, the Python API, the IPython magic."""

import json
import os
import subprocess
import sys
import textwrap

import torch.nn as nn

import gpudoctor
from gpudoctor.trace import cli
from gpudoctor.trace.api import Probe, watch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(REPO, "fixtures", "trace", "demo_device_mismatch.py")


def run_cli(args, cwd=None):
    return subprocess.run([sys.executable, "-m", "gpudoctor.trace.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=240)


def test_cli_script_keeps_exit_code_output_traceback_and_writes_json(tmp_path):
    out = tmp_path / "report.json"
    proc = run_cli(["--json", str(out), DEMO])
    assert proc.returncode == 1
    # the user's traceback comes first, unchanged (no gpudoctor frames), then the report
    traceback_end = proc.stderr.index("FakeTensorDeviceMismatchError: Expected all tensors")
    assert proc.stderr.index("gpudoctor trace") > traceback_end
    assert "gpudoctor/trace/probe.py" not in proc.stderr[:traceback_end]
    merged = json.loads(out.read_text())
    assert merged["schema"] == "gpudoctor.trace/1" and merged["exit_code"] == 1 and len(merged["ranks"]) == 1
    failure = merged["ranks"][0]["failure"]
    assert failure["cause"]["id"] == "tensor_created_in_forward"
    assert failure["module"]["path"] == "positions" and failure["op"]["argument"] == "indices"
    assert failure["tensors"][1]["origin"]["location"]["code"].startswith("position_ids = torch.arange(")
    assert "tensor created inside forward() has no device=" in proc.stderr


def test_cli_module_and_launcher_ways_in(tmp_path):
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(textwrap.dedent("""
        import sys, torch, torch.nn as nn
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        print("trained", sys.argv[1:])
        sys.exit(3)
    """))
    out = tmp_path / "m.json"
    proc = run_cli(["--json", str(out), "-m", "userpkg.train", "--lr", "1"], cwd=tmp_path)
    assert proc.returncode == 3 and "trained ['--lr', '1']" in proc.stdout
    rank = json.loads(out.read_text())["ranks"][0]
    assert rank["failure"] is None and rank["stats"]["optimizer_steps"] == 1
    assert rank["placement"][0]["model"] == "Linear"

    # "--" launcher: torchrun-style with two ranks, each reporting
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent("""
        import os, torch, torch.nn as nn
        model = nn.Linear(4, 2)
        if os.environ["RANK"] == "1":
            model(torch.randn(3, 5))  # shape bug on rank 1 only
        model(torch.randn(3, 4))
    """))
    out = tmp_path / "ranks.json"
    proc = run_cli(["--json", str(out), "--", sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                    "--master_port", "29533", str(script)], cwd=tmp_path)
    assert proc.returncode != 0
    merged = json.loads(out.read_text())
    ranks = {r["rank"]: r for r in merged["ranks"] if r["rank"] is not None}
    assert set(ranks) == {0, 1}
    assert ranks[0]["failure"] is None and ranks[1]["failure"]["exception"]["type"] == "RuntimeError"
    assert ranks[1]["failure"]["module"]["class"] == "Linear"


def test_cli_usage_and_bad_script():
    assert cli.main([]) == 2
    assert cli.main(["--help"]) == 0
    assert cli.main(["does_not_exist.py"]) == 2
    assert cli.parse(["--deep", "--json", "x.json", "-m", "a.b", "--flag"]) == (
        {"json": "x.json", "deep": True, "quiet": False, "check": True}, [sys.executable, "-m", "a.b", "--flag"])
    assert cli.parse(["--no-check", "--", "accelerate", "launch", "t.py"]) == (
        {"json": None, "deep": False, "quiet": False, "check": False}, ["accelerate", "launch", "t.py"])
    assert cli.traced_scripts(["accelerate", "launch", __file__, "--epochs", "1"]) == [__file__]


def test_lazy_forwarding_and_watch_handle():
    assert gpudoctor.watch is watch and gpudoctor.Probe is Probe
    model = nn.Linear(2, 2)
    probe = gpudoctor.watch(model)
    assert probe.installed
    import torch
    model(torch.randn(1, 2))
    probe.close()
    assert not probe.installed and probe.report()["stats"]["module_calls"] == 1


def test_probe_failure_never_hides_user_error(monkeypatch):
    from gpudoctor.trace import diagnose

    def broken(*args, **kwargs):
        raise AssertionError("probe bug")

    monkeypatch.setattr(diagnose, "diagnose_exception", broken)
    model = nn.Linear(2, 2)
    import pytest
    import torch

    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes"):
        with Probe(model, print_on_error=False) as probe:
            model(torch.randn(1, 3))
    report = probe.report()
    assert report["failure"] is None and any("probe bug" in e for e in report["probe_errors"])


class FakeIPython:
    def __init__(self):
        self.magics = {}

    def register_magic_function(self, func, magic_kind="line", magic_name=None):
        self.magics[(magic_kind, magic_name)] = func

    def run_cell(self, cell):
        class Result:
            error_in_exec = None
            error_before_exec = None

        result = Result()
        try:
            exec(cell, {"nn": nn})
        except Exception as exc:
            result.error_in_exec = exc
        return result


def test_ipython_magic_reports_cell_errors(capsys):
    from gpudoctor.trace.magic import load_ipython_extension

    ipython = FakeIPython()
    load_ipython_extension(ipython)
    magic = ipython.magics[("cell", "gpudoctor")]
    magic("", "import torch\nm = nn.Linear(2, 2)\nm(torch.randn(1, 3))")
    err = capsys.readouterr().err
    assert "gpudoctor trace" in err and "mat1 and mat2 shapes cannot be multiplied" in err
    assert nn.Module.__call__.__name__ != "_traced_call"
