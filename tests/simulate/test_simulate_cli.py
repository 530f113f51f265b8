"""``gpudoctor trace --simulate``: the user's script, unchanged, on simulated cards (subprocesses)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpudoctor.trace.cli import main

ROOT = Path(__file__).resolve().parents[2]
SEEDS = ROOT / "fixtures" / "seeds"

TINY_TRAIN = textwrap.dedent("""\
    import torch, torch.nn as nn
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(10):
        loss = model(torch.randn(16, 4096).to(device)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        print("loss", loss.item())
""")


def _trace(tmp_path, script: str, *options: str, name: str = "train.py", args=()) -> tuple[subprocess.CompletedProcess, dict]:
    path = tmp_path / name
    if not path.exists():
        path.write_text(script)
    report = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "gpudoctor", "trace", *options, "--no-check", "--json", str(report), str(path), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    return proc, json.loads(report.read_text())


def test_list_gpus_and_unknown_card(capsys, tmp_path):
    assert main(["--list-gpus"]) == 0
    out = capsys.readouterr().out
    assert "T4" in out and "3070 Ti" in out and "A100-80GB" in out and "14.74 GiB" in out
    (tmp_path / "x.py").write_text("pass\n")
    assert main(["--simulate", "2xT5", str(tmp_path / "x.py")]) == 2
    assert "close matches: T4" in capsys.readouterr().err


def test_tiny_script_fits_then_stops_after_two_steps(tmp_path):
    proc, report = _trace(tmp_path, TINY_TRAIN, "--simulate", "1x4GB")
    assert proc.returncode == 0, proc.stderr[-3000:]
    sim = report["simulated"]
    assert sim["simulated"] and sim["optimizer_steps"] == 2 and sim["stopped_after_steps"]
    assert sim["verdict"]["fits"] is True
    weights = 2 * (4096 * 4096 + 4096) * 4
    device = sim["devices"][0]
    assert device["device"] == "cuda:0"
    assert device["peak_by_category"]["gradients"] >= weights and device["peak_by_category"]["optimizer_state"] >= 2 * weights
    assert proc.stdout.count("loss 0.0") == 1  # stopped inside the second step; the loss is a stand-in


def test_tiny_script_runs_out_of_memory_at_the_optimizer_step(tmp_path):
    proc, report = _trace(tmp_path, TINY_TRAIN, "--simulate", "1x1GB")
    assert proc.returncode == 1
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate" in proc.stderr
    assert "gpu:" not in proc.stderr.split("Traceback")[1].split("gpudoctor trace")[0]
    verdict = report["simulated"]["verdict"]
    assert verdict == {**verdict, "fits": False, "kind": "oom", "device": "cuda:0", "line": 8}


def _medical_dialogs(tmp_path: Path) -> None:
    from gpudoctor.reference.data import BUNDLED_DATA

    (tmp_path / "small_en_medical_dialog.json").write_bytes(BUNDLED_DATA.read_bytes())


@pytest.mark.slow
def test_seed003_dataparallel_runs_out_of_memory_on_gpu0_at_model_to(tmp_path):
    _medical_dialogs(tmp_path)
    script = (SEEDS / "seed003_llama_dataparallel.py").read_text()
    proc, report = _trace(tmp_path, script, "--simulate", "6x3070Ti", name="seed003.py")
    verdict = report["simulated"]["verdict"]
    assert verdict["kind"] == "oom" and verdict["device"] == "cuda:0" and verdict["code"] == "model.to(device)"
    assert "GPU 0 has a total capacity of 7.58 GiB" in proc.stderr


@pytest.mark.slow
def test_seed003_fixed_twin_fits_on_six_8gb_cards(tmp_path):
    _medical_dialogs(tmp_path)
    script = (SEEDS / "seed003_llama_dataparallel.fixed.py").read_text()
    proc, report = _trace(tmp_path, script, "--simulate", "6x3070Ti", name="seed003_fixed.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    sim = report["simulated"]
    assert sim["verdict"]["fits"] is True and sim["optimizer_steps"] == 2
    assert all(d["peak_allocated"] > 1 << 30 for d in sim["devices"])  # device_map="auto" spread the layers


def test_script_that_needs_values_stops_with_an_explanation(tmp_path):
    script = "import torch\nx = torch.randn(8, device='cuda')\nprint(torch.bincount(torch.randint(0, 5, (8,), device='cuda')))\n"
    proc, _ = _trace(tmp_path, script, "--simulate", "1x8GB")
    traceback = proc.stderr.split("gpudoctor trace")[0]
    assert "gpudoctor --simulate stopped at" in traceback and "no values" in traceback
    assert "gpudoctor/simulate" not in traceback


def test_program_that_aborts_before_reporting_gets_no_verdict(tmp_path):
    # An exception from a hook on an autograd node aborts the process on the virtual devices (torch's engine
    # loses it): gpudoctor must not claim the run fits, and says what is known to cause it.
    script = textwrap.dedent("""\
        import torch
        model = torch.nn.Linear(8, 8).cuda()
        loss = model(torch.randn(4, 8, device="cuda")).sum()
        def bad(*grads):
            raise ValueError("my hook failed")
        loss.grad_fn.register_hook(bad)
        loss.backward()
        """)
    proc, report = _trace(tmp_path, script, "--simulate", "1xT4")
    assert proc.returncode == -signal.SIGABRT  # gpudoctor ends the way the program did
    verdict = report["simulated"]["verdict"]
    assert verdict["kind"] == "not-simulated" and verdict["fits"] is None
    assert "grad_fn.register_hook" in verdict["message"]
    assert "not simulated on 1xT4" in proc.stderr and "left on the fullest card" not in proc.stderr


@pytest.mark.slow
def test_seed003_trainer_fixed_twin_fits_with_fp16_amp(tmp_path):
    _medical_dialogs(tmp_path)
    script = (SEEDS / "seed003_accelerate_trainer.fixed.py").read_text()
    proc, report = _trace(tmp_path, script, "--simulate", "6x3070Ti", name="seed003_trainer_fixed.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report["simulated"]["verdict"]["fits"] is True and report["simulated"]["optimizer_steps"] == 2


def test_offloaded_device_map_stops_with_an_explanation_not_a_traceback(tmp_path):
    script = ('from transformers import AutoModelForCausalLM\n'
              'model = AutoModelForCausalLM.from_pretrained("gpt2", device_map="auto", max_memory={0: "200MB", "cpu": "8GB"})\n')
    proc, report = _trace(tmp_path, script, "--simulate", "1x8GB")
    traceback = proc.stderr.split("gpudoctor trace")[0]
    assert "NotSimulable: the device map offloads 2 module(s) to cpu" in traceback
    assert "gpudoctor/simulate" not in traceback and "During handling" not in traceback
    assert report["simulated"]["verdict"]["line"] == 2


def test_script_prints_show_cuda_device_names(tmp_path):
    script = ('import torch, torch.nn as nn\n'
              'm = nn.Linear(4, 4).cuda()\n'
              'x = torch.zeros(2, 4, device="cuda:0")\n'
              'print(x.device, m.weight.device)\n'
              'print(f"on {x.device}", repr(x.device))\n'
              'print("my gpu")\n')
    proc, _ = _trace(tmp_path, script, "--simulate", "1x8GB")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "cuda:0 cuda:0\non cuda:0 device(type='cuda', index=0)\nmy gpu\n" in proc.stdout


BACKWARD_ERROR = textwrap.dedent("""\
    import sys
    import torch, torch.nn as nn

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            raise ValueError("refused in backward")

    def refuse(*args):
        raise ValueError("refused in backward")

    kind = sys.argv[1]
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).to("cuda:1")
    if kind == "module_hook":
        model[2].register_full_backward_hook(refuse)
    if kind == "module_pre_hook":
        model[2].register_full_backward_pre_hook(refuse)
    out = model(torch.randn(8, 64, device="cuda:1"))
    if kind == "function":
        out = Scale.apply(out)
    if kind == "tensor_hook":
        out.register_hook(refuse)
    loss = out.pow(2).mean()
    loss.backward()
    print("not reached")
