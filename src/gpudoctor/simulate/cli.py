"""The ``trace --simulate`` side of the command line: check the spec, hand it to the child, finish the report."""

from __future__ import annotations

import os

from gpudoctor.simulate.boot import DEFAULT_STEPS, ENV_SPEC, ENV_STEPS
from gpudoctor.simulate.cards import UnknownCard, parse_spec
from gpudoctor.simulate.devices import to_user


def prepare(spec: str, steps: str | None) -> str | None:
    """Validate ``--simulate``/``--steps`` and put them in the environment the child inherits; an error text or None."""
    try:
        parse_spec(spec)
    except UnknownCard as exc:
        return f"gpudoctor trace --simulate: {exc}"
    if steps is not None and not str(steps).isdigit():
        return f"gpudoctor trace --steps: not a number: {steps!r}"
    os.environ[ENV_SPEC] = spec
    os.environ[ENV_STEPS] = str(steps if steps is not None else DEFAULT_STEPS)
    return None


def _translate(value):
    if isinstance(value, str):
        return to_user(value)
    if isinstance(value, dict):
        return {_translate(k): _translate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_translate(v) for v in value]
    return value


def finish(merged: dict, ended_by_signal: int | None = None) -> dict:
    """Device names as the script wrote them (``cuda:N``) everywhere; ``simulated`` = the summary of the run."""
    merged = _translate(merged)
    summaries = [r.get("simulation") for r in merged.get("ranks", []) if r.get("simulation")]
    merged["simulated"] = summaries[0] if summaries else {"simulated": True, "spec": os.environ.get(ENV_SPEC), "devices": []}
    merged["simulated"]["verdict"] = verdict(merged) if summaries else _unreported(merged, ended_by_signal)
    return merged


def _unreported(merged: dict, ended_by_signal: int | None) -> dict:
    """No process of the program handed back a simulation summary: no verdict can be given."""
    import signal

    if ended_by_signal == signal.SIGABRT:
        why = ("the program aborted inside the simulator before it could report. A known cause: an exception raised by a "
               "hook registered directly on an autograd node (`loss.grad_fn.register_hook(...)`) cannot cross backward on "
               "the simulated devices (torch's engine loses it); hooks on tensors and modules are fine. Otherwise this is a "
               "gpudoctor bug: please report it with the script")
    elif ended_by_signal is not None:
        from gpudoctor.trace.launch import signal_name

        why = f"the program was ended by {signal_name(ended_by_signal)} before the simulation reported"
    else:
        why = (f"the program ended (exit status {merged.get('exit_code')}) without a simulated CUDA device being set up "
               "(it never used torch, or stopped before)")
    return {"fits": None, "kind": "not-simulated", "message": why}


def verdict(merged: dict) -> dict:
    sim = merged.get("simulated") or {}
    failures = [r["failure"] for r in merged.get("ranks", []) if r.get("failure")]
    oom = next((f for f in failures if f.get("kind") == "oom"), None)
    if oom is not None:
        frame = oom.get("user_frame") or {}
        return {"fits": False, "kind": "oom", "device": (oom.get("oom") or {}).get("device"),
                "line": frame.get("line"), "file": frame.get("file"), "code": frame.get("code")}
    if failures:
        frame = failures[0].get("user_frame") or {}
        return {"fits": None, "kind": failures[0].get("kind"), "line": frame.get("line"), "file": frame.get("file"),
                "message": failures[0].get("exception", {}).get("message")}
    return {"fits": True, "kind": "fits", "device": sim.get("fullest_device"), "left_bytes": sim.get("left_on_fullest")}


def _gib(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f}G"


def render_simulation(merged: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(stderr=True)
    sim = merged.get("simulated") or {}
    v = sim.get("verdict") or {}
    if v.get("kind") == "not-simulated":
        console.print(f"[bold yellow]not simulated[/] on {sim.get('spec')}: {v.get('message')}", highlight=False)
        return
    table = Table(title=f"SIMULATED GPU memory on {sim.get('spec')} after {sim.get('optimizer_steps', 0)} optimizer step(s) (not measured)")
    for column in ("device", "total", "peak alloc", "peak resv", "left", "weights", "grads", "optim", "activ+tmp"):
        table.add_column(column, justify="left" if column == "device" else "right")
    for row in sim.get("devices", []):
        at_peak = row.get("breakdown_at_peak", {})
        table.add_row(f"{row['device']} {row.get('card', '')}", _gib(row["total"]), _gib(row["peak_allocated"]), _gib(row["peak_reserved"]),
                      _gib(row["free_at_peak"]), _gib(at_peak.get("weights", 0)), _gib(at_peak.get("gradients", 0)),
                      _gib(at_peak.get("optimizer_state", 0)),
                      _gib(at_peak.get("activations", 0) + at_peak.get("temporaries", 0) + at_peak.get("other", 0)))
    console.print(table)
    for row in sim.get("devices", []):
        phases = row.get("phase_peaks") or {}
        if phases:
            text = ", ".join(f"{name} {_gib(p['allocated'])}" for name, p in phases.items() if p.get("allocated"))
            console.print(f"  {row['device']} peak allocated by phase: {text}")
    for line in sim.get("weights", []):
        console.print(f"  weights: {line}")
    if sim.get("stand_ins"):
        used = ", ".join(f"{what}: {n}" for what, n in sim["stand_ins"].items())
        console.print(f"  [yellow]values are not real[/]: stand-ins used ({used}); losses and metrics printed by the script are placeholders")
    for note in sim.get("notes", []):
        console.print(f"  note: {note}")
    if v.get("kind") == "fits":
        console.print(f"[bold green]fits[/] on {sim.get('spec')}: {_gib(v.get('left_bytes'))}iB left on the fullest card ({v.get('device')})"
                      + (f", stopped after {sim.get('optimizer_steps')} optimizer step(s)" if sim.get("stopped_after_steps") else ""))
    elif v.get("kind") == "oom":
        console.print(f"[bold red]does not fit[/] on {sim.get('spec')}: out of memory on {v.get('device')} at {v.get('file')}:{v.get('line')} ({v.get('code')})")
    elif v:
        console.print(f"[bold yellow]stopped[/]: {v.get('kind')} at {v.get('file')}:{v.get('line')}")
