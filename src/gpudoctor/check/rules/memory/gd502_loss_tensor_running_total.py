from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check.facts import AugAssignSite, FileFacts, LoopFrame, name_key
from gpudoctor.check.finding import Applicability, Edit, Fix, Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.memory._common import called_without_grad, computed_at, graph_tensor, grad_disabled, loops_in_function


class LossTensorRunningTotal(Rule):
    """``total_loss += loss`` where ``loss`` is the loss tensor itself (from the model output or a
    criterion), not ``loss.item()``: the running total becomes a tensor whose autograd history links
    every step's graph (pytorch#5251). Without a backward in the loop, every step's activations stay
    alive until the out-of-memory error; with one, backward frees the activations but the graph nodes
    still pile up and the total is a device tensor."""

    code = "GD502"
    name = "loss-tensor-running-total"
    summary = "Running total of the loss tensor (total += loss) instead of loss.item(): keeps every step's graph"
    severity = Severity.WARNING
    fixable = "unsafe"
    triggers = ("+=", "+ ")

    def check(self, facts: FileFacts):
        for site in facts.aug_assigns:
            node = site.node
            if not isinstance(node.operator, cst.AddAssign) or site.target_key is None:
                continue
            found = self._added_loss(facts, site, node.value, node)
            if found is not None:
                yield found
        for key, bindings in self._plain_totals(facts):
            yield from bindings

    def _added_loss(self, facts: FileFacts, site, value: cst.BaseExpression, shown: cst.CSTNode):
        loops = loops_in_function(site.context)
        if not loops or grad_disabled(facts, site.context) or called_without_grad(facts, site.context):
            return None
        loop = loops[-1]
        kind = graph_tensor(facts, value, site.order, site.scope)
        loss_expr = _loss_name(value) or value
        if kind in ("output", "logits") and name_key(loss_expr) is not None and self._backward_on(facts, loss_expr, loop):
            kind = "loss"  # ``loss = -torch.mean(self(x))`` ... ``loss.backward()``: what backward runs on is a loss
        if kind != "loss" or _computed_without_grad(facts, value, site.order, site.scope):
            return None
        total = site.target_key
        if not any(self._total_outside_loop(facts, total, site, outer) for outer in loops):
            return None
        if self._total_is_differentiated(facts, total, site):
            return None  # the sum is the loss to optimize (accumulated micro-batches, multi-task)
        backward = self._backward_on(facts, loss_expr, loop)
        if backward:
            severity = Severity.INFO
            effect = (
                "`backward()` in the loop frees each step's activations, but every step's autograd nodes stay "
                "linked to the total (host memory grows with the number of steps) and the total is a device "
                "tensor (logging it synchronises)"
            )
        else:
            severity = Severity.WARNING
            effect = (
                "nothing in the loop calls backward on it, so every step's graph *and its activations* stay alive: "
                "memory grows with each batch until CUDA runs out of memory"
            )
        fix = None
        replacement = None
        if isinstance(loss_expr, (cst.Name, cst.Attribute)) and loss_expr is value:
            replacement = cst.Call(func=cst.Attribute(value=value.deep_clone(), attr=cst.Name("item")))
            fix = Fix(f"Add `{snippet(facts, value)}.item()`", Applicability.UNSAFE, (Edit(value, replacement),))
        return self.report(
            shown,
            f"`{snippet(facts, shown)}` adds the loss tensor, with its autograd history, to a running total: "
            f"{effect} (pytorch#5251).",
            fix_hint=f"Accumulate a Python number: `{total} += {snippet(facts, loss_expr)}.item()` (or `.detach()`).",
            severity=severity,
            fix=fix,
            related=computed_at(facts, loss_expr, site, "the loss tensor, with its graph, is computed here"),
        )

    def _plain_totals(self, facts: FileFacts):
        """``total = total + loss`` (an assignment) — the same pattern without ``+=``."""
        out = []
        for scope in [facts.module_scope, *facts.functions]:
            for key, bindings in scope.bindings.items():
                for binding in bindings:
                    value = binding.value
                    if binding.kind != "assign" or not isinstance(value, cst.BinaryOperation):
                        continue
                    if not isinstance(value.operator, cst.Add) or name_key(value.left) != key:
                        continue
                    site = AugAssignSite(binding.target, binding.order, key, binding.scope, binding.context)
                    report = self._added_loss(facts, site, value.right, value)
                    if report is not None:
                        out.append(report)
        return [(None, out)] if out else []

    @staticmethod
    def _total_outside_loop(facts: FileFacts, key: str, site, loop: LoopFrame) -> bool:
        """The total is initialised before the loop (``total_loss = 0``), so it runs across iterations. Any
        enclosing loop will do: a total reset per epoch (``for epoch ...: total = 0.0; for batch ...: total +=
        loss``) still runs across the batches of the epoch."""
        binding = facts.binding_at(key, loop.order, site.scope)
        return binding is not None and binding.order < loop.order

    @staticmethod
    def _total_is_differentiated(facts: FileFacts, key: str, site) -> bool:
        for call in facts.calls:
            if call.method == "backward" and name_key(call.receiver) == key:
                return True
            if call.method == "backward" and any(name_key(a.value) == key for a in call.node.args):
                return True  # accelerator.backward(total)
        if site.scope.kind != "function":
            return False
        name = site.scope.name.lower()
        # A model's forward or a compute_loss-like function returns the sum: the caller optimizes it
        # (transformers' multi-token-prediction and MusicGen codebook losses are summed in loops).
        return name == "forward" or ("loss" in name and "train" not in name)

    @staticmethod
    def _backward_on(facts: FileFacts, loss: cst.BaseExpression, loop: LoopFrame) -> bool:
        key = name_key(loss)
        for call in facts.calls:
            if not (loop.order < call.order < loop.end_order) or call.method != "backward":
                continue
            if key is None or name_key(call.receiver) == key or any(name_key(a.value) == key for a in call.node.args):
                return True
            receiver = call.receiver
            # (loss / accum).backward()
            if isinstance(receiver, cst.BinaryOperation) and name_key(receiver.left) == key:
                return True
        return False


