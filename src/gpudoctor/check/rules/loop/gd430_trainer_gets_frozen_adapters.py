from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check.facts import TRAIT_FROZEN, TRAIT_PEFT, CallSite, FileFacts, Value, call_arg
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.loop.gd422_all_parameters_frozen import AllParametersFrozen

# Calls after which the file may have made adapters trainable again: a new or reloaded adapter, an adapter switch.
_ADAPTER_CHANGES = {"add_adapter", "load_adapter", "set_adapter", "enable_adapters", "enable_adapter_layers"}


class TrainerGetsFrozenAdapters(Rule):
    """A transformers/trl trainer is given, as the model to train, a peft model whose every parameter is frozen, and
    the file trains it (``trainer.train()``): an adapter loaded for inference (``PeftModel.from_pretrained(base,
    path)`` or ``AutoPeftModelForCausalLM.from_pretrained(path)`` without ``is_trainable=True``: peft's default loads
    the adapter with ``requires_grad=False``), or ``prepare_model_for_kbit_training`` run *after* ``get_peft_model``
    (it starts by setting ``requires_grad=False`` on every parameter, the new LoRA matrices included). Not reported:
    a trl trainer given ``peft_config=``, a file that sets ``requires_grad`` to anything but ``False`` or changes the
    adapters (``add_adapter``, ``load_adapter``, ``set_adapter``) anywhere, an ``is_trainable=`` the file computes."""

    code = "GD430"
    name = "trainer-gets-frozen-adapters"
    summary = "A trainer trains a peft model whose adapters are frozen (loaded without is_trainable=True, or re-frozen by prepare_model_for_kbit_training)"
    triggers = ("from_pretrained", "prepare_model_for_kbit_training")

    def check(self, facts: FileFacts):
        if AllParametersFrozen._unfreezes_anything(facts) or any(facts.method_calls(*_ADAPTER_CHANGES)):
            return
        for site in facts.trainer_calls():
            if call_arg(site.node, keyword="peft_config") is not None or not self._trained(facts, site):
                continue
            value = facts.value(call_arg(site.node, 0, "model"), site.order, site.scope)
            froze = _frozen_by(value) if value.kind == "model" else None
            if froze is None:
                continue
            if facts.qualname(froze.func) == "peft.prepare_model_for_kbit_training":
                cause = (
                    f"`{snippet(facts, froze, 60)}` runs over the peft model: it sets `requires_grad=False` on every "
                    "parameter, the LoRA matrices `get_peft_model` just added included"
                )
                hint = "Call `prepare_model_for_kbit_training(model)` on the base model, before `get_peft_model(...)`."
            else:
                cause = (
                    f"`{snippet(facts, froze, 60)}` loads the adapter without `is_trainable=True`, so peft loads it in "
                    "inference mode with every parameter frozen"
                )
                hint = "Pass `is_trainable=True` to continue training the saved adapter."
            yield self.report(
                froze,
                f"{cause}; `{snippet(facts, site.node.func)}(...)` then trains a model with no trainable parameter: "
                "`backward()` raises \"element 0 of tensors does not require grad and does not have a grad_fn\", or, "
                "with gradient checkpointing (which makes the inputs require grad), training runs with `grad_norm` 0 "
                "and the adapter never changes.",
                fix_hint=hint,
                related=((site.node, "the trainer is given the frozen model here"),),
            )

    @staticmethod
    def _trained(facts: FileFacts, site: CallSite) -> bool:
        """Something the trainer construction ``site`` built has ``.train()`` called on it."""
        for call in facts.method_calls("train"):
            if call.receiver is None or call.order <= site.order:
                continue
            value = facts.value(call.receiver, call.order, call.scope)
            if value.kind == "trainer" and value.node is site.node:
                return True
            if isinstance(call.receiver, cst.Call) and call.receiver is site.node:
                return True
        return False


def _frozen_by(value: Value) -> Optional[cst.Call]:
    """The call that left every parameter of ``value`` frozen, unless an adapter was added after it (outermost
    wrapper first: ``get_peft_model`` over a frozen base adds trainable adapters)."""
    current: Optional[Value] = value
    while current is not None:
        froze = current.traits.get(TRAIT_FROZEN)
        if isinstance(froze, cst.Call):
            return froze
        if TRAIT_PEFT in current.traits:
            return None
        current = current.base
    return None
