from __future__ import annotations

import re

import libcst as cst

from gpudoctor.check import versions
from gpudoctor.check.facts import TRAIT_PREPARED, FileFacts, int_value
from gpudoctor.check.finding import Applicability, Edit, Fix, Severity
from gpudoctor.check.queries import (
    accelerator_calls, accelerator_for, accelerator_kwargs, mixed_precision_fp16, prepare_behind, reachable_accelerator, snippet,
)
from gpudoctor.check.rule import Rule

# fp16, accumulation or DeepSpeed named outside the Accelerator call (launch comments, config flags).
_CONFIG_TEXT = re.compile(r"\bfp16\b|mixed_precision|gradient_accumulation|deepspeed|\bfsdp\b", re.IGNORECASE)


def _caller_accelerator(facts: FileFacts, scope, depth: int = 0):
    """The prepare behind a prepared optimizer that a function calling ``scope`` steps, or its accelerator's
    training call (``accumulate``, ``backward``, ``clip_grad_norm_``), up to three calls up: ``training_step(batch)``
    does the backward, the loop that calls it runs ``with accelerator.accumulate(model)`` and steps the prepared
    optimizer. A caller that only prepares a model (accelerate's own gradient-inspection scripts) does not count."""
    if depth >= 3:
        return None
    for caller in facts.call_sites_of(scope):
        if caller.scope is scope:
            continue
        trains = [c for c in accelerator_calls(facts, caller.scope) if c.method in _TRAINING_CALLS]
        found = prepare_behind(facts, caller) or (trains[0] if trains else None)
        found = found or _caller_accelerator(facts, caller.scope, depth + 1)
        if found is not None:
            return found
    return None


def _steps_unprepared_optimizer(facts: FileFacts, scope) -> bool:
    """The function runs its own plain loop: it steps an optimizer that never went through prepare (accelerate's
    ``mock_training`` baseline, called next to the accelerated run it is compared with)."""
    for step in facts.method_calls("step"):
        if step.scope is scope and step.receiver is not None:
            value = facts.value(step.receiver, step.order, step.scope)
            if value.kind == "optimizer" and value.trait(TRAIT_PREPARED) is None:
                return True
    return False


_TRAINING_CALLS = {"accumulate", "backward", "clip_grad_norm_", "clip_grad_value_"}


class LossBackwardWithAccelerator(Rule):
    """``loss.backward()`` where an Accelerator drives training: the loss is neither scaled (fp16),
    nor divided for gradient accumulation, nor routed through DeepSpeed."""

    code = "GD104"
    name = "loss-backward-with-accelerator"
    summary = "loss.backward() instead of accelerator.backward(loss) in an Accelerator training loop"
    fixable = "safe"
    triggers = ("backward",)

    def check(self, facts: FileFacts):
        if not facts.prepare_calls():
            return
        for site in facts.method_calls("backward"):
            if site.qualname is not None or site.receiver is None:
                continue  # torch.autograd.backward(...) or a module attribute
            accelerator = accelerator_for(facts, site)
            receiver = accelerator.receiver if accelerator is not None else None
            if accelerator is None:
                # A method or helper that steps an optimizer prepared elsewhere (``self.opt.step()``).
                accelerator = prepare_behind(facts, site)
                if accelerator is None and not _steps_unprepared_optimizer(facts, site.scope):
                    accelerator = _caller_accelerator(facts, site.scope)
                if accelerator is None:
                    continue  # neither this function nor the functions that call it touch the accelerator
                receiver = reachable_accelerator(facts, accelerator, site)
            receiver_value = facts.value(site.receiver, site.order, site.scope)
            if receiver_value.kind == "accelerator":
                continue
            acc_name = snippet(facts, receiver) if receiver is not None else "accelerator"
            loss = snippet(facts, site.receiver)
            fix = None
            if receiver is not None and all(a.keyword is not None for a in site.node.args):
                replacement = cst.Call(
                    func=cst.Attribute(value=receiver.deep_clone(), attr=cst.Name("backward")),
                    args=[cst.Arg(site.receiver.deep_clone()), *[a.deep_clone() for a in site.node.args if a.keyword]],
                )
                fix = Fix(f"Replace with `{acc_name}.backward({loss})`", Applicability.SAFE, (Edit(site.node, replacement),))
            kwargs = accelerator_kwargs(facts, accelerator.receiver, accelerator.order, accelerator.scope)
            steps = int_value(kwargs.get("gradient_accumulation_steps"))
            accumulates = "gradient_accumulation_steps" in kwargs and (steps is None or steps > 1)
            if mixed_precision_fp16(facts, kwargs) or accumulates:
                severity = Severity.ERROR
            elif "mixed_precision" not in kwargs or _CONFIG_TEXT.search(facts.source):
                # Not set in code: `accelerate launch` applies the config file's mixed precision.
                severity = Severity.WARNING
            else:
                severity = Severity.INFO  # precision set in code to no/bf16, no accumulation: as written it works
            causes = (
                [(kwargs["mixed_precision"], "fp16 mixed precision (a GradScaler) is turned on here")]
                if "mixed_precision" in kwargs and mixed_precision_fp16(facts, kwargs) else []
            )
            if accumulates:
                causes.append((kwargs["gradient_accumulation_steps"], "the loss is to be divided by these accumulation steps"))
            yield self.report(
                site.node,
                f"`{loss}.backward()` bypasses `{acc_name}.backward({loss})`, which (accelerate "
                f"{versions.installed('accelerate') or '1.x'}) divides the loss by `gradient_accumulation_steps`, "
                "scales it with the GradScaler under fp16 mixed precision and, under DeepSpeed, runs the engine's own "
                "backward. Without it: with fp16 the prepared optimizer unscales gradients that were never scaled "
                "(every update divided by the loss scale, 65536 at the start); with accumulation the gradients are N "
                "times too large; under DeepSpeed the engine's backward never runs. Under FSDP accelerate's backward "
                "is `loss.backward()` as well, so there the risk is the fp16 loss scaling (a ShardedGradScaler) that "
                "the launch config can turn on.",
                fix_hint=f"Use `{acc_name}.backward({loss})`." if receiver is not None else (
                    f"Call `backward` on the Accelerator that prepared the optimizer (`{snippet(facts, accelerator.node.func)}`): "
                    f"pass it to this function and use `accelerator.backward({loss})`."
                ),
                fix=fix,
                severity=severity,
                related=tuple(causes),
            )
