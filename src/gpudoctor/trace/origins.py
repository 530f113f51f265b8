"""Where a tensor came from: parameter, buffer, plain attribute, module input, optimizer state, ..."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from gpudoctor.trace.devicecheck import DeviceCheckMode, _named_tensor_args
from gpudoctor.trace.frames import short_path

# what a computed tensor is traced back to: data the user handed in (a product of the weights is the model's own)
_SOURCES = ("module_input", "user_local")
_WEIGHTS = ("parameter", "buffer", "attribute", "unregistered_parameter", "optimizer_state")


class ProvenanceCheckMode(DeviceCheckMode):
    """DeviceCheckMode for the diagnostic re-run that also remembers the tensor inputs of each op, so a tensor the
    model computed (T5's ``decoder_input_ids`` from ``labels``) is followed back to what the user passed in."""

    def __init__(self, module_path=lambda: None):
        super().__init__(module_path)
        self.inputs: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def _record(self, func, args, kwargs, out) -> None:
        outputs = [out] if isinstance(out, torch.Tensor) else [o for o in out if isinstance(o, torch.Tensor)] if isinstance(out, (list, tuple)) else []
        if func._schema.is_mutable and outputs and all(o in self.origins for o in outputs):
            return  # an in-place op (masked_fill_) keeps the tensor's first origin
        super()._record(func, args, kwargs, out)
        if func.is_view:
            return
        sources = [t for _, t in _named_tensor_args(func, args, kwargs)]
        for tensor in outputs:
            if tensor in self.origins:
                self.inputs[tensor] = [t for t in sources if t is not tensor]


class OriginIndex:
    """Built once per diagnosis from the probe's root models, optimizers and call stack."""

    def __init__(self, probe, stack=(), device_mode=None):
        self.by_id: dict[int, dict] = {}
        self.device_mode = device_mode
        # keep the tensors alive while the index exists so ids stay unique
        self._keep: list = []
        for root in probe.root_models():
            root_name = type(root).__name__
            for name, param in root.named_parameters(remove_duplicate=False):
                self._add(param, {"kind": "parameter", "name": name, "model": root_name})
            for name, buf in root.named_buffers(remove_duplicate=False):
                self._add(buf, {"kind": "buffer", "name": name, "model": root_name})
            for path, module in root.named_modules():
                for attr, value in vars(module).items():
                    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and attr not in ("_parameters", "_buffers"):
                        full = f"{path}.{attr}" if path else attr
                        self._add(value, {"kind": "attribute", "name": full, "model": root_name,
                                          "note": "plain tensor attribute: Module.to() and state_dict() don't see it"}, overwrite=False)
        for module_id, path in probe.unregistered.items():
            module = _find_module(stack, module_id)
            if module is not None:
                for name, param in module.named_parameters():
                    self._add(param, {"kind": "unregistered_parameter", "name": f"{path}.{name}",
                                      "note": "submodule held in a Python container, not registered: model.to() skips it"})
        for optimizer in list(probe.optimizers):
            names = {id(p): o["name"] for p, o in ((p, self.by_id.get(id(p))) for g in optimizer.param_groups for p in g["params"]) if o}
            for param, state in optimizer.state.items():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        owner = names.get(id(param), "a parameter")
                        self._add(value, {"kind": "optimizer_state", "name": f"{type(optimizer).__name__}.state[{owner}][{key!r}]",
                                          "param": owner})
        # module inputs, outermost first so the user's batch is named at the call they made
        for depth, frame in enumerate(stack):
            where = frame.path or type(frame.module).__name__
            for i, value in enumerate(frame.args):
                self._add_input(value, f"args[{i}]", where, depth)
            for key, value in frame.kwargs.items():
                self._add_input(value, key, where, depth)

    def _add(self, tensor, origin: dict, overwrite: bool = True) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        if overwrite or id(tensor) not in self.by_id:
            self.by_id[id(tensor)] = origin
            self._keep.append(tensor)

    def _add_input(self, value, argument: str, where: str, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            if id(value) not in self.by_id:
                self._add(value, {"kind": "module_input", "name": argument, "module": where, "depth": depth})
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                self._add_input(item, f"{argument}[{i}]", where, depth)
        elif isinstance(value, dict):
            for key, item in value.items():
                self._add_input(item, f"{argument}[{key!r}]", where, depth)

    def origin(self, tensor: torch.Tensor, _depth: int = 0) -> dict:
        found = self.by_id.get(id(tensor))
        if found is not None:
            return dict(found)
        base = getattr(tensor, "_base", None)
        if base is not None and _depth < 4:
            inner = self.origin(base, _depth + 1)
            if inner["kind"] != "unknown":
                inner["view"] = True
                return inner
        if self.device_mode is not None:
            made = self.device_mode.origins.get(tensor)
            if made is not None:
                source = self._source(tensor, _depth) if made.get("kind") in ("computed", "moved") else None
                if source is not None:
                    return dict(source, via=made.get("op"), via_module=made.get("module"))
                return dict(made)
        return {"kind": "unknown"}

    def _source(self, tensor, depth: int) -> dict | None:
        """What a computed tensor was made from: its inputs on the same device first (device follows data)."""
        inputs = getattr(self.device_mode, "inputs", None)
        if inputs is None or depth >= 8:
            return None
        candidates = sorted(inputs.get(tensor) or [], key=lambda t: t.device != tensor.device)
        found = [self.origin(c, depth + 1) for c in candidates if not (c.device != tensor.device and c.dim() == 0)]
        if any(f.get("kind") in _WEIGHTS for f in found):
            return None  # hidden states, logits: computed with the weights, not a reshaped input
        return next((f for f in found if f.get("kind") in _SOURCES), None)


def _find_module(stack, module_id):
    for frame in stack:
        for module in frame.module.modules():
            if id(module) == module_id:
                return module
        for value in vars(frame.module).values():
            if isinstance(value, (list, tuple, dict)):
                items = value.values() if isinstance(value, dict) else value
                for item in items:
                    if id(item) == module_id:
                        return item
    return None


def describe(origin: dict) -> str:
    kind = origin.get("kind")
    view = " (a view of it)" if origin.get("view") else ""
    if kind == "parameter":
        return f"parameter {origin['name']}{view}"
    if kind == "buffer":
        return f"buffer {origin['name']}{view}"
    if kind == "attribute":
        return f"plain tensor attribute {origin['name']} (not a registered buffer){view}"
    if kind == "unregistered_parameter":
        return f"parameter {origin['name']} of a submodule kept in a Python container{view}"
    if kind == "optimizer_state":
        return f"optimizer state {origin['name']}{view}"
    if kind == "module_input":
        via = f", turned into a new tensor by {origin['via']} inside the model" if origin.get("via") else ""
        return f"input `{origin['name']}` of {origin['module']}{view}{via}"
    if kind == "user_local":
        return f"`{origin['name']}` in your code ({origin.get('function')}())"
    if kind == "created_in_forward":
        loc = origin.get("location")
        at = f" at {short_path(loc['file'])}:{loc['line']}" if loc else ""
        return f"created in forward by {origin['op']}{at}"
    if kind == "accelerate_hook":
        return f"moved by accelerate's AlignDevicesHook in {origin.get('module')}"
    if kind == "moved":
        loc = origin.get("location")
        return f"copied with .to() in {origin.get('module')}" + (f" at {short_path(loc['file'])}:{loc['line']}" if loc else "")
    if kind == "computed":
        return f"computed by {origin['op']} in {origin.get('module') or 'the model'}"
    return "unknown origin"
