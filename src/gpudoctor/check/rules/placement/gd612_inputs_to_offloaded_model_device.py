from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check.facts import DeviceMap, FileFacts, string_value
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule


class InputsToOffloadedModelDevice(Rule):
    """``inputs.to(model.device)`` (or ``device=model.device``) where the model's device map offloads its
    *first* module: ``model.device`` is the first parameter's device, which is ``meta`` for offloaded
    weights. Only explicit maps are reported: ``"auto"`` fills the GPUs first, so the embedding stays
    resident and ``model.device`` is ``cuda:0``."""

    code = "GD612"
    name = "inputs-to-offloaded-model-device"
    summary = "inputs.to(model.device) when the device map offloads the model's first module (model.device is meta)"
    severity = Severity.ERROR
    triggers = (".device",)

    def check(self, facts: FileFacts):
        for site in facts.calls:
            for arg in site.node.args:
                if arg.keyword is not None and arg.keyword.value != "device":
                    continue
                if arg.keyword is None and site.method != "to":
                    continue
                target, model, order, scope = self._model_device(facts, arg.value, site.order, site.scope)
                if target is None:
                    continue
                value = facts.value(model, order, scope)
                if value.kind != "model":
                    continue
                device_map = value.trait("device_map")
                first = self._first_entry(facts, device_map)
                if first is None:
                    continue
                module, device = first
                if device == "disk":
                    why = f"its device map puts the first module (`{module}`) on disk"
                elif device == "cpu" and (device_map.devices - {"cpu", "disk"}):
                    why = (f"its device map puts the first module (`{module}`) on the CPU while a GPU is the "
                           "execution device, so accelerate offloads it")
                else:
                    continue
                yield self.report(
                    arg.value,
                    f"`{snippet(facts, target, 40)}` is the device of the model's first parameter, and {why}: that parameter is a "
                    f"`meta` placeholder, so `{snippet(facts, site.node, 50)}` targets `meta` and the forward raises "
                    "\"NotImplementedError: Cannot copy out of meta tensor; no data!\" (`generate`: \"Tensor.item() "
                    "cannot be called on meta tensors\").",
                    fix_hint="Leave the inputs on the CPU (the accelerate hooks move them), or send them to the first "
                    "GPU of the map (e.g. `.to(0)`).",
                    related=(
                        *(() if target is arg.value else ((target, f"`{snippet(facts, arg.value, 20)}` is `{snippet(facts, target, 40)}`"),)),
                        (site.node, "the inputs are sent to that device here"),
                        *(((device_map.node, f"the device map offloads `{module}` here"),) if device_map.node is not None else ()),
                    ),
                )

    @staticmethod
    def _model_device(facts: FileFacts, node, order: int, scope):
        """(the expression giving the model's first-parameter device, the model, its order, its scope) that
        ``node`` is, directly or through names (``device = model.device``, ``self.device = self.model.device``):
        ``model.device``, or the first parameter spelled out, ``next(model.parameters()).device`` (also through
        ``iter(...)``, or ``list(model.parameters())[0].device``); (None, None, ...) otherwise."""
        for _ in range(4):
            if isinstance(node, cst.Attribute) and node.attr.value == "device":
                model = _first_parameter_owner(node.value) or node.value
                if facts.value(model, order, scope).kind == "model":
                    return node, model, order, scope
            binding = facts.assignment_of(node, order, scope)
            if binding is None or binding.value is None:
                break
            node, order, scope = binding.value, binding.order, binding.scope
        return None, None, order, scope

    def _first_entry(self, facts: FileFacts, device_map: Optional[DeviceMap]) -> Optional[tuple[str, str]]:
        if device_map is None or device_map.strategy != "explicit" or not isinstance(device_map.node, cst.Dict):
            return None
        elements = [e for e in device_map.node.elements if isinstance(e, cst.DictElement)]
        if not elements:
            return None
        key = string_value(elements[0].key)
        value = elements[0].value
        device = string_value(value)
        if device is None and isinstance(value, cst.Integer):
            device = value.value
        if key is None or device is None:
            return None
        leaf = key.split(".")[-1]
        if not (any(w in leaf for w in _FIRST_MODULE_WORDS) or key in _WHOLE_BODY):
            return None  # the map's first key is not necessarily the first parameter's module
        return key, device


_FIRST_MODULE_WORDS = ("embed", "wte", "word_embeddings", "shared")
_WHOLE_BODY = {"model", "transformer", "gpt_neox", "base_model", "model.model", "encoder", "model.decoder"}


def _first_parameter_owner(node) -> Optional[cst.BaseExpression]:
    """``model`` for ``next(model.parameters())``, ``next(iter(model.parameters()))`` and
    ``list(model.parameters())[0]``: the first parameter, whose device ``model.device`` also reports."""
    if isinstance(node, cst.Subscript) and len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index):
        index = node.slice[0].slice.value
        if isinstance(index, cst.Integer) and index.value == "0" and _called(node.value, "list"):
            node = node.value.args[0].value
            return _parameters_receiver(node)
        return None
    if _called(node, "next"):
        inner = node.args[0].value
        if _called(inner, "iter"):
            inner = inner.args[0].value
        return _parameters_receiver(inner)
    return None


def _called(node, name: str) -> bool:
    return isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == name and len(node.args) >= 1


def _parameters_receiver(node) -> Optional[cst.BaseExpression]:
    if (isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value == "parameters"
            and not node.args):
        return node.func.value
    return None
