"""Where each block of the model goes, with one rule: trained weights never leave an accelerator.

accelerate's ``infer_auto_device_map`` fills devices in order and spills whatever does not fit
to ``cpu``/``disk``, trained or not. Offloaded weights are ``meta`` placeholders streamed in for
each forward: they get no gradient, so a trained block there silently never learns, and LoRA
layers created on it fail at backward. ``plan_placement`` places the blocks that hold trainable
parameters first, on accelerators only, and lets only frozen blocks spill. It takes the memory
budgets as an argument, so it is tested with made-up budgets on a machine without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

OFFLOAD_DEVICES = ("cpu", "disk")


class PlacementError(RuntimeError):
    """The model cannot be placed without offloading a trained block."""


@dataclass(frozen=True)
class Block:
    name: str  # module path, a key of the device map ("model.layers.3")
    size: int  # bytes it needs where it lives
    trainable: bool  # holds a parameter that requires grad
    tied_to: str | None = None  # shares weights with this block, so must sit on the same device


@dataclass
class Placement:
    device_map: dict[str, int | str]  # what from_pretrained / dispatch_model take
    blocks: dict[str, int | str] = field(default_factory=dict)  # every block, in model order

    @property
    def devices(self) -> list[int | str]:
        return list(dict.fromkeys(self.blocks.values() or self.device_map.values()))

    @property
    def dispatched(self) -> bool:
        """Spread over several devices (or offloaded): accelerate hooks move the activations."""
        return len(self.devices) > 1

    @property
    def input_device(self) -> torch.device:
        """Where inputs go: the first accelerator used, never an offload device.

        With the first block offloaded, ``model.device`` reports ``meta``, so it cannot be used.
        """
        for device in self.devices:
            if device not in OFFLOAD_DEVICES:
                return torch_device(device)
        return torch.device("cpu")

    def describe(self) -> list[str]:
        """One line per run of consecutive blocks on the same device."""
        if all(d == "cpu" for d in self.devices):
            return ["no accelerator: every block on cpu (nothing offloaded, the CPU computes)"]
        lines, run = [], []
        items = list(self.blocks.items())
        for i, (name, device) in enumerate(items):
            run.append(name)
            if i + 1 == len(items) or items[i + 1][1] != device:
                span = run[0] if len(run) == 1 else f"{run[0]} … {run[-1]} ({len(run)} blocks)"
                where = f"{device} (offloaded, frozen)" if device in OFFLOAD_DEVICES else str(torch_device(device))
                lines.append(f"{span} → {where}")
                run = []
        return lines


def torch_device(device: int | str) -> torch.device:
    """A device-map value as a torch.device; an int is an index on the machine's accelerator type."""
    if isinstance(device, int):
        accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
        return torch.device(accelerator.type if accelerator else "cuda", device)
    return torch.device(device)


def model_blocks(model: torch.nn.Module, no_split: set[str] | list[str], frozen_dtype: torch.dtype) -> list[Block]:
    """Cut a model into the units a device map places: ``no_split`` classes (decoder layers) whole,
    other modules down to the ones that own tensors. Run it on a meta model with the LoRA layers
    already added, so ``trainable`` and the sizes are those of the run.

    Size: frozen weights in ``frozen_dtype``; each trainable parameter as fp32 weight, gradient and
    two AdamW moments (16 bytes), since that is what it costs while training.
    """
    no_split = set(no_split or ())
    blocks: list[Block] = []
    owner: dict[int, str] = {}  # tensor id -> first block holding it (finds tied weights)

    def visit(module: torch.nn.Module, name: str) -> None:
        children = list(module.named_children())
        owns_tensors = any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))
        if type(module).__name__ in no_split or not children or owns_tensors:
            add(module, name)
            return
        for child_name, child in children:
            visit(child, f"{name}.{child_name}" if name else child_name)

    def add(module: torch.nn.Module, name: str) -> None:
        size, trainable, tied_to = 0, False, None
        for _, p in module.named_parameters(remove_duplicate=False):
            if id(p) in owner:
                if owner[id(p)] != name:
                    tied_to = tied_to or owner[id(p)]
                continue
            owner[id(p)] = name
            trainable |= p.requires_grad
            size += p.numel() * (16 if p.requires_grad else frozen_dtype.itemsize)
        buffers = list(module.buffers())
        size += sum(b.numel() * b.element_size() for b in buffers)
        if size or tied_to or buffers:
            blocks.append(Block(name, size, trainable, tied_to))

    visit(model, "")
    return blocks


