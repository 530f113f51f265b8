"""Turn an exception plus the probe's state into a diagnosis: where, which tensors, why, and the fix.

Root causes and fixes are the ones verified on torch 2.13 / accelerate 1.15–1.16 / transformers 5.24
(shared research: pitfall-ground-truth.md rows, runtime-anchors.md §7.1).
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn as nn

from gpudoctor.trace.devicecheck import DeviceMismatchDetected
from gpudoctor.trace.frames import (
    assignment_line,
    attribute_assignment_line,
    first_user_frame_from_traceback,
    local_names_of,
    names_in_line,
    resolve_local,
    short_path,
    traceback_frames,
    user_tracebacks,
)
from gpudoctor.trace.messages import parse_device_message, parse_oom_message
from gpudoctor.trace.origins import OriginIndex, ProvenanceCheckMode, describe
from gpudoctor.trace.probe import Probe, _offload_hook

# id -> (title, fix template, static rule code or None, reference)
CAUSES: dict[str, tuple[str, str, str | None, str]] = {
    "batch_not_moved": (
        "The batch was not moved to the model's device",
        "Move every input to the model's device before the call, e.g. `batch = {{k: v.to(model.device) for k, v in batch.items()}}` "
        "(or let `accelerator.prepare(dataloader)` do it){also}.",
        None, "ground truth 5a; issues pytorch/tutorials#1657"),
    "model_not_moved": (
        "A second model (teacher / reference) was never moved to the device of its inputs",
        "Move `{name}` where its inputs are, once, right after building it ({where}): `{name}.to({device})` "
        "(or `{name} = accelerator.prepare({name})`).",
        "GD609", "ground truth 5a-5c; trl#1147, nlp-with-transformers/notebooks#61"),
    "loss_weight_on_cpu": (
        "The loss module's `weight` is on the CPU while the logits and labels are on the GPU",
        "Move the loss with its weight where it is built ({where}): `{name} = {cls}(weight=...).to({device})`, or create "
        "the weight tensor with `device=`.",
        "GD604", "pytorch#122757"),
    "user_code_mismatch": (
        "Your code combines tensors that live on different devices",
        "Move `{arg}` to the device of `{other}` before this line: `{arg} = {arg}.to({other}.device)`.",
        None, "shuxueslpi/chatGLM-6B-QLoRA#38; unsloth#4059"),
    "dominant_activation": (
        "One activation is most of the failing request",
        "{options}",
        None, "runtime-anchors OOM table (eager S² attention, B×S×V logits)"),
    "tensor_created_in_forward": (
        "A tensor created inside forward() has no device=",
        "Create it on the device of the data it meets: `torch.{op}(..., device={other}.device)` at {where}, "
        "or register it once as a buffer in __init__.",
        "GD601", "runtime-anchors 7.1 #3"),
    "plain_tensor_attribute": (
        "A tensor stored as a plain attribute, not a buffer, is left behind by model.to()",
        "Register it: `self.register_buffer(\"{attr}\", tensor, persistent=False)` in __init__ of {module}; "
        "Module.to()/cuda() then move it with the parameters.",
        "GD602", "runtime-anchors 7.1 #4 (transformers#22234)"),
    "submodule_in_python_list": (
        "Submodules kept in a Python list are invisible to model.to() and model.parameters()",
        "Hold them in `nn.ModuleList` (or `nn.ModuleDict`): {path} is never moved, trained or saved as it is.",
        "GD603", "runtime-anchors 7.1 #5"),
    "moved_after_dispatch": (
        "A dispatched model was moved after dispatch; accelerate's hooks still send activations to the old devices",
        "Don't move a model loaded with a device_map. If you must, run "
        "`accelerate.hooks.remove_hook_from_module(model, recurse=True)` after moving it.",
        "GD110", "ground truth 15b"),
    "split_no_split_module": (
        "The device map splits a block that must stay on one device",
        "Build the map with `infer_auto_device_map(model, no_split_module_classes=model._no_split_modules)` "
        "(transformers' `from_pretrained(device_map=\"auto\")` does this for you).",
        "GD108", "ground truth 12a/12b"),
    "manual_split_without_hooks": (
        "The model is split across devices by hand, and nothing moves activations between the parts",
        "Use `accelerate.dispatch_model(model, device_map)` / `from_pretrained(device_map=...)`, whose hooks move "
        "activations, or move them yourself in forward: `hidden = hidden.to(next_block_device)`.",
        None, "ground truth 5e"),
    "dataparallel_split_model": (
        "nn.DataParallel wraps a model whose layers are on several devices",
        "Don't wrap a split model in DataParallel: run one process with the device_map, or DDP with one full copy "
        "per GPU (`device_map={{\"\": PartialState().process_index}}`).",
        "GD111", "ground truth 6a"),
    "dataparallel_model_on_cpu": (
        "nn.DataParallel wraps a model that is still on the CPU",
        "Move the model to `device_ids[0]` first: `model.to(\"cuda:0\")`, then wrap it.",
        "GD608", "ground truth 6b"),
    "optimizer_state_device": (
        "Optimizer state lives on another device than its parameters",
        "Create the optimizer after moving the model, or re-cast its state after moving: "
        "`optimizer.load_state_dict(optimizer.state_dict())`.",
        "GD606", "ground truth 16a/16b"),
    "trainable_offloaded": (
        "Trainable parameters are accelerate-offloaded meta placeholders",
        "Keep the trained modules resident (no `cpu`/`disk` entries in the device_map for them), or put LoRA only on "
        "resident modules. Offloaded weights never receive gradients.",
        "GD102", "ground truth 1d/3d"),
    "inputs_to_meta_device": (
        "Inputs were sent to `model.device`, which is `meta` because the first parameter is offloaded",
        "Leave the inputs on CPU (accelerate's hooks move them), or send them to the first resident execution device "
        "(e.g. `inputs.to(0)`), not `model.device`.",
        "GD612", "ground truth 5d"),
    "meta_weights_not_loaded": (
        "Parameters are still on `meta`: the model was built empty and its weights were never loaded",
        "Load the weights (`load_checkpoint_and_dispatch`, `from_pretrained`), or `model.to_empty(device=...)` and "
        "initialise them, before running it.",
        None, "ground truth 14e/14f; transformers#34234"),
    "offload_dtype_mismatch": (
        "Offloaded and resident weights have different dtypes",
        "Pass the dtype when dispatching: `load_checkpoint_and_dispatch(..., dtype=torch.float16)`; a `.half()` on the "
        "empty model is undone for offloaded weights.",
        "GD202", "ground truth 14a/14b"),
    "generic_mismatch": (
        "Tensors on different devices meet in one op",
        "Move `{arg}` ({origin}) to {common} before this op, or create it there.",
        None, ""),
}


def _cause(cause_id: str, explanation: str, evidence: list[str], location: dict | None = None, **fmt) -> dict:
    """``location``: the line to change when it is not the line that failed (where a tensor or module was built)."""
    title, fix, rule, ref = CAUSES[cause_id]
    try:
        fix = fix.format(**fmt)
    except (KeyError, IndexError):
        fix = fix.replace("{{", "{").replace("}}", "}")
    return {"id": cause_id, "title": title, "explanation": explanation, "fix": fix, "rule": rule, "reference": ref,
            "evidence": evidence, "location": location}


def _where(location: dict | None, fallback: str = "where it is built") -> str:
    return f"{short_path(location['file'])}:{location['line']}" if location else fallback


# ---------------------------------------------------------------------------------------------
# phase, facts
# ---------------------------------------------------------------------------------------------

def detect_phase(exc: BaseException, probe: Probe, snapshot) -> str:
    frames = traceback_frames(exc.__traceback__)
    files = [f.replace(os.sep, "/") for f, _, _ in frames]
    if any("/torch/autograd/" in f for f in files) and any(fn in ("backward", "_engine_run_backward", "grad") for _, _, fn in frames):
        return "backward"
    if probe.in_step is not None or any("/torch/optim/" in f for f in files):
        return "optimizer_step"
    if snapshot is not None and snapshot.stack:
        if not snapshot.grad_enabled or not snapshot.training:
            return "evaluation"
        return "forward"
    if first_user_frame_from_traceback(exc.__traceback__) is not None:
        return "user_code"  # outside any module call: a loss, generate(), a metric written in the script
    return "unknown"


def param_devices(module: nn.Module) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in module.parameters():
        out[str(p.device)] = out.get(str(p.device), 0) + 1
    return out


def _hooks(module: nn.Module):
    hook = getattr(module, "_hf_hook", None)
    return getattr(hook, "hooks", None) or ([hook] if hook is not None else [])


def is_dispatched(model: nn.Module) -> bool:
    return bool(getattr(model, "hf_device_map", None)) or any(_hooks(m) for m in model.modules())


# ---------------------------------------------------------------------------------------------
# re-running the failing module under the device check
# ---------------------------------------------------------------------------------------------

def rerun_with_device_check(probe: Probe, snapshot):
    """Re-run the failing call under the device check; return (mismatch or None, mode).

    The outermost call is re-run first, so tensors made anywhere on the way (e.g. in the root's
    forward) get an origin; the innermost call is the fallback when that doesn't reproduce. Runs
    without grad and with a forked RNG. A failure here is swallowed: the user's error is what matters.
    """
    last_mode = None
    for depth in dict.fromkeys((0, len(snapshot.stack) - 1)):
        last_mode = ProvenanceCheckMode(probe.current_path)
        rerun_frame(probe, snapshot, depth, last_mode, DeviceMismatchDetected)
        if last_mode.mismatch is not None:
            return last_mode.mismatch, last_mode
    return None, last_mode


def rerun_frame(probe: Probe, snapshot, depth: int, mode, stop: type[BaseException], fake_fallback: bool = False) -> None:
    """Call ``snapshot.stack[depth]`` again under ``mode`` (no grad, forked RNG); ``stop`` is how the mode ends early.

    ``fake_fallback``: run on shape-only copies when the inputs hold data (an OOM must not allocate again).
    """
    frame = snapshot.stack[depth]
    fake_mode = _fake_mode_of(frame)
    if fake_mode is None and fake_fallback:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with contextlib.ExitStack() as stack:
            if fake_mode is not None:
                stack.enter_context(fake_mode)
            stack.enter_context(torch.no_grad())
            stack.enter_context(torch.random.fork_rng(devices=[]))
            stack.enter_context(mode)
            frame.module(*frame.args, **frame.kwargs)
    except stop:
        pass
    except Exception as exc:  # failing differently tells nothing about devices
        probe._record_error(f"diagnostic re-run of {frame.path or type(frame.module).__name__}", exc)


def _fake_mode_of(frame):
    from torch._subclasses.fake_tensor import FakeTensor

    candidates = list(frame.args) + list(frame.kwargs.values()) + list(frame.module.parameters())
    for value in candidates:
        if isinstance(value, FakeTensor):
            return value.fake_mode
    return None


# ---------------------------------------------------------------------------------------------
# main entry
# ---------------------------------------------------------------------------------------------

def diagnose_exception(exc: BaseException, probe: Probe) -> dict:
    message = str(exc)
    snapshot = probe.snapshot_for(exc)
    phase = detect_phase(exc, probe, snapshot)
    user_frame = first_user_frame_from_traceback(exc.__traceback__)
    failure: dict = {
        "exception": {"type": type(exc).__name__, "module": type(exc).__module__, "message": message},
        "phase": phase,
        "user_frame": user_frame,
        "module": None,
        "module_stack": [],
        "op": None,
        "tensors": [],
        "cause": None,
        "message_form": None,
        "kind": "other",
    }
    if snapshot is not None and snapshot.stack:
        inner = snapshot.stack[-1]
        failure["module"] = {"path": inner.path or "", "class": type(inner.module).__name__,
                             "root": type(snapshot.stack[0].module).__name__}
        failure["module_stack"] = [{"path": f.path, "class": type(f.module).__name__} for f in snapshot.stack]
    elif phase == "backward" and (path := probe.backward_module_path(exc)) is not None:
        failure["module"] = {"path": path, "class": _class_of_path(probe, path), "root": None}

    user_tbs = user_tracebacks(exc.__traceback__)
    oom = parse_oom_message(message) if isinstance(exc, (RuntimeError, MemoryError)) else None
    if oom is not None:
        from gpudoctor.trace.memory import diagnose_oom, find_dominant_tensor

        failure["kind"] = "oom"
        dominant = find_dominant_tensor(probe, snapshot, oom.requested, oom.total) if snapshot is not None and snapshot.stack else None
        failure["oom"] = diagnose_oom(oom, probe, phase, dominant=dominant, snapshot=snapshot)
        if dominant is not None:
            failure["cause"] = dominant_cause(failure["oom"], dominant)
        return failure

    mismatch = probe.device_mode.mismatch_for(exc) if probe.device_mode is not None else None
    if mismatch is None and isinstance(exc, DeviceMismatchDetected):
        mismatch = exc.mismatch
    info = parse_device_message(message)
    if info is None and mismatch is None:
        return failure
    failure["kind"] = info.kind if info else "device_mismatch"
    failure["message_form"] = info.to_dict() if info else None

    mode = probe.device_mode
    if mismatch is None and snapshot is not None and snapshot.stack and failure["kind"] == "device_mismatch":
        mismatch, mode = rerun_with_device_check(probe, snapshot)
    index = OriginIndex(probe, snapshot.stack if snapshot else (), mode)
    if mismatch is not None:
        failure["op"] = {"name": mismatch.op, "argument": mismatch.argument, "module": mismatch.module_path,
                         "common_device": mismatch.common_device, "offending_device": mismatch.offending_device}
        for arg in mismatch.tensors:
            origin = index.origin(arg.tensor)
            failure["tensors"].append({"argument": arg.argument, "device": arg.device, "dtype": arg.dtype, "shape": arg.shape,
                                       "origin": origin, "origin_text": describe(origin)})
        if mismatch.module_path is not None and failure["module"] is not None:
            failure["module"]["op_module"] = mismatch.module_path
    elif not (snapshot and snapshot.stack) and user_tbs:
        # outside any module call: the operands are in the user's own frame
        failure["tensors"] = user_operands(user_tbs[0])
    failure["cause"] = match_cause(failure, info, mismatch, probe, snapshot, index, user_tbs)
    return failure


def user_operands(tb) -> list[dict]:
    """Tensors the failing line of the user's frame reads (``logits``, ``batch['labels']``), with their devices."""
    frame, line = tb.tb_frame, tb.tb_lineno
    function = frame.f_code.co_name
    out = []
    for name in names_in_line(frame.f_code.co_filename, line):
        value = resolve_local(frame, name)
        items = [(name, value)] if isinstance(value, torch.Tensor) else (
            [(f"{name}[{k!r}]", v) for k, v in value.items() if isinstance(v, torch.Tensor)] if isinstance(value, dict) else [])
        for argument, tensor in items[:8]:
            origin = {"kind": "user_local", "name": argument, "function": function}
            out.append({"argument": argument, "device": str(tensor.device), "dtype": str(tensor.dtype).replace("torch.", ""),
                        "shape": list(tensor.shape), "origin": origin, "origin_text": describe(origin)})
    return out


