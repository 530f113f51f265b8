"""The reference LoRA fine-tuning loop: accelerate + peft, placed so nothing trained is offloaded.

Run on one process (``python``) it may spread a model that does not fit one GPU over several
GPUs (device map, no DataParallel). Run with ``accelerate launch`` on N processes, each process
holds a whole copy on its own GPU: accelerate refuses a model split over devices in distributed
mode.
"""

from __future__ import annotations

import gc
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from gpudoctor.reference.data import (
    BUNDLED_DATA,
    IGNORE_INDEX,
    DialogDataset,
    PadToLongest,
    format_prompt,
    load_dialogs,
    prompt_ids,
)
from gpudoctor.reference.model import (
    add_lora,
    attach_adapter,
    build_optimizer,
    count_parameters,
    enable_checkpointing,
    load_base,
    load_tokenizer,
    lora_config,
    plan_for,
    quiet_hub_progress,
    save_tiny_checkpoint,
)
from gpudoctor.reference.placement import Placement, available_budgets, check_trainable_resident

DEFAULT_PROMPT = format_prompt(
    "Sore throat and fever.", "My throat hurts and I have had a fever since yesterday. What should I do?"
)


@dataclass
class TrainConfig:
    model: str = "tiny"  # "tiny" (built here, random weights) or a local checkpoint directory
    data: str | None = None  # JSON list of {Description, Patient, Doctor}; None: the bundled sample
    output_dir: str = "gpudoctor-reference-out"
    steps: int = 30  # optimizer steps
    batch_size: int = 4  # per process
    grad_accum: int = 1
    lr: float | None = None  # None: 1e-2 for the tiny random model, 2e-4 (usual for LoRA) otherwise
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    warmup_ratio: float = 0.1
    max_length: int = 256
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    lora_targets: str | list[str] = "all-linear"
    gradient_checkpointing: bool = True
    eval_fraction: float = 0.15
    seed: int = 0
    prompt: str = DEFAULT_PROMPT
    max_new_tokens: int = 40
    memory_reserve: float = 0.2  # fraction of each device's free memory kept for activations
    max_memory: dict[int | str, int | str] | None = None  # per-device cap ("20GiB"), instead of measuring
    mixed_precision: str | None = None  # None: bf16 or fp16 on CUDA, none on CPU


@dataclass
class TrainResult:
    placement: list[str]
    device_map: dict[str, int | str]
    trainable_params: int
    total_params: int
    optimizer_params: int  # elements the optimizer updates; equals trainable_params
    losses: list[float]  # training loss per optimizer step
    eval_loss_before: float
    eval_loss_after: float
    adapter_dir: str
    base_model: str
    prompt: str
    answer: str
    reload_max_abs_diff: float  # trained vs reloaded-from-disk logits on the prompt
    probe_logits: torch.Tensor = field(repr=False)  # the trained model's logits on the prompt (cpu)
    train_examples: int = 0
    eval_examples: int = 0
    seconds: float = 0.0
    tiny: bool = False  # the base is the built-in random tiny model


def train(config: TrainConfig, console=None, quiet: bool = False) -> TrainResult:
    """Place, add LoRA, train ``config.steps`` optimizer steps, evaluate, save the adapter, reload it
    and answer ``config.prompt``. ``console``: a rich Console to print to; ``quiet``: print nothing."""
    with quiet_hub_progress():
        return _train(config, console, quiet)


