from __future__ import annotations

import re
from typing import Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import FileFacts, IfFrame, call_arg
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule

_PAD_ATTRS = {"pad_token": "eos_token", "pad_token_id": "eos_token_id"}
# The texts end with EOS: appended by hand, in a template, or by the tokenizer.
_EOS_IN_DATA = re.compile(
    r"\+\s*[\w.]*eos_token\b|\{[\w.]*eos_token\}|eos_token_id\s*\]|append\(\s*[\w.]*eos_token_id\s*\)|"
    r"add_eos_token\s*=\s*True|</s>|<\|endoftext\|>|<\|eot_id\|>|<\|im_end\|>"
)


class PadEosLmCollator(Rule):
    """``tokenizer.pad_token = tokenizer.eos_token`` with ``DataCollatorForLanguageModeling(mlm=False)``:
    the collator sets ``labels[labels == pad_token_id] = -100``, and since pad and EOS share one id,
    every real end-of-sequence token is masked too. The model never learns to stop."""

    code = "GD304"
    name = "pad-eos-lm-collator"
    summary = "pad_token = eos_token with DataCollatorForLanguageModeling(mlm=False): EOS is never learned"
    severity = Severity.ERROR
    triggers = ("DataCollatorForLanguageModeling",)

    def check(self, facts: FileFacts):
        if self._pad_is_eos(facts, None) is None:
            return
        for site in facts.calls_to(*apis.LM_COLLATOR):
            node, guarded = self._pad_is_eos(facts, site.scope.class_name)
            mlm = call_arg(site.node, 1, "mlm")
            if not (isinstance(mlm, cst.Name) and mlm.value == "False"):
                continue
            evidence = _EOS_IN_DATA.search(facts.source)
            if not evidence:
                # Nothing puts an EOS in the texts (Llama/GPT-2 tokenizers add none by themselves): the collator
                # masks padding only, which is what the script wants.
                continue
            when = " (the branch runs for tokenizers without a pad token: Llama, Mistral, GPT-2...)" if guarded else ""
            effect = (
                f"The texts do end with EOS (`{evidence.group(0)}`), and every one of those targets is masked: "
                "the model is never trained to stop and generates until `max_new_tokens`."
            )
            severity = Severity.ERROR
            yield self.report(
                site.node,
                f"`{snippet(facts, node)}`{when} makes padding and end-of-sequence one token id, and "
                f"`{snippet(facts, site.node)}` sets `labels[labels == pad_token_id] = -100`. {effect}",
                fix_hint=(
                    "Use a pad token distinct from EOS (`tokenizer.add_special_tokens({\"pad_token\": \"<pad>\"})` then "
                    "`model.resize_token_embeddings(len(tokenizer))`, or a reserved/unk token), or build `labels` "
                    "yourself with -100 where `attention_mask == 0` and pad with `DataCollatorForSeq2Seq`."
                ),
                severity=severity,
                related=((node, "padding is made the end-of-sequence token here"),),
            )

    @staticmethod
    def _pad_is_eos(facts: FileFacts, class_name: Optional[str]) -> Optional[tuple[cst.CSTNode, bool]]:
        """The assignment that makes pad = EOS (preferring one in the collator's class)."""
        assigns = sorted(facts.attribute_assigns, key=lambda a: a.scope.class_name != class_name or class_name is None)
        for site in assigns:
            wanted = _PAD_ATTRS.get(site.target.attr.value)
            value = site.value
            held = facts.assignment_of(value, site.order, site.scope)  # eos = tok.eos_token; tok.pad_token = eos
            if held is not None:
                value = held.value
            if wanted and isinstance(value, cst.Attribute) and value.attr.value == wanted:
                guarded = any(isinstance(f, IfFrame) and "pad_token" in facts.module.code_for_node(f.test) for f in site.context)
                return site.node, guarded
        for entry in facts.dict_entries:
            if entry.key == "pad_token" and isinstance(entry.value, cst.Attribute) and entry.value.attr.value == "eos_token":
                return entry.element, False
        for site in facts.calls:
            value = site.arg(keyword="pad_token")
            if isinstance(value, cst.Attribute) and value.attr.value == "eos_token":
                return site.node, False
        return None
