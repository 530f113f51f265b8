"""`gpudoctor trace` is invisible to the program it runs (issue 11, items 16-21 and 24; issue 10 items 8 and 10):
same output, traceback, exit status or signal, signals delivered once, torch imported only by the program."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep + "src"


def env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))


def write(tmp_path, source, name="prog.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def trace_cmd(*args):
    return [sys.executable, "-m", "gpudoctor", "trace", *args]


def run(cmd, cwd, **kwargs):
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env(), timeout=240, **kwargs)


def rank_of(json_path):
    ranks = json.loads(json_path.read_text())["ranks"]
    assert len(ranks) == 1
    return ranks[0]


TRACEBACKS = """
    import sys, threading, traceback
    import torch, torch.nn as nn

    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(5, 2)))
    try:
        model(torch.randn(2, 4))
    except RuntimeError:
        traceback.print_exc()                      # printed by the program itself
    try:
        try:
            model(torch.randn(2, 4))
        except RuntimeError as exc:
            raise ValueError("training step failed") from exc   # chained
    except ValueError:
        traceback.print_exc()
    try:
        torch.mm(torch.randn(2, 3), torch.randn(4, 2))   # an op outside any module
    except RuntimeError:
        traceback.print_exc()
    thread = threading.Thread(target=lambda: model(torch.randn(2, 4)), name="worker")
    thread.start()                                 # threading.excepthook prints this one
    thread.join()
    print("done")
    model(torch.randn(2, 4))                       # uncaught: sys.excepthook
"""


@pytest.mark.parametrize("mode", [[], ["--deep"]], ids=["default", "deep"])
def test_program_output_and_tracebacks_are_python_own(tmp_path, mode):
    """11.17 and 10.8: tracebacks printed by the program (print_exc, chained, threads, uncaught) hold no probe frames;
    with --quiet the program's stdout, stderr and exit code are byte-for-byte those of a plain run, --deep included."""
    script = write(tmp_path, TRACEBACKS)
    plain = run([sys.executable, script], tmp_path)
    traced = run(trace_cmd("--quiet", "--no-check", *mode, script), tmp_path)
    assert plain.returncode == traced.returncode == 1
    assert "gpudoctor" not in traced.stderr
    assert traced.stdout == plain.stdout and traced.stderr == plain.stderr
    assert traced.stderr.count("Traceback (most recent call last)") == 6


def test_torch_is_imported_by_the_program_not_by_gpudoctor(tmp_path):
    """11.18: the probe waits for the program's own `import torch`: a script without torch never loads it,
    OMP_NUM_THREADS set before the import counts, and processes with nothing to report print nothing."""
    no_torch = write(tmp_path, """
        import sys
        print("torch loaded:", "torch" in sys.modules)
        import json  # an import after start-up still leaves torch alone
        print("torch loaded:", "torch" in sys.modules)
    """, "no_torch.py")
    traced = run(trace_cmd("--quiet", no_torch), tmp_path)
    assert traced.returncode == 0 and traced.stdout == "torch loaded: False\ntorch loaded: False\n" and traced.stderr == ""

    threads = write(tmp_path, """
        import os
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch, torch.nn as nn
        print("threads", torch.get_num_threads())
        nn.Linear(2, 2)(torch.randn(1, 2))
    """, "threads.py")
    out = tmp_path / "threads.json"
    traced = run(trace_cmd("--quiet", "--json", str(out), threads), tmp_path)
    assert traced.stdout == "threads 1\n"
    assert rank_of(out)["stats"]["module_calls"] == 1  # the probe was installed when torch was imported

    spawn = write(tmp_path, """
        import multiprocessing as mp, os
        import torch, torch.nn as nn

        def work(q):
            q.put(1)

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=work, args=(q,))
            p.start(); q.get(); p.join()
            ctx.Lock()  # a semaphore: the resource tracker process starts
            nn.Linear(2, 2)(torch.randn(1, 2))
            forked = mp.get_context("fork").Process(target=work, args=(mp.get_context("fork").Queue(),))
            forked.start(); forked.join()  # inherits the probe, leaves by os._exit
            print("ok", forked.exitcode, os.listdir(os.environ["GPUDOCTOR_TRACE_DIR"]))  # the workers wrote nothing
    """, "spawn.py")
    out = tmp_path / "spawn.json"
    traced = run(trace_cmd("--quiet", "--json", str(out), spawn), tmp_path)
    assert traced.returncode == 0 and traced.stdout == "ok 0 []\n"
    assert "gpudoctor" not in traced.stderr
    assert rank_of(out)["stats"]["module_calls"] == 1  # the spawned and forked workers and the resource tracker wrote nothing


