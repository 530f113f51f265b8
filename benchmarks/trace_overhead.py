"""Overhead of gpudoctor's default probe: training steps of a ~20M-parameter Llama on CPU,
with and without the probe in the same process, interleaved so drift hits both equally.

    python benchmarks/trace_overhead.py [--steps 8] [--batch 4] [--seq 128]

Prints the ratio of the fastest steps (min is the least noise-sensitive estimate on a shared machine),
the ratio of medians, and an estimate from the measured cost per module call (target <= 1.05).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gpudoctor.trace.api import Probe


def build():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=8000)
    return LlamaForCausalLM(config)


def step(model, opt, ids) -> float:
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args(argv)
    model = build().train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 8000, (args.batch, args.seq))
    for _ in range(2):  # warm-up: allocator, optimizer state
        step(model, opt, ids)
    plain, probed = [], []
    probe = Probe(model, print_on_error=False)
    for i in range(args.steps):
        order = (False, True) if i % 2 == 0 else (True, False)
        for with_probe in order:
            if with_probe:
                probe.install()
                probed.append(step(model, opt, ids))
                probe.uninstall()
            else:
                plain.append(step(model, opt, ids))
    calls_per_step = probe.forward_calls // max(args.steps, 1)
    base, traced = min(plain), min(probed)
    ratio = traced / base
    per_call = per_module_call_cost()
    estimate = 1 + calls_per_step * per_call / base
    print(f"model: {n_params / 1e6:.1f}M params, batch {args.batch}x{args.seq}, {args.steps} steps each, torch {torch.__version__}")
    print(f"without probe: min {base * 1000:.1f} ms/step, median {statistics.median(plain) * 1000:.1f}")
    print(f"with probe:    min {traced * 1000:.1f} ms/step, median {statistics.median(probed) * 1000:.1f}; {calls_per_step} module calls/step")
    print(f"ratio (min): {ratio:.3f}   ratio (median): {statistics.median(probed) / statistics.median(plain):.3f}")
    print(f"probe cost per module call (fwd bookkeeping + backward hooks): {per_call * 1e6:.1f} us -> estimated ratio {estimate:.4f}")
    print(f"verdict: {'OK' if ratio <= 1.05 else 'ABOVE'} target 1.05")
    return ratio


def per_module_call_cost(calls: int = 500) -> float:
    """Seconds the probe adds to one module call with grad (forward + backward), measured on a tiny module."""
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)

    def run() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            layer(x).sum().backward()
        return time.perf_counter() - start

    run()
    timings = {True: [], False: []}
    for _ in range(5):
        for with_probe in (False, True):
            probe = Probe(layer, print_on_error=False).install() if with_probe else None
            timings[with_probe].append(run())
            if probe:
                probe.uninstall()
    return max(min(timings[True]) - min(timings[False]), 0.0) / calls


if __name__ == "__main__":
    main()
