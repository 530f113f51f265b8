from __future__ import annotations

import re
from typing import Iterator, Optional

import libcst as cst

from gpudoctor.check.facts import FileFacts, name_key, string_value
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import language_model_kind, snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.data._common import code, computes_own_loss, dict_groups, peel, shifted_base

_IDS = re.compile(r"ids|token", re.IGNORECASE)
_MODEL_NAME = re.compile(r"(^|[._])\w*model$", re.IGNORECASE)


class PreShiftedLabels(Rule):
    """``labels=input_ids[:, 1:]`` given to a Hugging Face causal LM. The model shifts the labels
    itself (``ForCausalLMLoss`` pads them by one and takes ``labels[..., 1:]``), so shifting them
    again either breaks the shapes or trains the model to predict two tokens ahead."""

    code = "GD302"
    name = "pre-shifted-labels"
    summary = "Labels shifted by hand (input_ids[:, 1:]) for an HF causal LM, which shifts them again"
    severity = Severity.ERROR
    triggers = ("labels",)

    def check(self, facts: FileFacts):
        if language_model_kind(facts) != "causal":
            return
        for labels, inputs, where in self._candidates(facts):
            # ``labels = chunk[:, 1:]`` ... ``model(input_ids=input_ids, labels=labels)``: the local slices
            given = labels
            # ``torch.tensor(targets[1:])``: the wrappers that keep the ids do not change the shift.
            labels = peel(facts, _sliced_local(facts, labels))
            inputs = peel(facts, _sliced_local(facts, inputs)) if inputs is not None else None
            base = shifted_base(labels)
            if base is None:
                continue
            # The token ids: named so, the very tensor given as ``input_ids=``, bound to ``batch["input_ids"]``,
            # or ``input_ids=`` cut at the end (``x[:, :-1]`` with ``y[:, 1:]`` as labels: the next-token shift done
            # by hand, whether x and y are one tensor or the ids and their -100-masked copy).
            same_as_inputs = inputs is not None and code(facts, inputs) == code(facts, base)
            inputs_cut = inputs is not None and shifted_base(inputs, upper=True) is not None
            if not (_IDS.search(code(facts, base)) or same_as_inputs or inputs_cut or _bound_to_input_ids(facts, base)):
                continue
            if inputs_cut:
                effect = (
                    f"with `input_ids` cut to `{snippet(facts, inputs)}` the shapes match and nothing raises: "
                    "the model is silently trained to predict the token two positions ahead"
                )
            else:
                effect = (
                    "the labels are one token shorter than the logits, so it raises \"ValueError: Expected input "
                    "batch_size (B*L) to match target batch_size (B*(L-1))\" (padded back to L, it silently "
                    "predicts two tokens ahead)"
                )
            via = f"`{snippet(facts, given)}` is " if isinstance(given, cst.Name) else ""
            yield self.report(
                given,
                f"{via}`{snippet(facts, labels)}`{': it' if via else ''} shifts the labels by hand and they go to {where}, whose loss "
                f"(transformers `ForCausalLMLoss`) shifts them again; {effect}.",
                fix_hint=(
                    f"Pass unshifted labels: `labels={snippet(facts, base)}` with the full `input_ids` (set `-100` "
                    "where no loss is wanted). Shift only when you compute the loss yourself from `logits`."
                ),
                related=((labels, "the labels are shifted by hand here"),),
            )

    def _candidates(self, facts: FileFacts) -> Iterator[tuple[cst.BaseExpression, Optional[cst.BaseExpression], str]]:
        # labels= given to a model call: the model computes the loss.
        for site in facts.calls:
            labels = site.arg(keyword="labels")
            if labels is None or not self._is_model_call(facts, site):
                continue
            # ``model(x[:, :-1], labels=x[:, 1:])``: a causal LM's first positional parameter is input_ids
            yield labels, site.arg(0, "input_ids"), f"`{snippet(facts, site.node.func)}(...)`"
        # Batches built by hand ({"input_ids": ..., "labels": ...}): only when nothing in the file computes
        # its own loss (a custom loss over logits is where shifting by hand is right).
        if computes_own_loss(facts):
            return
        for group in dict_groups(facts):
            labels = group.get("labels")
            if labels is not None and "input_ids" in group:
                yield labels.value, group["input_ids"].value, "the model in the batch (`model(**batch)`/Trainer)"
        for site in facts.subscript_assigns:
            target = site.target
            if len(target.slice) == 1 and isinstance(target.slice[0].slice, cst.Index):
                if string_value(target.slice[0].slice.value) == "labels":
                    yield site.value, _sibling_input_ids(facts, site), "the model in the batch (`model(**batch)`/Trainer)"
        # A Dataset/generator item returned as a pair cut by hand: ``return tokens[:-1], targets[1:]`` (or names
        # bound to them, through ``torch.tensor(...)``): the "tokens < n predict n" shift done before the model.
        # Only where labels reach an HF loss: a model call given ``labels=`` or a Trainer.
        hf_loss = facts.trainer_calls() or any(
            site.arg(keyword="labels") is not None and self._is_model_call(facts, site) for site in facts.calls
        )
        for labels, inputs in (_returned_shift_pairs(facts) if hf_loss else ()):
            yield labels, inputs, "the model with each returned item (DataLoader batches -> `model(..., labels=...)`)"

    @staticmethod
    def _is_model_call(facts: FileFacts, site) -> bool:
        """``model(...)``, ``self.model(...)``, ``model.forward(...)``."""
        func = site.node.func
        if isinstance(func, cst.Attribute) and func.attr.value == "forward":
            func = func.value
        key = name_key(func)
        if key is None:
            return False
        return facts.value(func, site.order, site.scope).kind == "model" or bool(_MODEL_NAME.search(key))


