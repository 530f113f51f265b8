from __future__ import annotations

import re
from typing import Iterator

import libcst as cst

from gpudoctor.check.facts import FileFacts, Scope, call_arg, is_true, string_value
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import language_model_kind, snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.data._common import (
    dict_groups,
    encoding_source,
    ids_source,
    masks_labels_somewhere,
    max_length_of,
    padding_of,
)

# Collators and trainers that build or mask labels themselves.
_LABEL_COLLATORS = ("DataCollatorForLanguageModeling", "DataCollatorForSeq2Seq", "DataCollatorForCompletionOnlyLM",
                    "SFTTrainer", "SFTConfig", "data_collator")


_DEFAULT_COLLATOR = re.compile(r"(?:\bdata_collator\s*=\s*)?\bdefault_data_collator\b")


class PaddingLabelsNotMasked(Rule):
    """Causal-LM labels copied from ``input_ids`` that the tokenizer padded, and nothing in the file ever
    sets ``-100``: the padding positions count in the loss, so the model learns to predict padding
    (often EOS) and the reported loss is diluted by easy pad-after-pad targets."""

    code = "GD303"
    name = "padding-labels-not-masked"
    summary = "Labels copied from padded input_ids without -100 on the padding positions"
    severity = Severity.ERROR
    triggers = ("labels",)

    def check(self, facts: FileFacts):
        kind = language_model_kind(facts)
        if kind == "seq2seq":
            yield from self._padded_targets(facts)
            return
        if not (kind == "causal" or kind is None and _pads_with_eos(facts)) or masks_labels_somewhere(facts):
            return
        # transformers' ``default_data_collator`` stacks the labels as given (it masks nothing): naming it, or passing
        # it as ``data_collator=default_data_collator``, is no sign of a collator that masks the padding.
        text = _DEFAULT_COLLATOR.sub("", facts.source)
        if any(word in text for word in _LABEL_COLLATORS):
            return
        reported = set()
        for labels, call, order, scope in self._copies(facts):
            padding = padding_of(facts, call)
            if padding is None or (padding == "longest" and not _batched(facts, call)):
                continue  # padding=True on one text pads nothing
            # ``labels = input_ids.clone()`` then ``{"labels": labels}`` / ``model(..., labels=labels)``: the copy is
            # what the user fixes (mask it right after), the use is part of the evidence.
            use = None
            copy = facts.assignment_of(labels, order, scope) if isinstance(labels, cst.Name) else None
            if copy is not None and copy.scope is scope and ids_source(facts, copy.value, copy.order, copy.scope) is call:
                use, labels = labels, copy.value
            if id(labels) in reported:
                continue
            reported.add(id(labels))
            length = max_length_of(facts, call)
            padded = f"padded to `max_length={length}`" if padding == "max_length" and length else (
                "padded to the longest text of the batch" if padding == "longest" else "padded to the model's maximum length"
            )
            yield self.report(
                labels,
                f"`{snippet(facts, labels)}` copies `input_ids` that `{snippet(facts, call.func)}(...)` {padded}, and "
                "nothing in the file sets the padding positions to -100: they are counted in the loss (the model "
                "is trained to predict padding after padding and the loss is diluted by these easy targets).",
                fix_hint=(
                    "Mask the padding: `labels[attention_mask == 0] = -100` (per example: "
                    "`labels = [t if m else -100 for t, m in zip(ids, mask)]`), or tokenize without padding and "
                    "let `DataCollatorForSeq2Seq` pad labels with -100."
                ),
                related=(
                    *(((use, "the copy is passed as the labels here"),) if use is not None else ()),
                    (call, "the input_ids are padded here"),
                    *(((call_arg(call, keyword="padding"), "`padding=` asks for it here"),)
                      if call_arg(call, keyword="padding") is not None else ()),
                ),
            )

    def _padded_targets(self, facts: FileFacts):
        """Encoder-decoder labels that are the ``input_ids`` of a padded *target* tokenization
        (``tokenizer(text_target=..., padding="max_length")``) stored as given, in a function that never writes
        ``-100``: ``DataCollatorForSeq2Seq`` pads with ``label_pad_token_id`` only what it pads itself, so the pad ids
        already in the labels are scored by the model's loss (``CrossEntropyLoss(ignore_index=-100)``)."""
        for labels, order, scope in _stored_labels(facts):
            call = ids_source(facts, labels, order, scope)
            if call is None or not _target_tokenization(facts, call):
                continue
            padding = padding_of(facts, call)
            if padding is None or (padding == "longest" and not _batched(facts, call)):
                continue
            if _MASKS.search(facts.module.code_for_node(scope.node) if scope.kind == "function" else facts.source):
                continue  # ``[(t if t != tokenizer.pad_token_id else -100) for t in label]`` in the same function
            length = max_length_of(facts, call)
            padded = f"padded to `max_length={length}`" if padding == "max_length" and length else "padded"
            yield self.report(
                labels,
                f"`{snippet(facts, labels)}` stores the target ids that `{snippet(facts, call.func)}(...)` {padded}, "
                "and this function never sets the padding positions to -100: `DataCollatorForSeq2Seq` only uses "
                "`label_pad_token_id` for padding it adds itself, so the pad ids already in the labels are scored by "
                "the loss (the model learns to emit padding; summaries come out short or empty).",
                fix_hint=(
                    "Replace the pad ids: `[[(t if t != tokenizer.pad_token_id else -100) for t in ids] for ids in "
                    "labels[\"input_ids\"]]`, or tokenize the targets without padding and let `DataCollatorForSeq2Seq` "
                    "pad them with -100."
                ),
                related=(
                    (call, "the targets are padded here"),
                    *(((call_arg(call, keyword="padding"), "`padding=` asks for it here"),)
                      if call_arg(call, keyword="padding") is not None else ()),
                ),
            )

    def _copies(self, facts: FileFacts) -> Iterator[tuple[cst.BaseExpression, cst.Call, int, Scope]]:
        """(labels expression, tokenizer call of the copied input_ids, order, scope)."""
        for group in dict_groups(facts):
            labels, inputs = group.get("labels"), group.get("input_ids")
            if labels is None or inputs is None:
                continue
            a = ids_source(facts, labels.value, labels.order, labels.scope)
            b = ids_source(facts, inputs.value, inputs.order, inputs.scope)
            if a is not None and a is b:
                yield labels.value, a, labels.order, labels.scope
        for site in facts.calls:
            labels, inputs = site.arg(keyword="labels"), site.arg(keyword="input_ids")
            # ``model(**batch, labels=batch["input_ids"])``: the input ids are the unpacked encoding's.
            mapping = next((a.value for a in site.node.args if a.star == "**"), None) if inputs is None else None
            if labels is None or (inputs is None and mapping is None):
                continue
            a = ids_source(facts, labels, site.order, site.scope)
            if inputs is not None:
                b = ids_source(facts, inputs, site.order, site.scope)
            else:
                b = encoding_source(facts, mapping, site.order, site.scope)
            if a is not None and a is b:
                yield labels, a, site.order, site.scope
        for site in facts.subscript_assigns:
            target = site.target
            if not (len(target.slice) == 1 and isinstance(target.slice[0].slice, cst.Index)):
                continue
            if string_value(target.slice[0].slice.value) != "labels":
                continue
            encoding = encoding_source(facts, target.value, site.order, site.scope)
            copied = ids_source(facts, site.value, site.order, site.scope)
            if encoding is not None and copied is encoding:
                yield site.value, encoding, site.order, site.scope


