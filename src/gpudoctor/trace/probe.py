"""The runtime probe: cheap bookkeeping while the user's program runs, the real work at failure.

Default mode (what ``gpudoctor trace`` installs when the program imports torch):

* ``nn.Module.__call__`` gets a thin wrapper: a counter and one set lookup per call. Only a module's
  first call (naming it, finding new root models, meta parameters, offload hooks) and calls of
  offloaded modules do more. When an exception leaves a module call, the wrapper notes the grad
  mode and optimizer step of that moment and removes its own frame from the traceback, so every
  traceback the program prints is the one Python would print.
* Where a forward failure happened is read *at failure* from the traceback: each
  ``Module._call_impl`` frame holds the module (``self``) and its ``args``/``kwargs``; paths come from
  the root model's ``named_modules()``. A backward failure is attributed from the autograd graph
  of the tensor ``backward()`` ran on. No per-call hooks, no shared call stack (threads are safe).
* Global optimizer step hooks give the optimizer-step phase and the facts for silent problems.

Nothing checks devices per op here (that costs a Python call per aten op): when a device error
happens, :mod:`gpudoctor.trace.diagnose` re-runs the failing module under
:class:`~gpudoctor.trace.devicecheck.DeviceCheckMode`. ``deep=True`` keeps that mode on all along;
it records the first mismatch and lets the op run, so the program fails (or not) exactly as without it.

Every piece of bookkeeping is guarded: a failure inside the probe is recorded in ``probe_errors``
and never changes what the user's program does.
"""

from __future__ import annotations

import re
import sys
import threading
import traceback
import types
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn

from gpudoctor.trace.devicecheck import DeviceCheckMode
from gpudoctor.trace.frames import drop_own_frame

_ORIGINAL_CALL = nn.Module.__call__
_CALL_IMPL_CODE = nn.Module._call_impl.__code__  # its frame holds (self, args, kwargs) of one module call
_ACTIVE: "Probe | None" = None
_install_lock = threading.Lock()
_RAISE_RECORDS = 16  # exceptions remembered per probe (a few threads failing at once)


@dataclass
class CallFrame:
    module: nn.Module
    path: str
    args: tuple
    kwargs: dict


@dataclass
class Snapshot:
    """State of the program when an exception left a module call; ``stack`` is read from its traceback."""

    exc_id: int
    stack: list[CallFrame]
    grad_enabled: bool
    training: bool
    optimizer: object = None


@dataclass
class _Raised:
    """What only the moment of the failure knows (grad mode, optimizer step): cheap, holds no tensors."""

    grad_enabled: bool
    optimizer: object


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
    if probe is not None:
        probe.forward_calls += 1
        if id(module) not in probe.settled:
            probe._call_bookkeeping(module)
    try:
        return _ORIGINAL_CALL(module, *args, **kwargs)
    except BaseException as exc:
        if probe is not None:
            probe._on_raise(exc)
        drop_own_frame(exc, sys._getframe())
        raise  # a bare raise adds no traceback entry: the program sees Python's own traceback


def module_call_frames(tb: types.TracebackType | None) -> list[tuple[nn.Module, tuple, dict]]:
    """(module, args, kwargs) of each module call a traceback went through, outermost first."""
    calls = []
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code is _CALL_IMPL_CODE:
            local = frame.f_locals
            module = local.get("self")
            if isinstance(module, nn.Module):
                calls.append((module, tuple(local.get("args") or ()), dict(local.get("kwargs") or {})))
        tb = tb.tb_next
    return calls


def live_module_calls(frame: types.FrameType | None, limit: int = 400):
    """Modules whose call is running on this thread's stack, innermost first (a generator: callers stop early)."""
    depth = 0
    while frame is not None and depth < limit:
        if frame.f_code is _CALL_IMPL_CODE:
            module = frame.f_locals.get("self")
            if isinstance(module, nn.Module):
                yield module
        frame = frame.f_back
        depth += 1


