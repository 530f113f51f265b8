"""What an expression evaluates to: a kind (model, optimizer, ...) with traits and the value it wraps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import libcst as cst

TRAIT_DISPATCHED = "dispatched"  # placed by accelerate with hooks (hf_device_map), or may be
TRAIT_OFFLOADED = "offloaded"  # some weights live on cpu/disk as meta placeholders
TRAIT_QUANTIZED = "quantized"  # bitsandbytes 8/4-bit
TRAIT_EMPTY = "empty"  # created under init_empty_weights
TRAIT_CAST = "cast"  # .half()/.to(dtype) applied; detail: (dtype, node)
TRAIT_MOVED = "moved"  # .to(device)/.cuda() applied; detail: node
TRAIT_FP16 = "fp16"  # weights loaded or cast to float16
# .to(dtype=weight_dtype) where weight_dtype is float16 exactly when fp16 mixed precision is on (diffusers'
# ``if accelerator.mixed_precision == "fp16": weight_dtype = torch.float16``); detail: node
TRAIT_PRECISION_CAST = "precision_cast"
TRAIT_PEFT = "peft"  # wrapped by get_peft_model; detail: the call
# every parameter left with requires_grad=False: an adapter loaded for inference (PeftModel.from_pretrained without
# is_trainable=True), prepare_model_for_kbit_training applied to a model that already has its adapters; detail: the call
TRAIT_FROZEN = "frozen"
TRAIT_PREPARED = "prepared"  # returned by accelerator.prepare; detail: the prepare call


@dataclass
class DeviceMap:
    """What a ``device_map=`` argument says about placement."""

    strategy: str  # "auto" (auto/balanced/sequential/inferred) | "explicit" | "single" | "unknown"
    devices: frozenset = frozenset()
    node: Optional[cst.CSTNode] = None
    label: str = ""

    @property
    def explicit_offload(self) -> set[str]:
        return {d for d in self.devices if d in ("cpu", "disk")}

    @property
    def certainly_dispatched(self) -> bool:
        """More than one device, or disk: accelerate installs hooks and sets hf_device_map."""
        return self.strategy == "explicit" and (len(self.devices) > 1 or "disk" in self.devices)

    @property
    def maybe_dispatched(self) -> bool:
        return self.certainly_dispatched or self.strategy == "auto"


@dataclass
class Value:
    kind: str  # model | accelerator | optimizer | dataloader | scheduler | trainer | training_args |
    #            tokenizer | device_map | tensor | unknown
    node: Optional[cst.CSTNode] = None
    traits: dict[str, Any] = field(default_factory=dict)
    base: Optional["Value"] = None

    def carrier(self, name: str) -> Optional["Value"]:
        """The value in this wrapper chain (self, base, base's base...) that holds trait ``name``."""
        value: Optional[Value] = self
        while value is not None:
            if name in value.traits:
                return value
            value = value.base
        return None

    def trait(self, name: str) -> Any:
        carrier = self.carrier(name)
        return carrier.traits[name] if carrier is not None else None

    def has(self, name: str) -> bool:
        return self.trait(name) is not None

    def derive(self, node: cst.CSTNode, **traits: Any) -> "Value":
        return Value(self.kind, node, dict(traits), base=self)

    def frozen_by(self) -> Optional[cst.CSTNode]:
        """The call that left every parameter of this model frozen, when nothing in the chain above it adds
        trainable parameters again (``get_peft_model`` over a frozen model trains its new adapters)."""
        value: Optional[Value] = self
        while value is not None:
            if TRAIT_FROZEN in value.traits:
                return value.traits[TRAIT_FROZEN]
            if TRAIT_PEFT in value.traits:
                return None
            value = value.base
        return None

    def origin(self) -> "Value":
        value = self
        while value.base is not None:
            value = value.base
        return value


UNKNOWN = Value("unknown")