def _train(config: TrainConfig, console, quiet: bool) -> TrainResult:
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from rich.console import Console
    from transformers import get_linear_schedule_with_warmup

    start = time.perf_counter()
    console = console or Console()
    mixed_precision = config.mixed_precision or _auto_mixed_precision()
    accelerator = Accelerator(gradient_accumulation_steps=config.grad_accum, mixed_precision=mixed_precision)
    show = not quiet and accelerator.is_main_process
    set_seed(config.seed)
    out = Path(config.output_dir).resolve()

    dialogs = load_dialogs(config.data or BUNDLED_DATA)
    if config.model == "tiny":
        base_path = out / "base"
        if accelerator.is_main_process:
            save_tiny_checkpoint(base_path, [d.prompt + d.response for d in dialogs], config.seed)
        accelerator.wait_for_everyone()
    else:
        base_path = Path(config.model)
    tokenizer = load_tokenizer(base_path)

    # Place first, then add LoRA: the plan already knows which blocks LoRA will make trainable.
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision, torch.float32)
    lora = lora_config(config.lora_r, config.lora_alpha, config.lora_dropout, config.lora_targets)
    distributed = accelerator.num_processes > 1
    budgets = available_budgets(
        config.memory_reserve, only=accelerator.device if distributed else None, max_memory=config.max_memory
    )
    placement = plan_for(base_path, lora, budgets, dtype)
    model = load_base(base_path, placement, dtype, offload_folder=out / "offload")
    if config.gradient_checkpointing:
        enable_checkpointing(model)
    model = add_lora(model, lora)
    check_trainable_resident(model)
    model.train()  # from_pretrained returns eval(): no dropout and no checkpointing until this
    trainable_params, total_params = count_parameters(model)

    train_set, eval_set = _split(dialogs, config.eval_fraction, config.seed)
    train_data = DialogDataset(train_set, tokenizer, config.max_length)
    eval_data = DialogDataset(eval_set, tokenizer, config.max_length)
    collate = PadToLongest(tokenizer.pad_token_id)
    train_loader = torch.utils.data.DataLoader(train_data, batch_size=config.batch_size, shuffle=True, collate_fn=collate)
    eval_loader = torch.utils.data.DataLoader(eval_data, batch_size=config.batch_size, collate_fn=collate)

    lr = config.lr or (1e-2 if config.model == "tiny" else 2e-4)
    optimizer = build_optimizer(model, lr, config.weight_decay)
    optimizer_params = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    # The prepared scheduler steps once per process on each optimizer step.
    scheduler = get_linear_schedule_with_warmup(
        optimizer,
        num_warmup_steps=int(config.warmup_ratio * config.steps) * accelerator.num_processes,
        num_training_steps=config.steps * accelerator.num_processes,
    )
    if placement.dispatched:
        # Already spread over devices by its device map: prepare() must not move or wrap it.
        train_loader, eval_loader, optimizer, scheduler = accelerator.prepare(
            train_loader, eval_loader, optimizer, scheduler
        )
    else:
        model, train_loader, eval_loader, optimizer, scheduler = accelerator.prepare(
            model, train_loader, eval_loader, optimizer, scheduler
        )

    eval_loss_before = evaluate(model, eval_loader, accelerator)
    losses = _train_loop(model, train_loader, optimizer, scheduler, accelerator, config, console, show)
    eval_loss_after = evaluate(model, eval_loader, accelerator)

    # Save the adapter (only the LoRA weights) and the tokenizer next to it.
    adapter_dir = out / "adapter"
    input_device = placement.input_device if placement.dispatched else accelerator.device
    accelerator.wait_for_everyone()
    trained = accelerator.unwrap_model(model)
    probe_logits = prompt_logits(trained, tokenizer, config.prompt, input_device)
    trained.save_pretrained(adapter_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(adapter_dir)
    accelerator.wait_for_everyone()

    # Free the trained copy before reloading, so a model that barely fits is not held twice.
    del model, trained, optimizer, scheduler
    accelerator.free_memory()
    gc.collect()

    answer, reload_diff = "", float("nan")
    if accelerator.is_main_process:
        reloaded, _ = load_trained(adapter_dir, placement, dtype)
        reload_diff = (prompt_logits(reloaded, tokenizer, config.prompt, input_device) - probe_logits).abs().max().item()
        answer = generate_answer(reloaded, tokenizer, config.prompt, input_device, config.max_new_tokens)
        del reloaded

    result = TrainResult(
        placement=placement.describe(),
        device_map=placement.device_map,
        trainable_params=trainable_params,
        total_params=total_params,
        optimizer_params=optimizer_params,
        losses=losses,
        eval_loss_before=eval_loss_before,
        eval_loss_after=eval_loss_after,
        adapter_dir=str(adapter_dir),
        base_model=str(base_path),
        prompt=config.prompt,
        answer=answer,
        reload_max_abs_diff=reload_diff,
        probe_logits=probe_logits,
        train_examples=len(train_data),
        eval_examples=len(eval_data),
        seconds=time.perf_counter() - start,
        tiny=config.model == "tiny",
    )
    if show:
        print_summary(result, console)
    return result


def _train_loop(model, train_loader, optimizer, scheduler, accelerator, config, console, show) -> list[float]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    losses: list[float] = []
    micro_losses: list[torch.Tensor] = []  # the micro-batches of the current optimizer step
    columns = [TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn()]
    with Progress(*columns, console=console, disable=not show) as progress:
        task = progress.add_task("train", total=config.steps, loss="…")
        if len(train_loader) == 0:
            raise ValueError("no training batches: the data set is empty after the eval split")
        model.train()
        while len(losses) < config.steps:
            for batch in train_loader:
                with accelerator.accumulate(model):
                    with accelerator.autocast():
                        loss = model(**batch).loss
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        # Once per optimizer step: with fp16 it also unscales, which may happen once.
                        accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm)
                    # The prepared optimizer and scheduler only act on the last micro-batch.
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                micro_losses.append(loss.detach())
                if accelerator.sync_gradients:
                    step_loss = accelerator.reduce(torch.stack(micro_losses).mean(), reduction="mean")
                    losses.append(step_loss.item())
                    micro_losses.clear()
                    progress.update(task, advance=1, loss=f"{losses[-1]:.3f}")
                    if len(losses) == config.steps:
                        break
    return losses


