"""What a file says, collected in one walk: imports, bindings, calls in context, and values.

Rules ask questions here instead of matching text:

* ``facts.qualname(expr)``: ``nn.utils.clip_grad_norm_`` -> ``torch.nn.utils.clip_grad_norm_``;
* ``facts.value(expr)``: what a name, ``self.model`` or call evaluates to, with traits such as
  ``dispatched`` (placed over several devices by accelerate), ``offloaded``, ``empty``, ``peft``,
  ``prepared``; in-place changes (``dispatch_model(model, ...)``, ``model.half()``) are applied;
* ``facts.calls``: every call in source order, with its enclosing loops, ``with`` blocks, ``if``
  tests and function.

Layout: ``records`` (what the walk saw), ``values`` (what expressions evaluate to), ``nodes`` (small
node helpers), ``model`` (``FileFacts``: the questions, and evaluation; ``lattice``, ``dicts`` and ``containers``
(what sequences hold) are its mixins), ``collector`` (the walk).
The walk is our own over the dataclass fields of libcst nodes: libcst's visitor rebuilds every node
and its metadata providers cost 100-400 ms per file, which we never pay here.
"""

from gpudoctor.check.facts.collector import collect
from gpudoctor.check.facts.dicts import DictContents, DictEntry
from gpudoctor.check.facts.lattice import PASS_ITEMS, FollowedCall
from gpudoctor.check.facts.model import FileFacts
from gpudoctor.check.facts.nodes import (
    call_arg,
    dotted,
    int_value,
    is_true,
    name_key,
    string_value,
    unwrap_iterable,
)
from gpudoctor.check.facts.records import (
    AttributeAssignSite,
    AugAssignSite,
    Binding,
    CallSite,
    DictEntrySite,
    Frame,
    FunctionFrame,
    IfFrame,
    LoopFrame,
    Scope,
    SubscriptAssignSite,
    WithFrame,
)
from gpudoctor.check.facts.values import (
    TRAIT_CAST,
    TRAIT_DISPATCHED,
    TRAIT_EMPTY,
    TRAIT_FP16,
    TRAIT_MOVED,
    TRAIT_OFFLOADED,
    TRAIT_FROZEN,
    TRAIT_PEFT,
    TRAIT_PRECISION_CAST,
    TRAIT_PREPARED,
    TRAIT_QUANTIZED,
    UNKNOWN,
    DeviceMap,
    Value,
)

__all__ = [
    "AttributeAssignSite", "AugAssignSite", "Binding", "CallSite", "DeviceMap", "DictContents", "DictEntry", "DictEntrySite", "FileFacts", "FollowedCall",
    "Frame", "FunctionFrame", "IfFrame", "LoopFrame", "Scope", "SubscriptAssignSite", "UNKNOWN", "Value",
    "WithFrame", "TRAIT_CAST", "TRAIT_DISPATCHED", "TRAIT_EMPTY", "TRAIT_FP16", "TRAIT_MOVED", "TRAIT_OFFLOADED",
    "TRAIT_FROZEN", "TRAIT_PEFT", "TRAIT_PRECISION_CAST", "TRAIT_PREPARED", "TRAIT_QUANTIZED", "call_arg", "collect", "dotted", "int_value", "is_true",
    "name_key", "string_value", "unwrap_iterable", "PASS_ITEMS",
]
