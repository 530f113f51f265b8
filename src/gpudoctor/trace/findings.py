"""Silent problems (nothing crashes) and the placement summary of a run.

The facts silent problems need are taken at each optimizer step (:func:`observe_step`), while the models are
alive: in the usual ``def main(): ...; main()`` layout they are freed before the report is built at exit. Only
names, ids and counts are kept, never the user's tensors or modules.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from gpudoctor.trace.diagnose import compress_paths, placement_groups
from gpudoctor.trace.frames import assignment_line, construction_line, freeze_line, is_user_file, local_names_of
from gpudoctor.trace.probe import Probe, _offload_hook, value_fingerprint

_SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
_UNCHANGED_CHECKS = {2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024}  # steps at which "never changed" is re-checked


@dataclass
class RootFacts:
    """A root model as the optimizer last saw it."""

    ref: weakref.ref
    model: str
    trainable: dict[int, tuple[str, int]] = field(default_factory=dict)  # id -> (name, numel), requires_grad params
    offloaded: set[int] = field(default_factory=set)
    grads: set[int] = field(default_factory=set)  # ids that had a .grad at some step


@dataclass
class OptimizerFacts:
    ref: weakref.ref
    cls: str
    param_ids: set[int] = field(default_factory=set)
    orphans: int = 0  # parameters the model alive at the last step no longer has
    with_grad_elsewhere: dict[int, str] = field(default_factory=dict)  # model params with .grad that no optimizer holds
    lrs: list[float] = field(default_factory=list)
    site: dict | None = None  # the user frame of the first step, and the names / lines that built the optimizer


@dataclass
class SilentFacts:
    roots: list[RootFacts] = field(default_factory=list)
    optimizers: list[OptimizerFacts] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)
    unchanged: dict[int, str] = field(default_factory=dict)  # id -> name, still equal to its first-step value when checked
    changed: set[int] = field(default_factory=set)
    frozen_site: dict | None = None


def facts_of(probe: Probe) -> SilentFacts:
    facts = probe.__dict__.get("silent_facts")
    if facts is None:
        facts = probe.__dict__["silent_facts"] = SilentFacts()
    return facts


def _entry(entries, obj, make):
    for entry in entries:
        if entry.ref() is obj:
            return entry
    entry = make()
    entries.append(entry)
    return entry


def observe_step(probe: Probe, optimizer) -> None:
    """Called by the probe before each optimizer step: record what the findings will need."""
    facts = facts_of(probe)
    opt = _entry(facts.optimizers, optimizer, lambda: OptimizerFacts(weakref.ref(optimizer), type(optimizer).__name__))
    opt.param_ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if len(opt.lrs) < 16:
        opt.lrs.append(max((float(g.get("lr", 0.0)) for g in optimizer.param_groups), default=0.0))
    if opt.site is None:
        opt.site = _step_site(optimizer)
    related = [r for r in probe.root_models() if any(id(p) in opt.param_ids for p in r.parameters())]
    model_ids: set[int] = set()
    swapped = False
    for root in related:
        entry = _entry(facts.roots, root, lambda: RootFacts(weakref.ref(root), type(root).__name__))
        entry.offloaded = _offloaded_param_ids(root)
        entry.trainable = {}
        for name, p in root.named_parameters():
            pid = id(p)
            model_ids.add(pid)
            facts.names[pid] = name
            if p.requires_grad:
                entry.trainable[pid] = (name, p.numel())
            if p.grad is not None:
                entry.grads.add(pid)
                if pid not in opt.param_ids:
                    opt.with_grad_elsewhere[pid] = name
        # accelerate's offload hooks swap the placeholder Parameter objects at every forward: an optimizer holding
        # an older meta placeholder of an offloaded weight is not holding a replaced parameter
        swapped = swapped or bool(entry.offloaded)
    if related:
        opt.orphans = sum(1 for group in optimizer.param_groups for p in group["params"]
                          if id(p) not in model_ids and not (swapped and p.device.type == "meta"))
    if len(probe.frozen_with_grad) and facts.frozen_site is None:
        facts.frozen_site = opt.site
    if probe.steps in _UNCHANGED_CHECKS:
        for pid, (ref, first) in list(probe.first_values.items()):
            param = ref()
            if param is None or pid in facts.changed:
                continue
            if value_fingerprint(param) == first:
                facts.unchanged[pid] = facts.names.get(pid, "?")
            else:
                facts.changed.add(pid)
                facts.unchanged.pop(pid, None)


def _step_site(optimizer) -> dict | None:
    """The user's line that stepped, the local names of the optimizer and its LR scheduler, and where they were built."""
    frame = sys._getframe(1)
    depth = 0
    site = None
    while frame is not None and depth < 60:
        filename = frame.f_code.co_filename
        if is_user_file(filename):
            site = site or {"file": filename, "line": frame.f_lineno, "function": frame.f_code.co_name}
            names = local_names_of(frame, optimizer)
            if names and "optimizer_name" not in site:
                site.update(optimizer_name=names[0], optimizer_frame=(filename, frame.f_lineno))
            for name, value in frame.f_locals.items():
                if "scheduler_name" not in site and isinstance(value, _SCHEDULERS) and value.optimizer is optimizer:
                    site.update(scheduler_name=name, scheduler_line=assignment_line(filename, name, frame.f_lineno))
        frame = frame.f_back
        depth += 1
    if site is not None:
        filename, line = site.pop("optimizer_frame", (site["file"], site["line"]))
        site["optimizer_line"] = construction_line(filename, {type(optimizer).__name__}, site.get("optimizer_name"), line)
        if site["optimizer_line"] is None and site.get("optimizer_name"):
            site["optimizer_line"] = assignment_line(filename, site["optimizer_name"], line)
    return site


