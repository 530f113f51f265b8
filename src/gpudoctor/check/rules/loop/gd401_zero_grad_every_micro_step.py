from __future__ import annotations

from gpudoctor.check.facts import TRAIT_PREPARED, FileFacts, WithFrame
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.loop._common import accumulation_guard, in_loop, innermost_loop, is_optimizer_step, is_zero_grad


class ZeroGradEveryMicroStep(Rule):
    """Manual gradient accumulation (``if (step + 1) % accum == 0: optimizer.step()``) with
    ``optimizer.zero_grad()`` outside that test: the gradients are wiped on every micro-batch, so each
    update only sees the last micro-batch."""

    code = "GD401"
    name = "zero-grad-every-micro-step"
    summary = "zero_grad() runs on every micro-batch while optimizer.step() only runs every N (accumulation lost)"
    triggers = ("zero_grad",)

    def check(self, facts: FileFacts):
        for step in facts.method_calls("step"):
            loop = innermost_loop(step)
            if loop is None or not is_optimizer_step(facts, step):
                continue
            guard = accumulation_guard(facts, step, loop)
            if guard is None or self._accelerate_gated(facts, step):
                continue
            for zero in facts.method_calls("zero_grad"):
                if innermost_loop(zero) is not loop or not in_loop(zero, loop):
                    continue
                if accumulation_guard(facts, zero, loop) is not None:
                    continue
                if not is_zero_grad(facts, zero):
                    continue
                if self._accelerate_gated(facts, zero):
                    continue
                yield self.report(
                    zero.node,
                    f"`{snippet(facts, zero.node)}` runs on every micro-batch, but `{snippet(facts, step.node)}` only "
                    f"runs when `{snippet(facts, guard.test)}`: the gradients of the earlier micro-batches are wiped "
                    "before the update, so gradient accumulation silently does nothing (each update sees one micro-batch).",
                    fix_hint="Call zero_grad() right after optimizer.step(), inside the same `if`.",
                    related=((step.node, "the optimizer steps only under the accumulation guard here"),),
                )

    @staticmethod
    def _accelerate_gated(facts: FileFacts, site) -> bool:
        """A prepared optimizer under ``accelerator.accumulate`` gates step/zero_grad itself."""
        if any(isinstance(f, WithFrame) and f.method == "accumulate" for f in site.context):
            return True
        return facts.value(site.receiver, site.order, site.scope).has(TRAIT_PREPARED)
