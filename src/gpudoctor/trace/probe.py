"""The runtime probe: cheap bookkeeping while the user's program runs.

Default mode (what ``gpudoctor trace`` installs):

* ``nn.Module.__call__`` is wrapped: a stack of (module, args, kwargs) gives the module path of
  forward work, and the innermost call is remembered when an exception goes through it.
* Backward work is attributed like ``torch.utils.module_tracker.ModuleTracker``: a multi-grad hook
  on each module's outputs marks "backward entered this module", one on its inputs "left it".
* Global optimizer step hooks give the optimizer-step phase and the facts for silent problems.

Nothing checks devices per op here (that costs a Python call per aten op): when a device error
happens, :mod:`gpudoctor.trace.diagnose` re-runs the failing module under
:class:`~gpudoctor.trace.devicecheck.DeviceCheckMode`. ``deep=True`` keeps that mode on all along.

Every piece of bookkeeping is guarded: a failure inside the probe is recorded in ``probe_errors``
and never changes what the user's program does.
"""

from __future__ import annotations

import threading
import traceback
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook

from gpudoctor.trace.devicecheck import DeviceCheckMode

_ORIGINAL_CALL = nn.Module.__call__
_ACTIVE: "Probe | None" = None
_install_lock = threading.Lock()


@dataclass
class CallFrame:
    module: nn.Module
    path: str
    args: tuple
    kwargs: dict


@dataclass
class Snapshot:
    """State of the probe when an exception first went through a module call."""

    exc_id: int
    stack: list[CallFrame]
    grad_enabled: bool
    training: bool
    optimizer: object = None


def _tensors(value, depth: int = 0):
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 2 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item, depth + 1)
    elif depth < 2 and isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item, depth + 1)


def _on_first_grad(tensors: list, callback) -> None:
    """Call ``callback`` once, when the first of ``tensors`` receives its gradient.

    One tensor (the common case) takes a plain tensor hook: ``register_multi_grad_hook`` costs several
    times more per call and this runs on every module call of every step.
    """
    if len(tensors) == 1:
        def hook(grad):
            callback((grad,))  # returns None: the gradient is left unchanged

        tensors[0].register_hook(hook)
    else:
        register_multi_grad_hook(tensors, callback, mode="any")


def value_fingerprint(tensor: torch.Tensor) -> tuple[float, float] | None:
    """(sum, sum of squares) in float64: changes when any element changes (a whole-tensor reduction, so a
    sparse update of an embedding row counts too). None for data-less tensors (meta, fake)."""
    if tensor.device.type == "meta" or type(tensor).__name__ == "FakeTensor" or tensor.numel() == 0:
        return None
    try:
        with torch.no_grad():
            total = squares = None
            # In chunks: a float64 copy of a whole embedding matrix could itself run the GPU out of memory.
            for chunk in tensor.detach().reshape(-1).split(1 << 22):
                chunk = chunk.double()
                part, part_sq = chunk.sum(), chunk.square().sum()
                total = part if total is None else total + part
                squares = part_sq if squares is None else squares + part_sq
            return (total.item(), squares.item())
    except Exception:  # noqa: BLE001 - a tensor we cannot read is simply not fingerprinted
        return None


def _offload_hook(module: nn.Module):
    """accelerate's AlignDevicesHook on ``module`` if it offloads (weights live in a weights_map)."""
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", None) or ([hook] if hook is not None else [])
    for item in hooks:
        if getattr(item, "offload", False):
            return item
    return None


def _traced_call(module, *args, **kwargs):
    probe = _ACTIVE
    if probe is None or probe._busy:
        return _ORIGINAL_CALL(module, *args, **kwargs)
    frame = probe._enter(module, args, kwargs)
    try:
        result = _ORIGINAL_CALL(module, *args, **kwargs)
    except BaseException as exc:
        probe._on_exception(exc, frame)
        raise
    probe._exit(frame, args, result)
    return result