def _names(probe: Probe) -> dict[int, str]:
    out = dict(facts_of(probe).names)
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


def _optimizer_line(probe: Probe) -> dict | None:
    for opt in facts_of(probe).optimizers:
        if opt.site and opt.site.get("optimizer_line"):
            return opt.site["optimizer_line"]
    return None


def silent_findings(probe: Probe) -> list[dict]:
    findings: list[dict] = []
    facts = facts_of(probe)
    names = _names(probe)
    roots = probe.root_models()
    stepped = set().union(*(o.param_ids for o in facts.optimizers)) if facts.optimizers else set(probe.optimizer_param_ids)
    opt_line = _optimizer_line(probe)

    if probe.steps:
        never, offloaded_never = [], []
        for entry in facts.roots:
            for pid, (name, numel) in entry.trainable.items():
                if pid not in entry.grads and pid not in probe.grads_seen:
                    (offloaded_never if pid in entry.offloaded else never).append((name, numel))
        if offloaded_never:
            numel = sum(n for _, n in offloaded_never)
            findings.append({
                "id": "offloaded_weights_never_train", "severity": "error", "rule": "GD102",
                "title": f"{len(offloaded_never)} trainable parameter(s) ({numel:,} values) are offloaded and never change",
                "detail": "accelerate keeps offloaded weights as `meta` placeholders; they get no .grad and the optimizer skips "
                          f"them. Over {probe.steps} optimizer step(s) only the resident weights were trained.",
                "fix": "Keep trained modules resident (no cpu/disk entries for them in the device_map), or train LoRA adapters on resident modules only.",
                "items": compress_paths(sorted({n.rsplit('.', 1)[0] for n, _ in offloaded_never}))[:12],
                "location": opt_line,
            })
        if never:
            findings.append({
                "id": "trainable_without_grad", "severity": "warning", "rule": None,
                "title": f"{len(never)} trainable parameter(s) never received a gradient in {probe.steps} step(s)",
                "detail": "They require grad but no loss depends on them (unused branch, detached output, or a module replaced after the optimizer was built).",
                "fix": "Freeze them (`requires_grad_(False)`) or make the loss use them; check what forward actually calls.",
                "items": [n for n, _ in never][:12],
                "location": opt_line,
            })
    findings += _optimizer_coverage(probe, facts, stepped)
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
        site = facts.frozen_site or {}
        findings.append({
            "id": "frozen_but_updated", "severity": "error", "rule": "GD414",
            "title": f"{len(frozen)} frozen parameter(s) still had a .grad when the optimizer stepped",
            "detail": "requires_grad=False doesn't clear an existing .grad: the optimizer keeps updating these 'frozen' weights.",
            "fix": "Build the optimizer over `[p for p in model.parameters() if p.requires_grad]`, or `optimizer.zero_grad(set_to_none=True)` before freezing.",
            "items": frozen[:12],
            "location": freeze_line(site["file"], site["line"]) if site.get("file") else None,
        })
    orphans = sum(o.orphans for o in facts.optimizers)
    if orphans:
        findings.append({
            "id": "optimizer_orphans", "severity": "error", "rule": "GD413",
            "title": f"the optimizer holds {orphans} tensor(s) the model no longer uses",
            "detail": "Parameters were replaced after the optimizer was built: it updates the old tensors and the model never changes.",
            "fix": "Create the optimizer after the last change to the model's parameters (e.g. after get_peft_model, resize_token_embeddings, .to()).",
            "items": [],
            "location": opt_line,
        })
    unchanged = _stepped_but_unchanged(probe, names, facts)
    if unchanged:
        findings.append(_unchanged_finding(probe, facts, unchanged))
    return findings


