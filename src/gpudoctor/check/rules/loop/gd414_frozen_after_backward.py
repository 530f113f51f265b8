from __future__ import annotations

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import FileFacts, LoopFrame, call_arg
from gpudoctor.check.queries import _parameters_owner, snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.loop._common import in_loop, is_backward, is_optimizer_step


class FrozenAfterBackward(Rule):
    """Parameters frozen (``requires_grad_(False)``) after a backward pass, while their stale ``.grad`` is
    still set and an optimizer built over *all* parameters steps again: the "frozen" weights keep
    changing (Adam applies the stale gradient, momentum and weight decay)."""

    code = "GD414"
    name = "frozen-after-backward"
    summary = "Parameters frozen after backward with stale gradients still updated by the optimizer"
    triggers = ("requires_grad",)

    def check(self, facts: FileFacts):
        optimizers = [s for s in facts.calls if s.qualname and apis.is_optimizer(s.qualname)]
        if not any(_parameters_owner(s.arg(0, "params")) is not None and not _filtered(s.arg(0, "params")) for s in optimizers):
            return
        backwards = [c for c in facts.calls if is_backward(facts, c)]
        if not backwards:
            return
        zeroes = list(facts.method_calls("zero_grad"))
        steps = [s for s in facts.method_calls("step") if is_optimizer_step(facts, s)]
        for freeze in self._freezes(facts):
            before = [b for b in backwards if b.order < freeze.order and b.scope is freeze.scope]
            if not before:
                continue
            local = [z for z in zeroes if z.scope is freeze.scope]
            never_none = bool(local) and all(_keeps_tensors(z) for z in local)
            later_step = next((s for s in steps if s.order > freeze.order and s.scope is freeze.scope), None)
            if later_step is not None and not never_none:
                # Straight-line: stale grads exist at the freeze and survive until the step.
                last = before[-1]
                clears = [z for z in zeroes if z.scope is freeze.scope and not _keeps_tensors(z)]
                if any(last.order < z.order < freeze.order for z in clears):
                    continue
                if any(freeze.order < z.order < later_step.order for z in clears):
                    continue
            elif later_step is None:
                # The freeze sits in a loop that steps again on its next iteration.
                loops = [f for f in freeze.context if isinstance(f, LoopFrame)]
                later_step = next((s for s in steps if any(in_loop(s, loop) for loop in loops)), None)
                if later_step is None or not never_none:
                    continue
            why = (
                "`zero_grad(set_to_none=False)` only zeroes `.grad`, it never sets it to None"
                if never_none
                else "nothing clears `.grad` between the backward, the freeze and the next step"
            )
            yield self.report(
                freeze.node,
                f"`{snippet(facts, freeze.node)}` freezes parameters that already have a `.grad` from an earlier "
                f"backward, and the optimizer holds them ({why}): `{snippet(facts, later_step.node)}` keeps updating "
                "the \"frozen\" weights (stale gradient, momentum, weight decay).",
                fix_hint="Build the optimizer over `[p for p in model.parameters() if p.requires_grad]` after freezing, "
                "or call `optimizer.zero_grad(set_to_none=True)` before freezing.",
                related=((before[-1].node, "the gradients come from this backward"), (later_step.node, "the optimizer still updates the frozen parameters here")),
            )

    @staticmethod
    def _freezes(facts: FileFacts):
        for site in facts.method_calls("requires_grad_"):
            arg = call_arg(site.node, 0, "requires_grad")
            if isinstance(arg, cst.Name) and arg.value == "False":
                yield site
        for site in facts.attribute_assigns:
            value = site.value
            if site.target.attr.value == "requires_grad" and isinstance(value, cst.Name) and value.value == "False":
                yield _Freeze(site.target, site.order, site.scope, site.context)


class _Freeze:
    def __init__(self, node, order, scope, context) -> None:
        self.node, self.order, self.scope, self.context = node, order, scope, context


def _keeps_tensors(site) -> bool:
    arg = call_arg(site.node, 0, "set_to_none")
    return isinstance(arg, cst.Name) and arg.value == "False"


def _filtered(params) -> bool:
    return not (isinstance(params, cst.Call) and isinstance(params.func, cst.Attribute))