class Probe:
    """Watches models while code runs. Use :func:`gpudoctor.trace.api.watch` in user code."""

    def __init__(self, *models: nn.Module, deep: bool = False, track_backward: bool = True):
        self.deep = deep
        self.track_backward = track_backward
        self.names: dict[int, str] = {}
        self.roots: list[weakref.ref] = []
        self.unregistered: dict[int, str] = {}  # module id -> path of a module kept outside _modules
        self.stack: list[CallFrame] = []
        self.backward_stack: list[str] = []
        self.snapshot: Snapshot | None = None
        self.optimizers: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
        self.in_step = None
        self.steps = 0
        self.grads_seen: set[int] = set()
        self.frozen_with_grad: dict[int, str] = {}
        self.optimizer_param_ids: set[int] = set()
        # id -> (parameter, fingerprint when the optimizer first saw it with a gradient)
        self.first_values: dict[int, tuple] = {}
        self.offloaded_calls: dict[str, int] = {}
        self.meta_at_forward: dict[str, list[str]] = {}
        self.checked_modules: set[int] = set()
        self.forward_calls = 0
        self.probe_errors: list[str] = []
        self.device_mode: DeviceCheckMode | None = None
        self._handles: list = []
        self._busy = False
        self._installed = False
        for model in models:
            self.add_root(model)

    # -- installation -------------------------------------------------------------------------
    def install(self) -> "Probe":
        global _ACTIVE
        with _install_lock:
            if self._installed:
                return self
            if _ACTIVE is not None:
                raise RuntimeError("another gpudoctor probe is already active in this process")
            _ACTIVE = self
            nn.Module.__call__ = _traced_call
            from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

            self._handles = [register_optimizer_step_pre_hook(self._step_pre), register_optimizer_step_post_hook(self._step_post)]
            if self.deep:
                self.device_mode = DeviceCheckMode(self.current_path)
                self.device_mode.__enter__()
            self._installed = True
        return self

    def uninstall(self) -> None:
        global _ACTIVE
        with _install_lock:
            if not self._installed:
                return
            if self.device_mode is not None:
                try:
                    self.device_mode.__exit__(None, None, None)
                except Exception as exc:  # a mode stack popped out of order must not break the user's exit
                    self._record_error("leaving the device-check mode", exc)
            for handle in self._handles:
                handle.remove()
            self._handles = []
            if nn.Module.__call__ is _traced_call:
                nn.Module.__call__ = _ORIGINAL_CALL
            _ACTIVE = None
            self._installed = False

    @property
    def installed(self) -> bool:
        return self._installed

    # -- names --------------------------------------------------------------------------------
    def add_root(self, model: nn.Module) -> None:
        if any(ref() is model for ref in self.roots):
            return
        self.roots.append(weakref.ref(model))
        for path, sub in model.named_modules(remove_duplicate=False):
            self.names[id(sub)] = path
        self.unregistered.pop(id(model), None)

    def root_models(self) -> list[nn.Module]:
        models = [ref() for ref in self.roots]
        alive = [m for m in models if m is not None]
        # a root wrapped later by another root (PeftModel around the base) is reported once, as part of it
        inner = {id(sub) for m in alive for sub in list(m.modules())[1:]}
        return [m for m in alive if id(m) not in inner]

    def current_path(self) -> str | None:
        if self.stack:
            return self.stack[-1].path
        if self.backward_stack:
            return self.backward_stack[-1]
        return None

    def _name_new_module(self, module: nn.Module) -> str:
        if not self.stack:
            self.add_root(module)
            return ""
        parent = self.stack[-1]
        for key, child in parent.module._modules.items():
            if child is module:
                path = f"{parent.path}.{key}" if parent.path else key
                self.names[id(module)] = path
                return path
        # held outside ``_modules`` (a Python list or dict attribute): .to() and .parameters() miss it
        attr = _find_attribute(parent.module, module) or f"<{type(module).__name__}>"
        path = f"{parent.path}.{attr}" if parent.path else attr
        self.names[id(module)] = path
        self.unregistered[id(module)] = path
        return path

    # -- module calls -------------------------------------------------------------------------
    def _enter(self, module, args, kwargs) -> CallFrame | None:
        try:
            if not self.stack:
                self.backward_stack.clear()  # a new forward: stale backward state from a failed step is gone
            path = self.names.get(id(module))
            if path is None:
                path = self._name_new_module(module)
            frame = CallFrame(module, path, args, kwargs)
            self.stack.append(frame)
            self.forward_calls += 1
            if id(module) not in self.checked_modules:
                self._first_call_checks(module, path)
            if path in self.offloaded_calls:
                self.offloaded_calls[path] += 1
            if self.track_backward and torch.is_grad_enabled():
                inputs = [t for t in _tensors(args) if t.requires_grad]
                if inputs:
                    _on_first_grad(inputs, self._make_backward_leave(path))
            return frame
        except Exception as exc:
            self._record_error("module pre-call bookkeeping", exc)
            return None

    def _exit(self, frame: CallFrame | None, args, result) -> None:
        if frame is None:
            return
        try:
            if self.stack and self.stack[-1] is frame:
                self.stack.pop()
            if self.track_backward and torch.is_grad_enabled():
                outputs = [t for t in _tensors(result) if t.requires_grad]
                if outputs:
                    _on_first_grad(outputs, self._make_backward_enter(frame.path))
        except Exception as exc:
            self._record_error("module post-call bookkeeping", exc)

    def _make_backward_enter(self, path: str):
        def enter(_grads) -> None:
            self.backward_stack.append(path)
        return enter

    def _make_backward_leave(self, path: str):
        def leave(_grads) -> None:
            if path in self.backward_stack:
                while self.backward_stack and self.backward_stack.pop() != path:
                    pass
        return leave

    def _on_exception(self, exc: BaseException, frame: CallFrame | None) -> None:
        try:
            if self.snapshot is None or self.snapshot.exc_id != id(exc):
                # the innermost module call sees the exception first: that is where it happened
                root = self.stack[0].module if self.stack else None
                self.snapshot = Snapshot(
                    exc_id=id(exc),
                    stack=list(self.stack),
                    grad_enabled=torch.is_grad_enabled(),
                    training=bool(getattr(root, "training", True)),
                    optimizer=self.in_step,
                )
            if frame is not None and self.stack and self.stack[-1] is frame:
                self.stack.pop()
        except Exception as probe_exc:
            self._record_error("exception bookkeeping", probe_exc)

    def _first_call_checks(self, module: nn.Module, path: str) -> None:
        self.checked_modules.add(id(module))
        if _offload_hook(module) is not None:
            self.offloaded_calls[path] = 1
            return
        if any(_offload_hook(f.module) is not None for f in self.stack[:-1]):
            return  # an ancestor's hook loads these weights
        meta = [name for name, p in module._parameters.items() if p is not None and p.device.type == "meta"]
        meta += [name for name, b in module._buffers.items() if b is not None and b.device.type == "meta"]
        if meta:
            self.meta_at_forward[path] = meta

    # -- optimizer ----------------------------------------------------------------------------
    def _step_pre(self, optimizer, args, kwargs) -> None:
        try:
            self.in_step = optimizer
            self.optimizers.add(optimizer)
            self.steps += 1
            for group in optimizer.param_groups:
                for param in group["params"]:
                    pid = id(param)
                    self.optimizer_param_ids.add(pid)
                    if param.grad is not None:
                        self.grads_seen.add(pid)
                        if pid not in self.first_values and param.requires_grad:
                            fingerprint = value_fingerprint(param)
                            if fingerprint is not None:
                                self.first_values[pid] = (weakref.ref(param), fingerprint)
                        if not param.requires_grad and pid not in self.frozen_with_grad:
                            self.frozen_with_grad[pid] = ""
            self._observe_step(optimizer)
        except Exception as exc:
            self._record_error("optimizer step bookkeeping", exc)

    def _observe_step(self, optimizer) -> None:
        """Facts for silent problems, taken while the models are alive (a main() frees them before exit)."""
        from gpudoctor.trace.findings import observe_step

        observe_step(self, optimizer)

    def _step_post(self, optimizer, args, kwargs) -> None:
        self.in_step = None

    # -- misc -----------------------------------------------------------------------------------
    def _record_error(self, where: str, exc: BaseException) -> None:
        if len(self.probe_errors) < 20:
            self.probe_errors.append(f"{where}: {type(exc).__name__}: {exc} @ {traceback.format_exc(limit=2).splitlines()[-3:]}")

    def snapshot_for(self, exc: BaseException) -> Snapshot | None:
        if self.snapshot is not None and self.snapshot.exc_id == id(exc):
            return self.snapshot
        return None

    def __enter__(self) -> "Probe":
        return self.install()

    def __exit__(self, *exc_info) -> None:
        self.uninstall()


def _find_attribute(parent: nn.Module, module: nn.Module) -> str | None:
    for attr, value in vars(parent).items():
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if item is module:
                    return f"{attr}[{i}]"
        elif isinstance(value, dict):
            for key, item in value.items():
                if item is module:
                    return f"{attr}[{key!r}]"
        elif value is module:
            return attr
    return None
