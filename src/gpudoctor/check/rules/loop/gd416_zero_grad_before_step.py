from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check.facts import CallSite, FileFacts, FunctionFrame, IfFrame, LoopFrame, name_key
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.loop._common import is_backward, is_optimizer_step, is_zero_grad


class ZeroGradBeforeStep(Rule):
    """``loss.backward()``, then ``optimizer.zero_grad()``, then ``optimizer.step()`` in the same iteration: the
    gradients are cleared (set to None since torch 2.0) right before the step that should use them, so the step
    updates nothing and the model never learns."""

    code = "GD416"
    name = "zero-grad-before-step"
    summary = "zero_grad() runs between backward() and optimizer.step(): the step sees no gradients"
    severity = Severity.ERROR
    triggers = ("zero_grad",)

    def check(self, facts: FileFacts):
        calls = [c for c in facts.calls if c.method == "step"]
        backwards = [c for c in facts.calls if is_backward(facts, c)]
        for zero in facts.method_calls("zero_grad"):
            if not is_zero_grad(facts, zero):
                continue
            unit = _iteration_unit(zero)
            step = next((s for s in calls if s.order > zero.order and s.method == "step" and _iteration_unit(s) is unit
                         and is_optimizer_step(facts, s)), None)
            if step is None or _closure_step(facts, step) or not _same_branches(zero, step):
                continue
            if not _clears_what_steps(facts, zero, step):
                continue
            if any(zero.order < b.order < step.order for b in backwards):
                continue  # a new backward fills the gradients again before the step
            if _grads_restored(facts, zero, step):
                continue
            before = [b for b in backwards if b.order < zero.order and _iteration_unit(b) is unit
                      and _branches(b) <= _branches(zero)]
            if not before:
                continue
            backward = before[-1]
            yield self.report(
                zero.node,
                f"`{snippet(facts, zero.node)}` runs after `{snippet(facts, backward.node, 50)}` and before "
                f"`{snippet(facts, step.node)}` in the same iteration: it clears the gradients the backward just "
                "computed (sets them to None), so the step has nothing to apply; the weights never change and the "
                "loss stays where it started, without any error.",
                fix_hint=f"Clear the gradients before the backward (or after the step): move `{snippet(facts, zero.node)}` "
                f"above `{snippet(facts, backward.node, 40)}`.",
                related=((backward.node, "the gradients are computed here"), (step.node, "the step sees none of them")),
            )


def _iteration_unit(site) -> Optional[object]:
    """The body that runs backward, zero_grad and step once per training step: the innermost loop, or, outside
    any loop, the function itself (a ``train_step(batch)`` method the caller runs per batch), or the module
    (None) for straight-line code."""
    for frame in reversed(site.context):
        if isinstance(frame, (LoopFrame, FunctionFrame)):
            return frame
    return None


def _grads_restored(facts: FileFacts, zero: CallSite, step: CallSite) -> bool:
    """``p.grad = saved`` between the zero_grad and the step (gradient surgery such as PCGrad): the step applies
    the gradients the script put back."""
    return any(
        a.target.attr.value == "grad" and zero.order < a.order < step.order for a in facts.attribute_assigns
    )


def _branches(site) -> set:
    return {(id(f.node), f.branch) for f in site.context if isinstance(f, IfFrame)}


def _same_branches(zero: CallSite, step: CallSite) -> bool:
    """Whenever the zero_grad runs, the step after it runs too (same ``if`` branches)."""
    return _branches(zero) == _branches(step)


def _closure_step(facts: FileFacts, step: CallSite) -> bool:
    """``optimizer.step(closure)`` (LBFGS): the closure recomputes the loss and the gradients."""
    if not step.node.args:
        return False
    text = snippet(facts, step.receiver) if step.receiver is not None else ""
    return "scaler" not in text.lower()


def _clears_what_steps(facts: FileFacts, zero: CallSite, step: CallSite) -> bool:
    """The zero_grad clears the stepped optimizer's gradients: the same optimizer, or the model whose
    ``parameters()`` it was built over."""
    stepped = step.node.args[0].value if step.method == "step" and step.node.args else step.receiver
    zero_key, step_key = name_key(zero.receiver), name_key(stepped)
    if zero_key is None or step_key is None:
        return False
    if zero_key == step_key:
        return True
    return _params_owner_key(facts, stepped, step) == zero_key


def _params_owner_key(facts: FileFacts, optimizer: cst.BaseExpression, site: CallSite) -> Optional[str]:
    built = facts.built_by(optimizer, site.order, site.scope)
    if not isinstance(built, cst.Call) or not built.args:
        return None
    params = built.args[0].value
    if isinstance(params, cst.Call) and isinstance(params.func, cst.Attribute) and params.func.attr.value in (
        "parameters", "named_parameters"
    ):
        return name_key(params.func.value)
    return None
