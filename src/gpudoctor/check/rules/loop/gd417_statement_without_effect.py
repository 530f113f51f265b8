from __future__ import annotations

import re

import libcst as cst

from gpudoctor.check.facts import FileFacts
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule

# Context managers whose constructor does nothing until ``__enter__`` (torch 2.13: ``no_grad.__init__`` only
# records state for the decorator form, ``inference_mode``/``autocast`` store their arguments). Not
# ``torch.set_grad_enabled(False)``: its constructor switches grad mode at once, so the statement form works.
_CONTEXT_ONLY = {
    "torch.no_grad": "gradients are still recorded (each forward keeps its graph and activations)",
    "torch.inference_mode": "gradients are still recorded (each forward keeps its graph and activations)",
    "torch.enable_grad": "nothing is re-enabled",
    "torch.autocast": "nothing runs in reduced precision: the code after it stays in float32",
    "torch.amp.autocast": "nothing runs in reduced precision: the code after it stays in float32",
    "torch.cuda.amp.autocast": "nothing runs in reduced precision: the code after it stays in float32",
    "torch.cpu.amp.autocast": "nothing runs in reduced precision: the code after it stays in float32",
}
_ACCELERATOR_CONTEXTS = {
    "accumulate": "no gradient accumulation happens: gradients sync and the optimizer steps on every batch",
    "autocast": "nothing runs in reduced precision",
    "no_sync": "gradients are still synchronised on every backward",
}
# Methods whose only effect is the call: read as a bare attribute they do nothing.
_METHODS = {
    "eval": "the model stays in training mode (dropout on, batch-norm statistics updated)",
    "train": "the model stays in evaluation mode",
    "zero_grad": "the gradients are not cleared and keep accumulating",
    "step": "nothing is updated",
    "backward": "no gradient is computed",
    "cuda": "nothing is moved",
}
_BARE_METHOD = re.compile(r"^[ \t]*[\w.\[\]()'\"]+\.(?:" + "|".join(_METHODS) + r")[ \t]*(?:#.*)?$", re.MULTILINE)


class StatementWithoutEffect(Rule):
    """A statement that does nothing although it reads like a training step: a context manager called instead of
    entered (``torch.no_grad()`` on its own line, ``accelerator.accumulate(model)`` without ``with``), or a method
    named but not called (``model.eval``, ``loss.backward``, ``optimizer.zero_grad``)."""

    code = "GD417"
    name = "statement-without-effect"
    summary = "torch.no_grad()/autocast()/accumulate() called without `with`, or model.eval / loss.backward without ()"
    severity = Severity.WARNING
    triggers = ("no_grad", "inference_mode", "autocast", "enable_grad", "accumulate", "no_sync", "eval", "train",
                "zero_grad", "step", "backward", "cuda")

    def check(self, facts: FileFacts):
        for site in facts.calls:
            if not site.statement:
                continue
            effect = _CONTEXT_ONLY.get(site.qualname or "")
            if effect is None and site.receiver is not None and site.method in _ACCELERATOR_CONTEXTS:
                if facts.value(site.receiver, site.order, site.scope).kind == "accelerator":
                    effect = _ACCELERATOR_CONTEXTS[site.method]
            if effect is None:
                continue
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node)}` on its own line only builds a context manager and drops it: it acts "
                f"only when entered with `with`, so {effect}.",
                fix_hint=f"Enter it: `with {snippet(facts, site.node)}:` around the code it should cover (or use it as "
                "a decorator).",
            )
        if _BARE_METHOD.search(facts.source):
            for node in _bare_method_statements(facts.module):
                attr = node.attr.value
                yield self.report(
                    node,
                    f"`{snippet(facts, node)}` names the method without calling it: the statement has no effect, so "
                    f"{_METHODS[attr]}.",
                    fix_hint=f"Call it: `{snippet(facts, node)}()`.",
                )


def _bare_method_statements(module: cst.Module):
    """``x.eval`` (an attribute of one of ``_METHODS``) as a whole expression statement."""
    stack: list[cst.CSTNode] = [module]
    while stack:
        node = stack.pop()
        if isinstance(node, cst.Expr) and isinstance(node.value, cst.Attribute) and node.value.attr.value in _METHODS:
            yield node.value
            continue
        if isinstance(node, (cst.BaseExpression,)):
            continue  # statements never sit inside expressions (lambdas hold expressions only)
        stack.extend(reversed(node.children))
