from __future__ import annotations

import re
from typing import Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import FileFacts, call_arg, string_value
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.data._common import is_tokenizer_expr
from gpudoctor.check.rules.data.gd308_added_tokens_without_resize import AddedTokensWithoutResize

# Module names that put the embedding matrix or the output head under training in a LoRA config.
_EMBEDDING_MODULES = re.compile(r"embed|wte|lm_head|word_embeddings|shared|output|head", re.IGNORECASE)


class AddedTokensFrozenByLora(Rule):
    """Tokens added to a tokenizer whose vocabulary already fills the embedding matrix (GPT-2, Llama 2, Mistral-7B
    v0.1: each added token is a new row), the embeddings resized for them, then ``get_peft_model`` with a
    ``LoraConfig`` that neither saves the embedding/output layers (``modules_to_save=["embed_tokens", "lm_head"]``)
    nor marks the new rows trainable (``trainable_token_indices``) nor targets them, and the peft model is trained:
    ``get_peft_model`` freezes every base weight, the new rows included, so the added tokens keep their
    initialisation. The model never learns to read or emit them (a chat model that never produces its new
    ``<|im_end|>`` and generates until ``max_new_tokens``). A pad token alone is not reported (padding is masked)."""

    code = "GD309"
    name = "added-tokens-frozen-by-lora"
    summary = "New tokens resized into the embeddings, then frozen by get_peft_model (no modules_to_save / trainable_token_indices)"
    severity = Severity.WARNING
    triggers = ("resize_token_embeddings",)

    def check(self, facts: FileFacts):
        if next(facts.method_calls("resize_token_embeddings"), None) is None:
            return  # not resized: GD308's case
        for site in facts.method_calls("add_special_tokens", "add_tokens"):
            if site.receiver is None or not is_tokenizer_expr(facts, site.receiver):
                continue
            checkpoint = AddedTokensWithoutResize._checkpoint(facts, site)
            if checkpoint is None:
                continue  # the tokens may already be in the vocabulary: no new rows shown
            existing = checkpoint[2][2]
            added = [token for key, token in AddedTokensWithoutResize._new_tokens(facts, site)
                     if key != "pad_token" and token not in existing]
            if not added:
                continue
            for peft_site in facts.calls_to(*apis.GET_PEFT_MODEL):
                if peft_site.order <= site.order:
                    continue
                config = facts.built_by(peft_site.arg(1, "peft_config"), peft_site.order, peft_site.scope)
                if not isinstance(config, cst.Call) or facts.qualname(config.func) != "peft.LoraConfig":
                    continue
                if _trains_embeddings(config) or not _trained(facts, peft_site):
                    continue
                tokens = ", ".join(f"`{t}`" for t in added[:3]) + (" ..." if len(added) > 3 else "")
                yield self.report(
                    config,
                    f"{tokens} are new rows of the resized embedding matrix, but this `LoraConfig` neither saves the "
                    "embedding and output layers (`modules_to_save`) nor marks the new rows trainable "
                    f"(`trainable_token_indices`): `{snippet(facts, peft_site.node.func)}(...)` freezes every base "
                    "weight, the new rows included, so the added tokens keep their initialisation and the model never "
                    "learns to read or emit them (a chat model that never produces its new end-of-turn token).",
                    fix_hint='Add `modules_to_save=["embed_tokens", "lm_head"]` (the names of your model\'s input '
                    "embedding and output head), or `trainable_token_indices=` with the new token ids (peft >= 0.15).",
                    related=((site.node, "the tokens are added here"), (peft_site.node, "the base weights are frozen here")),
                )
                break


def _trains_embeddings(config: cst.Call) -> bool:
    """The LoRA config trains the embedding rows somehow, or says something the file does not show."""
    if call_arg(config, keyword="trainable_token_indices") is not None:
        return True
    if any(arg.star for arg in config.args):
        return True  # ``LoraConfig(**cfg)``
    for keyword in ("modules_to_save", "target_modules"):
        value = call_arg(config, keyword=keyword)
        if value is None:
            continue
        names = _names(value)
        if names is None:
            return keyword == "modules_to_save"  # a variable: may hold the embeddings
        if any(_EMBEDDING_MODULES.search(name) for name in names):
            return True
    return False


def _names(value: cst.BaseExpression) -> Optional[list[str]]:
    text = string_value(value)
    if text is not None:
        return [text]
    if isinstance(value, (cst.List, cst.Tuple, cst.Set)):
        names = [string_value(e.value) for e in value.elements]
        return None if any(n is None for n in names) else names
    return None


def _trained(facts: FileFacts, peft_site) -> bool:
    """The peft model is trained: the model argument of a trainer built after it, or a file that calls backward()."""
    for site in facts.trainer_calls():
        if site.order > peft_site.order and call_arg(site.node, keyword="peft_config") is None:
            value = facts.value(call_arg(site.node, 0, "model"), site.order, site.scope)
            current = value
            while current is not None:
                if current.node is peft_site.node:
                    return True
                current = current.base
    return any(c.method == "backward" for c in facts.calls)
