"""``cuda`` as the script says it, ``gpu`` (PrivateUse1) as the simulation runs it, and back.

Fake tensors on real ``cuda`` devices abort a CPU build of torch, so every ``"cuda"``, ``"cuda:N"``,
``torch.device("cuda", N)`` and bare device index the script passes is rewritten to ``gpu:N`` on the way
in (:class:`DeviceTranslation`), and :func:`to_user` turns ``gpu`` back into ``cuda`` in what the user sees.
"""

from __future__ import annotations

import re
import weakref

import torch
from torch.overrides import TorchFunctionMode

BACKEND = "gpu"
_CUDA_RE = re.compile(r"^cuda(?::(\d+))?$")
_GPU_TEXT_RE = re.compile(r"\bgpu(:\d+)?\b")
_DEVICE_REPR_RE = re.compile(r"device\(type='gpu'")


class State:
    current = 0  # torch.cuda.set_device
    autocast: list = []  # stack of (enabled, dtype) for torch.autocast("cuda")
    # autocast's weight-cast cache, as torch keeps it: one per thread, shared by nested contexts, emptied when the
    # outermost context exits (torch.autocast.__exit__ -> clear_autocast_cache). The fp16 copies then live only as
    # long as the autograd graph that saved them, so they are freed by reference counting, never by the cyclic GC.
    autocast_cache: dict = {}

    @classmethod
    def reset(cls) -> None:
        """Back to a process that never simulated (``Simulation.close``)."""
        cls.current = 0
        cls.autocast.clear()
        cls.autocast_cache.clear()


import torch.nn.functional as F  # noqa: E402

# torch's autocast lists (aten/src/ATen/autocast_mode.cpp) for the ops training scripts hit: torch has no
# autocast kernels for a Python PrivateUse1 backend, so the casts are made here, above autograd, where
# real autocast makes them too (the low-precision copies are what backward saves).
_LOWER = {F.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.addbmm, torch.Tensor.__matmul__,
          torch.Tensor.matmul, torch.Tensor.mm, torch.Tensor.bmm, F.conv1d, F.conv2d, F.conv3d, F.scaled_dot_product_attention,
          torch.einsum, F.multi_head_attention_forward}
_FP32 = {F.softmax, F.log_softmax, F.cross_entropy, F.nll_loss, F.layer_norm, F.group_norm, F.mse_loss, F.l1_loss,
         F.binary_cross_entropy_with_logits, torch.Tensor.softmax, torch.Tensor.log_softmax, torch.softmax, torch.log_softmax,
         torch.exp, torch.log, torch.pow, torch.Tensor.pow, torch.rsqrt, torch.cumsum, torch.sum, torch.prod, torch.norm}


def _autocast_args(func, args, kwargs):
    enabled, dtype = State.autocast[-1]
    if not enabled:
        return args, kwargs
    target = dtype if func in _LOWER else torch.float32 if func in _FP32 else None
    if target is None:
        return args, kwargs
    einsum = func is torch.einsum
    return tuple(_autocast_cast(a, target, einsum) for a in args), {k: _autocast_cast(v, target, einsum) for k, v in kwargs.items()}


def _autocast_cast(value, target, einsum: bool):
    # A module-level function, not a closure over the cache: a nested function that calls itself is a reference
    # cycle (function -> cell -> function) that kept the cache, and every fp16 weight copy in it, alive until the
    # cyclic GC ran, so the simulated peaks depended on when Python happened to collect.
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != target and value.dtype != torch.float64:
        if target != torch.float32 and value.is_leaf and value.requires_grad:  # autocast caches weight casts
            key = (id(value), target)
            cached = State.autocast_cache.get(key)
            if cached is None or cached[0]() is not value:
                cached = State.autocast_cache[key] = (weakref.ref(value), value.to(target))
            return cached[1]
        return value.to(target)
    if isinstance(value, (list, tuple)) and einsum:
        return type(value)(_autocast_cast(v, target, einsum) for v in value)
    return value


def translate(device):
    """A device argument as the script wrote it -> the same on the virtual backend (others unchanged)."""
    if isinstance(device, str):
        match = _CUDA_RE.match(device.strip())
        if match:
            return f"{BACKEND}:{match.group(1) if match.group(1) is not None else State.current}"
        return device
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device(BACKEND, device.index if device.index is not None else State.current)
    return device


