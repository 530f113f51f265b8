from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import TRAIT_PEFT, TRAIT_QUANTIZED, FileFacts, call_arg, name_key
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule

_UNLOADERS = ("merge_and_unload", "unload", "get_base_model")
_ERROR = (
    "ValueError: You cannot perform fine-tuning on purely quantized models. Please attach trainable adapters on top "
    "of the quantized model to correctly perform fine-tuning."
)


class QuantizedModelTrainerWithoutAdapters(Rule):
    """A bitsandbytes-quantized model (``quantization_config=BitsAndBytesConfig(...)``) handed to a ``Trainer`` (or a
    trl trainer without ``peft_config=``) with no adapter attached: ``Trainer.__init__`` refuses it."""

    code = "GD205"
    name = "quantized-model-trainer-without-adapters"
    summary = "A bitsandbytes-quantized model is given to a Trainer without LoRA adapters (purely quantized model)"
    severity = Severity.ERROR
    triggers = ("quantization_config",)

    def check(self, facts: FileFacts):
        adapted = {name_key(c.receiver) for c in facts.calls if c.method in ("add_adapter", "load_adapter") and c.receiver is not None}
        for site in facts.trainer_calls():
            if call_arg(site.node, keyword="peft_config") is not None:
                continue  # trl wraps the model with the adapters first
            model = site.arg(0, "model")
            if model is None:
                continue
            value = facts.value(model, site.order, site.scope)
            quantized = value.trait(TRAIT_QUANTIZED)
            if value.kind != "model" or quantized is None or value.carrier(TRAIT_PEFT) is not None:
                continue
            loaded_at = facts._position_of(quantized)
            if facts.keyword_argument(quantized, "quantization_config", *loaded_at) is None:
                continue  # `load_in_8bit=True` fails earlier, in from_pretrained (GD201)
            if name_key(model) in adapted or facts.on_another_path(value, site.context):
                continue
            unloaded = _adapters_removed_by(value)
            if unloaded is not None:
                # LoRA was attached, then merged/dropped before training: that call is what to remove.
                yield self.report(
                    unloaded,
                    f"`{snippet(facts, unloaded, 60)}` takes the adapters off the bitsandbytes-quantized model "
                    f"(`{snippet(facts, quantized, 60)}`) and returns the bare quantized model, which "
                    f"`{snippet(facts, site.node.func)}(...)` then receives: transformers refuses to fine-tune the "
                    f"quantized weights themselves and the trainer's constructor raises \"{_ERROR}\"",
                    fix_hint="Train the peft model as it is and merge the adapters only after training (for export).",
                    related=((site.node, "the trainer receives the bare quantized model here"),
                             (quantized, "the model is quantized here")),
                )
                continue
            yield self.report(
                site.node,
                f"`{snippet(facts, model)}` is quantized by bitsandbytes (`{snippet(facts, quantized, 60)}`) and has no "
                f"adapter attached when `{snippet(facts, site.node.func)}(...)` receives it: transformers refuses to "
                f"fine-tune the quantized weights themselves and the trainer's constructor raises \"{_ERROR}\"",
                fix_hint="Attach LoRA adapters first: `model = prepare_model_for_kbit_training(model)`, then "
                "`model = get_peft_model(model, LoraConfig(...))` (or pass `peft_config=` to a trl trainer).",
                related=((quantized, "the model is quantized here"),),
            )


def _adapters_removed_by(value) -> Optional[cst.Call]:
    """The ``merge_and_unload()`` / ``unload()`` / ``get_base_model()`` call that made ``value`` a model without
    its adapters (the lattice's ``_without_adapters``), if one did."""
    current = value
    while current is not None:
        node = current.node
        if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value in _UNLOADERS:
            return node
        current = current.base
    return None