# Writing -100 (or an ignore index) in the function that builds the labels.
_MASKS = re.compile(r"-\s*100\b|IGNORE_INDEX|ignore_index")


def _stored_labels(facts: FileFacts) -> Iterator[tuple[cst.BaseExpression, int, Scope]]:
    """(value, order, scope) stored as ``"labels"``: a dict display entry or ``enc["labels"] = value``."""
    for group in dict_groups(facts):
        labels = group.get("labels")
        if labels is not None:
            yield labels.value, labels.order, labels.scope
    for site in facts.subscript_assigns:
        target = site.target
        if len(target.slice) == 1 and isinstance(target.slice[0].slice, cst.Index) \
                and string_value(target.slice[0].slice.value) == "labels":
            yield site.value, site.order, site.scope


def _target_tokenization(facts: FileFacts, call: cst.Call) -> bool:
    """``tokenizer(text_target=...)``, or a tokenizer call under ``with tokenizer.as_target_tokenizer():``."""
    if call_arg(call, keyword="text_target") is not None:
        return True
    site = facts.call_site(call)
    return site is not None and any(getattr(frame, "method", None) == "as_target_tokenizer" for frame in site.context)


def _batched(facts: FileFacts, call: cst.Call) -> bool:
    """The tokenizer gets several texts at once: a list display or comprehension, a name bound to one in the same
    function (``texts = [b["text"] for b in batch]`` in a collate function), or a column of the batch a
    ``.map(fn, batched=True)`` function receives (``tokenizer(examples["text"], padding=True)``)."""
    first = call.args[0].value if call.args and call.args[0].keyword is None else None
    if isinstance(first, (cst.List, cst.ListComp)):
        return True
    site = facts.call_site(call)
    if site is None or first is None:
        return False
    if isinstance(first, cst.Name):
        binding = facts.binding_at(first.value, site.order, site.scope)
        if binding is not None and binding.kind == "assign" and isinstance(binding.value, (cst.List, cst.ListComp)):
            return True
    if isinstance(first, cst.Subscript) and isinstance(first.value, cst.Name) and site.scope.kind == "function":
        # ``def tokenize(examples): tokenizer(examples["text"], ...)`` mapped with ``batched=True``
        function = site.scope.name
        for mapped in facts.method_calls("map"):
            given = mapped.arg(0, "function")
            if isinstance(given, cst.Name) and given.value == function and is_true(call_arg(mapped.node, keyword="batched")):
                return True
    return False


def _pads_with_eos(facts: FileFacts) -> bool:
    """``tokenizer.pad_token = tokenizer.eos_token`` (or the ids): a tokenizer without a pad token of its own,
    the decoder-only (causal LM) families; read when the file names no model class (a preprocessing script)."""
    for site in facts.attribute_assigns:
        attr = site.target.attr.value
        assigned = facts.assignment_of(site.value, site.order, site.scope)  # ``eos = tokenizer.eos_token`` first
        value = assigned.value if assigned is not None else site.value
        if attr in ("pad_token", "pad_token_id") and isinstance(value, cst.Attribute) and value.attr.value in (
            "eos_token", "eos_token_id"
        ):
            return True
    return False
