"""The recommendation in one sentence and the few lines that implement it.

The code follows the reference trainer (``gpudoctor.reference``): load straight onto the planned devices
with an explicit ``dtype``, LoRA over all linear layers with peft, non-reentrant activation
checkpointing, AdamW over the trainable parameters only; multi-process placements are launched with
``torchrun`` / ``accelerate launch``.
"""

from __future__ import annotations

GiB = 1 << 30

_DTYPE = {"float32": "torch.float32", "bfloat16": "torch.bfloat16", "float16": "torch.float16"}


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def recommendation(plan) -> str:
    best = plan.recommended
    if best is None:
        return (f"Nothing fits {len(plan.cards)}x{plan.cards[0].name} at batch {plan.workload.batch} x {plan.workload.seq} "
                "tokens: lower the batch or the sequence length, or use bigger cards.")
    how = {"1 GPU": "on one GPU", "device_map": f"split over the {len(plan.cards)} GPUs with a device_map (one process)",
           "DDP": f"with DDP ({len(plan.cards)} processes, one copy per GPU)",
           "FSDP": f"with FSDP full sharding ({len(plan.cards)} processes)"}[best.placement]
    ckpt = " with gradient checkpointing" if best.checkpointing else ""
    estimate = " (an estimate: FSDP is not simulated sharded)" if best.estimate else ""
    return (f"Train {best.method.label}{ckpt} {how}: {gib(best.peak)} on the fullest GPU (cuda:{best.fullest}), "
            f"{gib(best.headroom)} left{estimate}.")


def _auto_class(info) -> str:
    if info.remote_code:
        return "AutoModel"  # what the checkpoint's auto_map names (e.g. ChatGLM-6B's)
    try:
        from gpudoctor.plan.simulated import auto_class_name

        return auto_class_name(info)
    except Exception:
        return "AutoModelForSeq2SeqLM" if info.encoder_decoder else "AutoModelForCausalLM"


def snippet(plan) -> str:
    best = plan.recommended
    if best is None:
        return ""
    m, name, wl = best.method, plan.info.name, plan.workload
    dtype = _DTYPE[m.dtype]
    auto = _auto_class(plan.info)
    lines = ["import torch", f"from transformers import {auto}"]
    kwargs = [f"dtype={dtype}"]
    if plan.info.remote_code:
        kwargs.insert(0, "trust_remote_code=True")
    if m.quant_bits:
        lines.append("from transformers import BitsAndBytesConfig")
        quant = ("BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=\"nf4\", bnb_4bit_use_double_quant=True, "
                 f"bnb_4bit_compute_dtype={dtype})" if m.quant_bits == 4 else "BitsAndBytesConfig(load_in_8bit=True)")
        kwargs.append(f"quantization_config={quant}")
    if best.placement == "device_map":
        kwargs.append('device_map="auto"')
    elif best.placement == "1 GPU" or m.quant_bits:
        kwargs.append('device_map={"": local_rank}' if best.placement == "DDP" else 'device_map={"": 0}')
    if m.lora:
        lines.append("from peft import LoraConfig, get_peft_model" + (", prepare_model_for_kbit_training" if m.quant_bits else ""))
    if best.placement in ("DDP", "FSDP") and not m.quant_bits:
        lines.append("import os\nlocal_rank = int(os.environ[\"LOCAL_RANK\"]); torch.cuda.set_device(local_rank)")
    elif best.placement == "DDP":
        lines.insert(2, "import os\nlocal_rank = int(os.environ[\"LOCAL_RANK\"]); torch.cuda.set_device(local_rank)")
    lines.append(f"model = {auto}.from_pretrained({name!r}, {', '.join(kwargs)})")
    if m.quant_bits:
        lines.append(f"model = prepare_model_for_kbit_training(model, use_gradient_checkpointing={best.checkpointing})")
    elif best.checkpointing:
        lines.append('model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})')
    if m.lora:
        targets = wl.lora_targets if isinstance(wl.lora_targets, str) else list(wl.lora_targets)
        task = "SEQ_2_SEQ_LM" if plan.info.encoder_decoder else "CAUSAL_LM"
        lines.append(f"model = get_peft_model(model, LoraConfig(task_type={task!r}, r={wl.lora_r}, lora_alpha={wl.lora_alpha}, "
                     f"target_modules={targets!r}))")
    if best.placement == "DDP":
        if not m.quant_bits:
            lines.append("model.to(local_rank)")
        lines.append("model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])")
    if best.placement == "FSDP":
        lines.append("# wrap with FSDP (accelerate config: FULL_SHARD, auto-wrap by transformer layer) or torch's fully_shard")
    autocast = " under torch.autocast('cuda', dtype=torch.float16) with a GradScaler" if m.autocast else ""
    lines.append(f"optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)"
                 f"  # batch {wl.batch} x {wl.seq} tokens{autocast}")
    if best.placement in ("DDP", "FSDP"):
        lines.append(f"# launch: torchrun --nproc_per_node {len(plan.cards)} train.py"
                     + ("   (or accelerate launch --use_fsdp ...)" if best.placement == "FSDP" else ""))
    elif best.placement == "device_map":
        lines.append("# launch: python train.py   (one process; not torchrun / accelerate launch with several processes: GD107)")
    return "\n".join(lines)
