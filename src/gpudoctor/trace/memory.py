"""Memory: OOM diagnosis with a per-device breakdown, options with estimated savings, and peak memory."""

from __future__ import annotations

import os
import resource
import sys

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from gpudoctor.trace.frames import first_user_frame_from_stack, frame_info
from gpudoctor.trace.messages import OomInfo, classify_oom

ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq in fp32


def _storage_key(t: torch.Tensor):
    try:
        from torch.multiprocessing.reductions import StorageWeakRef

        return StorageWeakRef(t.untyped_storage()).cdata
    except Exception:
        return id(t)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def breakdown(probe) -> dict[str, dict[str, int]]:
    """Bytes per device: weights, buffers, gradients, optimizer_state (shared storages counted once)."""
    seen: set = set()
    out: dict[str, dict[str, int]] = {}

    def add(t, category):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        key = _storage_key(t)
        if key in seen:
            return
        seen.add(key)
        row = out.setdefault(str(t.device), {"weights": 0, "buffers": 0, "gradients": 0, "optimizer_state": 0})
        row[category] += _nbytes(t)

    for root in probe.root_models():
        for p in root.parameters():
            add(p, "weights")
            if p.grad is not None:
                add(p.grad, "gradients")
        for b in root.buffers():
            add(b, "buffers")
    for opt in list(probe.optimizers):
        for state in opt.state.values():
            for value in state.values():
                add(value, "optimizer_state")
    return out


def model_numbers(probe) -> dict:
    total = trainable = weight_bytes = linear_lora = 0
    linear_weight_params = 0
    for root in probe.root_models():
        for p in root.parameters():
            total += p.numel()
            weight_bytes += _nbytes(p)
            if p.requires_grad:
                trainable += p.numel()
        for name, module in root.named_modules():
            if isinstance(module, nn.Linear) and not name.endswith("lm_head"):
                linear_lora += 16 * (module.in_features + module.out_features)  # LoRA r=16
                linear_weight_params += module.weight.numel()
    return {"params": total, "trainable": trainable, "weight_bytes": weight_bytes, "lora_r16_params": linear_lora,
            "linear_weight_params": linear_weight_params}


def device_count() -> int:
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    try:
        backend = torch._C._get_privateuse1_backend_name()
        module = getattr(torch, backend, None)
        if module is not None and backend != "privateuseone":
            return int(module.device_count())
    except Exception:
        pass
    return 1


# ---------------------------------------------------------------------------------------------
# the tensor that did not fit
# ---------------------------------------------------------------------------------------------

class _Found(Exception):
    pass


class LargestOutputMode(TorchDispatchMode):
    """Shape-only re-run of the failing module: stops at the first op whose output is as large as the failed request."""

    def __init__(self, module_path, stop_at: int | None):
        super().__init__()
        self.module_path = module_path
        self.stop_at = stop_at
        self.largest: dict | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for tensor in out if isinstance(out, (list, tuple)) else (out,):
            if not isinstance(tensor, torch.Tensor):
                continue
            size = tensor.numel() * tensor.element_size()
            if self.largest is None or size > self.largest["bytes"]:
                caller = sys._getframe(1)
                self.largest = {"op": f"aten.{func._overloadpacket.__name__}", "shape": list(tensor.shape),
                                "dtype": str(tensor.dtype).replace("torch.", ""), "bytes": size, "module": self.module_path(),
                                "user_location": first_user_frame_from_stack(caller), "code_location": _code_location(caller)}
            if self.stop_at and size >= self.stop_at:
                raise _Found()
        return out


