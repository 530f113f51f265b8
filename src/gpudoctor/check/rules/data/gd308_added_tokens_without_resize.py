from __future__ import annotations

import re
from typing import Iterator, Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import FileFacts, call_arg, name_key, string_value
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import model_class_names, snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.data._common import is_tokenizer_expr

# Evidence that batches are padded (so an added pad token reaches the model).
_PADS = re.compile(r"padding\s*=\s*(?:True|[\"'](?:max_length|longest)[\"'])|DataCollator\w*\(|\.pad\(|padding_value\s*=")


class AddedTokensWithoutResize(Rule):
    """``tokenizer.add_special_tokens({"pad_token": "<PAD>"})`` / ``tokenizer.add_tokens([...])`` for a checkpoint
    whose tokenizer already fills the embedding matrix (GPT-2, Llama 2, Mistral-7B v0.1), with no
    ``model.resize_token_embeddings(len(tokenizer))`` anywhere: the new token's id is one past the last embedding
    row, and the first batch holding it fails in the embedding lookup."""

    code = "GD308"
    name = "added-tokens-without-resize"
    summary = "Tokens added to a full-vocabulary tokenizer (GPT-2, Llama 2) without model.resize_token_embeddings"
    severity = Severity.ERROR
    triggers = ("add_special_tokens", "add_tokens")

    def check(self, facts: FileFacts):
        if next(facts.method_calls("resize_token_embeddings"), None) is not None or not model_class_names(facts):
            return  # resized somewhere (the order is another question), or no model in this file
        for site in facts.method_calls("add_special_tokens", "add_tokens"):
            if site.receiver is None or not is_tokenizer_expr(facts, site.receiver):
                continue
            added = list(self._new_tokens(facts, site))
            if not added:
                continue
            checkpoint = self._checkpoint(facts, site)
            if checkpoint is None:
                continue
            model_id, from_default, (family, vocab, existing) = checkpoint
            added = [(key, token) for key, token in added if token not in existing]
            if any(key == "pad_token" for key, _ in added) and _pad_replaced_after(facts, site):
                added = [(key, token) for key, token in added if key != "pad_token"]
            if not added:
                continue
            if all(key == "pad_token" for key, _ in added) and not _PADS.search(facts.source):
                continue  # a pad token nothing pads with never reaches the model
            tokens = ", ".join(f"`{token}`" for _, token in added[:3]) + (" ..." if len(added) > 3 else "")
            where = f"`{model_id}`" + (" (the default the script is given)" if from_default else "")
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node, 60)}` adds {tokens} to the {family} tokenizer of {where}, whose "
                f"{vocab} entries already fill the model's {vocab} embedding rows: the new ids start at {vocab}, and "
                "nothing calls `model.resize_token_embeddings(len(tokenizer))`. The first batch holding one fails in "
                "the embedding lookup: \"IndexError: index out of range in self\" on the CPU, \"CUDA error: "
                "device-side assert triggered\" (or an illegal memory access) on a GPU.",
                fix_hint="Resize after adding: `model.resize_token_embeddings(len(tokenizer))` (before building the "
                "optimizer), or reuse a token the vocabulary has (`tokenizer.pad_token = tokenizer.unk_token`).",
                # Named by a default the command line may replace: the checkpoint is the likely one, not a certain one.
                severity=Severity.WARNING if from_default else Severity.ERROR,
                related=tuple((load, f"the model is loaded here with {vocab} embedding rows, never resized")
                              for load in _model_loads(facts, model_id)),
            )

    @staticmethod
    def _new_tokens(facts: FileFacts, site) -> Iterator[tuple[str, str]]:
        """(key, token) for each string literal the call adds: ``{"pad_token": "<PAD>"}``,
        ``additional_special_tokens=[...]`` entries, ``add_tokens(["<a>", "<b>"])``. Tokens given as
        ``tokenizer.eos_token`` (already in the vocabulary) or not readable are not counted."""
        given = site.arg(0)
        if site.method == "add_tokens":
            for token in _literals(given):
                yield "token", token
            return
        entries: dict[str, cst.BaseExpression] = {}
        if isinstance(given, cst.Dict):
            for element in given.elements:
                key = string_value(element.key) if isinstance(element, cst.DictElement) else None
                if key is not None:
                    entries[key] = element.value
        elif given is not None:
            contents = facts.dict_contents(given, site.order, site.scope)
            if contents is not None:
                entries = {key: entry.value for key, entry in contents.entries.items()}
        for key, value in entries.items():
            for token in _literals(value):
                yield key, token

    @staticmethod
    def _checkpoint(facts: FileFacts, site) -> Optional[tuple[str, bool, tuple[str, int, frozenset]]]:
        """(model id, named by a default, (family, vocab size, existing special tokens)) of the checkpoint the
        tokenizer is loaded from, when it is one whose tokenizer fills the embedding matrix."""
        loaded = facts.built_by(site.receiver, site.order, site.scope)
        if not isinstance(loaded, cst.Call) or not isinstance(loaded.func, cst.Attribute):
            return None
        if loaded.func.attr.value != "from_pretrained":
            return None
        order, scope = facts._position_of(loaded)
        resolved = _model_id(facts, call_arg(loaded, 0, "pretrained_model_name_or_path"), order, scope)
        if resolved is None:
            return None
        model_id, from_default = resolved
        for pattern, family, vocab, existing in apis.FULL_VOCAB_CHECKPOINTS:
            if re.search(pattern, model_id):
                return model_id, from_default, (family, vocab, existing)
        return None


def _model_loads(facts: FileFacts, model_id: str) -> list[cst.Call]:
    """The ``<ModelClass>.from_pretrained(...)`` calls of the same checkpoint (the resize belongs after them)."""
    loads = []
    for site in facts.calls:
        owner_method = apis.hf_class_method(site.qualname) if site.qualname else None
        if not (owner_method and owner_method[1] == "from_pretrained" and apis.is_model_class(owner_method[0])):
            continue
        resolved = _model_id(facts, site.arg(0, "pretrained_model_name_or_path"), site.order, site.scope)
        if resolved is not None and resolved[0] == model_id:
            loads.append(site.node)
    return loads


def _pad_replaced_after(facts: FileFacts, site) -> bool:
    """``tokenizer.pad_token = tokenizer.eos_token`` after the call: the added token is no longer the one padding
    uses (it stays in the vocabulary, unused)."""
    receiver = name_key(site.receiver)
    return any(
        assign.order > site.order and assign.target.attr.value in ("pad_token", "pad_token_id")
        and name_key(assign.target.value) == receiver
        for assign in facts.attribute_assigns
    )


def _literals(node: Optional[cst.BaseExpression]) -> list[str]:
    if node is None:
        return []
    text = string_value(node)
    if text is not None:
        return [text]
    if isinstance(node, (cst.List, cst.Tuple)):
        return [t for t in (string_value(e.value) for e in node.elements) if t is not None]
    return []


def _model_id(facts: FileFacts, node: Optional[cst.BaseExpression], order: int, scope, depth: int = 0) -> Optional[tuple[str, bool]]:
    """The string a model-id expression holds: a literal, a name bound to one, a parameter (what the first call
    passes), ``CFG["base_model"]`` (a dict the file builds), or ``args.model_name`` / ``cfg.model_name`` given by a
    default (a dataclass field, a class attribute, an argparse ``default=``). (id, True when it is such a
    default)."""
    if node is None or depth > 4:
        return None
    text = string_value(node)
    if text is not None:
        return text, False
    if isinstance(node, cst.Name):
        binding = facts.binding_at(node.value, order, scope)
        if binding is not None and binding.kind == "assign" and binding.value is not None:
            return _model_id(facts, binding.value, binding.order, binding.scope, depth + 1)
        if binding is not None and binding.kind == "param":
            passed = facts.param_argument(binding)
            return _model_id(facts, *passed, depth + 1) if passed is not None else None
        return None
    if isinstance(node, cst.Subscript) and len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index):
        key = string_value(node.slice[0].slice.value)
        contents = facts.dict_contents(node.value, order, scope) if key is not None else None
        if contents is not None and key in contents.entries:
            entry = contents.entries[key]
            return _model_id(facts, entry.value, entry.order, entry.scope, depth + 1)
        return None
    if isinstance(node, cst.Attribute):
        return _default_of(facts, node.attr.value)
    return None


def _default_of(facts: FileFacts, attribute: str) -> Optional[tuple[str, bool]]:
    """The one string default the file gives ``attribute``: a class-level field (``model_name: str =
    "gpt2"``, ``field(default="gpt2")``) or ``parser.add_argument("--model_name", default="gpt2")``."""
    found: set[str] = set()
    for scope in facts.classes.values():
        for binding in scope.bindings.get(attribute, ()):
            value = binding.value
            if isinstance(value, cst.Call) and name_key(value.func) in ("field", "dataclasses.field"):
                value = call_arg(value, keyword="default")
            text = string_value(value)
            if text is not None:
                found.add(text)
    for site in facts.method_calls("add_argument"):
        flags = [string_value(a.value) for a in site.node.args if a.keyword is None]
        if any(f is not None and f.lstrip("-").replace("-", "_") == attribute for f in flags):
            text = string_value(call_arg(site.node, keyword="default"))
            if text is not None:
                found.add(text)
    return (found.pop(), True) if len(found) == 1 else None
