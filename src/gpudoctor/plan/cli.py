"""``gpudoctor plan MODEL --gpus SPEC [--seq --batch --lora-r ...] [--script train.py] [--json]``."""

from __future__ import annotations

import argparse
import sys

from gpudoctor.plan.simulated import Workload


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpudoctor plan",
        description="What training setup fits on these GPUs, and the least change that makes it fit: every method "
        "(full fp32/bf16/fp16 AMP, LoRA, QLoRA 8/4-bit) x gradient checkpointing x placement (1 GPU, device_map, "
        "DDP, FSDP), from simulated training steps of the real architecture.")
    parser.add_argument("model", nargs="?", help="Hub id (bundled config offline), local checkpoint folder or config.json")
    parser.add_argument("--gpus", help="cards, e.g. 2xT4, 6x3070Ti, 1xA100-80GB, 2x16GB (gpudoctor trace --list-gpus)")
    parser.add_argument("--script", help="read model, batch, sequence length and LoRA settings from this training script "
                        "(read like `gpudoctor check` reads it; never imported or run)")
    parser.add_argument("--batch", type=int, help="micro-batch per process (default 4, or the script's)")
    parser.add_argument("--seq", type=int, help="tokens per example (default 512, or the script's)")
    parser.add_argument("--target-len", type=int, help="decoder tokens for encoder-decoder models (default: --seq)")
    parser.add_argument("--lora-r", type=int, help="LoRA rank (default 16, or the script's)")
    parser.add_argument("--lora-alpha", type=int, help="LoRA alpha (default 2 x r)")
    parser.add_argument("--lora-targets", help="comma-separated module names, or all-linear (default)")
    parser.add_argument("--methods", help="only these methods (comma-separated: full-fp32, full-bf16, full-amp, lora, qlora-8, qlora-4)")
    parser.add_argument("--no-search", action="store_true", help="skip the largest batch / sequence length search")
    parser.add_argument("--no-cache", action="store_true", help="simulate everything again (no read or write of the cache)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--published", action="store_true", help="reproduce the published measurements the simulator is "
                        "checked against (PEFT's A100-80GB table) through plan, and show the gaps (no MODEL or --gpus)")
    parser.add_argument("--quick", action="store_true", help="with --published: only the smallest model (T0_3B, LoRA and full)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.published:
        return _published(args)
    if not args.gpus:
        print("gpudoctor plan: --gpus is required (e.g. --gpus 2xT4)", file=sys.stderr)
        return 2
    from gpudoctor.simulate.cards import UnknownCard, parse_spec

    try:
        cards = parse_spec(args.gpus)
    except UnknownCard as exc:
        print(f"gpudoctor plan: {exc}", file=sys.stderr)
        return 2
    found: dict = {}
    if args.script:
        from gpudoctor.plan.script import read_script

        try:
            found = read_script(args.script)
        except OSError as exc:
            print(f"gpudoctor plan: cannot read {args.script}: {exc}", file=sys.stderr)
            return 2
    model = args.model or found.get("model")
    if not model:
        print("gpudoctor plan: name a model (Hub id, folder or config.json), or a --script that loads one by name",
              file=sys.stderr)
        return 2
    r = args.lora_r or found.get("lora_r") or 16
    targets = args.lora_targets or found.get("lora_targets") or "all-linear"
    if isinstance(targets, str) and "," in targets:
        targets = tuple(t.strip() for t in targets.split(",") if t.strip())
    workload = Workload(batch=args.batch or found.get("batch") or 4, seq=args.seq or found.get("seq") or 512,
                        target_len=args.target_len, lora_r=r, lora_alpha=args.lora_alpha or found.get("lora_alpha") or 2 * r,
                        lora_targets=targets)
    from gpudoctor.plan.planner import make_plan
    from gpudoctor.simulate.hub import NotSimulable

    console = None
    if not args.json and sys.stdout.isatty():
        from rich.console import Console

        console = Console()
    progress = None
    if not args.json and sys.stderr.isatty():
        def progress(message: str) -> None:
            print(f"\r\033[K{message[:100]}", end="", file=sys.stderr, flush=True)
    if found and not args.json:
        print(f"from {args.script}: " + ", ".join(f"{k}={v}" for k, v in found.items() if k != "lines"))
    try:
        plan = make_plan(model, cards, workload, use_cache=not args.no_cache, search=not args.no_search,
                         methods=[m.strip() for m in args.methods.split(",")] if args.methods else None, progress=progress)
    except NotSimulable as exc:
        print(f"gpudoctor plan: {exc}", file=sys.stderr)
        return 2
    finally:
        if progress:
            print("\r\033[K", end="", file=sys.stderr, flush=True)
    from gpudoctor.plan import render

    if args.json:
        print(render.to_json(plan))
    elif console is not None:
        render.print_rich(plan, console)
    else:
        print(render.plain(plan))
    return 0


def _published(args) -> int:
    import json

    from gpudoctor.plan import published

    points = published.POINTS[:1] + published.POINTS[2:3] if args.quick else published.POINTS  # T0_3B LoRA and full
    results = published.reproduce(points, use_cache=not args.no_cache)
    print(json.dumps(results, indent=2) if args.json else published.render(results))
    return 0
