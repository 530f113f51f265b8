"""Storage lifetimes of simulated tensors, fed to the allocator model; stand-ins for data-dependent values.

A :class:`TorchDispatchMode` above ``FakeTensorMode`` sees every aten op. Each op output on a virtual
device whose storage is new (not a view, not written in place) is one ``malloc`` of the storage's
bytes; a ``weakref.finalize`` on the storage frees it when the last tensor on it dies, exactly when
CUDA's allocator would get the block back. ``untyped_storage().resize_(n)`` (FSDP2 frees its gathered
parameters so) frees the storage's block when ``n`` is 0, else allocates ``n`` bytes and frees the old block. A
tensor subclass that wraps others (a DTensor) holds the memory of what it wraps (its local shard), not of its
own logical shape.

Values a fake tensor cannot have (``.item()``, ``.tolist()``, ``bool(t)``, ``nonzero``, boolean
masks, ``unique``) get a documented stand-in instead of an error:

* a scalar read (``_local_scalar_dense``: ``.item()``, ``.tolist()``, ``bool``, ``int``, ``float``) of a
  tensor made from Python numbers (``torch.tensor(0.0)``, e.g. Adam's step count) is its real value (fake
  mode keeps such constants); any other is ``0`` (``False`` for booleans, ``0.0`` for floats), so a
  GradScaler never sees an inf and every optimizer step runs;
* an output whose size depends on the data (``nonzero``, ``masked_select``, ``unique``, boolean
  indexing) has the largest size the inputs allow: every element selected.

Every stand-in is counted, and the report says the run's numbers are not real.
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from gpudoctor.simulate.allocator import DeviceAllocator

aten = torch.ops.aten


class _Held:
    """The block a tracked storage holds now (None while it is resized to 0 bytes) on card ``index``."""

    __slots__ = ("index", "block", "category")

    def __init__(self, index: int, block):
        self.index = index
        self.block = block
        self.category = block.category


def _inner_tensors(tensor: torch.Tensor):
    names, _ = tensor.__tensor_flatten__()
    for name in names:
        inner = getattr(tensor, name)
        if isinstance(inner, torch.Tensor):
            yield inner


class DataDependent(RuntimeError):
    """A value the simulation cannot stand in for (the script needs real data here)."""


class AllocationTracker(TorchDispatchMode):
    def __init__(self, allocators: list[DeviceAllocator], backend: str, phase_of):
        super().__init__()
        self.allocators = allocators
        self.backend = backend
        self.phase_of = phase_of  # () -> (phase, default category)
        self.blocks: dict[int, _Held] = {}  # storage cdata -> what it holds
        self.stand_ins: Counter = Counter()
        # An exception raised inside the autograd engine on the virtual backend aborts the process (C++
        # terminate, torch 2.13; see session._run_held): an OOM or a hook's error during backward is held here and
        # raised when backward returns, which is also the line a real backward error points at in the user's code.
        self.in_backward = 0
        self.pending_error: BaseException | None = None

    # -- storages -----------------------------------------------------------------------------
    def track(self, tensor: torch.Tensor, category: str | None = None) -> None:
        device = tensor.device
        if device.type != self.backend:
            return
        if is_traceable_wrapper_subclass(tensor):
            # a DTensor (or another wrapper subclass) holds no memory of its own: what it wraps (a DTensor's local
            # shard) does, and that is what a card holds
            for inner in _inner_tensors(tensor):
                self.track(inner, category)
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.blocks:
            return
        phase, default = self.phase_of()
        block = self._malloc(device.index or 0, storage.nbytes(), category or default, phase)
        if block is None:
            return
        holder = _Held(device.index or 0, block)
        self.blocks[key] = holder
        weakref.finalize(storage, self._free, key, holder)

    def _malloc(self, index: int, nbytes: int, category: str, phase: str):
        """One allocation on card ``index``; None when this backward already failed (then nothing more is counted),
        or when it fails inside backward (the OOM is held, see ``pending_error``)."""
        if self.pending_error is not None:
            return None
        try:
            return self.allocators[index].malloc(nbytes, category, phase)
        except torch.OutOfMemoryError as exc:
            if not self.in_backward:
                raise
            self.pending_error = exc
            return None

    def resize(self, storage, nbytes: int) -> None:
        """``untyped_storage().resize_(nbytes)`` of a tracked storage, as ``resize_bytes_cuda`` does it: to 0 the
        block is freed (FSDP2 frees its unsharded parameters so); to more than 0 a new block of ``nbytes`` is
        allocated and then the old one freed (the data is copied across)."""
        holder = self.blocks.get(storage._cdata)
        if holder is None:
            return
        old = holder.block
        category = old.category if old is not None else holder.category
        if nbytes > 0:
            phase, _ = self.phase_of()
            holder.block = self._malloc(holder.index, nbytes, category, phase)
        else:
            holder.block = None
        holder.category = category
        if old is not None:
            self.allocators[holder.index].free_block(old)

    def _free(self, key: int, holder: "_Held") -> None:
        if self.blocks.get(key) is holder:
            del self.blocks[key]
        if holder.block is not None:
            self.allocators[holder.index].free_block(holder.block)
            holder.block = None

    def categorize(self, tensor: torch.Tensor, category: str) -> None:
        if tensor is None or tensor.device.type != self.backend:
            return
        if is_traceable_wrapper_subclass(tensor):
            for inner in _inner_tensors(tensor):
                self.categorize(inner, category)
            return
        holder = self.blocks.get(tensor.untyped_storage()._cdata)
        if holder is not None:
            holder.category = category
            if holder.block is not None:
                self.allocators[holder.index].recategorize(holder.block, category)

    # -- dispatch -----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        constant = None
        if func is aten._to_copy.default and args and getattr(args[0], "constant", None) is not None and \
                torch.device(kwargs.get("device") or args[0].device).type == self.backend:
            # fake mode computes ops on a constant (a tensor made from Python numbers) for real, and a real tensor
            # cannot go to the virtual backend: copy it without its constant (devices.DeviceTranslation does the
            # same for Tensor.to, but torch function modes are not active in backward, e.g. in a checkpoint's recompute)
            constant, args[0].constant = args[0].constant, None
        try:
            out = func(*args, **kwargs)
        except torch._subclasses.fake_tensor.DataDependentOutputException:
            if func is aten._local_scalar_dense.default:
                return self._scalar_stand_in(args[0])
            raise DataDependent(f"{func.overloadpacket.__name__} needs the tensor's values, which a simulated run does not have") from None
        except torch._subclasses.fake_tensor.DynamicOutputShapeException:
            out = self._shape_stand_in(func, args, kwargs)
        finally:
            if constant is not None:
                args[0].constant = constant
        for tensor in _tensors_in(out):
            self.track(tensor)
        return out

    def _scalar_stand_in(self, tensor: torch.Tensor):
        self.stand_ins["scalar read (.item(), .tolist(), bool(), int(), float())"] += 1
        if tensor.dtype == torch.bool:
            return False
        if tensor.dtype.is_floating_point:
            return 0.0
        if tensor.dtype.is_complex:
            return 0j
        return 0

    def _shape_stand_in(self, func, args, kwargs):
        name = func.overloadpacket.__name__
        x = args[0]
        if name == "nonzero":
            self.stand_ins["nonzero / boolean mask (every element selected)"] += 1
            return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
        if name == "masked_select":
            self.stand_ins["nonzero / boolean mask (every element selected)"] += 1
            shape = torch.broadcast_shapes(x.shape, args[1].shape)
            return torch.empty((int(torch.Size(shape).numel()),), dtype=x.dtype, device=x.device)
        if name in ("_unique2", "unique_dim", "unique_consecutive", "_unique"):
            self.stand_ins["unique (every element distinct)"] += 1
            values = torch.empty((x.numel(),), dtype=x.dtype, device=x.device)
            inverse = torch.empty(x.shape, dtype=torch.long, device=x.device)
            counts = torch.empty((x.numel(),), dtype=torch.long, device=x.device)
            return (values, inverse, counts) if name != "_unique" else (values, inverse)
        if name in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1:
            # boolean-mask indexing: every element selected, i.e. the same as full-length integer indices
            self.stand_ins["nonzero / boolean mask (every element selected)"] += 1
            indices = []
            for idx in args[1]:
                if idx is not None and idx.dtype in (torch.bool, torch.uint8):
                    indices.extend(torch.zeros((idx.numel(),), dtype=torch.long, device=idx.device) for _ in range(idx.dim()))
                else:
                    indices.append(idx)
            return func(x, indices, *args[2:], **kwargs)
        raise DataDependent(f"{name} needs the tensor's values, which a simulated run does not have")


def _tensors_in(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)
