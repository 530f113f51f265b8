from __future__ import annotations

import re
from typing import Optional

import libcst as cst

from gpudoctor.check.facts import CallSite, FileFacts, LoopFrame, Scope, name_key
from gpudoctor.check.finding import Applicability, Edit, Fix, Severity
from gpudoctor.check.queries import sets_requires_grad, snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.memory._common import (
    EVAL_FUNCTION,
    forward_target,
    function_frame,
    grad_disabled,
    grad_switched_off_before,
    loops_in_function,
    scope_span,
    torch_no_grad_expr,
    trains_between,
)

_LIGHTNING = re.compile(r"^\s*(import|from)\s+(pytorch_lightning|lightning)\b", re.MULTILINE)
_READS_GRADIENTS = re.compile(r"\.grad\b|autograd\.(grad|backward)\b")


class EvalWithoutNoGrad(Rule):
    """Evaluation or inference forward passes in a loop with autograd on: the model is in ``eval()``
    mode or the loop is in an ``evaluate``/``validate``/``predict``/``infer`` function, nothing in the
    loop (or after it in that function) calls ``backward``, and no ``torch.no_grad()`` /
    ``inference_mode`` / ``set_grad_enabled(False)`` is in force. Every forward records its graph and
    keeps the activations a backward would need."""

    code = "GD501"
    name = "eval-without-no-grad"
    summary = "Evaluation/inference forward passes in a loop without torch.no_grad(): activations kept for a backward that never comes"
    severity = Severity.WARNING
    fixable = "safe"
    triggers = ("eval", "val", "predict", "infer")

    def check(self, facts: FileFacts):
        if sets_requires_grad(facts) or _READS_GRADIENTS.search(facts.source):
            return  # gradients of inputs or frozen parameters: what autograd must record is unknown
        lightning = bool(_LIGHTNING.search(facts.source))
        seen_loops: set[int] = set()
        for site in facts.calls:
            model = forward_target(facts, site)
            if model is None or grad_disabled(facts, site.context):
                continue
            loops = loops_in_function(site.context)
            if not loops or id(loops[0]) in seen_loops:
                continue
            frame = function_frame(site.context)
            scope = frame.scope if frame else facts.module_scope
            if lightning and scope.name.endswith("_step"):
                continue  # Lightning runs validation/test/predict steps without grad itself
            if _framework_method(facts, scope):
                continue  # a framework class calls it (transformers' Pipeline wraps _forward in no_grad)
            why = self._why_eval(facts, site, model, scope, loops[0])
            if why is None:
                continue
            outer = loops[0]
            if grad_switched_off_before(facts, scope, outer.order):
                continue
            if frame is not None:
                start, end = scope_span(facts, scope)
                if trains_between(facts, start, end, scope):
                    continue
            elif trains_between(facts, outer.order, outer.end_order):
                continue
            seen_loops.add(id(outer))
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node)}` runs in a loop {why} with autograd on: each forward records its "
                "graph and keeps the activations a backward would need (about the memory of a training step, and "
                "the previous batch's outputs are still alive while the next forward runs). Nothing here calls "
                "backward, so this is memory and time spent for nothing; anything that keeps an output across "
                "iterations (a list, a running total) keeps every batch's graph until OOM.",
                fix_hint="Wrap the loop in `with torch.no_grad():` (or decorate the function with `@torch.no_grad()`; "
                "`torch.inference_mode()` is faster still).",
                fix=self._fix(facts, outer),
                related=((outer.iter if outer.iter is not None else outer.node, "the loop to run under `torch.no_grad()`"),),
            )

    def _why_eval(self, facts: FileFacts, site: CallSite, model: cst.BaseExpression, scope: Scope, loop: LoopFrame) -> Optional[str]:
        if scope.kind == "function":
            if scope.name.startswith("test_"):
                return None  # a pytest test
            if EVAL_FUNCTION.search(scope.name):
                if self._always_called_without_grad(facts, scope) is False:
                    return f"of `{scope.name}()`"
                return None
        key = name_key(model)
        if key is None:
            return None
        last = None
        for call in facts.method_calls("eval", "train"):
            if call.order > site.order or name_key(call.receiver) != key:
                continue
            if call.scope is not site.scope and call.scope.kind != "module":
                continue
            last = call
        if last is not None and last.method == "eval" and last.order < loop.order:
            if scope.kind == "function" and self._always_called_without_grad(facts, scope) is not False:
                return None
            return f"after `{snippet(facts, last.node)}`"
        return None

    @staticmethod
    def _always_called_without_grad(facts: FileFacts, scope: Scope) -> Optional[bool]:
        """False when some call of the function runs with grad on (or the file never calls it); True when
        every call is under no_grad."""
        calls = [
            c for c in facts.calls
            if (isinstance(c.node.func, cst.Name) and c.node.func.value == scope.name)
            or (isinstance(c.node.func, cst.Attribute) and c.node.func.attr.value == scope.name)
        ]
        if calls and all(grad_disabled(facts, c.context) for c in calls):
            return True
        if any(grad_disabled(facts, c.context) for c in calls):
            return True  # mixed: stay silent
        return False

    @staticmethod
    def _fix(facts: FileFacts, loop: LoopFrame) -> Optional[Fix]:
        no_grad = torch_no_grad_expr(facts)
        if no_grad is None:
            return None
        node = loop.node
        wrapped = cst.With(
            items=[cst.WithItem(item=cst.Call(func=no_grad))],
            body=cst.IndentedBlock(body=[node.with_changes(leading_lines=[])]),
            leading_lines=node.leading_lines,
        )
        # Safe: forward values are the same under no_grad, and nothing in this file differentiates
        # anything (no backward/autograd.grad at all). Otherwise outputs that leave the loop might be
        # differentiated later, and losing their history would change behaviour: unsafe.
        safe = not trains_between(facts, 0, 1 << 30)
        return Fix(
            f"Wrap the loop in `with {facts.module.code_for_node(no_grad)}():`",
            Applicability.SAFE if safe else Applicability.UNSAFE,
            (Edit(node, wrapped),),
        )


def _framework_method(facts: FileFacts, scope: Scope) -> bool:
    """A method of a class derived from an imported, non-torch class (a Pipeline, a Trainer, a LightningModule,
    a relative import): the framework calls it, often under no_grad, which this file cannot show."""
    if scope.kind != "function" or scope.parent is None or scope.parent.kind != "class":
        return False
    for arg in getattr(scope.parent.node, "bases", ()):
        base = arg.value
        q = facts.qualname(base)
        if q is not None:
            if not q.startswith("torch."):
                return True
        elif isinstance(base, cst.Name) and not any(b.kind == "def" for b in facts.module_scope.bindings.get(base.value, ())):
            return True  # from .base import Pipeline: defined elsewhere
    return False
