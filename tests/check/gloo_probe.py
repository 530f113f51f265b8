"""Run a torch.distributed snippet on one gloo CPU rank in a fresh interpreter (truth tests of the distributed
rules): the process group must not leak into other tests, and each run gets a free port."""

import subprocess
import sys
import textwrap

_SETUP = """
import os, socket
import torch.distributed as dist
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
"""


def run_on_one_gloo_rank(body: str) -> list[str]:
    """The lines ``body`` prints, run after ``init_process_group("gloo")`` (world size 1)."""
    source = _SETUP + textwrap.dedent(body) + "\ndist.destroy_process_group()\n"
    done = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return [line for line in done.stdout.splitlines() if line.strip()]
