from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import FileFacts, call_arg, name_key
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import parameters_owner, snippet
from gpudoctor.check.rule import Rule

_INITIALIZE = {"deepspeed.initialize"}


class TorchClipDeepspeedEngine(Rule):
    """``torch.nn.utils.clip_grad_norm_`` over the parameters of a DeepSpeed engine (``deepspeed.initialize``
    returned it, or the module handed to it): DeepSpeed owns the gradients, clipping belongs in its
    config (``"gradient_clipping"``)."""

    code = "GD415"
    name = "torch-clip-deepspeed-engine"
    summary = "torch clip_grad_norm_ on a DeepSpeed engine (ZeRO owns the gradients; clip via gradient_clipping)"
    severity = Severity.WARNING
    triggers = ("deepspeed",)

    def check(self, facts: FileFacts):
        engines = list(self._engines(facts))
        if not engines:
            return
        for site in facts.calls_to(*apis.TORCH_CLIP):
            owner = parameters_owner(facts, site.arg(0, "parameters"), site.order, site.scope)  # also `params = m.parameters()`
            key = _engine_key(owner)
            if key is None:
                continue
            init = next((i for i, names in engines if i.order < site.order and key in names), None)
            binding = facts.binding_at(key, site.order, site.scope)
            if init is None:
                continue
            if binding is not None and binding.kind == "param" and binding is not facts.binding_at(key, init.order, init.scope):
                continue  # another object of the same name (another function's parameter)
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node)}` clips the parameters of a DeepSpeed engine, but DeepSpeed owns the "
                "gradients: under ZeRO-2/3 backward reduces them into partitioned buffers and sets `param.grad = None` "
                "outside this rank's partition (`zero/stage_1_and_2.py`, `reduce_independent_p_g_buckets_and_remove_grads`), "
                "so the norm is one rank's share and every rank clips with a different coefficient; under fp16 the "
                "gradients still carry the loss scale, so the max norm is compared with scaled values. The clip does "
                "not bound the real gradient norm.",
                fix_hint="Delete the call and set `\"gradient_clipping\": <max_norm>` in the DeepSpeed config: the engine "
                "clips in `step()` with the global, unscaled norm.",
                related=((init.node, "the DeepSpeed engine is created here"),),
            )

    @staticmethod
    def _engines(facts: FileFacts):
        """(initialize call site, names whose parameters are the engine's: the engine and the module given)."""
        for site in facts.calls_to(*_INITIALIZE):
            names = {b.key for b in facts._bindings_of_value(site.node) if b.kind == "unpack" and b.index == 0}
            module = _module_arg(site.node)
            if module is not None and name_key(module) is not None:
                names.add(name_key(module))
            if names:
                yield site, names


def _engine_key(owner: Optional[cst.BaseExpression]) -> Optional[str]:
    """The name whose parameters are clipped: ``engine`` for ``engine.parameters()`` and for
    ``engine.module.parameters()`` (``DeepSpeedEngine.module`` is the wrapped model: the same parameters)."""
    if type(owner) is cst.Attribute and owner.attr.value == "module":
        owner = owner.value
    return name_key(owner)


def _module_arg(call: cst.Call) -> Optional[cst.BaseExpression]:
    # deepspeed.initialize(args=None, model=None, optimizer=None, model_parameters=None, ...)
    return call_arg(call, 1, "model")