def _code_location(frame) -> dict | None:
    """Innermost frame outside torch: the modelling or user line that called the op."""
    depth = 0
    while frame is not None and depth < 80:
        filename = frame.f_code.co_filename.replace(os.sep, "/")
        if "/torch/" not in filename and "/gpudoctor/trace/" not in filename and not filename.startswith("<"):
            return frame_info(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
        depth += 1
    return None


def find_dominant_tensor(probe, snapshot, requested: int | None, total: int | None = None) -> dict | None:
    """Re-run the innermost module (shape only, nothing allocated) to name the tensor the failed request was for.

    Returned only when one tensor is at least 90% of the request and the request is a large share of the device
    (a quarter or more): then that tensor, not the rest of the memory, is the problem.
    """
    if not requested or (total and requested < total / 4):
        return None
    from gpudoctor.trace.diagnose import rerun_frame

    mode = LargestOutputMode(probe.current_path, int(requested * 0.9))
    rerun_frame(probe, snapshot, len(snapshot.stack) - 1, mode, _Found, fake_fallback=True)
    found = mode.largest
    if found is None or found["bytes"] < requested * 0.9:
        return None
    return found


def _input_dims(snapshot) -> tuple[int | None, int | None]:
    """(batch, sequence length) of the outermost call: the first integer tensor with 2 dims (input_ids), else any."""
    frame = snapshot.stack[0] if snapshot is not None and snapshot.stack else None
    if frame is None:
        return None, None
    tensors = [v for v in list(frame.args) + list(frame.kwargs.values()) if isinstance(v, torch.Tensor) and v.dim() >= 2]
    tensors.sort(key=lambda t: t.is_floating_point())
    return (tensors[0].shape[0], tensors[0].shape[1]) if tensors else (None, None)


def dominant_options(dominant: dict, snapshot) -> list[dict]:
    """Options that shrink the dominant tensor itself, with savings computed from its shape."""
    size, shape = dominant["bytes"], dominant["shape"]
    batch, seq = _input_dims(snapshot)
    seq_dims = [i for i, d in enumerate(shape) if seq and d == seq and seq > 1]
    module = (dominant.get("module") or "").lower()
    code = dominant.get("code_location") or {}
    already_fused = any(k in f"{code.get('file', '')} {code.get('function', '')}".lower() for k in ("sdpa", "flash", "flex"))
    attention = (len(seq_dims) >= 2 and seq_dims[-2:] == [len(shape) - 2, len(shape) - 1] and ("attn" in module or "attention" in module)
                 and not already_fused)
    shape_text = "×".join(map(str, shape))
    options = []
    if attention:
        options.append({"id": "sdpa_attention", "title": "SDPA / FlashAttention instead of eager attention",
                        "saving_bytes": size, "targets_dominant": True,
                        "detail": f"`attn_implementation=\"sdpa\"` (or \"flash_attention_2\") never materialises the {shape_text} "
                                  "attention scores"})
    elif len(shape) >= 2:
        axis = seq_dims[0] if seq_dims else max(range(1, len(shape)), key=lambda i: shape[i])
        if shape[axis] >= 8:
            options.append({"id": "chunking", "title": f"compute it in chunks along dim {axis} ({shape[axis]})",
                            "saving_bytes": size - size // 8, "targets_dominant": True,
                            "detail": f"loop over 8 slices of dim {axis} and reduce each (e.g. score span starts in blocks) instead of "
                                      f"building the whole {shape_text} tensor at once"})
    if seq_dims:
        options.append({"id": "shorter_sequence", "title": "halve the sequence length",
                        "saving_bytes": int(size * (1 - 0.5 ** len(seq_dims))), "targets_dominant": True,
                        "detail": f"max_length {seq} -> {seq // 2} (truncate or split documents): the tensor has {len(seq_dims)} "
                                  f"sequence dim(s), so it shrinks {2 ** len(seq_dims)}x"})
    if batch and batch > 1 and shape and shape[0] == batch:
        options.append({"id": "smaller_micro_batch", "title": "halve the micro-batch, double gradient accumulation",
                        "saving_bytes": size // 2, "targets_dominant": True,
                        "detail": f"batch {batch} -> {batch // 2} with `gradient_accumulation_steps*2`: same effective batch"})
    return options


def diagnose_oom(info: OomInfo, probe, phase: str, dominant: dict | None = None, snapshot=None) -> dict:
    per_device = breakdown(probe)
    device = f"{info.device_type}:{info.device_index}" if info.device_index is not None else info.device_type
    if info.device_type == "cuda" and device not in per_device:
        # a simulated CUDA OOM on virtual devices carries the index; name the device we actually see
        match = [d for d in per_device if d.endswith(f":{info.device_index}") and not d.startswith("cpu")]
        if match:
            device = match[0]
    row = per_device.get(device, {"weights": 0, "buffers": 0, "gradients": 0, "optimizer_state": 0})
    known = sum(row.values())
    if info.allocated is not None:
        row = dict(row, activations_and_other=max(info.allocated - known, 0))
    classes = classify_oom(info)
    if info.device_type == "cpu" and info.requested:
        ram = _physical_ram()
        if ram and info.requested > ram:
            classes.insert(0, {"id": "single_allocation_too_large", "title": "one allocation is larger than the machine's RAM",
                               "detail": f"requested {info.requested} bytes, the machine has {ram} bytes"})
            classes = [c for c in classes if c["id"] != "host_memory" or len(classes) == 1]
    return {
        "device": device,
        "message_fields": info.to_dict(),
        "classification": classes,
        "phase": phase,
        "memory_by_category": {device: row, **{d: r for d, r in per_device.items() if d != device}},
        "dominant_tensor": dominant,
        "options": oom_options(probe, row, phase, info.requested, dominant_options(dominant, snapshot) if dominant else []),
    }


def _physical_ram() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def oom_options(probe, row: dict, phase: str, requested: int | None = None, first: list[dict] = ()) -> list[dict]:
    """Concrete options with savings estimated from the model in hand (not from a model name), largest first; those
    saving under 1% of the failed request are dropped (they cannot make it fit)."""
    # with the failing tensor known, its own micro-batch option (from its shape) replaces the model-wide estimate
    options = _model_options(probe, row, phase, skip={"smaller_micro_batch"} if first else set())
    options = list(first) + options
    if requested:
        options = [o for o in options if o["saving_bytes"] >= 0.01 * requested]
    options.sort(key=lambda o: -o["saving_bytes"])
    return options


def _model_options(probe, row: dict, phase: str, skip: set[str]) -> list[dict]:
    numbers = model_numbers(probe)
    if not numbers["params"]:
        return []
    n_devices = max(device_count(), 1)
    weights, grads, optim = row.get("weights", 0), row.get("gradients", 0), row.get("optimizer_state", 0)
    trainable = numbers["trainable"]
    training = trainable > 0 and phase in ("forward", "backward", "optimizer_step")
    # before the first step grads/state don't exist yet: estimate what they will cost (fp32 Adam)
    future_grads = grads or (trainable * 4 if training else 0)
    future_optim = optim or (trainable * ADAM_STATE_BYTES if training else 0)
    activations = row.get("activations_and_other")
    options = []
    if training and numbers["lora_r16_params"] and trainable > 4 * numbers["lora_r16_params"]:
        lora = numbers["lora_r16_params"]
        saving = future_grads + future_optim - lora * (4 + ADAM_STATE_BYTES)
        options.append({"id": "lora", "title": "LoRA instead of full fine-tuning (peft, r=16 on every Linear)",
                        "saving_bytes": max(saving, 0),
                        "detail": f"trainable params {trainable:,} -> ~{lora:,}: gradients and Adam state shrink accordingly"})
    if numbers["linear_weight_params"]:
        linear_bytes = sum(_nbytes(m.weight) for r in probe.root_models() for n, m in r.named_modules()
                           if isinstance(m, nn.Linear) and not n.endswith("lm_head") and m.weight.device.type != "meta")
        for bits, label in ((8, "8-bit"), (4, "4-bit")):
            quantized = numbers["linear_weight_params"] * bits // 8
            if linear_bytes > quantized:
                options.append({"id": f"quantize_{bits}bit", "title": f"{label} weights (bitsandbytes; QLoRA when training)",
                                "saving_bytes": linear_bytes - quantized,
                                "detail": "`quantization_config=BitsAndBytesConfig(load_in_%dbit=True)`; only adapters can then be trained" % bits})
    if activations:
        if phase in ("forward", "backward"):
            layers = sum(1 for r in probe.root_models() for m in r.modules() if type(m).__name__.endswith(("DecoderLayer", "EncoderLayer", "Block")))
            keep = 1 / max(layers, 1) if layers else 0.5
            options.append({"id": "gradient_checkpointing", "title": "gradient checkpointing",
                            "saving_bytes": int(activations * (1 - keep)),
                            "detail": "`model.gradient_checkpointing_enable()` and `model.train()`: keeps one layer's activations at a time (~30% slower)"})
        if "smaller_micro_batch" not in skip:
            options.append({"id": "smaller_micro_batch", "title": "halve the micro-batch, double gradient accumulation",
                            "saving_bytes": activations // 2,
                            "detail": "same effective batch: `per_device_train_batch_size/2`, `gradient_accumulation_steps*2`"})
    if n_devices > 1:
        options.append({"id": "device_map_sharding", "title": f"shard the weights over {n_devices} devices (device_map='auto')",
                        "saving_bytes": int(weights * (1 - 1 / n_devices)),
                        "detail": "single process; layers run in turn, so it fits but doesn't speed up"})
        if training:
            options.append({"id": "zero3_fsdp", "title": f"ZeRO-3 / FSDP over {n_devices} GPUs",
                            "saving_bytes": int((weights + future_grads + future_optim) * (1 - 1 / n_devices)),
                            "detail": "shards weights, gradients and optimizer state; one process per GPU"})
    elif training and future_optim:
        options.append({"id": "optimizer_offload", "title": "ZeRO-Offload / paged or 8-bit optimizer",
                        "saving_bytes": int(future_optim),
                        "detail": "moves (or shrinks to 1/4 with 8-bit Adam) the optimizer state off the GPU"})
    if not training and weights:
        options.append({"id": "cpu_offload", "title": "offload part of the weights to CPU (device_map with max_memory)",
                        "saving_bytes": weights // 2, "detail": "inference only: offloaded weights are never trained"})
    options.sort(key=lambda o: -o["saving_bytes"])
    return options


# ---------------------------------------------------------------------------------------------
# peak memory for the summary
# ---------------------------------------------------------------------------------------------

def peak_memory() -> dict:
    devices = []
    notes = []
    source = "none"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        source = "cuda"
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            devices.append({"device": f"cuda:{i}", "peak_allocated": torch.cuda.max_memory_allocated(i),
                            "peak_reserved": torch.cuda.max_memory_reserved(i), "total": total})
        nvml = _nvml_process_usage()
        if nvml is None:
            notes.append("NVML unavailable (pip install nvidia-ml-py): memory outside PyTorch (context, NCCL) not shown")
        else:
            for row in devices:
                row["nvml_process_used_now"] = nvml.get(int(row["device"].split(":")[1]))
            notes.append("NVML gives the process's current usage (context + non-PyTorch memory), not its peak")
    else:
        notes.append("no CUDA device in this process: GPU peak memory not measured")
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    devices.append({"device": "cpu", "peak_rss": rss_kib * 1024})
    notes.append("cpu: peak resident set size of the process (includes Python and libraries)")
    return {"source": source, "devices": devices, "notes": notes}


def _nvml_process_usage() -> dict | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        out = {}
        pid = os.getpid()
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == pid:
                    out[i] = proc.usedGpuMemory
        return out
    except Exception:
        return None
