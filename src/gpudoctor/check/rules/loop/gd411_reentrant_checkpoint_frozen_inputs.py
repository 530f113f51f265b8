from __future__ import annotations

import re
from typing import Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import TRAIT_PEFT, FileFacts, call_arg, is_true
from gpudoctor.check.facts.nodes import string_value
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule

_CHECKPOINT = {"torch.utils.checkpoint.checkpoint", "torch.utils.checkpoint.checkpoint_sequential"}
_INPUT_GRADS = re.compile(r"enable_input_require_grads|requires_grad_\(\s*(True)?\s*\)|\.requires_grad\s*=\s*True")
# transformers models whose main input is not ``input_ids`` (``input_features``, ``input_values``, ``pixel_values``):
# transformers 5.24 ``_activation_checkpointing_enable`` only calls ``enable_input_require_grads()`` itself when
# ``main_input_name == "input_ids"`` (or a transformers-loaded adapter), so none of their inputs require grad
_NON_TOKEN_INPUT = re.compile(
    r"^(Whisper|Wav2Vec2|Hubert|WavLM|Speech2Text|SpeechT5|Data2VecAudio|UniSpeech|SEW|ViT|DeiT|BEiT|Beit|Swin|Dinov2|"
    r"ConvNext|ConvNextV2|ResNet|Segformer|CLIPVision|SiglipVision|AutoModelForSpeechSeq2Seq|AutoModelForCTC|"
    r"AutoModelForAudioClassification|AutoModelForAudioFrameClassification|AutoModelForImageClassification|"
    r"AutoModelForSemanticSegmentation|AutoModelForObjectDetection)"
)
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
        yield from self._transformers_reentrant(facts)
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

    def _transformers_reentrant(self, facts: FileFacts):
        """``TrainingArguments(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})``
        given to a trainer of a peft model whose main input is not ``input_ids`` (or that model's own
        ``gradient_checkpointing_enable(...)`` with it, after ``get_peft_model``: before it, peft hooks the inputs)."""
        if facts.calls_to(*apis.PASSTHROUGH):
            return  # prepare_model_for_kbit_training calls enable_input_require_grads for reentrant checkpointing
        sites = []
        for trainer in facts.trainer_calls():
            if not _peft_over_non_token_input(facts.value(trainer.arg(0, "model"), trainer.order, trainer.scope)):
                continue
            args = trainer.arg(1, "args")
            sources = facts.follow_name(args, trainer.order, trainer.scope, params=False) if isinstance(args, cst.Name) else None
            if sources and len(sources) == 1:
                args = sources[0][0]
            made = facts.call_site(args) if isinstance(args, cst.Call) else None
            if made is not None and made.qualname in apis.TRAINING_ARGS \
                    and is_true(call_arg(made.node, keyword="gradient_checkpointing")):
                sites.append((made, call_arg(made.node, keyword="gradient_checkpointing_kwargs")))
        for site in facts.method_calls("gradient_checkpointing_enable", "activation_checkpointing_enable"):
            if _peft_over_non_token_input(facts.value(site.receiver, site.order, site.scope)):
                kwargs = call_arg(site.node, keyword="gradient_checkpointing_kwargs")
                sites.append((site, kwargs if kwargs is not None else call_arg(site.node, keyword="activation_checkpointing_kwargs")))
        for site, kwargs in sites:
            flag = _use_reentrant(kwargs)
            if flag is None or not is_true(flag):
                continue
            yield self.report(
                kwargs,
                f"`{snippet(facts, kwargs)}` makes transformers checkpoint with the reentrant form, and the peft "
                "model's main input is not `input_ids` (audio/vision: `input_features`, `pixel_values`), so transformers "
                "does not call `enable_input_require_grads()` for it, and the adapters were added before checkpointing was "
                "on: no checkpointed block gets an input that requires grad, so backward raises \"RuntimeError: element "
                "0 of tensors does not require grad and does not have a grad_fn\" (or the adapters inside get no gradient).",
                fix_hint="Use `{\"use_reentrant\": False}` (transformers' default), or call "
                "`model.enable_input_require_grads()` before training.",
            )


def _peft_over_non_token_input(value) -> bool:
    """A ``get_peft_model`` model over a transformers model whose main input is not ``input_ids``."""
    peft = value.carrier(TRAIT_PEFT) if value.kind == "model" else None
    if peft is None or peft.base is None:
        return False
    cls = peft.base.origin().traits.get("class")
    return bool(cls) and bool(_NON_TOKEN_INPUT.match(cls))


def _use_reentrant(node: Optional[cst.BaseExpression]) -> Optional[cst.BaseExpression]:
    if not isinstance(node, cst.Dict):
        return None
    for element in node.elements:
        if isinstance(element, cst.DictElement) and string_value(element.key) == "use_reentrant":
            return element.value
    return None
