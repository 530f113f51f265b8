from __future__ import annotations

import re

from gpudoctor.check.facts import FileFacts
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.loop._common import calling_loops, in_loop, innermost_loop, is_backward, is_optimizer_step, reach

# Any way of clearing gradients we know of; when one appears anywhere in the file we stay silent.
_CLEARS = re.compile(
    r"zero_grad|set_to_none|\.grad\s*=\s*None|\.grad(\.data)?\.zero_\(|\.grad(\.data)?\.fill_\(|\.grad\s*=\s*torch\.zeros"
    r"|\.grad\s*\*=\s*0|grad\.detach_\(\)\.zero_|\.grad\s*=\s*0"
)

# Strings and comments (a docstring that says "we forgot zero_grad" clears nothing).
_STRINGS_AND_COMMENTS = re.compile(
    r"[rRbBuUfF]{0,2}(?:'''.*?'''|\"\"\".*?\"\"\"|'(?:[^'\\\r\n]|\\.)*'|\"(?:[^\"\\\r\n]|\\.)*\")|#[^\r\n]*",
    re.DOTALL,
)


def _clears_gradients(source: str) -> bool:
    return bool(_CLEARS.search(source)) and bool(_CLEARS.search(_STRINGS_AND_COMMENTS.sub(" ", source)))


class ZeroGradMissing(Rule):
    """A loop calls ``backward()`` and ``optimizer.step()`` but nothing in the file ever clears the
    gradients: they accumulate over every iteration, so each update uses the sum of all past gradients."""

    code = "GD402"
    name = "zero-grad-missing"
    summary = "A training loop calls backward() and optimizer.step() but gradients are never zeroed"
    triggers = ("backward",)

    def check(self, facts: FileFacts):
        if _clears_gradients(facts.source):
            return
        for step in facts.method_calls("step"):
            if not is_optimizer_step(facts, step):
                continue
            found = self._training_loop(facts, step)
            if found is None:
                continue
            loop, backward, via = found
            if self._optimizer_built_in(facts, step, loop):
                continue  # a fresh optimizer every iteration: a one-off step (numeric checks), not a training loop
            where = f" (through `{snippet(facts, via.node, 40)}`)" if via is not None else ""
            yield self.report(
                step.node,
                f"`{snippet(facts, step.node)}` runs in a loop{where} that calls `{snippet(facts, backward.node)}`, but "
                "the gradients are never zeroed (no `zero_grad()` anywhere in the file): backward() adds to `.grad`, "
                "so every update uses the sum of all gradients since the start and training diverges.",
                fix_hint="Call `optimizer.zero_grad()` after `optimizer.step()` (or at the start of each iteration).",
                related=((backward.node, "each backward adds to the gradients here"),),
            )

    @staticmethod
    def _training_loop(facts: FileFacts, step):
        """(loop, backward call, the loop's call into the helper or None) for the loop that runs ``step``
        together with a backward: directly, or through the file's own helpers up to 3 calls deep (``for batch
        in loader: self.train_step(batch)`` where ``train_step`` calls backward and ``optimizer.step()``)."""
        loop = innermost_loop(step)
        if loop is not None:
            backward = next(
                (c for c in facts.calls if in_loop(c, loop) and is_backward(facts, c) and innermost_loop(c) is loop), None
            )
            return (loop, backward, None) if backward is not None else None
        for loop, via in calling_loops(facts, step.scope):
            backward = next((c for c, _ in reach(facts, loop, depth=3) if is_backward(facts, c)), None)
            if backward is not None:
                return loop, backward, via
        return None

    @staticmethod
    def _optimizer_built_in(facts: FileFacts, step, loop) -> bool:
        origin = facts.value(step.receiver, step.order, step.scope).origin().node
        site = facts.call_site(origin) if origin is not None else None
        return site is not None and in_loop(site, loop)