class Probe:
    """Watches models while code runs. Use :func:`gpudoctor.trace.api.watch` in user code."""

    def __init__(self, *models: nn.Module, deep: bool = False):
        self.deep = deep
        self.names: dict[int, str] = {}
        self.roots: list[weakref.ref] = []
        self.unregistered: dict[int, str] = {}  # module id -> path of a module kept outside _modules
        self.settled: set[int] = set()  # modules whose calls need no bookkeeping beyond the counter
        self.raised: dict[int, _Raised] = {}  # id(exception) -> the moment it left a module call
        self.optimizers: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
        self._step = threading.local()
        self.steps = 0
        self.grads_seen: set[int] = set()
        self.frozen_with_grad: dict[int, str] = {}
        self.optimizer_param_ids: set[int] = set()
        # id -> (parameter, fingerprint when the optimizer first saw it with a gradient)
        self.first_values: dict[int, tuple] = {}
        self.offloaded_calls: dict[str, int] = {}
        self._offloaded_ids: dict[int, str] = {}
        self.meta_at_forward: dict[str, list[str]] = {}
        self.forward_calls = 0
        self.probe_errors: list[str] = []
        self.device_mode: DeviceCheckMode | None = None
        self._handles: list = []
        self._installed = False
        self._lock = threading.RLock()  # first-call bookkeeping may run in several threads at once
        self._alive: dict[int, weakref.ref] = {}  # module id -> weak ref that forgets the id when the module is freed
        self._freed: list[int] = []
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
                self.device_mode = DeviceCheckMode(self.current_path, raise_on_mismatch=False)
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

    @property
    def in_step(self):
        """The optimizer whose ``step()`` this thread is running (left set when a step fails)."""
        return getattr(self._step, "optimizer", None)

    # -- names --------------------------------------------------------------------------------
    def add_root(self, model: nn.Module) -> None:
        with self._lock:
            self._purge_freed()
            if any(ref() is model for ref in self.roots):
                return
            self.roots.append(weakref.ref(model))
            for path, sub in model.named_modules(remove_duplicate=False):
                self.names[id(sub)] = path
                self._track(sub)
            self.unregistered.pop(id(model), None)

    def _track(self, module: nn.Module) -> None:
        """Forget what is known by a module's id once it is freed: a new model (a k-fold loop) may reuse the id."""
        key = id(module)
        if key not in self._alive:
            self._alive[key] = weakref.ref(module, lambda _ref, key=key: self._forget(key))

    def _forget(self, key: int) -> None:
        # runs inside garbage collection, maybe while a report iterates the dicts: only the set is changed now,
        # the dicts when the next new module is named (_purge_freed)
        self.settled.discard(key)
        self._freed.append(key)

    def _purge_freed(self) -> None:
        while self._freed:
            key = self._freed.pop()
            for known in (self._alive, self.names, self.unregistered, self._offloaded_ids):
                known.pop(key, None)

    def root_models(self) -> list[nn.Module]:
        models = [ref() for ref in self.roots]
        alive = [m for m in models if m is not None]
        # a root wrapped later by another root (PeftModel around the base) is reported once, as part of it
        inner = {id(sub) for m in alive for sub in list(m.modules())[1:]}
        return [m for m in alive if id(m) not in inner]

    def current_path(self) -> str | None:
        """Path of the innermost module running on this thread (walks the live frames: for failures and --deep)."""
        for module in live_module_calls(sys._getframe(1)):
            path = self.names.get(id(module))
            if path is not None:
                return path
        return None

    def path_of(self, module: nn.Module, parent: nn.Module | None) -> str:
        """The module's path, naming it now when it is new (a root when nothing encloses its call)."""
        path = self.names.get(id(module))
        if path is not None:
            return path
        with self._lock:
            if parent is None:
                self.add_root(module)
                return self.names.get(id(module), "")
            parent_path = self.path_of(parent, None) if id(parent) not in self.names else self.names[id(parent)]
            for key, child in parent._modules.items():
                if child is module:
                    path = f"{parent_path}.{key}" if parent_path else key
                    self.names[id(module)] = path
                    return path
            # held outside ``_modules`` (a Python list or dict attribute): .to() and .parameters() miss it
            attr = _find_attribute(parent, module) or f"<{type(module).__name__}>"
            path = f"{parent_path}.{attr}" if parent_path else attr
            self.names[id(module)] = path
            self.unregistered[id(module)] = path
            return path

    # -- module calls -------------------------------------------------------------------------
    def _call_bookkeeping(self, module: nn.Module) -> None:
        """A module's first call (and every call of an offloaded one): the only per-call work beyond a counter."""
        try:
            if self._freed:
                with self._lock:
                    self._purge_freed()
            offloaded = self._offloaded_ids.get(id(module))
            if offloaded is not None:
                self.offloaded_calls[offloaded] += 1
                return
            # the wrapper runs before this call's own _call_impl: every module call on the stack is an ancestor
            enclosing = list(live_module_calls(sys._getframe(2)))
            path = self.path_of(module, enclosing[0] if enclosing else None)
            self._track(module)
            self._first_call_checks(module, path, enclosing)
        except Exception as exc:
            self.settled.add(id(module))
            self._record_error("module first-call bookkeeping", exc)

    def _first_call_checks(self, module: nn.Module, path: str, enclosing: list[nn.Module]) -> None:
        if _offload_hook(module) is not None:
            self._offloaded_ids[id(module)] = path
            self.offloaded_calls[path] = 1
            return
        self.settled.add(id(module))
        if any(_offload_hook(m) is not None for m in enclosing):
            return  # an ancestor's hook loads these weights
        meta = [name for name, p in module._parameters.items() if p is not None and p.device.type == "meta"]
        meta += [name for name, b in module._buffers.items() if b is not None and b.device.type == "meta"]
        if meta:
            self.meta_at_forward[path] = meta

    def _on_raise(self, exc: BaseException) -> None:
        """The innermost module call an exception leaves sees it first: note that moment, once."""
        try:
            key = id(exc)
            if key not in self.raised:
                if len(self.raised) >= _RAISE_RECORDS:
                    self.raised.pop(next(iter(self.raised)), None)
                self.raised[key] = _Raised(torch.is_grad_enabled(), self.in_step)
        except Exception as probe_exc:
            self._record_error("exception bookkeeping", probe_exc)

    def snapshot_for(self, exc: BaseException) -> Snapshot | None:
        """The module calls ``exc`` went through (from its traceback) and the moment it was raised."""
        raised = self.raised.get(id(exc))
        calls = module_call_frames(exc.__traceback__)
        if raised is None or not calls:
            return None
        stack = []
        parent = None
        for module, args, kwargs in calls:
            stack.append(CallFrame(module, self.path_of(module, parent), args, kwargs))
            parent = module
        return Snapshot(exc_id=id(exc), stack=stack, grad_enabled=raised.grad_enabled,
                        training=bool(getattr(stack[0].module, "training", True)), optimizer=raised.optimizer)

    def backward_module_path(self, exc: BaseException) -> str | None:
        """Module of the parameter behind the autograd node a backward failure names (read from the graph at failure)."""
        try:
            return _backward_failure_path(self, exc)
        except Exception as probe_exc:
            self._record_error("backward attribution", probe_exc)
            return None

    # -- optimizer ----------------------------------------------------------------------------
    def _step_pre(self, optimizer, args, kwargs) -> None:
        try:
            self._step.optimizer = optimizer
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
        self._step.optimizer = None

    # -- misc -----------------------------------------------------------------------------------
    def _record_error(self, where: str, exc: BaseException) -> None:
        if len(self.probe_errors) < 20:
            self.probe_errors.append(f"{where}: {type(exc).__name__}: {exc} @ {traceback.format_exc(limit=2).splitlines()[-3:]}")

    def has_something_to_report(self) -> bool:
        return bool(self.forward_calls or self.steps or self.probe_errors)

    def __enter__(self) -> "Probe":
        return self.install()

    def __exit__(self, *exc_info) -> None:
        self.uninstall()


