from __future__ import annotations

import re
from typing import Optional

import libcst as cst

from gpudoctor import hardware
from gpudoctor.check import apis
from gpudoctor.check.facts import TRAIT_DISPATCHED, TRAIT_PEFT, TRAIT_QUANTIZED, FileFacts
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import checkpoint_name, params_from_name, sets_requires_grad, stated_gpus, trained_models, weight_bytes
from gpudoctor.check.rule import Rule

_GB = 1e9
_GIB = 1024**3
_SHARDED = re.compile(r"(?i:deepspeed|\bfsdp|FullyShardedDataParallel|zero_stage|zero[_-]?3|offload_optimizer)|\bZeRO\b")
_CHEAP_OPTIMIZERS = re.compile(r"8bit|paged|adafactor|sgd|lion|galore|lomo", re.IGNORECASE)


class FullFinetuneExceedsGpu(Rule):
    """Full fine-tuning with Adam of a model whose checkpoint name gives its size (``Llama-2-7b``) on
    the hardware given by ``--gpus``/``[tool.gpudoctor] gpus``, stated in the file (``6x RTX 3070 Ti
    (8 GB)``) or read from the local GPUs (else the largest common card, 24 GB), when weights + gradients + the two Adam
    moments alone (4 x the weight size: 16 B/param in float32, 8 B/param in 16-bit) exceed the memory
    that can hold them. Activations come on top, so the estimate is a lower bound."""

    code = "GD506"
    name = "full-finetune-exceeds-gpu"
    summary = "Full fine-tune with Adam whose weights+grads+Adam state exceed the GPU memory the file states"
    severity = Severity.WARNING
    preview = False
    triggers = ("from_pretrained",)

    def check(self, facts: FileFacts):
        if sets_requires_grad(facts) or any(c.qualname in apis.DATA_PARALLEL for c in facts.calls):
            return  # frozen parts (unknown trained size), or DataParallel (GD112 speaks)
        gpus = hardware.for_file(stated_gpus(facts.source, model_names=True))
        sharded_in_file = bool(_SHARDED.search(facts.source))
        processes = _stated_processes(facts.source)
        seen = set()
        for model, site, how in trained_models(facts):
            if site.qualname in apis.GET_PEFT_MODEL:
                continue
            value = facts.value(model, site.order, site.scope)
            if value.kind != "model" or value.has(TRAIT_PEFT) or value.has(TRAIT_QUANTIZED):
                continue
            origin = value.origin()
            if not origin.trait("class") or not isinstance(origin.node, cst.Call) or id(origin.node) in seen:
                continue
            # ZeRO/FSDP, or a device map spreading the layers: all GPUs together hold the model.
            sharded = sharded_in_file or value.has(TRAIT_DISPATCHED)
            # How many GPUs share it: the stated GPUs, else (ZeRO/FSDP: one GPU a process) the stated launch.
            count = gpus.count if gpus is not None and gpus.count > 1 else None
            if count is None and sharded_in_file and processes:
                count = processes
            if sharded and count is None:
                continue  # spread over an unknown number of GPUs: nothing to compare with
            optimizer = self._adam(facts, site)
            if optimizer is None:
                continue
            load = facts.call_site(origin.node)
            name = checkpoint_name(facts, origin.node, load.order, load.scope) if load else None
            params = params_from_name(name)
            if params is None:
                continue
            bytes_per_weight, dtype_note = weight_bytes(facts, origin.node, value)
            need = params * 4 * bytes_per_weight / _GB
            per_gpu = gpus.gb_each if gpus is not None else float(hardware.LARGEST_TRAINING_GB)
            capacity = per_gpu * count if sharded else per_gpu
            if need <= capacity:
                continue
            seen.add(id(origin.node))
            if gpus is None:
                against = (
                    f"more than {hardware.LARGEST_TRAINING_GB} GB, the largest GPU training usually runs on "
                    f"(A100/H100 80 GB), and far more than a common {hardware.LARGEST_COMMON_GB} GB card "
                    "(RTX 3090/4090, A10G, L4); the hardware is not stated (no `--gpus`, no `[tool.gpudoctor] gpus`, "
                    "no local GPU, none named in the file)"
                )
                if sharded:
                    against += (
                        f", and sharded over the {count} process{'es' if count > 1 else ''} the file launches "
                        f"it is ~{need / count:.0f} GB each"
                    )
                against += ". This runs out of memory"
            else:
                bound = (
                    f"{count} x {per_gpu:.0f} GB = {capacity:.0f} GB in all (sharded)" if sharded
                    else f"{per_gpu:.0f} GB per GPU (nothing shards the model, so each GPU holds all of it)"
                )
                against = f"but the GPUs are {gpus.describe()}: {bound}. This runs out of memory"
            if site.qualname in apis.TRAINERS and _args_from_command_line(facts):
                against += (
                    " unless the command line adds sharding (`--deepspeed` with ZeRO-3 or `--fsdp full_shard`), "
                    "which the file cannot show: its TrainingArguments are parsed from the command line"
                )
            yield self.report(
                site.node,
                f"Full fine-tuning of `{name}` (~{params / 1e9:g}B parameters by its name) with {optimizer} via {how}: "
                f"weights + gradients + Adam's two moments = 4 x {bytes_per_weight} B/param ({dtype_note}) = "
                f"~{need:.0f} GB before any activation, {against}.",
                fix_hint="Train adapters instead (peft LoRA, QLoRA with 4-bit weights), use an 8-bit/paged optimizer, "
                "or shard weights, gradients and optimizer state over the GPUs (DeepSpeed ZeRO-3 / FSDP, with CPU offload "
                "when even that is short).",
                related=((origin.node, "the model is loaded here"),),
            )

    @staticmethod
    def _adam(facts: FileFacts, site) -> Optional[str]:
        if site.qualname and apis.is_optimizer(site.qualname):
            name = site.qualname.split(".")[-1]
            return f"`{name}`" if name in ("Adam", "AdamW") else None
        if site.qualname in apis.TRAINERS:
            args = site.arg(1, "args")
            text = facts.module.code_for_node(args) if args is not None else ""
            if isinstance(args, cst.Name):
                binding = facts.binding_at(args.value, site.order, site.scope)
                if binding is not None and binding.value is not None:
                    text = facts.module.code_for_node(binding.value)
            optim = re.search(r"optim\s*=\s*['\"]([^'\"]+)", text)
            if (optim and _CHEAP_OPTIMIZERS.search(optim.group(1))) or _SHARDED.search(text):
                return None
            return "AdamW (the Trainer default)"
        return None


_PROCESS_COUNT = re.compile(r"""(?:num_processes|nproc[_-]per[_-]node|num_gpus)["']?\s*[=:\s]\s*["']?(\d+)\b""")
_CLI_ARGS = re.compile(r"parse_args_into_dataclasses|parse_json_file|parse_yaml_file|parse_dict")


def _stated_processes(source: str) -> Optional[int]:
    """The process count a launch line in the file states (``--num_processes=8``, ``--nproc_per_node 4``)."""
    counts = {int(m.group(1)) for m in _PROCESS_COUNT.finditer(source)}
    return counts.pop() if len(counts) == 1 and min(counts) >= 1 else None


def _args_from_command_line(facts: FileFacts) -> bool:
    return bool(_CLI_ARGS.search(facts.source))