def index_of(device) -> int:
    """``torch.cuda.*(device)`` argument -> index."""
    if device is None:
        return State.current
    if isinstance(device, int):
        return device
    device = torch.device(translate(device)) if isinstance(device, str) else device
    return device.index if device.index is not None else State.current


def to_user(text: str) -> str:
    """``gpu:1`` -> ``cuda:1`` in a message the user will read."""
    text = _DEVICE_REPR_RE.sub("device(type='cuda'", text)
    return _GPU_TEXT_RE.sub(lambda m: "cuda" + (m.group(1) or ""), text)


_PRINTED_DEVICE_RE = re.compile(r"\bgpu:(\d+)\b")


def printed_to_user(text: str) -> str:
    """What the script prints: ``gpu:1`` (a device, its index given) and ``device(type='gpu'`` -> cuda; a bare
    word "gpu" in the script's own text is left alone."""
    if "gpu" not in text:
        return text
    return _PRINTED_DEVICE_RE.sub(r"cuda:\1", _DEVICE_REPR_RE.sub("device(type='cuda'", text))


class UserStream:
    """``sys.stdout``/``sys.stderr`` of a simulated run: ``print(tensor.device)``, ``print(model.device)``,
    f-strings and tensor reprs show ``cuda:N`` as on the real cards."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        if isinstance(text, str):
            self._stream.write(printed_to_user(text))
        else:
            self._stream.write(text)
        return len(text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _map_args(args):
    return tuple(translate(a) for a in args)


_TO_LIKE = {torch.Tensor.to, torch.Tensor.new_empty, torch.Tensor.new_zeros, torch.Tensor.new_ones,
            torch.Tensor.new_full, torch.Tensor.new_tensor}


class DeviceTranslation(TorchFunctionMode):
    """Rewrites device arguments of every torch call; ``Tensor.cuda()`` becomes ``.to(gpu:N)``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.device:  # torch.device("cuda") stays cuda (accelerate checks .type); uses translate it
            return func(*args, **kwargs)
        if "device" in kwargs:
            device = kwargs["device"]
            kwargs = dict(kwargs, device=f"{BACKEND}:{device}" if isinstance(device, int) and not isinstance(device, bool) else translate(device))
        if func is torch.Tensor.cuda:
            tensor, device = args[0], (args[1] if len(args) > 1 else kwargs.pop("device", None))
            kwargs.pop("device", None)
            return tensor.to(f"{BACKEND}:{index_of(device)}", **kwargs)
        if func is torch.Tensor.pin_memory or func is torch.Tensor.record_stream:
            return args[0] if func is torch.Tensor.pin_memory else None
        if func in _TO_LIKE and len(args) > 1 and isinstance(args[1], int) and not isinstance(args[1], bool) and func is torch.Tensor.to:
            args = (args[0], f"{BACKEND}:{args[1]}", *args[2:])
        else:
            args = _map_args(args)
        if State.autocast:
            args, kwargs = _autocast_args(func, args, kwargs)
        if func in (torch.tensor, torch.as_tensor, torch.asarray) and _is_virtual(kwargs.get("device")):
            # fake mode does not intercept data -> gpu tensors: build on cpu, then move
            device = kwargs.pop("device")
            return _move_constant(func(*args, **kwargs), device)
        if func is torch.Tensor.to and getattr(args[0], "constant", None) is not None:
            # fake mode runs ops on a constant (a tensor made from Python numbers) for real; a real
            # tensor cannot go to the virtual backend, so the copy is made without the constant
            constant, args[0].constant = args[0].constant, None
            try:
                return func(*args, **kwargs)
            finally:
                args[0].constant = constant
        return func(*args, **kwargs)


class Autocast:
    """``torch.autocast("cuda")`` in a simulation (entered by the patched ``torch.autocast``)."""

    @staticmethod
    def enter(enabled: bool, dtype) -> None:
        State.autocast.append((enabled, dtype or torch.float16))

    @staticmethod
    def exit() -> None:
        if State.autocast:
            State.autocast.pop()
        if not State.autocast:
            State.autocast_cache.clear()


def _move_constant(tensor, device):
    constant = getattr(tensor, "constant", None)
    if constant is None:
        return tensor.to(device)
    tensor.constant = None
    try:
        return tensor.to(device)
    finally:
        tensor.constant = constant


def _is_virtual(device) -> bool:
    if device is None:
        return False
    return torch.device(device).type == BACKEND
