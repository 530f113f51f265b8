from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check.facts import FileFacts, Scope, name_key, unwrap_iterable
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.placement._common import CREATION

_NOT_IN_PLACE = {"to", "cuda", "cpu", "half", "float", "double", "bfloat16", "long", "int", "bool", "type", "pin_memory"}
_TENSOR_FACTORIES = CREATION | {"torch.stack", "torch.cat", "torch.clone", "torch.zeros_like", "torch.ones_like",
                                "torch.randn_like", "torch.rand_like", "torch.empty_like", "torch.full_like"}


class TensorToResultDiscarded(Rule):
    """``x.to(device)`` / ``x.cuda()`` as a statement on a tensor: ``Tensor.to`` returns a new tensor and
    leaves ``x`` where it was (unlike ``nn.Module.to`` and ``BatchEncoding.to``, which work in place).
    Only reported when the receiver is known to be a tensor: a ``torch.*`` creation, an item of a batch
    from a ``DataLoader`` with the default collate, or an item of a tokenizer's output; never a module."""

    code = "GD605"
    name = "tensor-to-result-discarded"
    summary = "tensor.to(...)/.cuda() used as a statement: the result is discarded, the tensor does not move"
    severity = Severity.WARNING
    triggers = (".to(", ".cuda(", ".cpu(", ".half(", ".float(")

    def check(self, facts: FileFacts):
        for site in facts.calls:
            if not site.statement or site.method not in _NOT_IN_PLACE or site.receiver is None:
                continue
            why = self._tensor_evidence(facts, site.receiver, site.order, site.scope)
            if why is None:
                continue
            if facts.value(site.receiver, site.order, site.scope).kind == "model":
                continue
            target = snippet(facts, site.receiver, 40)
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node, 60)}` discards its result: `{target}` is a tensor ({why}), and "
                f"`Tensor.{site.method}()` returns a new tensor instead of changing it in place (only `nn.Module` "
                f"moves itself). `{target}` stays where it was, which surfaces later as \"Expected all tensors to be "
                "on the same device\" or as work silently done on the CPU.",
                fix_hint=f"Assign the result: `{target} = {snippet(facts, site.node, 60)}`.",
            )

    def _tensor_evidence(self, facts: FileFacts, node: cst.CSTNode, order: int, scope: Scope) -> Optional[str]:
        key = name_key(node)
        if key is not None and not key.startswith("self."):
            binding = facts.binding_at(key, order, scope)
            if binding is None:
                return None
            if binding.kind == "assign" and isinstance(binding.value, cst.Call):
                q = facts.qualname(binding.value.func)
                if q in _TENSOR_FACTORIES:
                    return f"made by `{q}`"
                return None
            if self._batch_role(facts, binding) == "element":
                return f"an element of a batch from `{snippet(facts, binding.value, 30)}` (default collate)"
            return None
        if isinstance(node, cst.Subscript):
            base = node.value
            base_key = name_key(base)
            if base_key is None or base_key.startswith("self."):
                return None
            binding = facts.binding_at(base_key, order, scope)
            if binding is None:
                return None
            if self._batch_role(facts, binding) == "batch":
                return f"an item of a batch from `{snippet(facts, binding.value, 30)}`"
            if binding.kind == "assign" and isinstance(binding.value, cst.Call):
                func = binding.value.func
                if facts.value(func, binding.order, binding.scope).kind == "tokenizer" and _string_index(node):
                    return "an item of the tokenizer's output"
        return None

    def _batch_role(self, facts: FileFacts, binding) -> Optional[str]:
        """For a loop target over a DataLoader with the default collate: "batch" or "element"."""
        if binding.kind != "for" or binding.value is None:
            return None
        loop_iter = binding.value
        inner = unwrap_iterable(loop_iter)
        value = facts.value(inner, binding.order, binding.scope)
        if value.kind != "dataloader":
            return None
        call = value.origin().node
        if not isinstance(call, cst.Call):
            return None
        if any(a.keyword is not None and a.keyword.value == "collate_fn" for a in call.args):
            return None
        if len([a for a in call.args if a.keyword is None]) >= 6:
            return None
        enumerated = _is_enumerate(loop_iter)
        if binding.index is None:
            return None if enumerated else "batch"
        if enumerated:
            return "batch" if binding.index == 1 else None
        return "element"


def _is_enumerate(node: cst.CSTNode) -> bool:
    while isinstance(node, cst.Call) and node.args:
        func = node.func
        name = func.value if isinstance(func, cst.Name) else (func.attr.value if isinstance(func, cst.Attribute) else "")
        if name == "enumerate":
            return True
        node = node.args[0].value
    return False


def _string_index(node: cst.Subscript) -> bool:
    from gpudoctor.check.facts import string_value

    return len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index) and string_value(node.slice[0].slice.value) is not None
