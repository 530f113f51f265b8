from __future__ import annotations

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import FileFacts, call_arg
from gpudoctor.check.finding import Applicability, Edit, Fix, Severity
from gpudoctor.check.queries import snippet, with_kwarg
from gpudoctor.check.rule import Rule


class InferDeviceMapNoSplit(Rule):
    """``accelerate.infer_auto_device_map(model, ...)`` without ``no_split_module_classes``: the map may
    cut a decoder layer between two devices (``layers.0.mlp.gate_proj -> 0``, ``up_proj -> 1``), and the
    residual add then mixes devices. ``from_pretrained(device_map="auto")`` is not flagged: transformers
    passes ``model._no_split_modules`` itself."""

    code = "GD108"
    name = "infer-device-map-no-split"
    summary = "infer_auto_device_map without no_split_module_classes can split a transformer block across devices"
    severity = Severity.WARNING
    fixable = "safe"
    triggers = ("infer_auto_device_map",)

    def check(self, facts: FileFacts):
        for site in facts.calls_to(*apis.INFER_DEVICE_MAP):
            call = site.node
            if any(a.star for a in call.args):
                continue  # **kwargs may carry it
            if call_arg(call, 2, "no_split_module_classes") is not None:
                continue
            model = call_arg(call, 0, "model")
            if model is None:
                continue
            fix = None
            value = facts.value(model, site.order, site.scope)
            if isinstance(model, cst.Name) and value.kind == "model" and value.origin().trait("class"):
                fix = Fix(
                    f"Add `no_split_module_classes={model.value}._no_split_modules`",
                    Applicability.SAFE,
                    (Edit(call, with_kwarg(call, "no_split_module_classes", cst.Attribute(value=cst.Name(model.value), attr=cst.Name("_no_split_modules")))),),
                )
            name = snippet(facts, model)
            yield self.report(
                call,
                f"`{snippet(facts, call)}` has no `no_split_module_classes`: accelerate may cut a transformer block "
                "between devices (e.g. `layers.10.self_attn -> 0`, `layers.10.mlp -> 1`), and running that block "
                "raises \"Expected all tensors to be on the same device, but found at least two devices\" (the "
                "residual add mixes them) when the cut falls between two GPUs.",
                fix_hint=f"Pass `no_split_module_classes={name}._no_split_modules` (for a transformers model), or "
                "the decoder-layer class names, e.g. `[\"LlamaDecoderLayer\"]`.",
                fix=fix,
            )
