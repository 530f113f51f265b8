"""Silent problems (nothing crashes) and the placement summary of a run."""

from __future__ import annotations

import torch.nn as nn

from gpudoctor.trace.diagnose import compress_paths, placement_groups
from gpudoctor.trace.probe import Probe, _offload_hook, value_fingerprint


def _names(probe: Probe) -> dict[int, str]:
    out = {}
    for root in probe.root_models():
        for name, p in root.named_parameters(remove_duplicate=False):
            out.setdefault(id(p), name)
    return out


def _offloaded_param_ids(root: nn.Module) -> set[int]:
    ids = set()
    for module in root.modules():
        if _offload_hook(module) is not None:
            ids |= {id(p) for p in module.parameters()}
    return ids


def silent_findings(probe: Probe) -> list[dict]:
    findings: list[dict] = []
    names = _names(probe)
    roots = probe.root_models()

    if probe.steps:
        offloaded_ids = set().union(*(_offloaded_param_ids(r) for r in roots)) if roots else set()
        never, offloaded_never = [], []
        for root in roots:
            for name, p in root.named_parameters():
                if p.requires_grad and id(p) not in probe.grads_seen and (p.grad is None or id(p) not in probe.optimizer_param_ids):
                    (offloaded_never if (id(p) in offloaded_ids or p.device.type == "meta") else never).append((name, p))
        if offloaded_never:
            numel = sum(p.numel() for _, p in offloaded_never)
            findings.append({
                "id": "offloaded_weights_never_train", "severity": "error", "rule": "GD102",
                "title": f"{len(offloaded_never)} trainable parameter(s) ({numel:,} values) are offloaded and never change",
                "detail": "accelerate keeps offloaded weights as `meta` placeholders; they get no .grad and the optimizer skips "
                          f"them. Over {probe.steps} optimizer step(s) only the resident weights were trained.",
                "fix": "Keep trained modules resident (no cpu/disk entries for them in the device_map), or train LoRA adapters on resident modules only.",
                "items": compress_paths(sorted({n.rsplit('.', 1)[0] for n, _ in offloaded_never}))[:12],
            })
        if never:
            findings.append({
                "id": "trainable_without_grad", "severity": "warning", "rule": None,
                "title": f"{len(never)} trainable parameter(s) never received a gradient in {probe.steps} step(s)",
                "detail": "They require grad but no loss depends on them (unused branch, detached output, or a module replaced after the optimizer was built).",
                "fix": "Freeze them (`requires_grad_(False)`) or make the loss use them; check what forward actually calls.",
                "items": [n for n, _ in never][:12],
            })
    if probe.meta_at_forward:
        findings.append({
            "id": "meta_at_forward", "severity": "error", "rule": None,
            "title": f"{len(probe.meta_at_forward)} module(s) ran forward with parameters still on `meta`",
            "detail": "No accelerate hook loads them, and CPU kernels don't check meta inputs: results are garbage or meta.",
            "fix": "Load the weights (load_checkpoint_and_dispatch / from_pretrained) or `to_empty()` + init before running.",
            "items": [f"{path}: {', '.join(params)}" for path, params in list(probe.meta_at_forward.items())[:12]],
        })
    accepted = probe.device_mode.accepted if probe.device_mode is not None else []
    if accepted:  # --deep: ops that mixed devices and still ran (no error, wrong or meta results)
        findings.append({
            "id": "device_mix_accepted", "severity": "error", "rule": None,
            "title": f"{len(accepted)} op(s) mixed devices and ran without an error",
            "detail": "CPU kernels don't check meta (or other-device) inputs: these results are garbage or meta.",
            "fix": "Put every operand of these ops on one device (see the module and argument named).",
            "items": [f"{m.op} in {m.module_path or '<root>'}: {m.argument} on {m.offending_device}, others on {m.common_device}"
                      for m in accepted[:12]],
        })
    if probe.offloaded_calls:
        per_forward = 0
        for root in roots:
            for path, module in root.named_modules():
                if path in probe.offloaded_calls:
                    per_forward += sum(p.numel() * p.element_size() for p in module.parameters())
        calls = sum(probe.offloaded_calls.values())
        findings.append({
            "id": "offload_traffic", "severity": "info", "rule": None,
            "title": f"{len(probe.offloaded_calls)} offloaded module(s) were loaded from cpu/disk {calls} time(s)",
            "detail": f"Each forward copies ~{per_forward:,} bytes of weights to the execution device and drops them again: slow.",
            "fix": "Give the GPU(s) more of the model (max_memory, quantization) so fewer layers are offloaded.",
            "items": compress_paths(list(probe.offloaded_calls))[:12],
        })
    frozen = [names.get(pid, "?") for pid in probe.frozen_with_grad]
    if frozen:
        findings.append({
            "id": "frozen_but_updated", "severity": "error", "rule": "GD414",
            "title": f"{len(frozen)} frozen parameter(s) still had a .grad when the optimizer stepped",
            "detail": "requires_grad=False doesn't clear an existing .grad: the optimizer keeps updating these 'frozen' weights.",
            "fix": "Build the optimizer over `[p for p in model.parameters() if p.requires_grad]`, or `optimizer.zero_grad(set_to_none=True)` before freezing.",
            "items": frozen[:12],
        })
    if probe.steps and roots:
        model_ids = {id(p) for r in roots for p in r.parameters()}
        orphans = [pid for pid in probe.optimizer_param_ids if pid not in model_ids]
        if orphans:
            findings.append({
                "id": "optimizer_orphans", "severity": "error", "rule": "GD413",
                "title": f"the optimizer holds {len(orphans)} tensor(s) the model no longer uses",
                "detail": "Parameters were replaced after the optimizer was built: it updates the old tensors and the model never changes.",
                "fix": "Create the optimizer after the last change to the model's parameters (e.g. after get_peft_model, resize_token_embeddings, .to()).",
                "items": [],
            })
        stepped = set(probe.optimizer_param_ids)
        wasted = [n for r in roots for n, p in r.named_parameters() if p.grad is not None and id(p) not in stepped]
        if wasted:
            findings.append({
                "id": "grads_not_stepped", "severity": "warning", "rule": None,
                "title": f"gradients are computed for {len(wasted)} parameter(s) no optimizer updates",
                "detail": "They cost backward time and gradient memory for nothing.",
                "fix": "Freeze them with `requires_grad_(False)`, or add them to the optimizer if they should train.",
                "items": wasted[:12],
            })
    unchanged = _stepped_but_unchanged(probe, names)
    if unchanged:
        findings.append({
            "id": "stepped_but_unchanged", "severity": "warning", "rule": None,
            "title": f"{len(unchanged)} trainable parameter(s) had gradients and were stepped {probe.steps} times but never changed",
            "detail": "The optimizer ran and the gradients existed, yet the values are what they were at the first step: a "
                      "learning rate of 0 (a schedule stuck at its start), an fp16 GradScaler skipping every step on inf/NaN "
                      "gradients, or gradients zeroed between backward and step.",
            "fix": "Print the learning rate and `scaler.get_scale()` per step (a scale that halves every step means every step is "
                   "skipped), and keep the order zero_grad → backward → step.",
            "items": unchanged[:12],
        })
    return findings