def _returned_shift_pairs(facts: FileFacts) -> Iterator[tuple[cst.BaseExpression, cst.BaseExpression]]:
    """(labels, inputs) returned together by one of the file's functions where ``inputs`` is cut at the end
    (``x[:-1]``) and ``labels`` starts one later (``y[1:]``), directly or through names bound in that function;
    ``labels`` is the expression to report (the binding's value when returned by name)."""
    for function in facts.functions:
        for site in (*facts.returns.get(id(function), ()), *facts.yields.get(id(function), ())):
            if site.kind == "yield from":
                continue
            value = site.value
            elements = [e.value for e in value.elements] if isinstance(value, cst.Tuple) else []
            if len(elements) < 2:
                continue
            resolved = [_cut_of(facts, function, element, site.order) for element in elements]
            inputs = [node for node, kind in resolved if kind == "upper"]
            labels = [node for node, kind in resolved if kind == "lower"]
            if len(inputs) == 1 and len(labels) == 1:
                yield labels[0], inputs[0]


def _cut_of(facts: FileFacts, function, element: cst.BaseExpression, order: int) -> tuple[cst.BaseExpression, Optional[str]]:
    """(the expression, "lower" for ``y[1:]`` / "upper" for ``x[:-1]`` / None), seen through ``torch.tensor(...)``-like
    wrappers and a name bound once in ``function`` before ``order``."""
    node = element
    if isinstance(element, cst.Name):
        bindings = [b for b in function.bindings.get(element.value, ()) if b.order < order and b.kind == "assign"]
        if len(bindings) == 1 and bindings[0].value is not None:
            node = bindings[0].value
    peeled = peel(facts, node)
    if shifted_base(peeled) is not None:
        return node, "lower"
    if shifted_base(peeled, upper=True) is not None:
        return node, "upper"
    return node, None


def _sliced_local(facts: FileFacts, node: Optional[cst.BaseExpression]) -> Optional[cst.BaseExpression]:
    """A local name bound to a slice (``labels = chunk[:, 1:]``): the slice; anything else as it is."""
    if not isinstance(node, cst.Name):
        return node
    order, scope = facts._position_of(node)
    binding = facts.assignment_of(node, order, scope)
    if binding is not None and binding.scope is scope and isinstance(binding.value, cst.Subscript):
        return binding.value
    return node


def _bound_to_input_ids(facts: FileFacts, node: cst.BaseExpression) -> bool:
    order, scope = facts._position_of(node)
    binding = facts.assignment_of(node, order, scope)
    value = binding.value if binding is not None else None
    return (
        isinstance(value, cst.Subscript) and len(value.slice) == 1 and isinstance(value.slice[0].slice, cst.Index)
        and string_value(value.slice[0].slice.value) == "input_ids"
    )


def _sibling_input_ids(facts: FileFacts, site) -> Optional[cst.BaseExpression]:
    """``batch["input_ids"] = ...`` next to ``batch["labels"] = ...`` (same dict, same scope): its value."""
    if site.base_key is None:
        return None
    for other in facts.subscript_assigns:
        target = other.target
        if other is site or other.scope != site.scope or other.base_key != site.base_key:
            continue
        if len(target.slice) == 1 and isinstance(target.slice[0].slice, cst.Index):
            if string_value(target.slice[0].slice.value) == "input_ids":
                return other.value
    return None
