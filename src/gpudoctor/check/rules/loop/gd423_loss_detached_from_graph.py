from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check.facts import CallSite, FileFacts, Scope, call_arg, is_true, name_key
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.loop._common import is_backward, is_optimizer_step

# Constructors that copy their data into a NEW leaf tensor: whatever graph the data came from is not kept.
_LEAF_CONSTRUCTORS = ("torch.tensor", "torch.autograd.Variable", "torch.autograd.variable.Variable")
# Constructors whose result never has a graph: ``.requires_grad_()`` on them makes a new leaf.
_GRAPHLESS = ("torch.tensor", "torch.from_numpy")
# Tensor methods whose result depends on nothing but the tensor they are called on.
_SAME_GRAPH_METHODS = frozenset({"mean", "sum", "float", "double", "half", "to", "cuda", "view", "reshape",
                                 "squeeze", "unsqueeze", "clone", "abs"})


class LossDetachedFromGraph(Rule):
    """``loss.backward()`` on a loss that is a brand-new leaf tensor: rebuilt with ``torch.tensor(value,
    requires_grad=True)`` / ``Variable(value, requires_grad=True)``, or given ``loss.requires_grad = True`` by hand
    (the usual "fix" for "element 0 of tensors does not require grad"). No gradient reaches the model, so the
    optimizer step updates nothing."""

    code = "GD423"
    name = "loss-detached-from-graph"
    summary = "backward() on a loss rebuilt as a new leaf (torch.tensor(..., requires_grad=True)): the model gets no gradients"
    triggers = ("requires_grad",)

    def check(self, facts: FileFacts):
        if not any(is_optimizer_step(facts, site) for site in facts.calls):
            return  # without an optimizer step there is no training for the cut graph to break
        reported: set[int] = set()
        for site in facts.calls:
            if not is_backward(facts, site) or site.qualname is not None:
                continue
            loss = site.receiver
            evidence = _fresh_leaf(facts, loss, site.order, site.scope)
            if evidence is None or id(evidence[0]) in reported:
                continue
            node, how = evidence
            reported.add(id(node))
            yield self.report(
                node,
                f"`{snippet(facts, node, 70)}` {how}, and `{snippet(facts, site.node, 50)}` back-propagates from it: "
                "the gradient stops at this new tensor, every model parameter keeps `.grad` None and the optimizer "
                "step updates nothing; training runs and logs a loss but the model never changes.",
                fix_hint="Compute the loss with torch operations on the model's output (no `.item()`, `.detach()`, "
                ".numpy() or `torch.tensor(...)` on the way) and drop the `requires_grad=True`.",
                related=((site.node, "the backward starts from the detached loss"),),
            )


def _fresh_leaf(facts: FileFacts, node: Optional[cst.BaseExpression], order: int, scope: Scope,
                depth: int = 0) -> Optional[tuple[cst.CSTNode, str]]:
    """(the node that made it, how) when ``node`` is certainly a new leaf tensor cut from any graph: built by a
    leaf constructor with requires_grad=True, a name whose ``.requires_grad`` is set to True after its binding,
    or what every return of the file's own helper gives back of those."""
    if node is None or depth > 6:
        return None
    key = name_key(node)
    if key is not None:
        flag = _requires_grad_set(facts, key, order, scope)
        if flag is not None:
            return flag, (f"sets `requires_grad` on `{key}` by hand, which only works on a tensor outside any graph "
                          "(on a loss still attached to the model it raises)")
        binding = facts.binding_at(key, order, scope)
        if binding is None or binding.kind != "assign" or binding.value is None:
            return None
        return _fresh_leaf(facts, binding.value, binding.order, binding.scope, depth + 1)
    if isinstance(node, cst.BinaryOperation):  # ``1 - torch.tensor(ccc, requires_grad=True)``
        sides = [_fresh_leaf(facts, side, order, scope, depth + 1) for side in (node.left, node.right)]
        numbers = [isinstance(side, (cst.Integer, cst.Float)) for side in (node.left, node.right)]
        if all(found is not None or number for found, number in zip(sides, numbers)) and any(sides):
            return next(found for found in sides if found is not None)
        return None
    if not isinstance(node, cst.Call):
        return None
    site = facts.call_site(node)
    if site is None:
        return None
    if site.qualname in _LEAF_CONSTRUCTORS:
        if is_true(call_arg(node, keyword="requires_grad")):
            return node, "copies a value into a new leaf tensor"
        return None
    if site.method == "requires_grad_" and _graphless(facts, site.receiver):
        return node, "makes a new leaf tensor out of a value with no graph"
    if site.method in _SAME_GRAPH_METHODS and site.receiver is not None:
        return _fresh_leaf(facts, site.receiver, order, scope, depth + 1)
    if site.qualname is None and facts.callee_scopes(site):
        return facts.every_return(site, lambda value, o, s, _callee: _fresh_leaf(facts, value, o, s, depth + 1))
    return None


def _graphless(facts: FileFacts, node: Optional[cst.BaseExpression]) -> bool:
    """``torch.tensor(...)`` / ``torch.from_numpy(...)``, possibly behind ``.float()``/``.to(...)``."""
    site = facts.call_site(node) if isinstance(node, cst.Call) else None
    while site is not None and site.qualname is None and site.method in _SAME_GRAPH_METHODS:
        site = facts.call_site(site.receiver) if isinstance(site.receiver, cst.Call) else None
    return site is not None and site.qualname in _GRAPHLESS


def _requires_grad_set(facts: FileFacts, key: str, order: int, scope: Scope) -> Optional[cst.CSTNode]:
    """``key.requires_grad = True`` after ``key``'s last binding and before ``order``, in the same scope."""
    binding = facts.binding_at(key, order, scope)
    since = binding.order if binding is not None else -1
    for assign in facts.attribute_assigns:
        target = assign.target
        if (assign.scope is scope and since < assign.order < order and target.attr.value == "requires_grad"
                and name_key(target.value) == key and is_true(assign.value)):
            return assign.node
    return None