def test_own_excepthook_keeps_the_failure(tmp_path):
    """11.20: a program that installs its own sys.excepthook still gets its failure reported."""
    script = write(tmp_path, """
        import sys
        import torch, torch.nn as nn
        sys.excepthook = lambda kind, exc, tb: print("custom hook:", kind.__name__, file=sys.stderr)
        nn.Linear(4, 2)(torch.randn(3, 5))
    """)
    out = tmp_path / "r.json"
    traced = run(trace_cmd("--json", str(out), script), tmp_path)
    assert traced.returncode == 1 and traced.stderr.startswith("custom hook: RuntimeError\n")
    rank = rank_of(out)
    assert rank["status"] == "failed" and rank["failure"]["exception"]["type"] == "RuntimeError"
    assert rank["failure"]["module"]["class"] == "Linear"
    assert "failed, exit code 1" in traced.stderr and "finished" not in traced.stderr


def test_os_exit_is_reported_with_what_was_collected(tmp_path):
    """11.21: os._exit keeps its code; the report says how the program ended and keeps what was collected."""
    script = write(tmp_path, """
        import os
        import torch, torch.nn as nn
        nn.Linear(2, 2)(torch.randn(1, 2))
        print("bye", flush=True)
        os._exit(4)
    """)
    out = tmp_path / "r.json"
    traced = run(trace_cmd("--json", str(out), script), tmp_path)
    assert traced.returncode == 4 and traced.stdout == "bye\n"
    rank = rank_of(out)
    assert rank["exit"] == {"how": "os._exit", "code": 4} and rank["stats"]["module_calls"] == 1
    assert "exited via os._exit(4)" in traced.stderr and "did the program start" not in traced.stderr

    no_torch = write(tmp_path, "import os\nos._exit(4)\n", "bare_exit.py")
    traced = run(trace_cmd(no_torch), tmp_path)
    assert traced.returncode == 4 and "exited via os._exit(4)" in traced.stderr


def test_missing_torch_names_the_module_and_the_extra(tmp_path):
    """11.24 (trace): without torch the report names the missing module and `gpudoctor[runtime]`."""
    script = write(tmp_path, """
        import sys
        sys.modules["torch"] = None  # as in an environment without torch: `import torch` raises ModuleNotFoundError
        import torch
    """)
    plain = run([sys.executable, script], tmp_path)
    traced = run(trace_cmd(script), tmp_path)
    assert traced.returncode == plain.returncode == 1
    assert traced.stderr.startswith(plain.stderr)
    assert "import torch" in traced.stderr and "gpudoctor[runtime]" in traced.stderr
    assert "did the program start" not in traced.stderr


def test_trace_leaves_no_cache_next_to_the_script(tmp_path):
    """10.10: the closing static check writes no `.gpudoctor_cache/` next to the traced script."""
    script = write(tmp_path, "import torch\nx = torch.ones(2)\nprint(x.sum().item())\n")
    traced = run(trace_cmd(script), tmp_path)
    assert traced.returncode == 0 and "Static check" in traced.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prog.py"]


# -- signals (11.16) ---------------------------------------------------------------------------------------------