def built_at(user_tbs, obj) -> tuple[str | None, dict | None]:
    """(local name, line that assigned it) for ``obj`` in the user's frames, innermost first: where to fix it."""
    first_name = None
    for tb in user_tbs:
        for name in local_names_of(tb.tb_frame, obj):
            first_name = first_name or name
            location = assignment_line(tb.tb_frame.f_code.co_filename, name, tb.tb_lineno)
            if location is not None:
                return name, location
    return first_name, None


def _class_of_path(probe: Probe, path: str) -> str:
    for root in probe.root_models():
        for name, module in root.named_modules():
            if name == path:
                return type(module).__name__
    return "?"


def match_cause(failure: dict, info, mismatch, probe: Probe, snapshot, index: OriginIndex, user_tbs=()) -> dict | None:
    roots = probe.root_models()
    kind = failure["kind"]
    inner = snapshot.stack[-1].module if snapshot and snapshot.stack else None

    if kind == "dataparallel" and inner is not None:
        wrapped = getattr(inner, "module", inner)
        devices = param_devices(wrapped)
        evidence = [f"{n} parameter tensor(s) on {d}" for d, n in devices.items()]
        if set(devices) == {"cpu"}:
            return _cause("dataparallel_model_on_cpu", "DataParallel needs the whole model on device_ids[0] before it replicates it.", evidence)
        dispatched = is_dispatched(wrapped)
        cause = _cause("dataparallel_split_model",
                       "DataParallel replicates one full copy per GPU from device_ids[0] on every forward; a model already "
                       "split over several devices" + (" by a device_map" if dispatched else "") + " can't be replicated.", evidence)
        if not dispatched:
            cause["rule"] = None
        return cause

    if kind == "optimizer_state" or failure["phase"] == "optimizer_step" or any(t["origin"].get("kind") == "optimizer_state" for t in failure["tensors"]):
        stale = optimizer_state_mismatches(probe, index)
        if stale:
            return _cause("optimizer_state_device", "The optimizer built its state (exp_avg, ...) while the parameters were "
                          "elsewhere; moving the model afterwards does not move the state.", stale[:6])

    if kind == "meta_tensor":
        form = (info.form if info else "")
        meta_trainable = [f"{n}" for m in roots for n, p in m.named_parameters() if p.requires_grad and p.device.type == "meta"]
        if form == "invalid_gradient_device" or (meta_trainable and failure["phase"] == "backward"):
            return _cause("trainable_offloaded", f"{len(meta_trainable)} trainable parameter(s) are on `meta` (offloaded): "
                          "autograd can't give them a gradient on a real device.", meta_trainable[:6])
        meta_inputs = []
        if snapshot and snapshot.stack:
            root_frame = snapshot.stack[0]
            for key, value in list(enumerate(root_frame.args)) + list(root_frame.kwargs.items()):
                if isinstance(value, torch.Tensor) and value.device.type == "meta":
                    meta_inputs.append(f"input `{key}` of {type(root_frame.module).__name__} is on meta")
        location = None
        if not meta_inputs and user_tbs:
            for t in failure["tensors"]:
                if t["device"] == "meta" and t["origin"].get("kind") == "user_local":
                    meta_inputs.append(f"`{t['argument']}` in your code is on meta")
                    tb = user_tbs[0]
                    location = location or assignment_line(tb.tb_frame.f_code.co_filename, t["argument"].split("[")[0], tb.tb_lineno)
        offloaded = any(_offload_hook(m) is not None for r in roots for m in r.modules())
        if meta_inputs:
            first = next((p for r in roots for p in r.parameters()), None)
            evidence = meta_inputs + ([f"model.device is {first.device} (its first parameter is an offloaded placeholder)"] if first is not None else [])
            return _cause("inputs_to_meta_device", "`model.device` is the device of the first parameter; with offload that is a "
                          "`meta` placeholder, so `.to(model.device)` made data-less inputs.", evidence, location)
        meta_params = [n for m in roots for n, p in m.named_parameters() if p.device.type == "meta"]
        if meta_params and not offloaded:
            return _cause("meta_weights_not_loaded", f"{len(meta_params)} parameter(s) are on meta and no accelerate hook loads them.",
                          meta_params[:6])
        if meta_trainable:
            return _cause("trainable_offloaded", "Trainable parameters are offloaded placeholders.", meta_trainable[:6])
        return None

    if kind == "dtype_mismatch":
        mixed = offload_dtype_evidence(roots)
        if mixed:
            return _cause("offload_dtype_mismatch", "Resident weights and the offloaded copies accelerate loads at each forward "
                          "have different dtypes, so one matmul mixes them.", mixed)
        return None

    if kind != "device_mismatch":
        return None

    tensors = failure["tensors"]
    common = mismatch.common_device if mismatch else (info.devices[0] if info and info.devices else "?")
    table = [f"{o['argument']}: {o['device']} — {o['origin_text']}" for o in tensors]

    for t in tensors:
        origin = t["origin"]
        if origin.get("kind") == "created_in_forward":
            others = [o for o in tensors if o is not t and o["device"] != t["device"]]
            other_arg = others[0]["argument"] if others else "x"
            loc = origin.get("location") or None
            op = origin.get("op", "aten.empty").split(".")[-1]
            return _cause("tensor_created_in_forward", f"`{t['argument']}` was made by {origin.get('op')} on {t['device']} "
                          f"inside {origin.get('module') or 'forward'}, while the other operand is on {others[0]['device'] if others else common}.",
                          table, loc, op=op, other=other_arg, where=_where(loc, "the line that creates it"))
    for t in tensors:
        origin = t["origin"]
        if origin.get("kind") == "attribute":
            name = origin["name"]
            module_path, _, attr = name.rpartition(".")
            owner = _module_at(roots, module_path)
            loc = attribute_assignment_line(type(owner), attr) if owner is not None else None
            return _cause("plain_tensor_attribute", f"{name} is a plain tensor attribute on {t['device']}; model.to() moved the "
                          "parameters and buffers but not it.", table, loc, attr=attr, module=module_path or "the module")
        if origin.get("kind") == "unregistered_parameter":
            path = origin["name"].rsplit(".", 1)[0]
            return _cause("submodule_in_python_list", f"{origin['name']} stays on {t['device']}: its module is not registered.",
                          table, _container_location(roots, path), path=path)
    if probe.unregistered and not tensors:
        path = next(iter(probe.unregistered.values()))
        return _cause("submodule_in_python_list", f"{path} is called from forward but isn't a registered submodule.", [path],
                      _container_location(roots, path), path=path)

    for root in roots:
        if not is_dispatched(root):
            continue
        split = split_block_evidence(root)
        if split:
            return _cause("split_no_split_module", "A residual block was cut between devices: its residual add / norm meets "
                          "tensors from both sides.", split[:6])
        moved = moved_after_dispatch_evidence(root)
        if moved:
            return _cause("moved_after_dispatch", "The hooks' execution devices no longer match where the weights are.", moved[:6])

    root_inputs = [t for t in tensors if t["origin"].get("kind") == "module_input" and t["origin"].get("depth") == 0]
    params = [t for t in tensors if t["origin"].get("kind") in ("parameter", "buffer")]
    root = snapshot.stack[0].module if snapshot and snapshot.stack else None
    if root_inputs and params and root is not None and any(r["device"] != p["device"] for r in root_inputs for p in params):
        left = _left_behind(root, params, root_inputs)
        if left is not None:
            return left_behind_cause(root, left, root_inputs, table, user_tbs)
        r = next((x for x in root_inputs if x["device"] != params[0]["device"]), root_inputs[0])
        return _batch_cause(r, params[0]["device"], table)

    for root_model in roots:
        devices = {d for d in param_devices(root_model) if d != "meta"}
        if len(devices) > 1 and not is_dispatched(root_model):
            groups = placement_groups(root_model)
            return _cause("manual_split_without_hooks", f"{type(root_model).__name__} has parameters on {', '.join(sorted(devices))} "
                          "and no accelerate hooks.", [f"{d}: {', '.join(g)}" for d, g in groups.items()])

    if root_inputs:
        return _batch_cause(root_inputs[0], common, table)
    locals_ = [t for t in tensors if t["origin"].get("kind") == "user_local"]
    if locals_ and len({t["device"] for t in locals_}) > 1:
        offending = info.devices[-1] if info and len(info.devices) > 1 else None
        if any(t["device"] not in ("cpu", "meta") for t in locals_):
            offending = "cpu" if any(t["device"] == "cpu" for t in locals_) else offending  # data goes to the accelerator
        bad = next((t for t in locals_ if t["device"] == offending), locals_[-1])
        other = next((t for t in locals_ if t["device"] != bad["device"] and t["dtype"].startswith(("float", "bfloat"))),
                     next(t for t in locals_ if t["device"] != bad["device"]))
        return _cause("user_code_mismatch", f"`{bad['argument']}` is on {bad['device']} and `{other['argument']}` on {other['device']} "
                      f"where your code combines them (no module call is involved: the line below is where they meet).", table,
                      arg=bad["argument"], other=other["argument"])
    if tensors:
        bad = next((t for t in tensors if t["argument"] == (mismatch.argument if mismatch else None)), tensors[-1])
        return _cause("generic_mismatch", "See the tensors above.", table, arg=bad["argument"], origin=bad["origin_text"], common=common)
    return None


