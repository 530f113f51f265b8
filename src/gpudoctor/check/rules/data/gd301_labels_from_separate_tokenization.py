from __future__ import annotations

import re
from typing import Iterator, Optional

import libcst as cst

from gpudoctor.check.facts import FileFacts, name_key, string_value
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import language_model_kind, snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.data._common import (
    code as code_of,
    dict_groups,
    encoding_source,
    ids_source,
    max_length_of,
    padding_of,
    subscript_key,
    tokenized_text,
    tokenizer_call,
)


class LabelsFromSeparateTokenization(Rule):
    """Causal-LM ``labels`` taken from a second tokenization (the target text) while ``input_ids``
    come from another one (the prompt). A causal LM predicts the *next token of its own input*: its
    loss compares logits at input position t with ``labels[t + 1]``, so labels must be a copy of
    ``input_ids`` (with ``-100`` on positions not to learn). Encoder-decoder models are the opposite
    (labels are the target), so the rule only speaks when the file uses a causal LM and nothing
    sequence-to-sequence."""

    code = "GD301"
    name = "labels-from-separate-tokenization"
    summary = "Causal-LM labels from a separate (target) tokenization instead of a copy of input_ids"
    severity = Severity.ERROR
    triggers = ("labels", "text_target")

    def check(self, facts: FileFacts):
        if language_model_kind(facts) != "causal":
            return
        # Labels decoded back to text in a file that generates: gold answers compared with generated
        # text. A dict or an encoding holding them need not reach a loss; a model call's labels= does.
        gold_answers = _labels_decoded_next_to_generate(facts)
        forward_labels = {id(site.arg(keyword="labels")) for site in facts.calls if site.arg(keyword="labels") is not None}
        for labels, inputs, node, order, scope in self._pairs(facts):
            if gold_answers and id(labels) not in forward_labels:
                continue
            label_call = ids_source(facts, labels, order, scope)
            input_call = inputs[1] if isinstance(inputs, tuple) else ids_source(facts, inputs, order, scope)
            if label_call is None or input_call is None or label_call is input_call:
                continue
            label_text, _ = tokenized_text(facts, label_call)
            input_text, _ = tokenized_text(facts, input_call)
            if not label_text or label_text == input_text:
                continue  # the same text tokenized twice: the same ids
            if _ids_rewritten(facts, labels, order, scope) or _ids_rewritten(facts, _encoding_of(inputs), order, scope):
                continue  # `enc["input_ids"][i] = prompt + answer`: the ids were rebuilt element-wise
            yield self.report(
                node,
                self._message(facts, labels, label_call, input_call),
                fix_hint=self._hint(),
                related=(
                    (input_call, "`input_ids` are tokenized here"),
                    (label_call, "`labels` are tokenized separately here"),
                ),
            )
        # ``tokenizer(prompt, text_target=answer)``: the encoder-decoder spelling, whose ``labels`` are the answer's ids
        for site in facts.calls:
            target = site.arg(keyword="text_target")
            if target is None or tokenizer_call(facts, site.node) is None or gold_answers:
                continue
            source = site.arg(0, "text")
            if source is None:
                continue  # only the target tokenized: no input_ids to misalign with
            text = code_of(facts, source)
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node, 70)}` puts the token ids of `{_short(code_of(facts, target))}` in "
                f"`labels` (text_target=) next to `input_ids` of `{_short(text)}`: that is the encoder-decoder "
                "format. A causal LM's loss (transformers `ForCausalLMLoss`) shifts the labels by one and compares "
                "them with the logits of the input positions, so labels must be the input ids themselves; with "
                "lengths that differ it raises \"ValueError: Expected input batch_size (B*L_input) to match target "
                "batch_size (B*L_labels)\".",
                fix_hint=self._hint(),
            )

    def _pairs(self, facts: FileFacts) -> Iterator[tuple]:
        """(labels expr, input_ids expr or the encoding's tokenizer call, node to report, order, scope)."""
        for group in dict_groups(facts):
            labels, inputs = group.get("labels"), group.get("input_ids")
            if labels is not None and inputs is not None:
                yield labels.value, inputs.value, labels.value, labels.order, labels.scope
        for site in facts.calls:
            labels, inputs = site.arg(keyword="labels"), site.arg(keyword="input_ids")
            if labels is not None and inputs is not None:
                yield labels, inputs, labels, site.order, site.scope
        for site in facts.subscript_assigns:
            if subscript_key(site.target) != "labels" or site.base_key is None:
                continue
            encoding = encoding_source(facts, site.target.value, site.order, site.scope)
            if encoding is None:
                encoding = _items_copied_from(facts, site.target.value, site.order, site.scope)
            if encoding is not None:
                yield site.value, ("encoding", encoding, site.target.value), site.value, site.order, site.scope

    @staticmethod
    def _message(facts: FileFacts, labels, label_call: cst.Call, input_call: cst.Call) -> str:
        label_text, as_target = tokenized_text(facts, label_call)
        input_text, _ = tokenized_text(facts, input_call)
        same_length = (
            padding_of(facts, label_call) == "max_length"
            and padding_of(facts, input_call) == "max_length"
            and max_length_of(facts, label_call) == max_length_of(facts, input_call)
        )
        head = (
            f"`{snippet(facts, labels)}` are the token ids of `{_short(label_text)}`"
            f"{' (text_target=)' if as_target else ''} while `input_ids` tokenize `{_short(input_text)}`. "
            "A causal LM's loss (transformers `ForCausalLMLoss`) shifts the labels by one and compares them with "
            "the logits of the input positions: labels must be the input ids themselves."
        )
        if same_length:
            return head + (
                " Both are padded to the same `max_length`, so nothing raises: the model is silently trained to "
                "emit the target's token t+1 at the prompt's position t (padding included)."
            )
        return head + (
            " When the lengths differ it raises \"ValueError: Expected input batch_size (B*L_input) to match "
            "target batch_size (B*L_labels)\"; padded to the same length it trains silently on misaligned targets."
        )

    @staticmethod
    def _hint() -> str:
        return (
            "Tokenize prompt + answer together and copy the ids: `enc = tokenizer(prompt + answer, ...)`, "
            "`labels = enc[\"input_ids\"].clone()`, then set `-100` on the prompt and padding positions "
            "(`labels[:len_prompt] = -100`, `labels[enc[\"attention_mask\"] == 0] = -100`)."
        )