def plan_placement(blocks: list[Block], budgets: dict[int | str, int]) -> Placement:
    """Map blocks to devices within ``budgets`` (bytes per device; ints are accelerators, then
    optionally ``"cpu"`` and ``"disk"``, in the order given).

    1. Trainable blocks, in model order, fill the accelerators one after the other; if they do not
       fit, raise PlacementError rather than offload them.
    2. Frozen blocks join their neighbour's accelerator when there is room (fewer hops), else any
       accelerator with room, else ``cpu``, else ``disk``.
    Without accelerators everything goes to ``cpu``, which is then the compute device, not offload.
    """
    accelerators = [d for d in budgets if d not in OFFLOAD_DEVICES]
    total = sum(b.size for b in blocks)
    if not accelerators:
        if "cpu" in budgets and total > budgets["cpu"]:
            raise PlacementError(f"the model needs {_gib(total)} and the CPU has {_gib(budgets['cpu'])} free")
        return Placement({"": "cpu"}, {b.name: "cpu" for b in blocks})

    free = dict(budgets)
    where: dict[str, int | str] = {}

    def put(block: Block, device: int | str) -> None:
        where[block.name] = device
        free[device] -= block.size

    cursor = 0
    for block in blocks:
        if not block.trainable:
            continue
        while cursor < len(accelerators) and free[accelerators[cursor]] < block.size:
            cursor += 1
        if cursor == len(accelerators):
            need = sum(b.size for b in blocks if b.trainable)
            room = sum(budgets[d] for d in accelerators)
            raise PlacementError(
                f"{block.name} is trained but no accelerator has room for it: the trained blocks need "
                f"{_gib(need)} (weights, grads, AdamW state) and the accelerators offer {_gib(room)}. "
                "Offloaded weights never train; use fewer or smaller LoRA targets, a smaller or "
                "quantized model, more GPUs, or a lower memory reserve."
            )
        put(block, accelerators[cursor])

    for i, block in enumerate(blocks):
        if block.name in where:
            continue
        if block.tied_to is not None and block.tied_to in where:
            where[block.name] = where[block.tied_to]  # shares its weights: no extra memory
            continue
        neighbour = _neighbour_device(blocks, i, where, accelerators)
        others = sorted((d for d in accelerators if d != neighbour), key=lambda d: -free[d])
        candidates = ([neighbour] if neighbour is not None else []) + others + [d for d in OFFLOAD_DEVICES if d in budgets]
        device = next((d for d in candidates if d == "disk" or free[d] >= block.size), None)
        if device is None:
            raise PlacementError(f"{block.name} ({_gib(block.size)}) fits nowhere within the given budgets")
        put(block, device)

    ordered = {b.name: where[b.name] for b in blocks}
    devices = set(ordered.values())
    device_map = {"": devices.pop()} if len(devices) == 1 else ordered
    return Placement(device_map, ordered)


def _neighbour_device(blocks: list[Block], i: int, where: dict, accelerators: list) -> int | str | None:
    """The accelerator of the closest already placed block (previous first, then next)."""
    for j in [*range(i - 1, -1, -1), *range(i + 1, len(blocks))]:
        device = where.get(blocks[j].name)
        if device in accelerators:
            return device
    return None


def available_budgets(
    reserve: float = 0.2, only: torch.device | None = None, max_memory: dict | None = None
) -> dict[int | str, int]:
    """Free memory per device, minus ``reserve`` (a fraction) left for activations and the CUDA context.

    ``only``: one accelerator, for multi-process runs where each rank must hold a whole copy
    (a model spread over devices cannot be wrapped for distributed training).
    ``max_memory``: caps per device as in ``from_pretrained`` (``{0: "20GiB", "cpu": "60GiB"}``).
    """
    from accelerate.utils import get_max_memory

    memory = get_max_memory(max_memory)
    if only is not None and only.type != "cpu":
        index = only.index if only.index is not None else 0
        return {index: int(memory[index] * (1 - reserve))}
    return {device: int(free * (1 - reserve)) for device, free in memory.items()}


def check_trainable_resident(model: torch.nn.Module) -> None:
    """Fail loudly if a parameter that requires grad is an offloaded (``meta``) placeholder."""
    offloaded = [name for name, p in model.named_parameters() if p.requires_grad and p.device.type == "meta"]
    if offloaded:
        raise PlacementError(f"{len(offloaded)} trainable parameters are offloaded and would never train, e.g. {offloaded[0]}")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