def _batch_cause(r: dict, device: str, table: list[str]) -> dict:
    name = r["origin"]["name"]
    via = r["origin"].get("via")
    consumed = (f" The model turns `{name}` into a new tensor ({via}) inside forward, before any loss, so it must be on the "
                "model's device too.") if via else ""
    also = f"; `{name}` included: `{name} = {name}.to(model.device)`" if name not in ("input_ids", "args[0]") else ""
    return _cause("batch_not_moved", f"`{name}` reached {r['origin']['module']} on {r['device']}; the parameters it meets are on "
                  f"{device}.{consumed}", table, also=also)


def _left_behind(root: nn.Module, params: list[dict], root_inputs: list[dict]) -> str | None:
    """The device a whole module sits on when it, not its inputs, is in the wrong place: all of its parameters on the
    CPU while the inputs it is given already live on an accelerator. None when the inputs are the odd ones out."""
    devices = set(param_devices(root)) | {str(b.device) for b in root.buffers()}
    input_devices = {r["device"] for r in root_inputs}
    if devices == {"cpu"} and input_devices and "cpu" not in input_devices and "meta" not in input_devices:
        return "cpu"
    return None


def left_behind_cause(root: nn.Module, device: str, root_inputs: list[dict], table: list[str], user_tbs) -> dict:
    target = next(r["device"] for r in root_inputs if r["device"] != device)
    name, location = built_at(user_tbs, root)
    cls = type(root).__name__
    if cls.endswith("Loss"):
        return _cause("loss_weight_on_cpu", f"{cls}'s weight is a buffer on {device}; its inputs are on {target}. A loss module "
                      "is moved like a model (`.to()`), or its weight must be created on the device.", table, location,
                      name=name or "loss_fn", cls=f"nn.{cls}", device=_device_literal(target), where=_where(location))
    return _cause("model_not_moved", f"{cls}{f' (`{name}`)' if name else ''} has all its parameters on {device}, and is called "
                  f"with inputs on {target}: the model, not the batch, is in the wrong place.", table, location,
                  name=name or "model", device=_device_literal(target), where=_where(location))


