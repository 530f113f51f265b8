from __future__ import annotations

import re
from typing import Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import FileFacts, IfFrame, LoopFrame, WithFrame, call_arg, int_value, name_key
from gpudoctor.check.facts.nodes import walk
from gpudoctor.check.queries import accelerator_kwargs, prepares_of, snippet
from gpudoctor.check.rule import Rule

# The length argument of the common schedules: keyword, and position for the transformers helpers.
_LENGTH_KEYWORDS = ("num_training_steps", "total_steps", "T_max", "total_iters")
_LENGTH_POSITION = {"transformers.get_scheduler": 3}
_DEFAULT_LENGTH_POSITION = 2  # get_linear_schedule_with_warmup(optimizer, warmup, num_training_steps)
_LAMBDA_SCHEDULERS = {"torch.optim.lr_scheduler.LambdaLR", "torch.optim.lr_scheduler.MultiplicativeLR"}


class SchedulerNotPreparedWithAccumulation(Rule):
    """``lr_scheduler.step()`` on every micro-batch inside ``accelerator.accumulate(...)`` while the
    scheduler was never passed to ``accelerator.prepare``, and its length counts optimizer updates
    (``len(loader) / gradient_accumulation_steps``). Only a prepared scheduler (accelerate's
    ``AcceleratedScheduler``) skips the micro-batches without an optimizer update; this one advances N
    times per update, so the schedule ends after 1/N of training."""

    code = "GD114"
    name = "scheduler-not-prepared-with-accumulation"
    summary = "LR scheduler left out of accelerator.prepare while accumulating: it steps every micro-batch"
    triggers = ("accumulate",)

    def check(self, facts: FileFacts):
        prepared = {name_key(a.value) for site in facts.prepare_calls() for a in site.node.args} - {None}
        for site in facts.method_calls("step"):
            key = name_key(site.receiver) if site.receiver is not None else None
            if key is None or key in prepared:
                continue
            # through temporaries and the file's own helpers (``sched = make_scheduler(opt)``)
            created = facts.built_by(site.receiver, site.order, site.scope)
            if not isinstance(created, cst.Call):
                continue
            created_order, created_scope = facts._position_of(created)
            q = facts.qualname(created.func) or ""
            if not apis.is_scheduler(q) or facts.value(site.receiver, site.order, site.scope).kind != "scheduler":
                continue
            accumulate = self._accumulate_block(facts, site)
            if accumulate is None or _guarded(facts, site):
                continue
            kwargs = accelerator_kwargs(facts, accumulate.receiver, site.order, site.scope)
            steps_node = kwargs.get("gradient_accumulation_steps")
            if steps_node is None:
                continue  # accumulation not set in code (launch config): the file cannot show N
            steps = int_value(steps_node)
            if steps is not None and steps <= 1:
                continue
            length = _length_argument(created, q)
            if length is None or not _counts_updates(facts, length, created_order, created_scope, steps_node):
                continue  # sized in micro-batches (or unknown): stepping every micro-batch then fits it
            n = snippet(facts, steps_node)
            acc = snippet(facts, accumulate.receiver)
            related = [
                (accumulate.item, f"`{acc}.accumulate(...)` syncs gradients every {n} micro-batches"),
                (steps_node, "the accumulation steps are set here"),
                (created, f"`{key}` is sized in optimizer updates here (`{snippet(facts, length, 50)}`) and not prepared"),
            ]
            related += [
                (prepare.node, f"`{acc}.prepare(...)` leaves `{key}` out here")
                for prepare in _prepares_without(facts, accumulate.receiver, site, created)
            ]
            yield self.report(
                site.node,
                f"`{key}.step()` runs on every micro-batch inside `{acc}.accumulate(...)` "
                f"(gradient_accumulation_steps={n}), but `{key}` was never passed to `{acc}.prepare`: only a prepared "
                "scheduler (accelerate's `AcceleratedScheduler`) skips the micro-batches without an optimizer update. "
                f"It advances {n} times per update while its length `{snippet(facts, length, 50)}` counts updates, so "
                f"warmup ends after 1/{n} of its steps and the learning rate reaches its final value (0 for linear or "
                f"cosine decay) after 1/{n} of training: the remaining updates do not train.",
                fix_hint=f"Pass it to prepare (`..., {key} = {acc}.prepare(..., {key})`), or step it only under "
                f"`if {acc}.sync_gradients:`.",
                related=tuple(related),
            )

    @staticmethod
    def _accumulate_block(facts: FileFacts, site) -> Optional[WithFrame]:
        """The ``with <accelerator>.accumulate(...)`` around the step, or one in the same loop body."""
        for frame in site.context:
            if isinstance(frame, WithFrame) and frame.method == "accumulate" and frame.receiver is not None:
                if facts.value(frame.receiver, site.order, site.scope).kind == "accelerator":
                    return frame
        loops = [f for f in site.context if isinstance(f, LoopFrame)]
        if not loops:
            return None
        # A call inside an accumulate block of the same loop (the block's own frame is on its body's calls).
        for other in facts.calls:
            if other.scope is not site.scope or loops[-1] not in other.context:
                continue
            for frame in other.context:
                if isinstance(frame, WithFrame) and frame.method == "accumulate" and frame.receiver is not None:
                    if facts.value(frame.receiver, other.order, other.scope).kind == "accelerator":
                        return frame
        return None


