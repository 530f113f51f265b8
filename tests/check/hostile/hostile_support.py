"""Shared by the hostile-input tests: a source with one GD104 finding, file writing, the CLI in a child."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[3] / "src"

BACKWARD = textwrap.dedent(
    """\
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator()
    model, optimizer = accelerator.prepare(torch.nn.Linear(2, 2), torch.optim.SGD([], lr=0.1))
    for batch in range(3):
        loss = model(batch).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    """
)


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def cli(cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``gpudoctor ARGS`` in a child process (a crash there must not take the test run with it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    env.pop("GPUDOCTOR_OUTPUT_FORMAT", None)
    done = subprocess.run(
        [sys.executable, "-m", "gpudoctor", *args], cwd=cwd, capture_output=True, timeout=timeout, env=env
    )
    # Decoded leniently: an undecodable file name comes back as its bytes.
    return subprocess.CompletedProcess(
        done.args, done.returncode, done.stdout.decode("utf-8", "replace"), done.stderr.decode("utf-8", "replace")
    )