INTERRUPTIBLE = """
    import os, sys, time
    import torch, torch.nn as nn
    nn.Linear(2, 2)(torch.randn(1, 2))
    if "--read" in sys.argv:
        print("read", input(), flush=True)  # from the terminal: only its foreground group may read
    print("ready", os.getpid(), os.environ.get("GPUDOCTOR_TRACE_DIR"), flush=True)
    try:
        time.sleep(60)
    except KeyboardInterrupt:
        if "--reraise" in sys.argv:
            raise
        time.sleep(1.5)  # saving a checkpoint: a second SIGINT here would lose it
        print("checkpoint saved", flush=True)
    sys.exit(0)
"""


def start_traced(tmp_path, *args):
    script = write(tmp_path, INTERRUPTIBLE)
    proc = subprocess.Popen(trace_cmd("--no-check", script, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, env=env(), start_new_session=True)
    line = proc.stdout.readline().split()
    assert line[0] == "ready", proc.communicate()
    return proc, int(line[1]), line[2]


def read_line(proc, timeout):
    """The next line of the program's stdout, or "" after ``timeout`` seconds (the reader ends when the process does)."""
    import threading

    line = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return line[0] if line else ""


def assert_ends(pid, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    pytest.fail("the program outlived gpudoctor trace")


def finish(proc):
    out, err = proc.communicate(timeout=120)
    return out, err


def test_ctrl_c_to_the_foreground_group_reaches_the_program_once(tmp_path):
    """A terminal sends SIGINT to the whole foreground group: the program's KeyboardInterrupt handler runs to
    its end (the interrupt was not delivered a second time) and its exit status 0 is kept."""
    proc, _, _ = start_traced(tmp_path)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does (gpudoctor trace leads this group)
    out, err = finish(proc)
    assert "checkpoint saved" in out, err
    assert proc.returncode == 0


def test_uncaught_keyboard_interrupt_ends_by_sigint_like_the_program(tmp_path):
    """An uncaught KeyboardInterrupt makes Python die by SIGINT (a shell sees 130): gpudoctor trace ends the same way."""
    proc, _, _ = start_traced(tmp_path, "--reraise")
    os.killpg(proc.pid, signal.SIGINT)
    out, err = finish(proc)
    assert proc.returncode == -signal.SIGINT, err
    assert "KeyboardInterrupt" in err and "ended by SIGINT" in err


def test_sigterm_to_trace_ends_the_program_and_removes_the_temp_folder(tmp_path):
    proc, child_pid, report_dir = start_traced(tmp_path)
    proc.send_signal(signal.SIGTERM)  # to gpudoctor trace only, as a scheduler or `kill` does
    out, err = finish(proc)
    assert proc.returncode == -signal.SIGTERM, err
    assert "ended by SIGTERM" in err
    assert not os.path.exists(report_dir)
    assert_ends(child_pid)


def test_ctrl_c_on_a_terminal_goes_to_the_program_once(tmp_path):
    """On a real terminal (a pty), gpudoctor trace hands the terminal to the program's group: the program reads from
    it, and Ctrl-C reaches it once."""
    import pty
    import termios

    script = write(tmp_path, INTERRUPTIBLE)
    master, slave = pty.openpty()

    def controlling_terminal():
        os.setsid()
        import fcntl

        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(trace_cmd("--no-check", script, "--read"), stdin=slave, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env(), preexec_fn=controlling_terminal)
    os.close(slave)
    try:
        os.write(master, b"typed\n")
        # the program owns the terminal: in a background group it would be stopped by SIGTTIN and never answer
        assert read_line(proc, 60) == "read typed\n"
        assert read_line(proc, 60).startswith("ready")
        time.sleep(0.2)
        os.write(master, b"\x03")  # Ctrl-C typed on the terminal
        out, err = finish(proc)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()  # its program, stopped in an orphaned group, then gets SIGHUP
            proc.wait()
    assert "checkpoint saved" in out, err
    assert proc.returncode == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
def test_program_is_not_orphaned_when_trace_is_killed(tmp_path):
    """SIGKILL leaves gpudoctor trace no chance to forward: the program still ends (parent-death signal)."""
    proc, child_pid, _ = start_traced(tmp_path)
    proc.kill()
    proc.wait()
    assert_ends(child_pid)