_INVALID_GRADIENT = re.compile(r"Function (\w+) returned an invalid gradient at index (\d+) - expected device (\S+)")


def _backward_failure_path(probe: Probe, exc: BaseException) -> str | None:
    """For "Function X returned an invalid gradient at index i - expected device D": find node X in the graph of
    the tensor ``backward()`` ran on, follow its input i down to a parameter on D, and name that parameter's module."""
    match = _INVALID_GRADIENT.search(str(exc))
    if match is None:
        return None
    node_name, index, expected = match.group(1), int(match.group(2)), match.group(3)
    roots = _backward_roots(exc.__traceback__)
    owners = {id(p): name for root in probe.root_models() for name, p in root.named_parameters(remove_duplicate=False)}
    seen: set[int] = set()
    queue = [t.grad_fn for t in roots if getattr(t, "grad_fn", None) is not None]
    while queue and len(seen) < 100_000:
        node = queue.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.name() == node_name and index < len(node.next_functions):
            param = _parameter_below(node.next_functions[index][0], expected)
            if param is not None and id(param) in owners:
                return owners[id(param)].rpartition(".")[0]
        queue.extend(next_node for next_node, _ in node.next_functions)
    return None


def _parameter_below(node, device: str, depth: int = 0):
    """A leaf tensor on ``device`` reached from ``node`` through at most a few graph nodes (views, casts)."""
    if node is None or depth > 4:
        return None
    variable = getattr(node, "variable", None)
    if variable is not None:
        return variable if str(variable.device) == device else None
    for next_node, _ in node.next_functions:
        found = _parameter_below(next_node, device, depth + 1)
        if found is not None:
            return found
    return None


def _backward_roots(tb: types.TracebackType | None) -> list:
    """The tensors a failing ``backward()`` / ``autograd.grad()`` started from (locals of the frames it went through)."""
    while tb is not None:
        local = tb.tb_frame.f_locals
        name = tb.tb_frame.f_code.co_name
        if name == "_engine_run_backward" and local.get("t_outputs") is not None:
            return [t for t in local["t_outputs"] if isinstance(t, torch.Tensor)]
        tb = tb.tb_next
    return []


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
