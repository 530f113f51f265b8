"""A simulated multi-GPU machine inside this process: :class:`Simulation`.

    from gpudoctor.simulate import Simulation
    with Simulation("2xT4") as sim:
        model = MyModel().cuda()          # fake weights on virtual cuda:0, counted by the allocator model
        model(x.cuda()).sum().backward()  # OOMs where a real T4 would
    sim.summary()                         # per-device peaks by phase and category

Entering it registers the virtual backend, turns on ``FakeTensorMode`` (every tensor made inside has a
shape, dtype and device but no data, CPU ones included), rewrites ``cuda`` device arguments, and replaces
the ``torch.cuda`` queries by answers about the named cards. Everything is undone on exit, except the
backend registration (process-global in torch).
"""

from __future__ import annotations

import contextlib
import functools
import types
import warnings
import weakref

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.function import BackwardCFunction

from gpudoctor.simulate import devices
from gpudoctor.simulate.allocator import DeviceAllocator
from gpudoctor.simulate.cards import Card, parse_spec
from gpudoctor.simulate.tracker import AllocationTracker


_ABSENT = object()  # an attribute the patched owner did not define itself

class SimulationStopped(SystemExit):
    """Raised after ``max_steps`` optimizer steps: a clean stop (exit code 0) the user's ``except Exception`` won't catch."""

    def __init__(self, steps: int):
        super().__init__(0)
        self.steps = steps


_ARCH_CAPABILITY = {"kepler": (3, 7), "pascal": (6, 0), "volta": (7, 0), "turing": (7, 5), "ampere": (8, 0), "ada": (8, 9),
                    "hopper": (9, 0), "generic": (8, 0)}


