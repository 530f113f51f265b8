from __future__ import annotations

import libcst as cst

from gpudoctor.check.facts import FileFacts, FunctionFrame, IfFrame, name_key
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.loop._common import (
    frames_inside,
    in_loop,
    innermost_loop,
    is_optimizer_step,
    is_scheduler_call,
    receiver_kind,
)

# Libraries whose scheduler objects follow torch's LRScheduler protocol (step() after optimizer.step()).
_LIBRARY_PREFIXES = ("torch.", "transformers.", "diffusers.", "timm.", "accelerate.", "pytorch_lightning.", "lightning.")


class SchedulerBeforeOptimizer(Rule):
    """``scheduler.step()`` before ``optimizer.step()`` in the same loop iteration: PyTorch skips the
    first value of the learning-rate schedule (and warns once)."""

    code = "GD405"
    name = "scheduler-before-optimizer"
    summary = "lr_scheduler.step() is called before optimizer.step() in the same iteration"
    severity = Severity.WARNING
    triggers = ("step",)

    def check(self, facts: FileFacts):
        steps = list(facts.method_calls("step"))
        for sched in steps:
            if sched.node.args or not is_scheduler_call(facts, sched):
                continue  # ReduceLROnPlateau.step(metric) has no ordering check
            if _custom_scheduler(facts, sched):
                continue  # a hand-written scheduler that sets the lr for the step about to run
            loop = innermost_loop(sched)
            if loop is None:
                continue
            opt = self._later_optimizer_step(facts, sched, loop, steps)
            if opt is None:
                continue
            if any(s.order < sched.order and in_loop(s, loop) and is_optimizer_step(facts, s) for s in steps):
                continue  # an optimizer step already ran earlier in the iteration
            yield self.report(
                sched.node,
                f"`{snippet(facts, sched.node)}` runs before `{snippet(facts, opt.node)}` in the same iteration: "
                "PyTorch then skips the first value of the learning-rate schedule (it warns \"Detected call of "
                "`lr_scheduler.step()` before `optimizer.step()`\"), so warmup starts one step late and every "
                "later value is shifted.",
                fix_hint=f"Move `{snippet(facts, sched.node)}` after `{snippet(facts, opt.node)}`.",
                related=((opt.node, "the optimizer steps here, after the scheduler"),),
            )


    @staticmethod
    def _later_optimizer_step(facts: FileFacts, sched, loop, steps):
        """The optimizer step that follows ``sched`` in the same iteration of ``loop``: in the same loop body, or
        (when the scheduler steps unconditionally at the top of an epoch loop) in a batch loop nested in it
        (``for epoch: scheduler.step(); for batch: ... optimizer.step()``) or in the file's own function the
        epoch loop calls after it (``for epoch: scheduler.step(); train_one_epoch(model, optimizer, ...)``).
        In the first epoch the scheduler then steps before any optimizer step."""
        for s in steps:
            if s.order > sched.order and innermost_loop(s) is loop and in_loop(s, loop) and is_optimizer_step(facts, s):
                return s
        if any(isinstance(frame, IfFrame) for frame in frames_inside(sched, loop)):
            return None  # ``if epoch > 0: scheduler.step()``: not the first iteration
        for s in steps:
            if s.order > sched.order and in_loop(s, loop) and s.order < loop.end_order and is_optimizer_step(facts, s):
                if not any(isinstance(frame, FunctionFrame) for frame in frames_inside(s, loop)):
                    return s  # in a loop nested in this one
        for call in facts.calls:
            if not (sched.order < call.order < loop.end_order and in_loop(call, loop)):
                continue
            for callee in facts.callee_scopes(call):
                step = next((s for s in steps if s.scope is callee and is_optimizer_step(facts, s)), None)
                if step is not None:
                    return step
        return None


def _custom_scheduler(facts: FileFacts, site) -> bool:
    """The receiver is only *named* like a scheduler, and the file binds that name to an instance of a class
    from outside torch/transformers (``scheduler = CycleScheduler(optimizer, ...)`` from the project's own
    module). Such schedulers usually set the learning rate for the step about to run, so calling them
    before ``optimizer.step()`` is their intended use, and torch's ordering warning does not apply."""
    if receiver_kind(facts, site) == "scheduler":
        return False
    key = name_key(site.receiver)
    if key is None:
        return False
    built = facts.built_by(site.receiver, site.order, site.scope)  # through temporaries, helpers, parameters
    if built is not None:
        made = facts.call_site(built)
        if made is not None and facts.value(built, made.order + 1, made.scope).kind == "scheduler":
            return False
        if not (facts.qualname(built.func) or "").startswith(_LIBRARY_PREFIXES) and facts.qualname(built.func):
            return True
    custom = False
    for scope in (facts.module_scope, *facts.functions):
        for binding in scope.bindings.get(key, ()):
            if binding.kind != "assign" or not isinstance(binding.value, cst.Call):
                continue
            if facts.value(binding.value, binding.order, binding.scope).kind == "scheduler":
                return False
            qualname = facts.qualname(binding.value.func) or ""
            if qualname.startswith(_LIBRARY_PREFIXES):
                return False
            custom = True
    return custom
