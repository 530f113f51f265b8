from __future__ import annotations

import re

from gpudoctor.check.facts import FileFacts, call_arg, is_true
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule

_CHECKPOINT = {"torch.utils.checkpoint.checkpoint", "torch.utils.checkpoint.checkpoint_sequential"}
_INPUT_GRADS = re.compile(r"enable_input_require_grads|requires_grad_\(\s*(True)?\s*\)|\.requires_grad\s*=\s*True")
_FREEZES = re.compile(r"requires_grad_\(\s*False\s*\)|\.requires_grad\s*=\s*False|get_peft_model|inject_adapter_in_model")


class ReentrantCheckpointFrozenInputs(Rule):
    """``torch.utils.checkpoint.checkpoint`` in its reentrant form (``use_reentrant=True``, or not given:
    torch 2.13 still defaults to reentrant) in a file that freezes the base weights (adapters,
    ``requires_grad_(False)``) and never makes the inputs require grad: the checkpointed segment's
    output does not require grad, so backward fails ("element 0 of tensors does not require grad and
    does not have a grad_fn") or the adapters inside the segment get no gradient."""

    code = "GD411"
    name = "reentrant-checkpoint-frozen-inputs"
    summary = "Reentrant torch.utils.checkpoint with frozen weights and inputs that do not require grad"
    severity = Severity.WARNING
    preview = True
    triggers = ("checkpoint",)

    def check(self, facts: FileFacts):
        if not _FREEZES.search(facts.source) or _INPUT_GRADS.search(facts.source):
            return
        for site in facts.calls_to(*_CHECKPOINT):
            reentrant = call_arg(site.node, keyword="use_reentrant")
            if reentrant is not None and not is_true(reentrant):
                continue
            how = "`use_reentrant=True`" if reentrant is not None else "no `use_reentrant=` (torch 2.13 defaults to the reentrant form)"
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node)}` uses reentrant checkpointing ({how}) while the file freezes weights "
                "and never makes the inputs require grad: with frozen weights before the segment its inputs do not "
                "require grad, so backward raises \"RuntimeError: element 0 of tensors does not require grad and does "
                "not have a grad_fn\" (or the trainable weights inside the segment silently get no gradient).",
                fix_hint="Pass `use_reentrant=False`, or make the segment's input require grad "
                "(`model.enable_input_require_grads()` for transformers models).",
            )
