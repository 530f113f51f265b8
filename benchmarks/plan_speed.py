"""How long ``gpudoctor plan`` takes on field report 003's model and cards, cold and warm.

Runs, each in a fresh process with a fresh cache directory:

* baseline: one single-strategy simulation of the same model, ``simulate_step(MODEL, "6x3070Ti",
  lora=..., device_map="auto")`` (LoRA over a device map: the strategy the plan recommends), whole model;
* cold: ``gpudoctor plan MODEL --gpus 6x3070Ti`` (every method, with the batch / sequence search),
  nothing cached;
* warm: the same command again (every simulation cached).

Prints wall and CPU time (this process's children: the plan forks its simulations) of each, and the
plan's times as multiples of the baseline measured in the same run, so the numbers compare across
machines and loads; on a shared machine compare CPU time (wall grows with the other processes' load).
The issue's goal: a cold 7B table in under 2 minutes on a 2-core machine. Measured 2026-12-02 (2 cores,
load average 9 from other work): cold 92.9 s CPU (44 simulations; 151.6 s and 70 before the one-copy
pipeline layout and the aimed search), warm 9.1 s, baseline 13.1 s.

Run: ``python benchmarks/plan_speed.py [--model ID] [--gpus SPEC] [--skip-baseline]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = """
from gpudoctor.simulate import simulate_step
out = simulate_step({model!r}, {gpus!r}, batch=4, seq=512, dtype="bfloat16", lora={{"r": 16, "lora_alpha": 32}}, device_map="auto")
print("baseline peak (fullest card):", max(d["peak_reserved"] for d in out["devices"]) / 2**30, "GiB")
"""


def timed(command: list[str], env: dict) -> tuple[float, float, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command[:4])}... failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return wall, cpu, done.stdout


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="meta-llama/Llama-2-7b-hf")
    parser.add_argument("--gpus", default="6x3070Ti")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--show", action="store_true", help="print the plan's table")
    args = parser.parse_args(argv)
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_HUB_OFFLINE": "1"}
    results = {}
    with tempfile.TemporaryDirectory(prefix="gpudoctor-plan-speed-") as cache:
        env["GPUDOCTOR_CACHE_DIR"] = cache
        if not args.skip_baseline:
            results["baseline (1 simulation)"] = timed(
                [sys.executable, "-c", BASELINE.format(model=args.model, gpus=args.gpus)], env)
        command = [sys.executable, "-m", "gpudoctor.cli", "plan", args.model, "--gpus", args.gpus]
        results["plan, cold"] = timed(command, env)
        results["plan, warm"] = timed(command, env)
    base = results.get("baseline (1 simulation)")
    print(f"{args.model} on {args.gpus}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    print(f"{'run':26} {'wall':>8} {'CPU':>8} {'wall / baseline':>16} {'CPU / baseline':>15}")
    for name, (wall, cpu, _) in results.items():
        ratio = f"{wall / base[0]:.1f}x" if base else "-"
        cpu_ratio = f"{cpu / base[1]:.1f}x" if base else "-"
        print(f"{name:26} {wall:7.1f}s {cpu:7.1f}s {ratio:>16} {cpu_ratio:>15}")
    if args.show:
        print(results["plan, warm"][2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
