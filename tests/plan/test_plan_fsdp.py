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
@pytest.mark.xfail(strict=True, reason=(
    "engine gap, not plan's: on the engine, FSDP2's rank 0 of 2 grows by 320 MiB per fp32 Linear(4096, 4096) where "
    "FSDP2 keeps 128 MiB (shard 32 + gradient shard 32 + AdamW moments 64): weights +96 (the unsharded "
    "parameter, freed by FSDP2 with untyped_storage().resize_(0), stays counted), activations +64 (the same "
    "unsharded weight saved for backward), optimizer state +128 (full-size moments), temporaries +32 "
    "(measured 2026-12-02). When the engine follows FSDP2's storage, this passes: drop the xfail."))
def test_fsdp_row_agrees_with_a_sharded_simulation():
    layers, ranks = 6, 2
    one = _probe(layers, 1)
    one = {"peak_allocated": one["peak_allocated"], "peak_reserved": one["peak_allocated"], "breakdown": one["breakdown"]}
    # weights, gradients and AdamW's two moments of every layer, as plan's FSDP row shards them
    row = fsdp_peaks(one, ranks, layer_bytes=LAYER, state_bytes=4 * LAYER * layers)
    sharded = _probe(layers, ranks)
    assert sharded["peak_allocated"] == pytest.approx(row["peak_allocated"], rel=0.10)