def _device_literal(device: str) -> str:
    return f'"{device}"'


def _module_at(roots, path: str):
    for root in roots:
        if not path:
            return root
        for name, module in root.named_modules():
            if name == path:
                return module
    return None


def _container_location(roots, path: str) -> dict | None:
    """``blocks[0]`` / ``encoder.heads[1]``: where the plain list holding it is assigned."""
    parent_path, _, last = path.rpartition(".")
    attr = last.split("[", 1)[0]
    owner = _module_at(roots, parent_path)
    return attribute_assignment_line(type(owner), attr) if owner is not None else None


def dominant_cause(oom: dict, dominant: dict) -> dict:
    shape = "×".join(map(str, dominant["shape"]))
    where = dominant.get("code_location")
    at = f" at {short_path(where['file'])}:{where['line']}" if where else ""
    options = [o for o in oom["options"] if o.get("targets_dominant")][:3] or oom["options"][:2]
    fix = "; or ".join(f"{o['title']} — {o['detail']}" for o in options) or "Shrink that tensor (sequence length, micro-batch)."
    total = (oom.get("message_fields") or {}).get("total")
    share = f", {dominant['bytes'] / total:.0%} of the device" if total else ""
    return _cause("dominant_activation", f"The failing request ({dominant['bytes'] / 2**30:.2f} GiB{share}) is one tensor: {shape} "
                  f"{dominant['dtype']} made by {dominant['op']} in {dominant.get('module') or 'the model'}{at}. Shrinking that "
                  "tensor is what makes the step fit.",
                  [f"{dominant['op']} → {shape} {dominant['dtype']} ({dominant['bytes']:,} bytes)"], options=fix)


