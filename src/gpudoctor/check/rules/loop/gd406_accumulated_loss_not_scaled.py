from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import Binding, FileFacts, FunctionFrame, LoopFrame, call_arg, name_key
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import accelerator_kwargs, snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.loop._common import (
    _ACCUM_WORD,
    accumulation_guard,
    in_loop,
    innermost_loop,
    is_backward,
    is_optimizer_step,
)


def _is_scale_call(node: Optional[cst.CSTNode]) -> bool:
    """``scaler.scale(loss)``: GradScaler's scaled loss, whose backward accumulates the loss's gradient."""
    return isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value == "scale"


def _divides(node: Optional[cst.CSTNode]) -> bool:
    if isinstance(node, cst.BinaryOperation):
        if isinstance(node.operator, (cst.Divide, cst.FloorDivide, cst.Multiply)):
            return True
        return _divides(node.left) or _divides(node.right)
    return False


# Optimizers whose update divides the gradient by a running estimate of its own magnitude (Adam's m / sqrt(v),
# RMSprop, Adagrad, Adafactor) or takes its sign (Lion): multiplying every gradient by N leaves the update as it was
# (up to eps). SGD's update is lr * grad: N times the gradient is N times the step.
_SCALE_INVARIANT = {
    "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop", "Adafactor", "Lion", "FusedAdam",
    "Adam8bit", "AdamW8bit", "Adam32bit", "AdamW32bit", "PagedAdam", "PagedAdamW", "PagedAdam8bit", "PagedAdamW8bit",
    "PagedAdamW32bit", "Lion8bit", "PagedLion", "PagedLion8bit", "DeepSpeedCPUAdam",
}