def _stepped_but_unchanged(probe: Probe, names: dict[int, str]) -> list[str]:
    if probe.steps < 2:
        return []
    out = []
    for pid, (ref, first) in probe.first_values.items():
        param = ref()
        if param is None or pid not in probe.optimizer_param_ids or not param.requires_grad:
            continue
        if value_fingerprint(param) == first:
            out.append(names.get(pid, "?"))
    return out


def placement(probe: Probe) -> list[dict]:
    out = []
    for root in probe.root_models():
        device_map = None
        for m in root.modules():
            device_map = getattr(m, "hf_device_map", None)
            if device_map:
                break
        offloaded = _offloaded_param_ids(root)
        rows: dict[str, dict] = {}
        seen: set[int] = set()
        for p in root.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            device = "offloaded (meta)" if id(p) in offloaded or p.device.type == "meta" else str(p.device)
            row = rows.setdefault(device, {"device": device, "params": 0, "bytes": 0, "trainable": 0, "modules": []})
            row["params"] += p.numel()
            row["bytes"] += p.numel() * p.element_size()
            row["trainable"] += p.numel() if p.requires_grad else 0
        if device_map:
            by_device: dict[str, list[str]] = {}
            for path, dev in device_map.items():
                by_device.setdefault(str(dev), []).append(path or type(root).__name__)
            groups = {d: compress_paths(v) for d, v in by_device.items()}
        else:
            groups = placement_groups(root)
        for device, paths in groups.items():
            target = rows.get(device) or rows.get("offloaded (meta)") if device in ("cpu", "disk") and device_map else rows.get(device)
            if target is not None:
                target["modules"].extend(paths if not device_map or device == target["device"] else [f"{p} ({device})" for p in paths])
        out.append({"model": type(root).__name__, "hf_device_map": bool(device_map), "devices": list(rows.values())})
    return out
