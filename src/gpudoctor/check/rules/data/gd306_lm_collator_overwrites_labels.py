from __future__ import annotations

import re
from typing import Iterator, Optional

import libcst as cst

from gpudoctor.check import apis, versions
from gpudoctor.check.facts import FileFacts, call_arg, int_value, name_key
from gpudoctor.check.facts.nodes import walk
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.data._common import code, subscript_key

_IGNORE = r"(?:-\s*100\b|IGNORE_INDEX|ignore_index|IGNORE_TOKEN_ID)"
# Labels that mask the prompt, not just padding (the collator masks padding the same way):
# `[-100] * len(prompt) + answer`, `torch.full((n,), IGNORE_INDEX)`.
_MASKED = re.compile(rf"\[\s*{_IGNORE}\s*\]\s*\*|\*\s*\[\s*{_IGNORE}\s*\]|full\w*\([^)]*{_IGNORE}", re.IGNORECASE)
_IGNORE_VALUE = re.compile(rf"^{_IGNORE}$", re.IGNORECASE)


class LmCollatorOverwritesLabels(Rule):
    """``DataCollatorForLanguageModeling(mlm=False)`` in a file that builds its own ``labels`` with
    ``-100`` on the positions not to learn (the prompt): the collator discards them and sets
    ``labels = input_ids.clone()`` (pad positions -100), so the prompt is trained on."""

    code = "GD306"
    name = "lm-collator-overwrites-labels"
    summary = "DataCollatorForLanguageModeling(mlm=False) replaces the labels the script masked itself"
    triggers = ("DataCollatorForLanguageModeling",)

    def check(self, facts: FileFacts):
        collators = [s for s in facts.calls_to(*apis.LM_COLLATOR) if _is_false(call_arg(s.node, 1, "mlm"))]
        if not collators:
            return
        masked = next(self._masked_label_stores(facts), None)
        if masked is None:
            return
        store, value = masked
        for site in collators:
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node)}` replaces every batch's `labels` with a copy of `input_ids` (pad "
                f"positions -100; {versions.describe('transformers')}, `DataCollatorForLanguageModeling.torch_call`), "
                f"so the labels this file masks itself (`{snippet(facts, value, 50)}`) are discarded: with examples "
                "of equal length the masked positions (the prompt) are trained on silently; with different lengths "
                "padding the `labels` feature raises \"ValueError: Unable to create tensor, you should probably "
                "activate truncation and/or padding ...\".",
                fix_hint="Keep your labels: `DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)` "
                "pads them with -100 (it works for causal LMs too), or pad them yourself.",
                related=((store, "the script builds masked labels here"),),
            )

    @staticmethod
    def _masked_label_stores(facts: FileFacts) -> Iterator[tuple[cst.CSTNode, cst.BaseExpression]]:
        """(node to show, label value) for `{"labels": v}` / `enc["labels"] = v` / `dict(labels=v)` whose value
        masks."""
        stores = [(e.element, e.value, e.order, e.scope) for e in facts.dict_entries if e.key == "labels"]
        stores += [
            (s.target, s.value, s.order, s.scope) for s in facts.subscript_assigns if subscript_key(s.target) == "labels"
        ]
        # ``dict(input_ids=ids, labels=[-100] * len(src) + tgt)`` (the builtin, not shadowed by the file)
        stores += [
            (arg, arg.value, s.order, s.scope)
            for s in facts.calls
            if isinstance(s.node.func, cst.Name) and s.node.func.value == "dict" and s.qualname is None
            and facts.binding_at("dict", s.order, s.scope) is None
            for arg in s.node.args if arg.keyword is not None and arg.keyword.value == "labels"
        ]
        for node, value, order, scope in stores:
            if _masks(facts, value, order, scope):
                yield node, value


def _masks(facts: FileFacts, value: cst.BaseExpression, order: int, scope, depth: int = 0) -> bool:
    """The value masks a prefix itself, through the names it was built in, or by ``labels[:n] = -100``."""
    if depth > 4:
        return False
    if _MASKED.search(code(facts, value)) or _builds_mask(facts, value, order, scope) or _masks_by_position(facts, value, order, scope):
        return True
    key = name_key(value)
    if key is None:
        return False
    binding = facts.binding_at(key, order, scope)
    if binding is not None and binding.kind == "assign" and binding.value is not None:
        if _masks(facts, binding.value, binding.order, binding.scope, depth + 1):
            return True
    return any(
        s.scope is scope
        and s.order < order
        and name_key(s.target.value) == key
        and any(isinstance(element.slice, cst.Slice) for element in s.target.slice)
        and (
            _is_ignore(facts, s.value, s.order, s.scope)
            # a Python list: ``labels[:n] = [IGNORE_INDEX] * n`` masks the first n (the prompt), not the tail
            or (_prefix_slice(s.target) and _builds_mask(facts, s.value, s.order, s.scope))
        )
        for s in facts.subscript_assigns
    )


def _masks_by_position(facts: FileFacts, value: cst.BaseExpression, order: int, scope) -> bool:
    """``[t if i >= prompt_len else -100 for i, t in enumerate(ids)]``: a comprehension that puts the ignore index
    on the positions its test picks, when the test is not about padding (``if m`` over an attention mask, a pad id:
    the collator masks padding the same way)."""
    if not isinstance(value, (cst.ListComp, cst.GeneratorExp)) or not isinstance(value.elt, cst.IfExp):
        return False
    choice = value.elt
    if not (_is_ignore(facts, choice.body, order, scope) or _is_ignore(facts, choice.orelse, order, scope)):
        return False
    # what the test reads: its own names and what the comprehension iterates (``zip(ids, enc["attention_mask"])``)
    tested = code(facts, choice.test) + " " + code(facts, value.for_in.iter)
    return not re.search(r"mask|pad", tested, re.IGNORECASE)


def _prefix_slice(target: cst.Subscript) -> bool:
    """``x[:n]`` / ``x[0:n]``: a slice from the start (a prompt prefix), not ``x[n:]`` (padding at the end)."""
    if len(target.slice) != 1 or not isinstance(target.slice[0].slice, cst.Slice):
        return False
    piece = target.slice[0].slice
    return (piece.lower is None or int_value(piece.lower) == 0) and piece.upper is not None and piece.step is None


def _builds_mask(facts: FileFacts, value: cst.BaseExpression, order: int, scope) -> bool:
    """``[X] * n`` / ``n * [X]`` / ``torch.full(..., X)`` where X is the ignore index, also through a name
    (``IGNORE = -100``, renamed or held in a temporary; ``mask = [IGNORE] * n`` ... ``labels[:n] = mask``)."""
    assigned = facts.assignment_of(value, order, scope)
    if assigned is not None:
        value, order, scope = assigned.value, assigned.order, assigned.scope
    for node in walk(value):
        if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Multiply):
            for side in (node.left, node.right):
                if isinstance(side, cst.List) and len(side.elements) == 1 and _is_ignore(
                    facts, side.elements[0].value, order, scope
                ):
                    return True
        if isinstance(node, cst.Call) and re.search(r"full\w*$", code(facts, node.func)):
            if any(_is_ignore(facts, a.value, order, scope) for a in node.args):
                return True
    return False


def _is_ignore(facts: FileFacts, node: cst.BaseExpression, order: int, scope, depth: int = 0) -> bool:
    if _IGNORE_VALUE.match(code(facts, node)):
        return True
    key = name_key(node) if isinstance(node, cst.Name) else None
    if key is None or depth > 4:
        return False
    binding = facts.binding_at(key, order, scope)
    return (
        binding is not None and binding.kind == "assign" and binding.value is not None
        and _is_ignore(facts, binding.value, binding.order, binding.scope, depth + 1)
    )



def _is_false(node: Optional[cst.BaseExpression]) -> bool:
    return isinstance(node, cst.Name) and node.value == "False"