def _scale_invariant(facts: FileFacts, step) -> bool:
    """The optimizer ``step`` steps is certainly of a scale-invariant class (and without coupled L2 weight decay,
    whose relative strength N would change): an undivided accumulated loss changes nothing."""
    optimizer = step.receiver
    if optimizer is not None and facts.value(optimizer, step.order, step.scope).kind == "grad_scaler":
        optimizer = call_arg(step.node, 0, "optimizer")
    if optimizer is None:
        return False
    origin = facts.value(optimizer, step.order, step.scope).origin().node
    if not isinstance(origin, cst.Call):
        return False
    name = (facts.qualname(origin.func) or "").split(".")[-1]
    if name not in _SCALE_INVARIANT:
        return False
    decay = call_arg(origin, keyword="weight_decay")
    coupled = name in ("Adam", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adamax")
    return not (coupled and decay is not None and getattr(decay, "value", None) not in ("0", "0.0"))


class AccumulatedLossNotScaled(Rule):
    """Manual gradient accumulation (``optimizer.step()`` every N micro-batches) where the loss passed
    to ``backward()`` is not divided by N: the accumulated gradient is the *sum* of N mean gradients,
    N times too large (effective learning rate and clipping threshold are off by N)."""

    code = "GD406"
    name = "accumulated-loss-not-scaled"
    summary = "Manual gradient accumulation without dividing the loss by the number of accumulation steps"
    severity = Severity.WARNING
    triggers = ("backward",)

    def check(self, facts: FileFacts):
        for backward in facts.calls:
            if not is_backward(facts, backward):
                continue
            loop = innermost_loop(backward)
            if loop is None or accumulation_guard(facts, backward, loop) is not None:
                continue
            step = next(
                (
                    s
                    for s in facts.method_calls("step")
                    if innermost_loop(s) is loop and in_loop(s, loop) and is_optimizer_step(facts, s)
                    and accumulation_guard(facts, s, loop) is not None
                ),
                None,
            )
            guard_text = None
            if step is None:
                step = self._step_after_micro_loop(facts, backward, loop)
                if step is None:
                    continue
                guard_text = f"after the micro-batch loop `for ... in {snippet(facts, loop.iter)}`"
            loss = self._loss_expr(facts, backward)
            if loss is None or not self._plain_loss(facts, loss, backward, loop):
                continue
            invariant = _scale_invariant(facts, step)
            if invariant and not self._clipped(facts, loop):
                continue  # Adam-like update of N x the mean gradient is the same update
            effect = (
                "the clipping threshold meets an N-times-too-large norm, so far more updates are clipped (the Adam-like "
                "update itself does not change with the scale)"
                if invariant
                else "the effective learning rate (and any clipping threshold) is off by N"
            )
            computed = facts.assignment_of(loss, backward.order, backward.scope)  # ``loss = model(**batch).loss``
            if computed is not None and computed.value is None:
                computed = None
            if guard_text is None:
                guard_text = f"only when `{snippet(facts, accumulation_guard(facts, step, loop).test)}`"
            yield self.report(
                backward.node,
                f"`{snippet(facts, backward.node)}` accumulates gradients for `{snippet(facts, step.node)}`, which runs "
                f"{guard_text}, but the loss is not divided by the number of accumulation "
                f"steps: the update uses the sum of the micro-batch gradients, N times the mean: {effect}.",
                fix_hint="Divide the loss by the number of accumulation steps before backward(): `(loss / accum_steps).backward()`.",
                related=(
                    *(((computed.value, "the loss is computed here, undivided"),) if computed is not None else ()),
                    (step.node, "the summed gradients are applied here"),
                ),
            )

    @staticmethod
    def _step_after_micro_loop(facts: FileFacts, backward, loop):
        """The optimizer step that follows a micro-batch loop ``for _ in range(grad_accum_steps)`` (its bound names
        accumulation) whose body back-propagates and never steps: nanoGPT's layout, the step right after the loop in
        the enclosing loop or function."""
        node = loop.node
        if not (isinstance(node, cst.For) and isinstance(node.iter, cst.Call) and isinstance(node.iter.func, cst.Name)):
            return None
        if node.iter.func.value != "range" or not node.iter.args:
            return None
        if not _ACCUM_WORD.search(facts.module.code_for_node(node.iter.args[-1 if len(node.iter.args) <= 2 else 1].value)):
            return None
        steps = [s for s in facts.method_calls("step") if is_optimizer_step(facts, s)]
        if any(in_loop(s, loop) for s in steps):
            return None
        frames = list(backward.context)
        index = next(i for i, f in enumerate(frames) if f is loop)
        parent = next((f for f in reversed(frames[:index]) if isinstance(f, (LoopFrame, FunctionFrame))), None)
        parent_loop = parent if isinstance(parent, LoopFrame) else None
        return next(
            (
                s for s in steps
                if s.order > loop.end_order and s.scope is backward.scope and innermost_loop(s) is parent_loop
                and (parent_loop is None or in_loop(s, parent_loop))
            ),
            None,
        )

    @staticmethod
    def _clipped(facts: FileFacts, loop) -> bool:
        """Gradients are clipped in the loop: the threshold meets the N-times-too-large norm."""
        return any(
            in_loop(site, loop) and (site.qualname in apis.TORCH_CLIP or site.method in ("clip_grad_norm_", "clip_grad_value_"))
            for site in facts.calls
        )

    @staticmethod
    def _loss_expr(facts: FileFacts, backward) -> Optional[cst.BaseExpression]:
        receiver = backward.receiver
        if backward.qualname == "torch.autograd.backward":
            return call_arg(backward.node, 0, "tensors")
        value = facts.value(receiver, backward.order, backward.scope)
        if value.kind == "accelerator":
            kwargs = accelerator_kwargs(facts, receiver, backward.order, backward.scope)
            if "gradient_accumulation_steps" in kwargs:
                return None  # accelerator.backward divides by the configured steps
            return call_arg(backward.node, 0, "loss")
        scaled = receiver
        binding = facts.assignment_of(receiver, backward.order, backward.scope)
        if binding is not None and _is_scale_call(binding.value):
            scaled = binding.value  # ``scaled = scaler.scale(loss)`` ... ``scaled.backward()``
        if _is_scale_call(scaled):
            return call_arg(scaled, 0)
        return receiver

    @staticmethod
    def _plain_loss(facts: FileFacts, loss: cst.BaseExpression, backward, loop, depth: int = 0) -> bool:
        """True when the loss is certainly an undivided loss: ``outputs.loss``, ``criterion(out, y)``...,
        also through temporaries (``l = out.loss; total = l``)."""
        if depth > 6 or _divides(loss) or _ACCUM_WORD.search(facts.module.code_for_node(loss)):
            return False
        key = name_key(loss)
        if key is None:
            return _is_loss_source(facts, loss) or facts.value(loss, backward.order, backward.scope).has("loss")
        # Any in-place division (`loss /= accum`) or rebinding with a division in the loop.
        for site in facts.aug_assigns:
            if site.target_key == key and in_loop(site, loop) and site.order < backward.order:
                return False
        binding: Optional[Binding] = facts.binding_at(key, backward.order, backward.scope)
        if binding is None or binding.kind != "assign" or binding.value is None:
            return False
        for other in backward.scope.bindings.get(key, ()):
            if other.order < backward.order and other.value is not None and in_loop(other, loop):
                if _divides(other.value) or _ACCUM_WORD.search(facts.module.code_for_node(other.value)):
                    return False
        at = _At(binding.order, binding.scope)
        return AccumulatedLossNotScaled._plain_loss(facts, binding.value, at, loop, depth + 1)


class _At:
    """A position to evaluate at (what ``_plain_loss`` needs of a call site)."""

    def __init__(self, order: int, scope) -> None:
        self.order, self.scope = order, scope


def _is_loss_source(facts: FileFacts, node: cst.BaseExpression) -> bool:
    if isinstance(node, cst.Attribute) and node.attr.value == "loss":
        return True
    if isinstance(node, cst.Subscript) and node.slice and "loss" in facts.module.code_for_node(node.slice[0]):
        return True
    if isinstance(node, cst.Call):
        q = facts.qualname(node.func)
        if q and (q.startswith("torch.nn.functional.") and ("loss" in q or "entropy" in q)):
            return True
        key = name_key(node.func)
        if key:
            binding = facts.binding_at(key, 1 << 30, facts.module_scope)
            if binding is None:
                for scope in facts.functions:
                    if key in scope.bindings:
                        binding = scope.bindings[key][-1]
                        break
            if binding is not None and isinstance(binding.value, cst.Call):
                bq = facts.qualname(binding.value.func) or ""
                if bq.startswith("torch.nn.") and bq.endswith("Loss"):
                    return True
    return False