# ---------------------------------------------------------------------------------------------
# evidence helpers
# ---------------------------------------------------------------------------------------------

def optimizer_state_mismatches(probe: Probe, index: OriginIndex) -> list[str]:
    out = []
    for optimizer in list(probe.optimizers):
        for param, state in optimizer.state.items():
            name = (index.by_id.get(id(param)) or {}).get("name", f"param{tuple(param.shape)}")
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                if key == "step" and value.device.type == "cpu":
                    continue  # `step` may live on CPU by design
                if value.device != param.device:
                    out.append(f"{name}: parameter on {param.device}, state[{key!r}] on {value.device}")
    return out


def moved_after_dispatch_evidence(root: nn.Module) -> list[str]:
    out = []
    for path, module in root.named_modules():
        for hook in _hooks(module):
            execution = getattr(hook, "execution_device", None)
            if execution is None or getattr(hook, "offload", False):
                continue
            execution = torch.device(execution) if not isinstance(execution, torch.device) else execution
            for name, p in module.named_parameters(recurse=bool(getattr(hook, "place_submodules", False))):
                if p.device.type != "meta" and p.device != execution:
                    out.append(f"{path or type(root).__name__}: hook execution device {execution}, but {name} is on {p.device}")
                    break
    return out


def split_block_evidence(root: nn.Module) -> list[str]:
    no_split = set(getattr(root, "_no_split_modules", None) or [])
    for m in root.modules():
        no_split |= set(getattr(m, "_no_split_modules", None) or [])
    out = []
    for path, module in root.named_modules():
        if type(module).__name__ not in no_split:
            continue
        devices = {d for d in param_devices(module) if d != "meta"}
        if len(devices) > 1:
            placed = [f"{path}.{n}: {next(iter(param_devices(c)), '?')}" for n, c in module.named_children() if param_devices(c)]
            out.append(f"{path} ({type(module).__name__}, in _no_split_modules) spans {', '.join(sorted(devices))}: " + "; ".join(placed[:4]))
    return out