class Simulation:
    def __init__(self, cards: str | list[Card], max_steps: int | None = None):
        self.cards = parse_spec(cards) if isinstance(cards, str) else list(cards)
        self.spec = cards if isinstance(cards, str) else "+".join(c.name for c in self.cards)
        self.max_steps = max_steps
        self.allocators = [DeviceAllocator(i, c.total, c.context) for i, c in enumerate(self.cards)]
        self.phase = "load"
        self.forward_depth = 0
        self.optimizer_steps = 0
        self.stopped = False
        self.weights_source: list[str] = []
        self.notes: list[str] = []
        self.fake_mode: FakeTensorMode | None = None
        self.tracker: AllocationTracker | None = None
        self._stack = contextlib.ExitStack()
        self._saved: list[tuple[object, str, object]] = []
        self._hooked_params: dict[int, weakref.ref] = {}  # id -> param (tensors can't live in a WeakSet: == is elementwise)
        self.active = False

    # -- phases -----------------------------------------------------------------------------------
    def _phase_of(self):
        phase = self.phase
        if phase == "load":
            return phase, "weights"
        if phase in ("forward", "eval"):
            return phase, "activations"
        if phase == "backward":
            return phase, "temporaries"
        if phase == "optimizer_step":
            return phase, "optimizer_state"
        return phase, "other"

    def _forward_pre(self, module, args):
        if self.forward_depth == 0:
            self.phase = "forward" if torch.is_grad_enabled() and module.training else "eval"
            self._categorize_module(module)
        self.forward_depth += 1

    def _forward_post(self, module, args, output):
        self.forward_depth = max(self.forward_depth - 1, 0)
        if self.forward_depth == 0:
            self.phase = "between_steps"

    def _categorize_module(self, module: nn.Module) -> None:
        tracker = self.tracker
        for param in module.parameters():
            tracker.categorize(param, "weights")
            known = self._hooked_params.get(id(param))
            if param.requires_grad and (known is None or known() is not param):
                self._hooked_params[id(param)] = weakref.ref(param)
                param.register_post_accumulate_grad_hook(self._grad_ready)
        for buf in module.buffers():
            tracker.categorize(buf, "weights")

    def _grad_ready(self, param) -> None:
        self.tracker.categorize(param.grad, "gradients")

    def _step_pre(self, optimizer, args, kwargs):
        self.phase = "optimizer_step"

    def _step_post(self, optimizer, args, kwargs):
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self.tracker.categorize(value, "optimizer_state")
        self.phase = "between_steps"
        self.optimizer_steps += 1
        if self.max_steps is not None and self.optimizer_steps >= self.max_steps:
            self.stopped = True
            raise SimulationStopped(self.optimizer_steps)

    # -- install ----------------------------------------------------------------------------------
    def __enter__(self) -> "Simulation":
        from gpudoctor import virtual

        # the virtual backend is process-wide: give its device count back when the simulation ends
        self._stack.callback(setattr, virtual, "DEVICE_COUNT", virtual.DEVICE_COUNT)
        virtual.DEVICE_COUNT = len(self.cards)
        virtual.ensure_backend()
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._stack.enter_context(self.fake_mode)
        # backward on gpu:N>0 needs every autograd node on the calling thread (see gpudoctor.virtual)
        self._stack.enter_context(torch.autograd.set_multithreading_enabled(False))
        self.tracker = AllocationTracker(self.allocators, devices.BACKEND, self._phase_of)
        self._stack.enter_context(self.tracker)
        self._stack.enter_context(devices.DeviceTranslation())
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        for handle in (register_module_forward_pre_hook(self._forward_pre), register_module_forward_hook(self._forward_post),
                       register_optimizer_step_pre_hook(self._step_pre), register_optimizer_step_post_hook(self._step_post)):
            self._stack.callback(handle.remove)
        self._patch_torch()
        warnings_ctx = warnings.catch_warnings()
        self._stack.enter_context(warnings_ctx)
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")  # accelerate's tie checks
        # real CUDA params take the foreach optimizer path (its temporaries count); fake params must too
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.optim import optimizer as optimizer_module
        from torch.utils import _foreach_utils

        for supported in (optimizer_module._foreach_supported_types, _foreach_utils._foreach_supported_types):
            if FakeTensor not in supported:
                supported.append(FakeTensor)
                self._stack.callback(supported.remove, FakeTensor)
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if not self.active:
            return
        self.active = False
        for owner, name, value in reversed(self._saved):
            if value is _ABSENT:
                delattr(owner, name)  # it was inherited: the base class's attribute shows through again
            else:
                setattr(owner, name, value)
        self._saved.clear()
        self._stack.close()
        devices.State.reset()  # set_device and an autocast left open by an exception must not leak into the next run

    def _set(self, owner, name: str, value) -> None:
        # Save the raw attribute, not getattr's result: for a classmethod that is a method bound to this
        # class, and putting it back would make every subclass call it with the base class as ``cls``.
        saved = vars(owner).get(name, _ABSENT) if hasattr(owner, "__dict__") else getattr(owner, name)
        self._saved.append((owner, name, saved))
        setattr(owner, name, value)

    def _patch_torch(self) -> None:
        from gpudoctor.simulate import cuda_api

        for name, value in cuda_api.functions(self).items():
            self._set(torch.cuda, name, value)
            if hasattr(torch.cuda.memory, name):
                self._set(torch.cuda.memory, name, value)
        # torch.accelerator answers "gpu" (the backend) by itself; scripts and accelerate must see "cuda"
        if hasattr(torch, "accelerator"):
            self._set(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))
            self._set(torch.accelerator, "is_available", lambda: True)
            self._set(torch.accelerator, "device_count", lambda: len(self.cards))
        storage_resize = torch.UntypedStorage.resize_

        def resize_counted(storage, nbytes):  # FSDP2 frees and re-allocates its unsharded parameters so
            self.tracker.resize(storage, nbytes)  # first: an OOM leaves the storage as it was, as on a card
            return storage_resize(storage, nbytes)

        self._set(torch.UntypedStorage, "resize_", resize_counted)
        self._set(torch.Tensor, "is_cuda", property(lambda t: t.device.type in ("cuda", devices.BACKEND)))
        self._set(nn.Module, "_apply", _apply_replacing_fake)
        original_to, original_cuda = nn.Module.to, nn.Module.cuda

        def module_to(module, *args, **kwargs):
            if args and isinstance(args[0], int) and not isinstance(args[0], bool):
                args = (f"{devices.BACKEND}:{args[0]}", *args[1:])
            args = tuple(devices.translate(a) for a in args)
            if "device" in kwargs:
                kwargs["device"] = devices.translate(kwargs["device"])
            return original_to(module, *args, **kwargs)

        def module_cuda(module, device=None):
            return original_to(module, f"{devices.BACKEND}:{devices.index_of(device)}")

        self._set(torch.autograd, "backward", _engine_entry(torch.autograd.backward, self))
        self._set(torch.autograd, "grad", _engine_entry(torch.autograd.grad, self))
        self._set(nn.DataParallel, "forward", _data_parallel_forward)
        # the Python callbacks the autograd engine runs, held (see _run_held): tensor hooks; hooks on the nodes of
        # autograd.Functions, which is where module full backward hooks and pre-hooks go (BackwardHook registers them on
        # a BackwardHookFunction's node); module non-full backward hooks (a _WrappedHook on the output's node).
        # Not reachable from Python: a hook a script registers itself on a built-in node (``loss.grad_fn.register_hook``).
        for owner, name in ((torch.Tensor, "register_hook"), (torch.Tensor, "register_post_accumulate_grad_hook"),
                            (BackwardCFunction, "register_hook"), (BackwardCFunction, "register_prehook")):
            self._set(owner, name, _registers_held(getattr(owner, name), self))
        from torch.nn.modules.module import _WrappedHook

        wrapped_hook_call = _WrappedHook.__call__
        self._set(_WrappedHook, "__call__", lambda hook, *args, **kwargs: _run_held(self, wrapped_hook_call, hook, *args, **kwargs))
        self._set(nn.Module, "to", module_to)
        self._set(nn.Module, "cuda", module_cuda)
        autocast_cls = torch.amp.autocast_mode.autocast
        autocast_init, autocast_enter, autocast_exit = autocast_cls.__init__, autocast_cls.__enter__, autocast_cls.__exit__

        def autocast_init_translated(ac, device_type, dtype=None, enabled=True, cache_enabled=None):
            if device_type in ("cuda", devices.BACKEND):
                ac.device, ac.fast_dtype, ac._enabled, ac._simulated = devices.BACKEND, dtype or torch.float16, enabled, True
                ac._cache_enabled = cache_enabled
                return
            autocast_init(ac, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

        def autocast_enter_translated(ac):
            if getattr(ac, "_simulated", False):
                devices.Autocast.enter(ac._enabled, ac.fast_dtype)
                return ac
            return autocast_enter(ac)

        def autocast_exit_translated(ac, *exc):
            if getattr(ac, "_simulated", False):
                devices.Autocast.exit()
                return False
            return autocast_exit(ac, *exc)

        self._set(autocast_cls, "__init__", autocast_init_translated)
        self._set(autocast_cls, "__enter__", autocast_enter_translated)
        self._set(autocast_cls, "__exit__", autocast_exit_translated)
        scaler_init = torch.amp.grad_scaler.GradScaler.__init__

        def scaler_init_translated(scaler, device="cuda", *args, **kwargs):
            scaler_init(scaler, devices.BACKEND if device == "cuda" else device, *args, **kwargs)

        self._set(torch.amp.grad_scaler.GradScaler, "__init__", scaler_init_translated)
        self._set(torch.cuda.amp.GradScaler, "__init__", lambda scaler, *a, **k: scaler_init_translated(scaler, "cuda", *a, **k))
        self._set(torch.cuda.amp, "autocast", _cuda_autocast)

    # -- results ------------------------------------------------------------------------------------
    def summary(self) -> dict:
        devices_out = []
        for card, allocator in zip(self.cards, self.allocators):
            row = allocator.summary()
            row["card"] = card.name
            devices_out.append(row)
        fullest = max(devices_out, key=lambda d: d["peak_reserved"] / max(d["total"] - d["cuda_context"], 1)) if devices_out else None
        return {
            "simulated": True,
            "spec": self.spec,
            "cards": [c.name for c in self.cards],
            "optimizer_steps": self.optimizer_steps,
            "stopped_after_steps": self.stopped,
            "devices": devices_out,
            "fullest_device": fullest["device"] if fullest else None,
            "left_on_fullest": fullest["free_at_peak"] if fullest else None,
            "stand_ins": dict(self.tracker.stand_ins) if self.tracker else {},
            "weights": list(self.weights_source),
            "notes": list(self.notes),
        }


def _data_parallel_forward(dp, *inputs, **kwargs):
    """``nn.DataParallel.forward`` on simulated cards: its replicas are modelled by their memory.

    A real forward broadcasts every parameter and buffer of the module to each other device in
    ``device_ids`` (``replicate``); the copies live until backward has run. Here each copy is allocated on
    its device and held until the next forward (so they also count during the optimizer step, where the
    real ones are already freed). The forward itself runs the whole batch on the source device: its
    activations on cuda:0 are an upper bound (a real run scatters the batch, 1/N per card, and gathers the
    outputs on cuda:0)."""
    ids = list(dp.device_ids or [])
    if len(ids) <= 1:
        return dp.module(*inputs, **kwargs)
    source = devices.translate(f"cuda:{ids[0]}")
    tensors = list(dp.module.parameters()) + list(dp.module.buffers())
    for t in tensors:
        if t.device != torch.device(source):
            raise RuntimeError(f"module must have its parameters and buffers on device cuda:{ids[0]} "
                               f"(device_ids[0]) but found one of them on device: {devices.to_user(str(t.device))}")
    dp._gpudoctor_replicas = None  # the previous forward's copies are freed before the new broadcast
    with torch.no_grad():
        dp._gpudoctor_replicas = [torch.empty_like(t, device=devices.translate(f"cuda:{d}")) for d in ids[1:] for t in tensors]
    inputs = tuple(devices.translate(a) if not isinstance(a, torch.Tensor) else a.to(source) for a in inputs)
    kwargs = {k: (v.to(source) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    return dp.module(*inputs, **kwargs)


def _engine_entry(run, sim):
    """``torch.autograd.backward`` / ``grad`` on simulated cards: the phase is "backward", and an exception held
    during it (an OOM, an error in a hook: see :func:`_run_held`) is raised when it returns, at the user's
    ``backward()`` line, which is where a real GPU raises it."""

    def entry(*args, **kwargs):
        tracker = sim.tracker
        tracker.in_backward += 1
        sim.phase = "backward"
        try:
            result = run(*args, **kwargs)
        except BaseException:
            outermost = tracker.in_backward == 1
            if outermost and tracker.pending_error is not None:  # what made the engine fail afterwards is secondary
                error, tracker.pending_error = tracker.pending_error, None
                raise error from None
            raise
        finally:
            tracker.in_backward -= 1
            if not tracker.in_backward:
                sim.phase = "between_steps"
        if not tracker.in_backward and tracker.pending_error is not None:
            error, tracker.pending_error = tracker.pending_error, None
            raise error
        return result

    return entry


def _run_held(sim, hook, *args, **kwargs):
    """Call a hook the autograd engine runs. On the virtual backend a Python exception raised into the engine from
    a hook is lost: torch (2.13) throws it without saving Python's error state, and the device guard's Python
    callback that runs while the C++ exception unwinds clears it, so the process aborts (C++ terminate) or backward
    fails with a SystemError. So inside backward the exception is held, the hook returns None, and the exception is
    raised when backward returns (:func:`_engine_entry`), as on a real GPU. Once one is held the rest of that
    backward is not counted (the tracker stops) and no later hook runs: a real backward stopped at the error."""
    tracker = sim.tracker
    if tracker is None or not tracker.in_backward:
        return hook(*args, **kwargs)
    if tracker.pending_error is not None:
        return None
    try:
        return hook(*args, **kwargs)
    except BaseException as exc:
        tracker.pending_error = exc
        return None


def _registers_held(register, sim):
    """``register(tensor_or_node, hook)`` whose hook runs through :func:`_run_held`."""

    def register_held(owner, hook):
        return register(owner, functools.wraps(hook)(lambda *args: _run_held(sim, hook, *args)))

    return register_held


def _cuda_autocast(enabled=True, dtype=torch.float16, cache_enabled=True):
    return torch.autocast(devices.BACKEND, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


def _apply_replacing_fake(self, fn, recurse=True):
    """``Module._apply`` for fake parameters: torch's swap path fails on them, so parameters are replaced
    by new ``Parameter`` objects (what torch does for real ones that change device), keeping shared
    (tied) parameters shared."""
    memo = _APPLY_MEMO.memo
    outer = memo is None
    if outer:
        memo = _APPLY_MEMO.memo = {}
    try:
        if recurse:
            for module in self.children():
                module._apply(fn)
        for key, param in list(self._parameters.items()):
            if param is None:
                continue
            if id(param) in memo:
                self._parameters[key] = memo[id(param)]
                continue
            with torch.no_grad():
                applied = fn(param)
            if applied is param:
                memo[id(param)] = param
                continue
            new = nn.Parameter(applied, requires_grad=param.requires_grad)
            for attr, value in vars(param).items():
                if attr not in vars(new):  # keep user/library attributes, not the fake tensor's own
                    setattr(new, attr, value)
            if param.grad is not None:
                with torch.no_grad():
                    new.grad = fn(param.grad)
            memo[id(param)] = new
            self._parameters[key] = new
        for key, buf in list(self._buffers.items()):
            if buf is not None:
                self._buffers[key] = memo.setdefault(id(buf), fn(buf))
        return self
    finally:
        if outer:
            _APPLY_MEMO.memo = None


_APPLY_MEMO = types.SimpleNamespace(memo=None)
