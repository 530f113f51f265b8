from __future__ import annotations

import re
from typing import Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import TRAIT_PREPARED, CallSite, FileFacts, name_key, string_value
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule

# Methods of transformers/peft models that ``nn.Module`` does not have: ``DistributedDataParallel`` and
# ``DataParallel`` do not forward unknown attributes to the wrapped module (``Module.__getattr__`` only looks at
# parameters, buffers and sub-modules), so on the wrapper they raise AttributeError.
_MODEL_ONLY_METHODS = {
    "generate", "save_pretrained", "push_to_hub", "print_trainable_parameters", "gradient_checkpointing_enable",
    "gradient_checkpointing_disable", "resize_token_embeddings", "get_input_embeddings", "get_output_embeddings",
    "merge_and_unload", "enable_input_require_grads", "num_parameters",
}
# Distributed types whose wrappers forward attribute access to the model (DeepSpeedEngine.__getattr__, FSDP1's
# __getattr__) or that do not wrap at all (XLA, FSDP2, Megatron's own model): the file naming them is not DDP.
_FORWARDING_BACKENDS = re.compile(r"deepspeed|\bfsdp|FullyShardedDataParallel|megatron|\bxla\b|\btpu\b", re.IGNORECASE)


class HfMethodOnDdpWrapper(Rule):
    """``model.generate(...)`` (or ``save_pretrained``, ``print_trainable_parameters``...) on the object
    ``accelerator.prepare`` returned, in a multi-process run: prepare wraps a trained model in
    ``DistributedDataParallel``, which has no such method. Also on an explicit ``DistributedDataParallel`` /
    ``nn.DataParallel`` wrapper."""

    code = "GD115"
    name = "hf-method-on-ddp-wrapper"
    summary = "generate()/save_pretrained() on the DDP wrapper prepare() returned (AttributeError with several processes)"
    severity = Severity.ERROR
    triggers = ("prepare", "DistributedDataParallel", "DDP", "DataParallel")

    def check(self, facts: FileFacts):
        for site in facts.calls:
            if site.method not in _MODEL_ONLY_METHODS or site.receiver is None or name_key(site.receiver) is None:
                continue
            value = facts.value(site.receiver, site.order, site.scope)
            if value.kind != "model":
                continue
            wrapper = self._wrapper(facts, value)
            if wrapper is None or _unwrapped(facts, site.receiver, site.order, site.scope):
                continue
            wrapper_class, why, evidence = wrapper
            receiver = snippet(facts, site.receiver)
            unwrap = (
                f"{snippet(facts, value.trait(TRAIT_PREPARED).receiver)}.unwrap_model({receiver})"
                if value.has(TRAIT_PREPARED) else f"{receiver}.module"
            )
            yield self.report(
                site.node,
                f"`{receiver}` is the `{wrapper_class}` wrapper ({why}), and the wrapper does not forward "
                f"`{site.method}` to the model: \"AttributeError: '{wrapper_class}' object has no attribute "
                f"'{site.method}'\".",
                fix_hint=f"Call it on the model inside the wrapper: `{unwrap}.{site.method}(...)`.",
                related=((evidence, "the wrapper is made here"),),
            )

    @staticmethod
    def _wrapper(facts: FileFacts, value) -> Optional[tuple[str, str, object]]:
        """(wrapper class, why the object is that wrapper, the node that wraps it), or None."""
        explicit = value.carrier("wrapper")
        if explicit is not None:
            q = explicit.traits["wrapper"]
            name = "DataParallel" if q in apis.DATA_PARALLEL else "DistributedDataParallel"
            return name, f"`{snippet(facts, explicit.node, 40)}`", explicit.node
        prepared = value.trait(TRAIT_PREPARED)
        if not isinstance(prepared, CallSite):
            return None
        hints = facts.launch_hints
        if not hints or _FORWARDING_BACKENDS.search(facts.source):
            return None  # one process: prepare returns the model itself; DeepSpeed/FSDP forward attributes
        if not _trains(facts, prepared):
            return None  # accelerate wraps a model in DDP only when some parameter requires grad
        launch = ", ".join(f"`{h}`" for h in hints[:2])
        why = (
            f"`{snippet(facts, prepared.node.func)}(...)` wraps a trained model in DistributedDataParallel when the "
            f"script runs as several processes, as the file shows ({launch})"
        )
        return "DistributedDataParallel", why, prepared.node


def _trains(facts: FileFacts, prepared: CallSite) -> bool:
    """The prepare call also prepares an optimizer, or the file backpropagates through an accelerator."""
    if any(facts.value(arg.value, prepared.order, prepared.scope).kind == "optimizer" for arg in prepared.node.args):
        return True
    return any(c.method == "backward" and c.receiver is not None and
               facts.value(c.receiver, c.order, c.scope).kind == "accelerator" for c in facts.calls)


def _unwrapped(facts: FileFacts, node, order: int, scope, depth: int = 0) -> bool:
    """The name holds what ``accelerator.unwrap_model(...)`` (or ``wrapper.module``) returned, through names and
    parameters: the model inside the wrapper (the lattice gives it the wrapped object's value)."""
    if depth > 5 or node is None:
        return False
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
        return node.func.attr.value in ("unwrap_model", "extract_model_from_parallel")
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "getattr":
        return len(node.args) > 1 and string_value(node.args[1].value) == "module"  # getattr(model, "module", model)
    if isinstance(node, cst.Attribute) and node.attr.value == "module":
        return True
    if isinstance(node, cst.IfExp):  # ``model.module if hasattr(model, "module") else model``
        return any(_unwrapped(facts, branch, order, scope, depth + 1) for branch in (node.body, node.orelse))
    key = name_key(node)
    binding = facts.binding_at(key, order, scope) if key is not None else None
    if binding is None:
        return False
    if binding.kind == "param":
        passed = facts.param_argument(binding)
        return passed is not None and _unwrapped(facts, *passed, depth + 1)
    if binding.kind == "assign":
        return _unwrapped(facts, binding.value, binding.order, binding.scope, depth + 1)
    return False