def offload_dtype_evidence(roots) -> list[str]:
    resident: set[str] = set()
    offloaded: set[str] = set()
    for root in roots:
        for p in root.parameters():
            if p.device.type != "meta" and p.is_floating_point():
                resident.add(str(p.dtype).replace("torch.", ""))
        seen = 0
        for path, module in root.named_modules():
            hook = _offload_hook(module)
            if hook is None or seen >= 4:
                continue
            weights_map = getattr(hook, "weights_map", None)
            for name, p in module.named_parameters(recurse=False):
                try:
                    value = weights_map[name]
                except Exception:
                    continue
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    offloaded.add(str(value.dtype).replace("torch.", ""))
                seen += 1
                break
    if offloaded and resident and offloaded != resident:
        return [f"resident weights: {', '.join(sorted(resident))}", f"offloaded weights (loaded at each forward): {', '.join(sorted(offloaded))}"]
    return []


def placement_groups(root: nn.Module) -> dict[str, list[str]]:
    """Shallowest modules whose parameters all sit on one device, per device (ranges compressed)."""
    groups: dict[str, list[str]] = {}

    def walk(path: str, module: nn.Module) -> None:
        devices = {str(p.device) for p in module.parameters()}
        if not devices:
            return
        if len(devices) == 1:
            groups.setdefault(next(iter(devices)), []).append(path or type(module).__name__)
            return
        direct = {str(p.device) for p in module.parameters(recurse=False)}
        for d in direct:
            groups.setdefault(d, []).append(f"{path or type(module).__name__} (own params)")
        for name, child in module.named_children():
            walk(f"{path}.{name}" if path else name, child)

    walk("", root)
    return {d: compress_paths(paths) for d, paths in groups.items()}


def compress_paths(paths: list[str]) -> list[str]:
    """["m.layers.0", "m.layers.1", "m.layers.2"] -> ["m.layers.0-2"]."""
    out: list[str] = []
    run_prefix, run_start, run_end = None, None, None

    def flush():
        if run_prefix is not None:
            out.append(f"{run_prefix}.{run_start}" if run_start == run_end else f"{run_prefix}.{run_start}-{run_end}")

    for path in paths:
        prefix, _, last = path.rpartition(".")
        if last.isdigit() and prefix:
            n = int(last)
            if prefix == run_prefix and n == run_end + 1:
                run_end = n
                continue
            flush()
            run_prefix, run_start, run_end = prefix, n, n
        else:
            flush()
            run_prefix = None
            out.append(path)
    flush()
    return out