def evaluate(model, loader, accelerator) -> float:
    """Mean loss per response token over the whole eval set, across all processes."""
    was_training = model.training
    model.eval()
    loss_sum, token_count = 0.0, 0
    with torch.no_grad():
        for batch in loader:
            with accelerator.autocast():
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            sums, counts = _per_example_loss(logits, batch["labels"])
            # Per example, so gather_for_metrics can drop the samples padded onto the last batch.
            sums, counts = accelerator.gather_for_metrics((sums, counts))
            loss_sum += sums.sum().item()
            token_count += counts.sum().item()
    if was_training:
        model.train()
    return loss_sum / max(token_count, 1)


def _per_example_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token loss and number of predicted tokens, per example."""
    labels = labels.to(logits.device)[:, 1:]
    losses = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none")
    return losses.sum(dim=1), (labels != IGNORE_INDEX).sum(dim=1)


def load_trained(adapter_dir: str | Path, placement: Placement | None = None, dtype: torch.dtype = torch.float32):
    """Reload base + adapter for inference; the base is the one recorded in the adapter config."""
    from peft import PeftConfig

    base_path = PeftConfig.from_pretrained(str(adapter_dir)).base_model_name_or_path
    placement = placement or Placement({"": "cpu"}, {})
    base = load_base(base_path, placement, dtype, offload_folder=Path(adapter_dir).parent / "offload")
    model = attach_adapter(base, adapter_dir)
    model.eval()
    return model, load_tokenizer(adapter_dir)


def _input_ids(tokenizer, prompt: str, device) -> torch.Tensor:
    return torch.tensor([prompt_ids(tokenizer, prompt)], device=device)


def prompt_logits(model, tokenizer, prompt: str, device) -> torch.Tensor:
    """Logits of the model on ``prompt`` in eval mode, on the CPU (for comparisons)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=_input_ids(tokenizer, prompt, device)).logits.float().cpu()
    if was_training:
        model.train()
    return logits[0]


def generate_answer(model, tokenizer, prompt: str, device, max_new_tokens: int = 40) -> str:
    """Greedy decoding with generate(): one new token per step, each conditioned on the previous ones
    (an argmax over a single forward's logits would only echo guesses for the prompt positions)."""
    input_ids = _input_ids(tokenizer, prompt, device)
    with torch.no_grad():
        output = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            use_cache=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    return tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True).strip()


def _split(dialogs: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    shuffled = list(dialogs)
    random.Random(seed).shuffle(shuffled)
    n_eval = max(1, round(len(shuffled) * eval_fraction))
    return shuffled[n_eval:], shuffled[:n_eval]


def _auto_mixed_precision() -> str:
    if not torch.cuda.is_available():
        return "no"
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def print_summary(result: TrainResult, console) -> None:
    from rich.table import Table

    table = Table(title="gpudoctor reference run", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("base model", result.base_model)
    table.add_row("placement", "\n".join(result.placement))
    share = 100 * result.trainable_params / max(result.total_params, 1)
    table.add_row("trainable", f"{result.trainable_params:,} of {result.total_params:,} parameters ({share:.2f}%, LoRA)")
    k = max(1, min(5, len(result.losses) // 4))  # average a few steps: single-step losses are noisy
    start, end = sum(result.losses[:k]) / k, sum(result.losses[-k:]) / k
    table.add_row("train loss", f"{start:.3f} → {end:.3f} over {len(result.losses)} steps (mean of first/last {k})")
    table.add_row("eval loss", f"{result.eval_loss_before:.3f} → {result.eval_loss_after:.3f} ({result.eval_examples} examples)")
    table.add_row("adapter", f"{result.adapter_dir} (reloaded: max |Δ logit| = {result.reload_max_abs_diff:.2e})")
    table.add_row("prompt", result.prompt)
    table.add_row("answer", result.answer or "(empty)")
    if result.tiny:
        table.add_row("note", "the tiny base has random weights: the answer shows the pipeline runs end to end, not medicine")
    table.add_row("time", f"{result.seconds:.1f} s")
    console.print(table)
