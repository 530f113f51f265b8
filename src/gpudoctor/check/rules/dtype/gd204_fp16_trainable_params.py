from __future__ import annotations

import re

import libcst as cst
from typing import Optional

from gpudoctor.check import apis
from gpudoctor.check.facts import (
    TRAIT_CAST,
    TRAIT_FP16,
    TRAIT_PEFT,
    TRAIT_QUANTIZED,
    FileFacts,
    Value,
    call_arg,
    is_true,
    string_value,
)
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet, trained_models
from gpudoctor.check.rule import Rule

_UNSCALE = "ValueError: Attempting to unscale FP16 gradients."


def _fp16_source(value: Value) -> Optional[Value]:
    """The value whose dtype decides the model's weights, if that dtype is float16 (latest cast wins)."""
    current = value
    while current is not None:
        if TRAIT_CAST in current.traits:
            return current if current.traits[TRAIT_CAST][0] == "float16" else None
        if TRAIT_FP16 in current.traits:
            return current
        current = current.base
    return None


class Fp16TrainableParams(Rule):
    """fp16 mixed precision (``TrainingArguments(fp16=True)``, ``Accelerator(mixed_precision="fp16")``,
    ``GradScaler``) while the *trained* parameters are float16: a full fine-tune of a
    ``dtype=torch.float16``/``.half()`` model, or peft with ``modules_to_save`` (the saved copy stays
    fp16) or ``autocast_adapter_dtype=False``. The scaler refuses to unscale fp16 gradients. Plain LoRA
    on an fp16 base is fine: peft upcasts the adapters to float32 by default."""

    code = "GD204"
    name = "fp16-trainable-params"
    summary = "fp16 AMP (GradScaler) while the trained parameters are float16 (Attempting to unscale FP16 gradients)"
    triggers = ("fp16", "GradScaler")

    def check(self, facts: FileFacts):
        found = self._amp(facts)
        if found is None:
            return
        amp, amp_node = found
        if facts.calls_to(*apis.PASSTHROUGH) or self._upcast_loop(facts):
            return  # trainable params are upcast to float32 (prepare_model_for_kbit_training or by hand)
        seen: set[int] = set()
        for node, site, how in sorted(trained_models(facts), key=lambda t: t[1].order):
            value = facts.value(node, site.order, site.scope)
            if value.kind != "model" or value.has(TRAIT_QUANTIZED):
                continue
            if site.qualname in apis.GET_PEFT_MODEL:
                peft = Value("model", site.node, {TRAIT_PEFT: site.node}, base=value)
            else:
                peft = value.carrier(TRAIT_PEFT)
            base = peft.base if peft is not None else value
            if base is None:
                continue
            fp16 = _fp16_source(base)
            if fp16 is None:
                continue
            origin = id(base.origin().node)
            if origin in seen:
                continue
            if peft is not None:
                reason = self._peft_fp16_reason(facts, peft.node)
                if reason is None:
                    continue  # LoRA adapters are upcast to float32 by default: fine
                what = f"the peft model keeps trainable float16 parameters ({reason})"
            else:
                what = "all its parameters are trained in float16 (full fine-tune)"
            seen.add(origin)
            yield self.report(
                site.node,
                f"{how} trains `{snippet(facts, node)}`, whose weights are float16 (`{snippet(facts, fp16.node)}`), "
                f"and {amp}: {what}, so the first optimizer step (or gradient clipping) raises \"{_UNSCALE}\"",
                fix_hint="Load the weights in float32 and let fp16 autocast do the rest, use bf16, or upcast the "
                "trainable parameters: `for p in model.parameters(): if p.requires_grad: p.data = p.data.float()`.",
                severity=Severity.ERROR,
                related=((fp16.node, "the weights are loaded in float16 here"), (amp_node, "fp16 AMP is turned on here")),
            )

    @staticmethod
    def _amp(facts: FileFacts) -> Optional[tuple[str, cst.CSTNode]]:
        """How the file turns on fp16 AMP with a GradScaler, and where (keywords also read from a ``**kwargs``
        dict: ``TrainingArguments(**{"fp16": True, ...})``)."""
        for site in facts.calls_to(*apis.TRAINING_ARGS):
            if is_true(facts.keyword_argument(site.node, "fp16", site.order, site.scope)):
                return f"`{snippet(facts, site.node.func)}(fp16=True)` turns on fp16 AMP with a GradScaler", site.node
        for site in facts.calls_to(*apis.ACCELERATOR):
            if string_value(facts.keyword_argument(site.node, "mixed_precision", site.order, site.scope)) == "fp16":
                return f"`{snippet(facts, site.node.func)}(mixed_precision=\"fp16\")` unscales gradients with a GradScaler", site.node
        for site in facts.calls_to(*apis.GRAD_SCALER):
            enabled = call_arg(site.node, keyword="enabled")
            if enabled is None or is_true(enabled):
                return f"`{snippet(facts, site.node)}` unscales the gradients", site.node
        return None

    @staticmethod
    def _upcast_loop(facts: FileFacts) -> bool:
        for assign in facts.attribute_assigns:
            # ``p.data = p.data.float()`` / ``.to(torch.float32)``: trainable parameters upcast by hand
            if assign.target.attr.value == "data" and re.search(r"\.float\(\)|float32", facts.module.code_for_node(assign.value)):
                return True
        for loop in facts.loops:
            if loop.iter is None:
                continue
            if "parameters(" not in facts.module.code_for_node(loop.iter):
                continue
            body = facts.module.code_for_node(loop.node.body)
            if ".float()" in body or "float32" in body:
                return True
        return False

    @staticmethod
    def _peft_fp16_reason(facts: FileFacts, peft_call) -> Optional[str]:
        site = facts.call_site(peft_call) if peft_call is not None else None
        if site is None or site.qualname not in apis.GET_PEFT_MODEL:
            return None
        autocast = call_arg(site.node, keyword="autocast_adapter_dtype")
        if autocast is not None and facts.module.code_for_node(autocast) == "False":
            return "`autocast_adapter_dtype=False` leaves the adapters in float16"
        config = facts.built_by(call_arg(site.node, 1, "peft_config"), site.order, site.scope)
        if config is None:
            return None
        modules = call_arg(config, keyword="modules_to_save")
        if modules is not None and facts.module.code_for_node(modules) not in ("None", "[]"):
            return f"`modules_to_save={snippet(facts, modules)}` trains a float16 copy of those modules"
        task = call_arg(config, keyword="task_type")
        if task is not None and "SEQ_CLS" in facts.module.code_for_node(task):
            return "`task_type=SEQ_CLS` adds the classifier head to `modules_to_save`, a float16 copy"
        return None
