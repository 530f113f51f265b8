"""GD419 checked against the installed torch (2.13): a barrier that only rank 0 reaches (rank 1 skips it, as under
``if rank == 0:``) blocks rank 0 until the process group's timeout aborts it. Two gloo CPU ranks, a 3 s timeout."""

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

_PROBE = textwrap.dedent(
    """
    import datetime, os, socket, time
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def worker(rank, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=3))
        if rank == 0:
            try:
                dist.barrier()
                print("passed", flush=True)
            except RuntimeError as error:
                print("timed out" if "Timed out" in str(error) else str(error), flush=True)
        else:
            time.sleep(6)  # busy elsewhere: never reaches the barrier

    if __name__ == "__main__":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(port,), nprocs=2)
    """
)


@pytest.mark.slow  # spawns two processes that import torch (~25 s)
def test_barrier_reached_by_one_rank_blocks_until_timeout(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [line for line in done.stdout.splitlines() if line.strip()] == ["timed out"]
