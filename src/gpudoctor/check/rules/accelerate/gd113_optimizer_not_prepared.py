from __future__ import annotations

from gpudoctor.check.facts import TRAIT_PREPARED, FileFacts, LoopFrame, int_value
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import accelerator_kwargs, mixed_precision_fp16, prepares_of, snippet
from gpudoctor.check.rule import Rule


class OptimizerNotPrepared(Rule):
    """``accelerator.backward(loss)`` with fp16 or gradient accumulation configured, while the loop
    steps an optimizer that ``accelerator.prepare`` never wrapped: the backward scales (fp16) or divides
    (accumulation) the loss, and only the prepared optimizer undoes that."""

    code = "GD113"
    name = "optimizer-not-prepared"
    summary = "accelerator.backward with fp16/accumulation, but the stepped optimizer was never prepared"
    triggers = ("backward",)

    def check(self, facts: FileFacts):
        # Optimizers handed to prepare somewhere: whether the loop uses the result is GD103's question.
        handed_to_prepare = {
            id(facts.value(arg.value, site.order, site.scope).origin().node)
            for site in facts.prepare_calls()
            for arg in site.node.args
        }
        reported = set()
        for backward in facts.method_calls("backward"):
            if backward.receiver is None:
                continue
            if facts.value(backward.receiver, backward.order, backward.scope).kind != "accelerator":
                continue
            kwargs = accelerator_kwargs(facts, backward.receiver, backward.order, backward.scope)
            fp16 = mixed_precision_fp16(facts, kwargs)
            steps = int_value(kwargs.get("gradient_accumulation_steps"))
            # A value the file does not fix (``cfg.ga``, ``args.gradient_accumulation_steps``) is read as accumulating,
            # as GD106/GD114 do; the finding is then a warning (it is harmless when the value is 1).
            unknown_steps = steps is None and "gradient_accumulation_steps" in kwargs
            accumulating = unknown_steps or (steps is not None and steps > 1)
            if not (fp16 or accumulating):
                continue
            loops = [f for f in backward.context if isinstance(f, LoopFrame)]
            if not loops:
                continue
            loop = loops[-1]
            for step in facts.method_calls("step"):
                if id(step.node) in reported or step.receiver is None or not any(f is loop for f in step.context):
                    continue
                value = facts.value(step.receiver, step.order, step.scope)
                if value.kind != "optimizer" or value.has(TRAIT_PREPARED) or id(value.origin().node) in handed_to_prepare:
                    continue
                reported.add(id(step.node))
                acc, opt = snippet(facts, backward.receiver), snippet(facts, step.receiver)
                effects = []
                if fp16:
                    effects.append(
                        "with `mixed_precision=\"fp16\"` on a GPU the loss is multiplied by the scaler (65536 at the "
                        "start) and only a prepared optimizer unscales: this update is 65536x too large and steps with "
                        "inf/NaN gradients are not skipped"
                    )
                if accumulating:
                    n = steps if steps is not None else "N"
                    written = snippet(facts, kwargs["gradient_accumulation_steps"])
                    effects.append(
                        f"with `gradient_accumulation_steps={written}` the loss is divided by {n}, but this "
                        "optimizer steps on every micro-batch: no accumulation, and a learning rate effectively "
                        f"{n}x smaller" + (" (when it is more than 1)" if steps is None else "")
                    )
                yield self.report(
                    step.node,
                    f"`{opt}.step()` steps an optimizer that `{acc}.prepare` never wrapped, while "
                    f"`{acc}.backward(...)` is used: " + "; ".join(effects) + ".",
                    fix_hint=f"`{opt} = {acc}.prepare({opt})` (with the model and dataloaders), and step what prepare returns.",
                    related=(
                        (backward.node, f"`{acc}.backward(...)` scales/divides the loss here"),
                        *((prepare.node, f"`{acc}.prepare(...)` leaves `{opt}` out here")
                          for prepare in _prepares_without_optimizer(facts, backward, step)),
                        *(((kwargs["mixed_precision"], "fp16 mixed precision (a GradScaler) is turned on here"),) if fp16 else ()),
                        *(((kwargs["gradient_accumulation_steps"], "the accumulation steps are set here"),)
                          if accumulating else ()),
                    ),
                    severity=Severity.WARNING if unknown_steps and not fp16 else None,
                )


def _prepares_without_optimizer(facts: FileFacts, backward, step) -> list:
    """Where the optimizer belongs: the accelerator's only ``prepare`` call, else those in the stepping function."""
    own = prepares_of(facts, backward.receiver, backward.order, backward.scope)
    return own if len(own) == 1 else [site for site in own if site.scope is step.scope]
