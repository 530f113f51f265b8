"""FSDP rows (arithmetic on the 1-GPU simulation) against a sharded simulation: torch's ``fully_shard`` on the
engine's virtual cards (``fsdp_probe.py``, rank 0 of 2, torch's fake process group for the other rank)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpudoctor.plan.planner import fsdp_peaks

PROBE = Path(__file__).with_name("fsdp_probe.py")
LAYER = 4096 * 4096 * 4  # one fp32 Linear(4096, 4096) without bias


def _probe(layers: int, ranks: int) -> dict:
    done = subprocess.run([sys.executable, str(PROBE), str(layers), str(ranks)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_fsdp_row_agrees_with_a_sharded_simulation():
    layers, ranks = 6, 2
    one = _probe(layers, 1)
    # weights, gradients and AdamW's two moments of every layer, as plan's FSDP row shards them
    row = fsdp_peaks(one, ranks, layer_bytes=LAYER, state_bytes=4 * LAYER * layers)
    sharded = _probe(layers, ranks)
    assert sharded["peak_allocated"] == pytest.approx(row["peak_allocated"], rel=0.10)
