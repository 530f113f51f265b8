from __future__ import annotations

from gpudoctor.check.facts import FileFacts, IfFrame, WithFrame, int_value
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import accelerator_kwargs, mixed_precision_fp16, snippet
from gpudoctor.check.rule import Rule


class ClipEveryMicroStep(Rule):
    """``accelerator.clip_grad_norm_`` inside ``accelerator.accumulate(...)`` without an
    ``if accelerator.sync_gradients:`` guard: it runs on every micro-batch. With fp16 the second call
    before an optimizer update raises; without, it clips partial sums."""

    code = "GD106"
    name = "clip-every-micro-step"
    summary = "accelerator.clip_grad_norm_ on every micro-batch under gradient accumulation"
    triggers = ("accumulate",)

    def check(self, facts: FileFacts):
        for site in facts.method_calls("clip_grad_norm_", "clip_grad_value_"):
            if site.receiver is None or facts.value(site.receiver, site.order, site.scope).kind != "accelerator":
                continue
            in_accumulate = any(
                isinstance(f, WithFrame) and f.method == "accumulate" for f in site.context
            )
            guarded = any(
                isinstance(f, IfFrame) and "sync_gradients" in facts.module.code_for_node(f.test) for f in site.context
            )
            if not in_accumulate or guarded:
                continue
            kwargs = accelerator_kwargs(facts, site.receiver, site.order, site.scope)
            steps_node = kwargs.get("gradient_accumulation_steps")
            steps = int_value(steps_node)
            if steps_node is None or (steps is not None and steps <= 1):
                continue  # no accumulation configured in code: every step syncs
            acc = snippet(facts, site.receiver)
            fp16 = mixed_precision_fp16(facts, kwargs)
            if fp16:
                effect = (
                    "with fp16 the second micro-batch raises \"RuntimeError: unscale_() has already been called on "
                    "this optimizer since the last update().\""
                )
            else:
                effect = "it clips partial gradient sums, not the accumulated gradient (and with fp16 it raises \"unscale_() has already been called\")"
            yield self.report(
                site.node,
                f"`{acc}.{site.method}` runs on every micro-batch inside `{acc}.accumulate(...)` "
                f"(gradient_accumulation_steps={snippet(facts, steps_node)}): {effect}.",
                fix_hint=f"Guard it: `if {acc}.sync_gradients: {acc}.{site.method}(...)`.",
                severity=Severity.ERROR if fp16 else Severity.WARNING,
                related=(
                    *((f.item, f"`{acc}.accumulate(...)` syncs gradients only every few micro-batches")
                      for f in site.context if isinstance(f, WithFrame) and f.method == "accumulate"),
                    (steps_node, "the accumulation steps are set here"),
                ),
            )