""")


def _traceback_of(proc) -> str:
    """The traceback Python printed: from "Traceback" to the rule that opens gpudoctor's report."""
    lines = ("Traceback" + proc.stderr.split("Traceback", 1)[1]).splitlines()
    end = next(i for i, line in enumerate(lines) if line.startswith("─") and "gpudoctor trace" in line)
    return "\n".join(lines[:end])


def _simulator_frames(traceback: str) -> list[str]:
    frames = [line for line in traceback.splitlines() if line.strip().startswith("File ")]
    plumbing = ("gpudoctor/simulate", "gpudoctor/virtual", "torch/_subclasses", "_python_dispatch", "torch/overrides.py",
                "torch/_compile.py", "torch/_dynamo")
    return [line for line in frames if any(p in line for p in plumbing)]


@pytest.mark.parametrize("kind", ["module_hook", "module_pre_hook", "function", "tensor_hook"])
def test_error_raised_in_backward_is_the_scripts_exception_at_its_backward_line(tmp_path, kind):
    """On the virtual backend an exception raised into the autograd engine by a hook would abort the process; a real
    GPU raises it at the ``backward()`` line: so does the simulation, with the report, exit code 1."""
    proc, report = _trace(tmp_path, BACKWARD_ERROR, "--simulate", "2x8GB", args=(kind,))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr and "not reached" not in proc.stdout
    traceback = _traceback_of(proc)
    frames = [line.strip() for line in traceback.splitlines() if line.strip().startswith("File ")]
    assert frames[0].endswith("line 28, in <module>") and "loss.backward()" in traceback
    assert traceback.rstrip().endswith("ValueError: refused in backward")
    assert 'raise ValueError("refused in backward")' in traceback  # the hook's own frame, as on a real GPU
    assert _simulator_frames(traceback) == []
    assert "gpudoctor trace" in proc.stderr and "SIMULATED GPU memory" in proc.stderr
    verdict = report["simulated"]["verdict"]
    assert verdict["fits"] is None and verdict["message"] == "refused in backward"


