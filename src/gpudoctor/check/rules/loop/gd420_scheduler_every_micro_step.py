from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import FileFacts, IfFrame, WithFrame
from gpudoctor.check.facts.nodes import walk
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.loop._common import (
    accumulation_guard,
    in_loop,
    innermost_loop,
    is_optimizer_step,
    is_scheduler_call,
)

# The schedule-length reading GD114 uses for the accelerate form of the same mistake (one definition of "a length
# that counts optimizer updates").
from gpudoctor.check.rules.accelerate.gd114_scheduler_not_prepared_with_accumulation import (
    _counts_updates as counts_updates,
    _length_argument as schedule_length,
)


class SchedulerEveryMicroStep(Rule):
    """A hand-written gradient-accumulation loop steps the optimizer every N micro-batches
    (``if (step + 1) % accum == 0: optimizer.step()``) but ``lr_scheduler.step()`` on every micro-batch, while the
    schedule's length counts optimizer updates (``len(loader) // accum * epochs``): the schedule runs N times too
    fast, warmup ends after 1/N of its steps and the learning rate reaches its final value (0 for linear/cosine
    decay) after 1/N of training."""

    code = "GD420"
    name = "scheduler-every-micro-step"
    summary = "lr_scheduler.step() on every micro-batch while optimizer.step() runs every N (schedule sized in updates)"
    severity = Severity.ERROR
    triggers = ("step",)

    def check(self, facts: FileFacts):
        for site in facts.method_calls("step"):
            if not is_scheduler_call(facts, site) or any(
                isinstance(f, WithFrame) and f.method == "accumulate" for f in site.context
            ):
                continue  # accelerate's accumulate(): GD114
            loop = innermost_loop(site)
            if loop is None or accumulation_guard(facts, site, loop) is not None:
                continue
            if any(isinstance(f, IfFrame) and "sync_gradients" in facts.module.code_for_node(f.test) for f in site.context):
                continue
            guard = self._guarded_optimizer_step(facts, site, loop)
            if guard is None:
                continue
            optimizer_step, test = guard
            every = _modulus(test)
            created = facts.built_by(site.receiver, site.order, site.scope)
            if every is None or not isinstance(created, cst.Call):
                continue
            q = facts.qualname(created.func) or ""
            if not apis.is_scheduler(q):
                continue
            length = schedule_length(created, q)
            created_order, created_scope = facts._position_of(created)
            if length is None or not counts_updates(facts, length, created_order, created_scope, every):
                continue  # sized in micro-batches (or unknown): one step per micro-batch then fits it
            n = snippet(facts, every)
            key = snippet(facts, site.receiver)
            yield self.report(
                site.node,
                f"`{key}.step()` runs on every micro-batch, but `{snippet(facts, optimizer_step.node)}` only every "
                f"`{n}` (under `if {snippet(facts, test, 50)}:`), and the schedule's length "
                f"`{snippet(facts, length, 50)}` counts optimizer updates: it advances {n} times per update, so "
                f"warmup ends after 1/{n} of its steps and the learning rate reaches its final value (0 for linear "
                f"or cosine decay) after 1/{n} of training; the remaining updates barely train. Nothing raises.",
                fix_hint=f"Step the scheduler with the optimizer, inside `if {snippet(facts, test, 50)}:` (or size "
                "the schedule in micro-batches).",
                related=(
                    (optimizer_step.node, "the optimizer steps only every N micro-batches here"),
                    (created, "the schedule is sized in optimizer updates here"),
                ),
            )

    @staticmethod
    def _guarded_optimizer_step(facts: FileFacts, site, loop) -> Optional[tuple]:
        """An ``optimizer.step()`` of the same loop, under an accumulation test: (its call site, the test)."""
        for other in facts.method_calls("step"):
            if other.scope is not site.scope or not in_loop(other, loop) or not is_optimizer_step(facts, other):
                continue
            guard = accumulation_guard(facts, other, loop)
            if guard is not None:
                return other, guard.test
        return None


def _modulus(test: cst.BaseExpression) -> Optional[cst.BaseExpression]:
    """N in ``(step + 1) % N == 0``; None for other accumulation tests."""
    for node in walk(test):
        if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Modulo):
            return node.right
    return None
