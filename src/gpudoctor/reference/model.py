"""Model side: a tiny built-in checkpoint, placement planning, loading, LoRA, optimizer.

Everything loads from a local directory (``local_files_only=True``): nothing is downloaded.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from gpudoctor.reference.data import build_tokenizer
from gpudoctor.reference.placement import Block, Placement, model_blocks, plan_placement

# Small enough that ~30 optimizer steps take seconds on two CPU cores. The base stays random, so
# its init is wider than Llama's 0.02: the frozen random head can then express peaked
# distributions, and LoRA has something to steer (at 0.02 the loss barely moves).
TINY_CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    initializer_range=0.1,
)


def save_tiny_checkpoint(directory: str | Path, texts: list[str], seed: int) -> Path:
    """Write a randomly initialised tiny Llama and a tokenizer trained on ``texts`` to ``directory``.

    Saving it makes the tiny model an ordinary local checkpoint: the rest of the pipeline, and
    the reload of the adapter, are the same as for a real model.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(texts)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **TINY_CONFIG,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    directory = Path(directory)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token is None:
        # Safe here because the collator masks padding by position, not by id: EOS labels survive.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def lora_config(r: int = 8, alpha: int = 16, dropout: float = 0.05, targets: str | list[str] = "all-linear"):
    from peft import LoraConfig, TaskType

    return LoraConfig(task_type=TaskType.CAUSAL_LM, r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets)


def planning_blocks(path: str | Path, lora, dtype: torch.dtype) -> list[Block]:
    """The blocks of the checkpoint at ``path`` with LoRA ``lora`` added, without loading a single
    weight: the model is built on the meta device and LoRA applied to it, so the blocks know
    exactly which of them will hold trainable parameters."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config)
    skeleton.tie_weights()  # not done under init_empty_weights; tied blocks must share a device
    no_split = skeleton._no_split_modules or []
    return model_blocks(add_lora(skeleton, lora).get_base_model(), no_split, dtype)


def plan_for(path: str | Path, lora, budgets: dict[int | str, int], dtype: torch.dtype) -> Placement:
    return plan_placement(planning_blocks(path, lora, dtype), budgets)


@contextmanager
def _peft_deprecation_hidden():
    # peft 0.21 reads transformers' deprecated ``is_gradient_checkpointing``: not the caller's doing.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def add_lora(model, lora):
    """``peft.get_peft_model`` (transformers' own ``add_adapter`` needs peft >= 0.22)."""
    from peft import get_peft_model

    with _peft_deprecation_hidden():
        return get_peft_model(model, lora)


def attach_adapter(model, adapter_dir: str | Path):
    """Load a saved LoRA adapter onto ``model`` (the same base it was trained on)."""
    from peft import PeftModel

    with _peft_deprecation_hidden():
        return PeftModel.from_pretrained(model, str(adapter_dir))


@contextmanager
def quiet_hub_progress():
    """Hide transformers' per-shard progress bars while saving/loading (ours is the training bar)."""
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


def load_base(path: str | Path, placement: Placement, dtype: torch.dtype, offload_folder: str | Path | None = None):
    """Load the checkpoint straight onto its planned devices (no full copy in CPU RAM first)."""
    from transformers import AutoModelForCausalLM

    extra = {"offload_folder": str(offload_folder)} if "disk" in placement.devices else {}
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, device_map=placement.device_map, local_files_only=True, **extra
    )


def enable_checkpointing(model) -> None:
    """Activation checkpointing, non-reentrant: gradients reach the LoRA weights even though the
    frozen embeddings give inputs without ``requires_grad``. It only acts in ``train()`` mode."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False  # a KV cache is useless while training and conflicts with recompute


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """AdamW over the trainable (LoRA) parameters only; the frozen base is not its business."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())