OOM_IN_LIBRARY = textwrap.dedent("""\
    import torch, torch.nn as nn
    model = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096)).cuda()
    x = torch.randn(3 << 15, 4096, device="cuda")
    out = model(x)
""")


def test_simulated_oom_traceback_has_the_frames_of_a_real_one(tmp_path):
    # 1.5 GiB input + 1.5 GiB Linear output on a 4 GB card: ReLU's output is the allocation that fails
    proc, report = _trace(tmp_path, OOM_IN_LIBRARY, "--simulate", "1x4GB")
    assert proc.returncode == 1
    traceback = _traceback_of(proc)
    assert _simulator_frames(traceback) == []
    frames = [line.strip() for line in traceback.splitlines() if line.strip().startswith("File ")]
    assert frames[0].endswith("line 4, in <module>")
    assert frames[-1].endswith("in relu") and "torch/nn/functional.py" in frames[-1]  # the library line whose op failed
    assert [line.strip() for line in traceback.splitlines()][-3:-1] == ["result = torch.relu(input)", "^^^^^^^^^^^^^^^^^"]
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB" in traceback
    assert report["simulated"]["verdict"]["line"] == 4


def test_simulated_oom_in_backward_traceback_ends_in_torchs_backward(tmp_path):
    # the forward fits (768 MiB activations); backward's gradients of them do not
    script = TINY_TRAIN.replace("torch.randn(16, 4096)", "torch.randn(3 << 14, 4096)")
    proc, report = _trace(tmp_path, script, "--simulate", "1x4GB")
    assert proc.returncode == 1
    traceback = _traceback_of(proc)
    assert _simulator_frames(traceback) == [] and "torch.OutOfMemoryError" in traceback
    frames = [line.strip() for line in traceback.splitlines() if line.strip().startswith("File ")]
    assert frames[0].endswith("line 7, in <module>") and "torch/_tensor.py" in frames[-1] and frames[-1].endswith("in backward")
    assert report["simulated"]["verdict"]["line"] == 7
