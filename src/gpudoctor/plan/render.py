"""The plan as a rich table on a terminal, plain text elsewhere, or JSON."""

from __future__ import annotations

import json

from gpudoctor.plan.advice import gib, recommendation, snippet

HEADER = ("method", "ckpt", "placement", "peak (fullest GPU)", "CPU RAM", "fits", "headroom", "time/sample", "rules that bite")


def _relative_times(plan) -> dict[int, str]:
    fitting = [r.seconds_per_sample for r in plan.rows if r.fits and r.seconds_per_sample]
    base = min(fitting or [r.seconds_per_sample for r in plan.rows if r.seconds_per_sample] or [1.0])
    return {id(r): (f"{r.seconds_per_sample / base:.1f}x" if r.seconds_per_sample else "-") for r in plan.rows}


def table_rows(plan) -> list[tuple[str, ...]]:
    times = _relative_times(plan)
    out = []
    for r in plan.rows:
        if r.error:
            out.append((r.method.label, "yes" if r.checkpointing else "no", r.placement, "-", "-", r.verdict, "-", "-",
                        f"engine: {r.error[:70]}"))
            continue
        out.append((r.method.label, "yes" if r.checkpointing else "no",
                    r.placement if r.placement != "DDP" and r.placement != "FSDP" else f"{r.placement} x{len(r.devices)}",
                    (f"{gib(r.peak)} (cuda:{r.fullest})" if len(r.devices) > 1 else gib(r.peak)) + (" estimate" if r.estimate else ""),
                    gib(r.cpu_ram) if r.cpu_ram else "-", r.verdict,
                    gib(r.headroom) if r.headroom >= 0 else f"-{gib(-r.headroom)}", times[id(r)], ", ".join(r.rules) or "-"))
    return out


def header_lines(plan) -> list[str]:
    wl, cards = plan.workload, plan.cards
    spec = f"{len(cards)}x{cards[0].name}" if len({c.name for c in cards}) == 1 else "+".join(c.name for c in cards)
    lora = f", LoRA r={wl.lora_r} alpha={wl.lora_alpha} on {wl.lora_targets}" if wl.lora_targets else ""
    return [f"gpudoctor plan: {plan.info.name} on {spec} ({gib(cards[0].usable)} usable per card), batch {wl.batch} x {wl.seq} tokens"
            f"{lora}, {wl.optimizer}",
            f"model: {plan.info.source}; {plan.info.num_params / 1e9:.2f}B parameters, {plan.info.num_layers} layers"]


def footer_lines(plan) -> list[str]:
    lines = ["", "peak = memory reserved by PyTorch's caching allocator at the step's peak (what an OOM compares), simulated by "
             "gpudoctor's engine; 'tight' = allocated fits, reserved does not (the allocator may recover by freeing its cache). "
             "time/sample: relative estimate from FLOPs and the cards' spec throughput (communication ignored). "
             "DDP/FSDP: each GPU runs its own batch." + (
                 " FSDP 'estimate': not simulated sharded; the 1-GPU simulation, phase by phase, with its weights, "
                 "gradients, AdamW state and step temporaries divided by the number of GPUs, plus two gathered layers "
                 "in forward and backward." if any(r.estimate for r in plan.rows) else ""),
             "",
             "Recommendation: " + recommendation(plan)]
    if plan.recommended is not None:
        if plan.largest_batch or plan.largest_seq:
            lines.append(f"Largest that fits this way: batch {plan.largest_batch or '-'} at {plan.workload.seq} tokens; "
                         f"{plan.largest_seq or '-'} tokens at batch {plan.workload.batch} (simulated).")
        lines += ["", snippet(plan)]
    return lines


def plain(plan) -> str:
    rows = [HEADER, *table_rows(plan)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    body = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(header_lines(plan) + [""] + body + footer_lines(plan))


def print_rich(plan, console) -> None:
    from rich.table import Table

    for line in header_lines(plan):
        console.print(line, highlight=False)
    table = Table(show_lines=False)
    for name in HEADER:
        table.add_column(name, no_wrap=name not in ("rules that bite", "method"))
    style = {"fits": "green", "tight": "yellow"}
    for row in table_rows(plan):
        table.add_row(*row, style=style.get(row[5], "red" if row[5].startswith("no") else None))
    console.print(table)
    for line in footer_lines(plan):
        console.print(line, highlight=False, markup=False)


def to_json(plan) -> str:
    return json.dumps(plan.to_json(), indent=2)
