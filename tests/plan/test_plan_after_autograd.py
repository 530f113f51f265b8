"""``plan`` in a process that already ran autograd (a notebook, a test session after the engine's own tests).

torch refuses autograd in a child forked from such a process; ``plan`` then switches to spawned children. With
several children forked at once, every one of them was refused, and only the first was run again: the others
came back as "not simulated" (seen as ``test_json_plan_of_a_small_model`` failing after ``tests/simulate``)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

SCRIPT = textwrap.dedent("""\
    import sys
    import torch
    from gpudoctor.plan import simulated
    from gpudoctor.plan.simulated import Method, Workload
    from gpudoctor.simulate.cards import parse_spec

    if __name__ == "__main__":
        from gpudoctor.simulate import Simulation

        with Simulation("1x8GB"):  # autograd on a device: this process's forks are refused autograd from now on
            torch.nn.Linear(8, 8).cuda()(torch.ones(2, 8, device="cuda")).sum().backward()
        info = simulated.resolve(sys.argv[1])
        card = parse_spec("1xT4")[0]
        method = Method("lora", "LoRA", "float16", lora=True)
        requests = [(info, method, Workload(batch=b, seq=32), False, card, (1,), None) for b in (1, 4)]
        simulated.prefetch(requests, jobs=2, use_cache=False)
        results = [simulated.simulate(*r, use_cache=False) for r in requests]
        print("PEAKS" + json.dumps([r["devices"][0]["peak_allocated"] for r in results]))
""").replace("import sys\n", "import json, sys\n", 1)


def test_every_case_is_simulated_when_the_parent_ran_autograd(tiny_model, tmp_path):
    script = tmp_path / "plan_after_autograd.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(SRC), GPUDOCTOR_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, str(script), tiny_model], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]  # simulate() raises SimulationFailed for a case that failed
    peaks = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("PEAKS"))[len("PEAKS"):])
    assert len(peaks) == 2 and peaks[0] < peaks[1]  # both simulated; the larger batch needs more
