from __future__ import annotations

import re
from typing import Optional

import libcst as cst

from gpudoctor.check.facts import CallSite, FileFacts, FunctionFrame, Scope, call_arg, int_value, name_key
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.data._common import encoding_source, ids_source, is_tokenizer_expr, peel

_MODEL_NAME = re.compile(r"(^|[._])\w*model$", re.IGNORECASE)
# Functions where argmax over teacher-forced logits is the point (token accuracy, metrics).
_METRIC_FUNCTION = re.compile(r"metric|accuracy|preprocess_logits|score", re.IGNORECASE)


class ArgmaxAsGeneration(Rule):
    """``model(prompt).logits.argmax(-1)`` decoded with the tokenizer as if it were the model's answer.
    One forward pass gives, for every *prompt* position, a guess of the token that follows it
    (teacher-forced); only the last one is the first generated token. The decoded text is the prompt
    echoed with one-token errors, not a reply."""

    code = "GD305"
    name = "argmax-as-generation"
    summary = "Decoding logits.argmax(-1) of one forward pass as the model's answer instead of model.generate()"
    severity = Severity.ERROR
    triggers = ("argmax",)

    def check(self, facts: FileFacts):
        decodes = [s for s in facts.method_calls("decode", "batch_decode") if is_tokenizer_expr(facts, s.receiver)]
        if not decodes:
            return
        for site in decodes:
            if _in_metric_function(site):
                continue
            first = site.arg(0, "token_ids") or site.arg(0, "sequences")
            argmax = self._argmax_of(facts, first, site.order, site.scope)
            if argmax is None:
                continue
            argmax_call, forward = argmax
            model = forward.node.func
            wrapper = facts.value(model, forward.order, forward.scope).trait("wrapper")
            generate = f"{snippet(facts, model)}{'.module' if wrapper else ''}.generate"
            yield self.report(
                argmax_call,
                f"`{snippet(facts, argmax_call)}` is decoded by `{snippet(facts, site.node.func)}(...)` as an answer, but "
                f"one forward pass of `{snippet(facts, forward.node)}` only gives, for each prompt position, its "
                "guess of the next prompt token (teacher forcing): the text is the prompt echoed with one-token "
                "errors; only its last token is the first generated one.",
                fix_hint=(
                    f"Generate: `out = {generate}(**inputs, max_new_tokens=100)` then "
                    "`tokenizer.decode(out[0][inputs[\"input_ids\"].shape[1]:], skip_special_tokens=True)`."
                ),
                related=(
                    (forward.node, "one forward pass (teacher forcing) here"),
                    (site.node, "its argmax is decoded as the answer here"),
                ),
            )

    def _argmax_of(self, facts: FileFacts, node, order: int, scope: Scope, depth: int = 0) -> Optional[tuple[cst.Call, CallSite]]:
        if node is None or depth > 5:
            return None
        node = peel(facts, node)
        if isinstance(node, cst.Call):
            found = self._argmax_call(facts, node)
            if found is not None:
                return found
            return None
        binding = facts.assignment_of(node, order, scope)
        if binding is None:
            return None
        return self._argmax_of(facts, binding.value, binding.order, binding.scope, depth + 1)

    def _argmax_call(self, facts: FileFacts, call: cst.Call) -> Optional[tuple[cst.Call, CallSite]]:
        """``X.logits.argmax(-1)`` / ``torch.argmax(X.logits, dim=-1)`` where X is a forward on a prompt."""
        site = facts.call_site(call)
        if site is None:
            return None
        if site.method == "argmax" and site.qualname is None:
            logits, dim = site.receiver, call_arg(call, 0, "dim")
        elif site.qualname == "torch.argmax":
            logits, dim = call_arg(call, 0, "input"), call_arg(call, 1, "dim")
        else:
            return None
        if not _last_dim(dim):
            return None
        logits = _logits_expression(facts, logits, site.order, site.scope)
        if logits is None:
            return None
        forward = self._forward(facts, logits.value, site.order, site.scope)
        if forward is None:
            return None
        return call, forward

    def _forward(self, facts: FileFacts, node, order: int, scope: Scope) -> Optional[CallSite]:
        if name_key(node) is not None:
            node = facts.built_by(node, order, scope)  # through names and temporaries
        if not isinstance(node, cst.Call):
            return None
        site = facts.call_site(node)
        func = node.func
        key = name_key(func)
        if site is None or key is None:
            return None
        if not (facts.value(func, site.order, site.scope).kind == "model" or _MODEL_NAME.search(key)):
            return None
        if site.arg(keyword="labels") is not None:
            return None  # a loss is computed: this is evaluation, not a reply
        # The input is a prompt the file tokenizes itself.
        for arg in node.args:
            value = arg.value
            if arg.star == "**":
                if encoding_source(facts, value, site.order, site.scope) is not None:
                    return site
            elif ids_source(facts, value, site.order, site.scope) is not None or _tokenized_ids(facts, value, site):
                return site
        return None


def _logits_expression(facts: FileFacts, node, order: int, scope: Scope) -> Optional[cst.Attribute]:
    """``X.logits`` the argmax reads: directly, or through a name (``logits = model(ids).logits``). A slice of
    it (``logits[:, -1, :]``, one greedy decoding step) is not the whole teacher-forced sequence: None."""
    for _ in range(4):
        if node is None:
            return None
        node = peel(facts, node)
        if isinstance(node, cst.Attribute) and node.attr.value == "logits":
            return node
        binding = facts.assignment_of(node, order, scope) if isinstance(node, cst.Name) else None
        if binding is None:
            return None
        node, order, scope = binding.value, binding.order, binding.scope
    return None


def _tokenized_ids(facts: FileFacts, value, site: CallSite) -> bool:
    """``input_ids`` bound to ``tokenizer.encode(query, return_tensors="pt")``."""
    key = name_key(value)
    if key is None:
        return False
    binding = facts.binding_at(key, site.order, site.scope)
    if binding is None or not isinstance(binding.value, cst.Call):
        return False
    func = binding.value.func
    return isinstance(func, cst.Attribute) and func.attr.value == "encode" and is_tokenizer_expr(facts, func.value)


def _last_dim(dim) -> bool:
    if isinstance(dim, cst.UnaryOperation) and isinstance(dim.operator, cst.Minus):
        return int_value(dim.expression) == 1
    return int_value(dim) == 2


def _in_metric_function(site: CallSite) -> bool:
    return any(isinstance(f, FunctionFrame) and _METRIC_FUNCTION.search(f.scope.name) for f in site.context)
