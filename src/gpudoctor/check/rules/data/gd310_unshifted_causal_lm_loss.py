from __future__ import annotations

import re
from typing import Optional

import libcst as cst

from gpudoctor.check.facts import FileFacts, call_arg, name_key, string_value
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import language_model_kind, model_class_names, snippet
from gpudoctor.check.rule import Rule

_CROSS_ENTROPY = {"torch.nn.functional.cross_entropy", "torch.nn.functional.nll_loss"}
_CROSS_ENTROPY_MODULES = {"torch.nn.CrossEntropyLoss", "torch.nn.NLLLoss"}
# Reshapes and casts that keep every position where it is.
_KEEPS_POSITIONS = {"view", "reshape", "contiguous", "float", "to", "flatten", "log_softmax", "type", "half", "bfloat16"}
# Heads whose logits are per sequence or per token of the *input* (no next-token objective).
_OTHER_HEADS = re.compile(r"For(Sequence|Token)Classification|ForQuestionAnswering|ForMultipleChoice|ValueHead")
# A slice that drops the first or last position (``[..., :-1, :]``, ``[:, 1:]``): a shift written somewhere.
_SHIFT = re.compile(r":\s*-\s*1\b|\[[^\]]*\b1\s*:")


class UnshiftedCausalLmLoss(Rule):
    """A causal LM's logits and its labels (the input ids, as transformers' causal-LM labels are) given to
    cross-entropy position by position — ``loss_fct(logits.view(-1, vocab), labels.view(-1))`` — in a function that
    never shifts them (no ``logits[..., :-1, :]`` / ``labels[..., 1:]``): position t is scored against the token it
    already sees, so the model learns to copy its input. The loss drops toward 0 while generation degrades; nothing
    errors. Only in files whose models are all causal LMs (no classification/QA head)."""

    code = "GD310"
    name = "unshifted-causal-lm-loss"
    summary = "Cross-entropy of a causal LM's logits against its labels without the next-token shift"
    severity = Severity.WARNING
    preview = True
    triggers = ("logits",)

    def check(self, facts: FileFacts):
        if language_model_kind(facts) != "causal" or any(_OTHER_HEADS.search(n) for n in model_class_names(facts)):
            return
        for site in facts.calls:
            pair = self._logits_and_labels(facts, site)
            if pair is None:
                continue
            logits, labels = pair
            function = site.scope.node if site.scope.kind == "function" else None
            if function is None or _SHIFT.search(facts.module.code_for_node(function)):
                continue
            if not (_from_logits(facts, logits, site.order, site.scope) and _labels_of_batch(facts, labels, site.order, site.scope)):
                continue
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node, 70)}` scores the causal LM's logits at each position against the label "
                "at the same position, and this function never shifts them: transformers' causal-LM labels are the "
                "input ids (the model's own loss compares logits[:, :-1] with labels[:, 1:]), so here position t is "
                "trained to predict the token it already sees. The loss falls toward 0 while the model learns to copy "
                "its input.",
                fix_hint="Shift before the loss: `shift_logits = logits[..., :-1, :].contiguous()`, "
                "`shift_labels = labels[..., 1:].contiguous()`, then cross-entropy of their flattened views "
                "(`ignore_index=-100`).",
            )

    @staticmethod
    def _logits_and_labels(facts: FileFacts, site) -> Optional[tuple[cst.BaseExpression, cst.BaseExpression]]:
        if site.qualname in _CROSS_ENTROPY:
            first, second = call_arg(site.node, 0, "input"), call_arg(site.node, 1, "target")
            return (first, second) if first is not None and second is not None else None
        built = facts.built_by(site.node.func, site.order, site.scope)
        if isinstance(built, cst.Call) and facts.qualname(built.func) in _CROSS_ENTROPY_MODULES and len(site.node.args) >= 2:
            if any(a.keyword is not None or a.star for a in site.node.args[:2]):
                return None
            return site.node.args[0].value, site.node.args[1].value
        return None


def _peel(facts: FileFacts, node: Optional[cst.BaseExpression], order: int, scope, depth: int = 0):
    """``node`` without position-keeping reshapes/casts, followed through plain assignments; None when a slice
    (a shift, a selection) or anything else intervenes."""
    while node is not None and depth < 8:
        depth += 1
        if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value in _KEEPS_POSITIONS:
            node = node.func.value
            continue
        key = name_key(node)
        if isinstance(node, cst.Name) and key is not None:
            binding = facts.assignment_of(node, order, scope)
            if binding is None:
                return node, order, scope
            node, order, scope = binding.value, binding.order, binding.scope
            continue
        return node, order, scope
    return None


def _from_logits(facts: FileFacts, node, order, scope) -> bool:
    """``outputs.logits``, ``outputs.get("logits")``, ``outputs["logits"]`` of a model call's result."""
    peeled = _peel(facts, node, order, scope)
    if peeled is not None and isinstance(peeled[0], cst.Attribute):
        return peeled[0].attr.value == "logits"
    return peeled is not None and _entry_read(peeled[0], ("get",)) == "logits"


def _labels_of_batch(facts: FileFacts, node, order, scope) -> bool:
    """The batch's ``labels``: ``inputs.pop("labels")``, ``inputs["labels"]``, ``batch.get("labels")``."""
    peeled = _peel(facts, node, order, scope)
    return peeled is not None and _entry_read(peeled[0], ("pop", "get")) == "labels"


def _entry_read(node, methods: tuple[str, ...]) -> Optional[str]:
    """The string key of ``mapping.get("k")`` / ``mapping.pop("k")`` (``methods``) or ``mapping["k"]``."""
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value in methods:
        return string_value(call_arg(node, 0))
    if isinstance(node, cst.Subscript) and len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index):
        return string_value(node.slice[0].slice.value)
    return None
