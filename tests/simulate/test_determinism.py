"""The engine gives one answer per case: not dependent on when Python's cyclic GC runs, on hash randomisation,
or on what the process did before (``plan`` runs its cases in forked children of whatever the parent did).

The bug this guards against: the emulated autocast's weight-cast cache was held by a reference cycle, so the
fp16 copies of every weight lived until the cyclic GC happened to run, and one ChatGLM-6B AMP case gave
65 GiB in one process and 115 GiB in another."""

import gc
import json
import os
import subprocess
import sys

import torch
import torch.nn as nn

from gpudoctor.simulate import Simulation, simulate_step

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=4096, max_position_embeddings=256, tie_word_embeddings=False)
    return LlamaForCausalLM(config)  # fp32 master weights


def _peaks(autocast="float16"):
    out = simulate_step(_tiny_llama, "1xT4", batch=2, seq=64, autocast=autocast)
    return [{key: row[key] for key in ("peak_allocated", "peak_reserved", "breakdown_at_peak", "phase_peaks")}
            for row in out["devices"]]


def _with_gc(setting):
    enabled, threshold = gc.isenabled(), gc.get_threshold()
    try:
        if setting == "off":
            gc.disable()
        else:
            gc.enable()
            gc.set_threshold(*setting)
        return _peaks()
    finally:
        gc.set_threshold(*threshold)
        (gc.enable if enabled else gc.disable)()


def test_amp_peaks_do_not_depend_on_when_the_cyclic_gc_runs():
    never = _with_gc("off")
    always = _with_gc((1, 1, 1))
    default = _with_gc((700, 10, 10))
    assert never == always == default
    assert never == _with_gc("off")  # and the same twice in one process


_CHILD = """
import json, sys
sys.path.insert(0, {tests!r})
from test_determinism import _peaks
print("PEAKS" + json.dumps(_peaks()))
"""


def _peaks_in_subprocess(hash_seed: str):
    env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=os.path.abspath(SRC))
    code = _CHILD.format(tests=os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("PEAKS"))
    return json.loads(line[len("PEAKS"):])


def test_amp_peaks_are_the_same_in_fresh_processes_with_any_hash_seed():
    here = json.loads(json.dumps(_peaks()))  # JSON's view of it (tuples -> lists), as the children print it
    assert _peaks_in_subprocess("0") == _peaks_in_subprocess("1") == here


def test_autocast_weight_casts_are_freed_when_autocast_exits_and_the_graph_dies():
    """As in torch: the cast cache is emptied when the outermost autocast exits, and the fp16 copy then lives only
    as long as the graph that saved it (reference counting), with the cyclic GC off."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with Simulation("1x8GB"):
            model = nn.Linear(1024, 1024, bias=False).cuda()  # 4 MiB fp32 weight
            weights = torch.cuda.memory_allocated()
            x = torch.empty(8, 1024, device="cuda")
            with torch.autocast("cuda", dtype=torch.float16):
                with torch.autocast("cuda", dtype=torch.float16):  # nested: one cache, one cast
                    y = model(x)
                z = model(x)
                in_autocast = torch.cuda.memory_allocated()
            # the input, the weight's 2 MiB fp16 copy once (cached), and for each call the input's 16 KiB fp16 copy
            # (saved for the weight's gradient) and its 16 KiB output
            assert in_autocast == weights + 8 * 1024 * 4 + 2 * 2**20 + 2 * (8 * 1024 * 2 + 8 * 1024 * 2)
            del y, z
            assert torch.cuda.memory_allocated() == weights + 8 * 1024 * 4
    finally:
        if enabled:
            gc.enable()