def _prepares_without(facts: FileFacts, accelerator: cst.BaseExpression, step, scheduler: cst.Call) -> list:
    """The ``prepare`` calls of the accumulating accelerator where the scheduler belongs: those that prepare
    its optimizer, else the accelerator's only ``prepare``."""
    own = prepares_of(facts, accelerator, step.order, step.scope)
    optimizer = name_key(call_arg(scheduler, 0, "optimizer"))
    with_optimizer = [site for site in own if optimizer is not None and optimizer in {name_key(a.value) for a in site.node.args}]
    return with_optimizer or (own if len(own) == 1 else [])


def _guarded(facts: FileFacts, site) -> bool:
    """Stepped only at an update: ``if accelerator.sync_gradients:`` or a ``step % N == 0`` test."""
    return any(
        isinstance(f, IfFrame) and re.search(r"sync_gradients|%", facts.module.code_for_node(f.test)) for f in site.context
    )


def _length_argument(call: cst.Call, qualname: str) -> Optional[cst.BaseExpression]:
    for keyword in _LENGTH_KEYWORDS:
        found = call_arg(call, keyword=keyword)
        if found is not None:
            return found
    if qualname.startswith("transformers."):
        return call_arg(call, _LENGTH_POSITION.get(qualname, _DEFAULT_LENGTH_POSITION))
    if qualname in _LAMBDA_SCHEDULERS:
        # ``LambdaLR(opt, lambda s: 1 - s / max_train_steps)``: the length is inside the lambda (its names are
        # followed like any other length expression)
        lr_lambda = call_arg(call, 1, "lr_lambda")
        return lr_lambda if isinstance(lr_lambda, cst.Lambda) else None
    return None


def _counts_updates(facts: FileFacts, expr: cst.BaseExpression, order: int, scope, steps_node, depth: int = 0) -> bool:
    """The length divides by the accumulation steps, through names (``max_train_steps =
    epochs * ceil(len(loader) / args.gradient_accumulation_steps)``)."""
    if depth > 4 or expr is None:
        return False
    steps_text = facts.module.code_for_node(steps_node)
    for node in walk(expr):
        if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, (cst.Divide, cst.FloorDivide)):
            if _is_accumulation_steps(facts, node.right, order, scope, steps_text):
                return True
        key = name_key(node) if isinstance(node, (cst.Name, cst.Attribute)) else None
        if key is not None:
            binding = facts.binding_at(key, order, scope)
            if binding is not None and binding.value is not None and binding.value is not expr:
                if _counts_updates(facts, binding.value, binding.order, binding.scope, steps_node, depth + 1):
                    return True
        elif isinstance(node, cst.Attribute):  # ``args.max_train_steps = epochs * updates_per_epoch`` (no_trainer)
            store = facts.attribute_store(node, order, scope)
            if store is not None and store.value is not expr:
                if _counts_updates(facts, store.value, store.order, store.scope, steps_node, depth + 1):
                    return True
    return False


def _is_accumulation_steps(facts: FileFacts, divisor: cst.BaseExpression, order: int, scope, steps_text: str,
                           depth: int = 0) -> bool:
    """The divisor is the accumulation count: named so, written like the Accelerator's argument, or a parameter
    the caller fills with it (``def build(loader, accum)`` ... ``build(loader, 8)``)."""
    text = facts.module.code_for_node(divisor)
    if "accumulation" in text or text == steps_text:
        return True
    key = name_key(divisor)
    binding = facts.binding_at(key, order, scope) if key is not None and depth < 3 else None
    if binding is None:
        return False
    if binding.kind == "param":
        passed = facts.param_argument(binding)
        return passed is not None and _is_accumulation_steps(facts, passed[0], passed[1], passed[2], steps_text, depth + 1)
    if binding.kind == "assign" and binding.value is not None:
        return _is_accumulation_steps(facts, binding.value, binding.order, binding.scope, steps_text, depth + 1)
    return False
