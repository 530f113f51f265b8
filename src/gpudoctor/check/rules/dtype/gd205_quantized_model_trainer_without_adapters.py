from __future__ import annotations

from gpudoctor.check import apis
from gpudoctor.check.facts import TRAIT_PEFT, TRAIT_QUANTIZED, FileFacts, call_arg, name_key
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule

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
        for site in facts.calls_to(*apis.TRAINERS):
            if call_arg(site.node, keyword="peft_config") is not None:
                continue  # trl wraps the model with the adapters first
            model = site.arg(0, "model")
            if model is None:
                continue
            value = facts.value(model, site.order, site.scope)
            quantized = value.trait(TRAIT_QUANTIZED)
            if value.kind != "model" or quantized is None or value.carrier(TRAIT_PEFT) is not None:
                continue
            if call_arg(quantized, keyword="quantization_config") is None:
                continue  # `load_in_8bit=True` fails earlier, in from_pretrained (GD201)
            if name_key(model) in adapted or facts.on_another_path(value, site.context):
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