_LABELS = re.compile(r"\blabels?\b|label_ids|\bgold|\breferences?\b|\btargets?\b")


def _labels_decoded_next_to_generate(facts: FileFacts) -> bool:
    """``tokenizer.decode/batch_decode`` of the labels (``batch["labels"]``, ``labels``, or a name bound to
    them) in a function that also calls ``.generate(...)``: an evaluation by generation."""
    generating = {id(site.scope) for site in facts.method_calls("generate")}
    for site in facts.method_calls("decode", "batch_decode"):
        if id(site.scope) not in generating:
            continue
        for arg in site.node.args:
            text = facts.module.code_for_node(arg.value)
            key = name_key(arg.value)
            if key is not None:
                binding = facts.binding_at(key, site.order, site.scope)
                if binding is not None and binding.value is not None:
                    text += " " + facts.module.code_for_node(binding.value)
            if _LABELS.search(text):
                return True
    return False


def _items_copied_from(facts: FileFacts, node, order: int, scope) -> Optional[cst.Call]:
    """``item = {k: torch.tensor(v[idx]) for k, v in self.encodings.items()}``: the tokenizer call of
    ``self.encodings`` (the item holds that encoding's ``input_ids``)."""
    binding = facts.assignment_of(node, order, scope)
    comp = binding.value if binding is not None else None
    if not isinstance(comp, cst.DictComp) or comp.for_in.inner_for_in is not None:
        return None
    iterable = comp.for_in.iter
    if not (isinstance(iterable, cst.Call) and isinstance(iterable.func, cst.Attribute) and iterable.func.attr.value == "items"):
        return None
    return encoding_source(facts, iterable.func.value, binding.order, binding.scope)


def _encoding_of(inputs) -> Optional[cst.BaseExpression]:
    """For the subscript-assignment pair, the encoding the labels are stored into (``model_inputs``)."""
    return inputs[2] if isinstance(inputs, tuple) else inputs


def _ids_rewritten(facts: FileFacts, expr, order: int, scope) -> bool:
    """``enc["input_ids"][i] = ...`` before ``order`` in the same scope, where ``expr`` is ``enc["input_ids"]``
    (or ``enc``): the ids no longer are one tokenization's output (the peft examples build
    ``input_ids[i] = prompt + answer`` and ``labels[i] = [-100] * len(prompt) + answer`` this way)."""
    if expr is None:
        return False
    base = expr
    if isinstance(base, cst.Subscript) and len(base.slice) == 1 and isinstance(base.slice[0].slice, cst.Index):
        if string_value(base.slice[0].slice.value) == "input_ids":
            base = base.value
    elif isinstance(base, cst.Attribute) and base.attr.value == "input_ids":
        base = base.value
    key = name_key(base)
    if key is None:
        return False
    for site in facts.subscript_assigns:
        if site.scope != scope or site.order >= order:
            continue
        inner = site.target.value
        if isinstance(inner, cst.Subscript) and subscript_key(inner) == "input_ids" and name_key(inner.value) == key:
            return True
    return False


def _short(text: str, limit: int = 40) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
