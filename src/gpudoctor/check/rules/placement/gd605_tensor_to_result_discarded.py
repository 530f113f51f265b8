from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check.facts import FileFacts, Scope
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule

_NOT_IN_PLACE = {"to", "cuda", "cpu", "half", "float", "double", "bfloat16", "long", "int", "bool", "type", "pin_memory"}


class TensorToResultDiscarded(Rule):
    """``x.to(device)`` / ``x.cuda()`` as a statement on a tensor: ``Tensor.to`` returns a new tensor and
    leaves ``x`` where it was (unlike ``nn.Module.to`` and ``BatchEncoding.to``, which work in place).
    Only reported when the receiver is known to be a tensor (the facts' lattice: a ``torch.*`` result, an
    item of a ``DataLoader`` batch whatever the collate function, a tokenizer's or model's output, arithmetic
    and views of those); never a module, a batch itself (a ``BatchEncoding`` moves in place) or an unknown."""

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
        """Why ``node`` is a tensor (from the facts' lattice), or None when it may be anything else."""
        value = facts.value(node, order, scope)
        if value.kind != "tensor":
            return None
        while value is not None:
            item_of = value.traits.get("batch_item")
            if item_of is not None:
                loader = item_of.traits.get("loader")
                if loader is not None and loader.node is not None:
                    return f"an item of a batch from `{snippet(facts, loader.node, 30)}`"
                return "an item of a batch"
            if value.traits.get("created"):
                return f"made by `{value.traits['created']}`"
            if value.traits.get("output") is not None:
                return "part of a model's or tokenizer's output"
            if value.traits.get("parameter") is not None:
                return "a module's parameter"
            value = value.base
        return "a tensor"
