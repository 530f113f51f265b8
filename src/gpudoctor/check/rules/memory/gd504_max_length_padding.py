from __future__ import annotations

import re
from typing import Optional

from gpudoctor.check.facts import FileFacts, call_arg, int_value, name_key
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.data._common import padding_of, tokenizer_call

# From this length on, padding every sample to it is worth a note.
THRESHOLD = 1024
# "tpu" as a word or an identifier part (`use_tpu`, `tpu_num_cores`), never inside one ("output").
_STATIC_SHAPES = re.compile(r"torch_xla|(?<![a-z])tpu(?![a-z])|static shape", re.IGNORECASE)


class MaxLengthPadding(Rule):
    """``tokenizer(..., padding="max_length", max_length=N)`` with a large N: every sample costs N
    tokens of compute and activation memory whatever its real length (the logits alone are N x vocabulary
    per sample). Dynamic padding (pad each batch to its longest sample) costs only the real lengths."""

    code = "GD504"
    name = "max-length-padding"
    summary = "padding=\"max_length\" with a large max_length: every sample costs max_length tokens of memory"
    severity = Severity.INFO
    preview = True
    triggers = ("max_length",)

    def check(self, facts: FileFacts):
        if _STATIC_SHAPES.search(facts.source):
            return  # XLA/TPU wants static shapes: padding to a fixed length is the right call there
        for site in facts.calls:
            call = tokenizer_call(facts, site.node)
            if call is None or padding_of(facts, call) != "max_length":
                continue
            length = self._length(facts, call_arg(call, keyword="max_length"), site)
            if length is None or length < THRESHOLD:
                continue
            yield self.report(
                call_arg(call, keyword="padding") or call,
                f"`{snippet(facts, call)}` pads every sample to {length} tokens: a 200-token sample wastes "
                f"{length - 200} padded positions ({(length - 200) / length:.0%} of its attention, MLP and activation "
                f"memory), and its logits are {length} x vocabulary (~{length * 32000 * 2 / 2**20:.0f} MiB in 16-bit for a "
                "32k vocabulary) whatever its length.",
                fix_hint="Pad per batch instead: tokenize with `truncation=True, max_length=...` and no padding, and use "
                "`DataCollatorWithPadding`/`DataCollatorForSeq2Seq` (or `padding=\"longest\"` in your collate function).",
                related=((call, f"the tokenizer call that pads to {length} tokens"),),
            )

    @classmethod
    def _length(cls, facts: FileFacts, node, site, depth: int = 0) -> Optional[int]:
        """An int literal, through names, ``self.x`` and parameter defaults (``max_length=2048``)."""
        value = int_value(node)
        if value is not None or depth > 3:
            return value
        key = name_key(node)
        if key is None:
            return None
        order, scope = (site.order, site.scope) if depth == 0 else site
        binding = facts.binding_at(key, order, scope)
        if binding is None or binding.value is None or binding.kind not in ("param", "assign"):
            return None
        return cls._length(facts, binding.value, (binding.order, binding.scope), depth + 1)
