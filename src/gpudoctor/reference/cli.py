"""``gpudoctor reference-train``: LoRA fine-tuning done right, on the bundled dialogs or yours.

Examples::

    gpudoctor reference-train                       # tiny built-in model, bundled data, CPU is fine
    gpudoctor reference-train --model ./llama-7b --steps 200 --batch-size 2 --grad-accum 8
    accelerate launch -m gpudoctor reference-train --model ./llama-7b   # one full copy per GPU
"""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpudoctor reference-train",
        description="Fine-tune a causal LM with LoRA (accelerate + peft) without the field reports' pitfalls: "
        "trained weights stay on accelerators, labels mask prompt and padding, the adapter is saved, "
        "reloaded and asked a question with generate().",
    )
    parser.add_argument("--model", default="tiny", help="'tiny' (built here, no download) or a local checkpoint directory")
    parser.add_argument("--data", default=None, help="JSON list of {Description, Patient, Doctor} (default: bundled sample)")
    parser.add_argument("--output", default="gpudoctor-reference-out", help="where the base (tiny), adapter and tokenizer go")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=4, help="per process")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=None, help="default: 1e-2 for tiny, 2e-4 for a checkpoint")
    parser.add_argument("--max-length", type=int, default=256, help="tokens per example, prompt included")
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt", default=None, help="the patient's message to answer (default: a sore-throat case); "
                        "used as is if it already starts with 'Description:'")
    parser.add_argument("--description", default="Question from a patient.", help="short case description for --prompt")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--memory-reserve", type=float, default=0.2, help="fraction of device memory left for activations")
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("steps", "batch_size", "grad_accum", "max_length"):
        if getattr(args, name) < 1:
            print(f"gpudoctor reference-train: --{name.replace('_', '-')} must be at least 1")
            return 2

    from rich.console import Console

    from gpudoctor.reference.placement import PlacementError
    from gpudoctor.reference.data import format_prompt
    from gpudoctor.reference.trainer import DEFAULT_PROMPT, TrainConfig, train

    prompt = DEFAULT_PROMPT
    if args.prompt:
        prompt = args.prompt if args.prompt.startswith("Description:") else format_prompt(args.description, args.prompt)

    config = TrainConfig(
        model=args.model,
        data=args.data,
        output_dir=args.output,
        steps=args.steps,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        lr=args.lr,
        max_length=args.max_length,
        lora_r=args.lora_r,
        lora_alpha=2 * args.lora_r,
        seed=args.seed,
        prompt=prompt,
        max_new_tokens=args.max_new_tokens,
        memory_reserve=args.memory_reserve,
        gradient_checkpointing=not args.no_gradient_checkpointing,
    )
    console = Console()
    try:
        train(config, console=console, quiet=args.quiet)
    except (PlacementError, OSError, ValueError) as exc:  # bad path, data or budget: say it, no traceback
        console.print(f"[bold red]reference-train failed:[/] {exc}")
        return 1
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
