from __future__ import annotations

from gpudoctor.check.facts import FileFacts
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.loop._common import in_loop, innermost_loop, is_optimizer_step, is_scheduler_call


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
            loop = innermost_loop(sched)
            if loop is None:
                continue
            opt = next(
                (
                    s
                    for s in steps
                    if s.order > sched.order and innermost_loop(s) is loop and in_loop(s, loop) and is_optimizer_step(facts, s)
                ),
                None,
            )
            if opt is None:
                continue
            if any(s.order < sched.order and innermost_loop(s) is loop and is_optimizer_step(facts, s) for s in steps):
                continue  # an optimizer step already ran earlier in the iteration
            yield self.report(
                sched.node,
                f"`{snippet(facts, sched.node)}` runs before `{snippet(facts, opt.node)}` in the same iteration: "
                "PyTorch then skips the first value of the learning-rate schedule (it warns \"Detected call of "
                "`lr_scheduler.step()` before `optimizer.step()`\"), so warmup starts one step late and every "
                "later value is shifted.",
                fix_hint=f"Move `{snippet(facts, sched.node)}` after `{snippet(facts, opt.node)}`.",
            )
