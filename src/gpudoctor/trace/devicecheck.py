"""gpudoctor's own device check at aten-op level.

CPU kernels do not check ``meta`` inputs (``cpu @ meta`` returns garbage), and PyTorch's messages
never say where a tensor came from, so this mode checks every op's tensor arguments itself and
remembers where tensors created during the check were made.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from gpudoctor.trace.frames import first_user_frame_from_stack

# Ops whose job is to mix devices, or that take per-index lists checked by their own kernels.
_MIXING_ALLOWED = {
    "_to_copy", "copy_", "_copy_from", "_copy_from_and_resize", "to", "set_", "lift_fresh", "lift_fresh_copy",
    "detach", "alias", "_local_scalar_dense", "is_same_size", "_has_compatible_shallow_copy_type",
    "record_stream", "resize_", "_pin_memory", "is_pinned", "_assert_tensor_metadata", "copy",
}
_MIXING_PREFIXES = ("_foreach_", "_fused_", "_amp_")
# Advanced indexing accepts CPU index tensors with a tensor on any device.
_CPU_INDEX_OK = {"index", "index_put_", "index_put", "_index_put_impl_", "_unsafe_index", "_unsafe_index_put"}


@dataclass
class TensorArg:
    argument: str
    device: str
    dtype: str
    shape: list[int]
    tensor: object = field(repr=False, default=None)  # strong ref, dropped before serialisation


@dataclass
class OpMismatch:
    op: str
    argument: str
    common_device: str
    offending_device: str
    tensors: list[TensorArg]
    module_path: str | None
    user_frame: dict | None

    def message(self) -> str:
        return (f"Expected all tensors to be on the same device, but got {self.argument} is on {self.offending_device}, "
                f"different from other tensors on {self.common_device} (when checking argument in method {self.op})")


class DeviceMismatchDetected(RuntimeError):
    """Raised by the diagnostic re-run at the first op mixing devices (including meta inputs CPU kernels accept)."""

    def __init__(self, mismatch: OpMismatch):
        super().__init__(mismatch.message() + " [detected by gpudoctor's device check]")
        self.mismatch = mismatch


def _named_tensor_args(func, args, kwargs):
    schema_args = func._schema.arguments
    for index, value in enumerate(args):
        name = schema_args[index].name if index < len(schema_args) else f"arg{index}"
        yield from _expand(name, value)
    for name, value in kwargs.items():
        yield from _expand(name, value)


def _expand(name, value):
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if isinstance(item, torch.Tensor):
                yield f"{name}[{i}]", item


def find_mismatch(func, args, kwargs) -> tuple[str, str, str, list[tuple[str, torch.Tensor]]] | None:
    """(argument, offending device, common device, tensors) for an op that mixes devices, else None."""
    op = func._overloadpacket.__name__
    if op in _MIXING_ALLOWED or op.startswith(_MIXING_PREFIXES):
        return None
    tensors = list(_named_tensor_args(func, args, kwargs))
    if len(tensors) < 2:
        return None
    common = None
    for name, tensor in tensors:
        device = tensor.device
        if device.type == "cpu" and tensor.dim() == 0:
            continue  # CPU scalars mix with any device in real kernels
        if op in _CPU_INDEX_OK and device.type == "cpu" and name.startswith("indices"):
            continue
        if common is None:
            common = device
        elif device != common:
            return name, str(device), str(common), tensors
    return None


class DeviceCheckMode(TorchDispatchMode):
    """Checks devices of every op; records where tensors made under it come from.

    ``module_path`` is a callable giving the module running now. With ``raise_on_mismatch`` (the diagnostic
    re-run) the first mismatch stops the run; without it (``--deep`` around the user's program) the op runs
    as it would have: its own error, if any, propagates unchanged and :meth:`mismatch_for` links it to the
    mismatch; a mismatch the kernel accepted (``cpu @ meta``) is kept in ``accepted``.
    """

    def __init__(self, module_path=lambda: None, track_origins: bool = True, user_frames: bool = True,
                 raise_on_mismatch: bool = True):
        super().__init__()
        self.module_path = module_path
        self.track_origins = track_origins
        self.user_frames = user_frames
        self.raise_on_mismatch = raise_on_mismatch
        self.origins: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.mismatch: OpMismatch | None = None
        self.accepted: list[OpMismatch] = []  # ops that mixed devices and still ran (tensors dropped)
        self._failed: tuple[int, OpMismatch] | None = None  # (id of the op's own exception, its mismatch)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps __torch_dispatch__ in a dynamo-disabling wrapper by default; its two frames would then sit
        # in every traceback of an op failing under --deep, which a plain run does not show
        return False

    def mismatch_for(self, exc: BaseException) -> OpMismatch | None:
        """The mismatch of the op whose own error ``exc`` is (``--deep``)."""
        if self._failed is not None and self._failed[0] == id(exc):
            return self._failed[1]
        return exc.mismatch if isinstance(exc, DeviceMismatchDetected) else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        found = find_mismatch(func, args, kwargs)
        mismatch = None
        if found is not None:
            argument, offending, common, tensors = found
            mismatch = OpMismatch(
                op=f"aten.{func._overloadpacket.__name__}",
                argument=argument,
                common_device=common,
                offending_device=offending,
                tensors=[TensorArg(n, str(t.device), str(t.dtype).replace("torch.", ""), list(t.shape), t) for n, t in tensors],
                module_path=self.module_path(),
                user_frame=first_user_frame_from_stack(sys._getframe(1)) if self.user_frames else None,
            )
            if self.raise_on_mismatch:
                self.mismatch = mismatch
                raise DeviceMismatchDetected(mismatch)
        try:
            out = func(*args, **kwargs)
        except BaseException as exc:
            if mismatch is not None:
                self._failed = (id(exc), mismatch)
            _drop_dispatch_frames(exc, sys._getframe())
            raise  # bare: the program's traceback stays the one a plain run prints
        if mismatch is not None and len(self.accepted) < 20:
            self.accepted.append(OpMismatch(mismatch.op, mismatch.argument, mismatch.common_device, mismatch.offending_device,
                                            [TensorArg(a.argument, a.device, a.dtype, a.shape) for a in mismatch.tensors],
                                            mismatch.module_path, mismatch.user_frame))
        if self.track_origins:
            self._record(func, args, kwargs, out)
        return out

    def _record(self, func, args, kwargs, out) -> None:
        outputs = [out] if isinstance(out, torch.Tensor) else [o for o in out if isinstance(o, torch.Tensor)] if isinstance(out, (list, tuple)) else []
        if not outputs:
            return
        op = func._overloadpacket.__name__
        has_tensor_input = any(True for _ in _named_tensor_args(func, args, kwargs))
        if func.is_view or op in ("detach", "alias"):
            return  # views resolve through ``_base`` / their source
        if not has_tensor_input:
            origin = {"kind": "created_in_forward", "op": f"aten.{op}", "module": self.module_path(),
                      "location": first_user_frame_from_stack(sys._getframe(2)) if self.user_frames else None}
        elif op == "_to_copy" and _called_from_accelerate(sys._getframe(2)):
            origin = {"kind": "accelerate_hook", "op": "aten._to_copy", "module": self.module_path(), "location": None}
        elif op == "_to_copy":
            origin = {"kind": "moved", "op": "aten._to_copy", "module": self.module_path(),
                      "location": first_user_frame_from_stack(sys._getframe(2)) if self.user_frames else None}
        else:
            origin = {"kind": "computed", "op": f"aten.{op}", "module": self.module_path(), "location": None}
        for tensor in outputs:
            self.origins[tensor] = origin


def _called_from_accelerate(frame) -> bool:
    depth = 0
    while frame is not None and depth < 40:
        filename = frame.f_code.co_filename
        if "accelerate" in filename and ("hooks.py" in filename or "operations.py" in filename):
            return True
        frame = frame.f_back
        depth += 1
    return False




_DISPATCH_GLUE = os.path.join("torch", "_ops.py")


def _drop_dispatch_frames(exc: BaseException, frame) -> None:
    """Remove this mode's frame and, when only torch's op wrapper lies below it, that too: without the mode the
    op fails in C++ and a plain run's traceback ends at the caller's line."""
    tb = exc.__traceback__
    if tb is None or tb.tb_frame is not frame:
        return
    below = tb.tb_next
    while below is not None and below.tb_frame.f_code.co_filename.endswith(_DISPATCH_GLUE):
        below = below.tb_next
    exc.__traceback__ = tb.tb_next if below is not None else None