def _optimizer_coverage(probe: Probe, facts: SilentFacts, stepped: set[int]) -> list[dict]:
    """Gradients no optimizer uses: the optimizer misses every trained parameter (built before get_peft_model, over the
    frozen backbone), or some of them (wasted backward work)."""
    out = []
    for opt in facts.optimizers:
        missed = {pid: name for pid, name in opt.with_grad_elsewhere.items() if pid not in stepped}
        if not missed:
            continue
        own_grads = any(pid in probe.grads_seen for pid in opt.param_ids)
        where = (opt.site or {}).get("optimizer_line")
        at = f" (built at line {where['line']})" if where else ""
        adapters = [n for n in missed.values() if "lora_" in n or "adapter" in n]
        if not own_grads and adapters:
            out.append({
                "id": "optimizer_misses_trainable", "severity": "error", "rule": "GD413",
                "title": f"the {opt.cls} optimizer{at} holds none of the {len(missed)} parameter(s) that train: the adapters were added after it",
                "detail": "It was built over the base model before get_peft_model froze the base and added the LoRA weights, so it "
                          "steps frozen weights with no gradient and the adapters never change.",
                "fix": "Create the optimizer after get_peft_model: `optimizer = AdamW(model.parameters(), ...)` on the PeftModel.",
                "items": list(missed.values())[:12], "location": where,
            })
        elif not own_grads:
            out.append({
                "id": "optimizer_misses_trainable", "severity": "error", "rule": None,
                "title": f"the {opt.cls} optimizer{at} holds none of the {len(missed)} parameter(s) that get gradients",
                "detail": "Every parameter it holds is frozen or unused (no gradient ever), while the ones that do get gradients are "
                          "in no optimizer: nothing is trained.",
                "fix": "Build it over the parameters that train: `optimizer = SGD([p for p in model.parameters() if p.requires_grad], ...)`.",
                "items": list(missed.values())[:12], "location": where,
            })
        else:
            out.append({
                "id": "grads_not_stepped", "severity": "warning", "rule": None,
                "title": f"gradients are computed for {len(missed)} parameter(s) no optimizer updates",
                "detail": "They cost backward time and gradient memory for nothing.",
                "fix": "Freeze them with `requires_grad_(False)`, or add them to the optimizer if they should train.",
                "items": list(missed.values())[:12], "location": where,
            })
    return out


def _unchanged_finding(probe: Probe, facts: SilentFacts, unchanged: list[str]) -> dict:
    opt = next((o for o in facts.optimizers if o.lrs), None)
    zero_lr = opt is not None and all(lr == 0 for lr in opt.lrs)
    site = (opt.site if opt else None) or {}
    location = site.get("scheduler_line") or site.get("optimizer_line")
    if zero_lr:
        built = f" (`{site['scheduler_name']}`, built at line {site['scheduler_line']['line']})" if site.get("scheduler_line") else ""
        detail = (f"The learning rate was 0 at every one of the {len(opt.lrs)} step(s) observed: the schedule{built} never leaves 0 "
                  "(num_training_steps computed as 0, an integer division, warmup that starts at 0 and never ends).")
        fix = (f"The learning rate never left 0: check the schedule{built}. Print `scheduler.get_last_lr()`; num_training_steps must be "
               "the real number of optimizer steps (> 0) and warmup shorter than the run.")
    else:
        detail = ("The optimizer ran and the gradients existed, yet the values are what they were at the first step: a learning rate "
                  "of 0 (a schedule stuck at its start), an fp16 GradScaler skipping every step on inf/NaN gradients, or gradients "
                  "zeroed between backward and step.")
        fix = ("Print the learning rate and `scaler.get_scale()` per step (a scale that halves every step means every step is "
               "skipped), and keep the order zero_grad → backward → step.")
    return {
        "id": "stepped_but_unchanged", "severity": "warning", "rule": None,
        "title": f"{len(unchanged)} trainable parameter(s) had gradients and were stepped {probe.steps} times but never changed",
        "detail": detail, "fix": fix, "items": unchanged[:12], "location": location,
    }


def _stepped_but_unchanged(probe: Probe, names: dict[int, str], facts: SilentFacts) -> list[str]:
    if probe.steps < 2:
        return []
    out = []
    for pid, (ref, first) in probe.first_values.items():
        param = ref()
        if param is None:
            if pid in facts.unchanged:  # freed with its model: the last check while it was alive decides
                out.append(facts.unchanged[pid])
            continue
        if pid not in probe.optimizer_param_ids or not param.requires_grad:
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
