from __future__ import annotations

import libcst as cst

from gpudoctor.check.facts import FileFacts
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.loop._common import is_backward, trainer_in_file
from gpudoctor.check.rules.loop.gd403_eval_without_train import is_train_call

_ENABLE = ("gradient_checkpointing_enable", "activation_checkpointing_enable")


class CheckpointingWithoutTrain(Rule):
    """Gradient checkpointing enabled on a ``from_pretrained`` model that a hand-written loop trains
    without ever calling ``model.train()``: ``from_pretrained`` returns the model in eval mode, and
    transformers only checkpoints layers in training mode, so nothing is checkpointed (no memory saved)
    and dropout stays off."""

    code = "GD412"
    name = "checkpointing-without-train"
    summary = "Gradient checkpointing is enabled but the model is never put in train() mode"
    severity = Severity.WARNING
    triggers = ("checkpointing_enable",)

    def check(self, facts: FileFacts):
        if trainer_in_file(facts) or any(is_train_call(facts, c) for c in facts.method_calls("train")):
            return
        backward = next((c for c in facts.calls if is_backward(facts, c)), None)
        if backward is None:
            return
        for site in facts.method_calls(*_ENABLE):
            value = facts.value(site.receiver, site.order, site.scope)
            if value.kind != "model" or not (value.trait("class") or value.has("peft")):
                continue  # only models loaded by from_pretrained are known to start in eval mode
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node)}` has no effect while the model is in eval mode, and nothing in the file "
                "calls `.train()`: `from_pretrained` returns the model in eval mode, and transformers layers only "
                "checkpoint when `self.training` is true, so no activation is recomputed (no memory saved, OOM risk) "
                "and dropout is off during training.",
                fix_hint="Call `model.train()` before the training loop.",
                related=(
                    *(((value.origin().node, "the model is loaded here, in eval mode"),)
                      if isinstance(value.origin().node, cst.Call) else ()),
                    (backward.node, "training runs here with the model still in eval mode"),
                ),
            )