def _computed_without_grad(facts: FileFacts, value: cst.BaseExpression, order: int, scope, depth: int = 0) -> bool:
    """The value was computed under ``torch.no_grad()`` / ``inference_mode()`` (``with torch.no_grad(): out =
    model(**batch)`` then ``loss = out.loss`` outside the block): it has no autograd history to keep."""
    if depth > 6:
        return False
    if isinstance(value, (cst.Attribute, cst.Subscript)) and name_key(value) is None:
        return _computed_without_grad(facts, value.value, order, scope, depth + 1)
    if isinstance(value, cst.BinaryOperation):
        return _computed_without_grad(facts, value.left, order, scope, depth + 1) and _computed_without_grad(
            facts, value.right, order, scope, depth + 1
        )
    if isinstance(value, cst.Call):
        site = facts.call_site(value)
        if site is None:
            return False
        if facts.under_no_grad(site.context):
            return True
        # ``loss.float()``, ``loss.mean()``: a tensor method of a value without history has none either.
        return site.receiver is not None and _computed_without_grad(facts, site.receiver, order, scope, depth + 1)
    key = name_key(value)
    if key is None:
        return isinstance(value, (cst.Integer, cst.Float))
    binding = facts.binding_at(key, order, scope)
    if binding is None and "." in key:
        return _computed_without_grad(facts, value.value, order, scope, depth + 1)
    if binding is None or binding.kind not in ("assign", "unpack", "with"):
        return False
    if facts.under_no_grad(binding.context):
        return True
    return binding.value is not None and _computed_without_grad(facts, binding.value, binding.order, binding.scope, depth + 1)


def _loss_name(value: cst.BaseExpression) -> Optional[cst.BaseExpression]:
    """``loss * batch_size`` -> ``loss``."""
    if isinstance(value, cst.BinaryOperation):
        return _loss_name(value.left) or _loss_name(value.right)
    if isinstance(value, (cst.Name, cst.Attribute)):
        return value
    return None
