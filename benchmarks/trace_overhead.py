"""Overhead of gpudoctor's default probe on a plain CPU training loop of many small modules, where a
per-module-call cost shows most: 18 x (Linear 256->256, ReLU) in a Sequential (37 modules), batch 64.

    python benchmarks/trace_overhead.py [--repeats 15] [--steps 20]

Baseline and probed steps run in the same process, interleaved (the order alternates each repeat), so
drift and neighbours on a shared machine hit both alike; time is the process's CPU time with one torch
thread, so waiting for a core does not count. Each repeat gives one ratio (probed / baseline CPU time of
``--steps`` steps); the verdict uses the median of those ratios (target <= 1.05).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn

from gpudoctor.trace.probe import Probe


def build(width: int = 256, blocks: int = 18) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def run_steps(model, opt, x, y, steps: int) -> float:
    """CPU seconds of this process (one torch thread): time the neighbours take on a shared machine is not counted."""
    start = time.process_time()
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.process_time() - start


def measure(repeats: int, steps: int, batch: int = 64, width: int = 256) -> dict:
    torch.set_num_threads(1)  # one core: the other one belongs to the neighbours
    model = build(width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    probe = Probe()  # what `gpudoctor trace` installs in the program (default mode)
    run_steps(model, opt, x, y, steps)  # warm-up: allocator, kernels
    plain, probed, ratios = [], [], []
    for i in range(repeats):
        times = {}
        for with_probe in ((False, True) if i % 2 == 0 else (True, False)):
            if with_probe:
                probe.install()
            try:
                times[with_probe] = run_steps(model, opt, x, y, steps)
            finally:
                probe.uninstall()
        plain.append(times[False])
        probed.append(times[True])
        ratios.append(times[True] / times[False])
    return {"modules": len(list(model.modules())), "module_calls": probe.forward_calls, "plain": plain, "probed": probed,
            "ratios": ratios, "median_ratio": statistics.median(ratios)}


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    result = measure(args.repeats, args.steps)
    per_step = lambda times: statistics.median(times) / args.steps * 1000  # noqa: E731
    print(f"model: {result['modules']} modules (18 x Linear 256 + ReLU), batch 64, SGD; torch {torch.__version__}; "
          f"{args.repeats} interleaved repeats of {args.steps} steps")
    print(f"baseline: median {per_step(result['plain']):.2f} CPU ms/step")
    print(f"probed:   median {per_step(result['probed']):.2f} CPU ms/step ({result['module_calls']} module calls seen)")
    quartiles = statistics.quantiles(result["ratios"], n=4)
    print(f"ratio probed/baseline: median {result['median_ratio']:.3f} (quartiles {quartiles[0]:.3f} .. {quartiles[2]:.3f})")
    print(f"verdict: {'OK' if result['median_ratio'] <= 1.05 else 'ABOVE'} target 1.05")
    return result["median_ratio"]


if __name__ == "__main__":
    main()
