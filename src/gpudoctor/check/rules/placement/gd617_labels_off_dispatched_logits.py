from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check.facts import TRAIT_DISPATCHED, TRAIT_OFFLOADED, FileFacts, call_arg, name_key
from gpudoctor.check.facts.nodes import string_value
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import max_memory_entries, snippet, stated_gpus
from gpudoctor.check.rule import Rule

# Loss functions that take (prediction, target) and refuse tensors on two devices.
_LOSS_FUNCTIONS = {
    f"torch.nn.functional.{name}"
    for name in ("cross_entropy", "nll_loss", "binary_cross_entropy_with_logits", "mse_loss", "l1_loss", "kl_div")
}
_LOSS_CLASSES = {
    f"torch.nn.{name}" for name in ("CrossEntropyLoss", "NLLLoss", "BCEWithLogitsLoss", "MSELoss", "L1Loss", "KLDivLoss")
}
# Methods that keep a tensor where it is (reshaping, slicing, casting to a dtype).
_SAME_DEVICE = {"contiguous", "view", "reshape", "flatten", "float", "half", "bfloat16", "long", "squeeze", "unsqueeze",
                "transpose", "permute", "clone", "detach"}
_MAX_DEPTH = 6


class LabelsOffDispatchedLogits(Rule):
    """A loss computed by hand from the ``.logits`` of a model that ``device_map`` spreads over several GPUs,
    with targets moved to a fixed device (``labels.to("cuda:0")``, ``.to(device)``, ``.to(model.device)``,
    ``.cuda()``): the logits come out of the last layer's GPU (``lm_head`` on the last card), the targets are on
    the first, and the loss raises "Expected all tensors to be on the same device, but found at least two
    devices, cuda:1 and cuda:0!". Reported only when the file shows several GPUs (an explicit map over two or more,
    a ``max_memory`` with two GPU entries, or the GPUs it states); silent when the targets follow the logits
    (``labels.to(logits.device)``) or the logits are moved."""

    code = "GD617"
    name = "labels-off-dispatched-logits"
    summary = "Loss targets moved to a fixed device while a multi-GPU device_map puts the logits on the last GPU"
    severity = Severity.ERROR
    triggers = (".logits",)

    def check(self, facts: FileFacts):
        losses = {id(b.value) for b in _loss_instances(facts)}
        for site in facts.calls:
            if site.qualname not in _LOSS_FUNCTIONS and not self._loss_instance_call(facts, site, losses):
                continue
            args = [a.value for a in site.node.args if a.keyword is None and not a.star][:2]
            if len(args) != 2:
                continue
            found = _logits_of(facts, args[0], site.order, site.scope)
            if found is None:
                continue
            model_value, model_node = found
            gpus = self._gpus(facts, model_value, model_node, site)
            if gpus is None:
                continue
            moved = _fixed_device_move(facts, args[1], site.order, site.scope)
            if moved is None:
                continue
            yield self.report(
                site.node,
                f"`{snippet(facts, args[0], 40)}` comes from `{snippet(facts, model_node, 30)}`'s logits, which "
                f"{gpus}, so they come out on the GPU of its last layer, while the targets were moved to a fixed device "
                f"by `{snippet(facts, moved, 50)}` (the first GPU): the loss raises \"Expected all tensors to be on the "
                "same device, but found at least two devices, cuda:1 and cuda:0!\"",
                fix_hint="Move the targets where the logits are: `labels.to(logits.device)`.",
                related=((moved, "the targets are moved to a fixed device here"),),
            )

    @staticmethod
    def _loss_instance_call(facts: FileFacts, site, losses: set[int]) -> bool:
        func = site.node.func
        if not isinstance(func, (cst.Name, cst.Attribute)) or name_key(func) is None:
            return False
        binding = facts.binding_at(name_key(func), site.order, site.scope)
        return binding is not None and id(binding.value) in losses

    @staticmethod
    def _gpus(facts: FileFacts, value, model_node, site) -> Optional[str]:
        device_map = value.trait(TRAIT_DISPATCHED)
        if device_map is None or value.has(TRAIT_OFFLOADED):
            return None
        gpus = {d for d in device_map.devices if d not in ("cpu", "disk", "meta")}
        if device_map.strategy == "explicit" and len(gpus) >= 2:
            return f"its device map spreads over {', '.join(sorted(map(str, gpus)))}"
        if device_map.strategy != "auto":
            return None
        load = value.origin().node
        if isinstance(load, cst.Call):
            entries = max_memory_entries(facts, call_arg(load, keyword="max_memory"), site.order, site.scope)
            if entries is not None and len([d for d in entries[0] if d not in ("cpu", "disk")]) >= 2:
                return f"`device_map={device_map.label or 'auto'}` spreads over the GPUs of `max_memory={entries[1]}`"
        stated = stated_gpus(facts.source, model_names=True)
        if stated is not None and stated[0] >= 2:
            return f"`device_map={device_map.label or 'auto'}` spreads over the {stated[0]} GPUs the file states ({stated[2]})"
        return None


def _loss_instances(facts: FileFacts):
    for scope in (facts.module_scope, *facts.functions):
        for bindings in scope.bindings.values():
            for binding in bindings:
                if binding.kind == "assign" and isinstance(binding.value, cst.Call) \
                        and facts.qualname(binding.value.func) in _LOSS_CLASSES:
                    yield binding


def _strip(node: cst.BaseExpression) -> tuple[cst.BaseExpression, bool]:
    """``logits[..., :-1, :].contiguous().view(-1, v)`` -> (``logits``, False); (node, True) when a ``.to(...)``
    / ``.cuda()`` on the way moves it."""
    while True:
        if isinstance(node, cst.Subscript):
            node = node.value
        elif isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
            method = node.func.attr.value
            if method in ("to", "cuda", "cpu"):
                return node, True
            if method not in _SAME_DEVICE:
                return node, False
            node = node.func.value
        else:
            return node, False


def _logits_of(facts: FileFacts, node, order, scope, depth: int = 0):
    """(model value, model expression) when ``node`` is (a reshaping of) the unmoved ``.logits`` of a call of a model."""
    if depth > _MAX_DEPTH:
        return None
    node, moved = _strip(node)
    if moved:
        return None
    if isinstance(node, cst.Attribute) and node.attr.value == "logits":
        output = node.value
        if isinstance(output, cst.Name):
            sources = facts.follow_name(output, order, scope, params=False)
            if not sources or len(sources) != 1:
                return None
            output, order, scope = sources[0]
        if isinstance(output, cst.Call):
            value = facts.value(output.func, order, scope)
            if value.kind == "model":
                return value, output.func
        return None
    if isinstance(node, cst.Name):
        sources = facts.follow_name(node, order, scope, params=False)
        if sources and len(sources) == 1:
            return _logits_of(facts, *sources[0], depth + 1)
    return None


def _fixed_device_move(facts: FileFacts, node, order, scope, depth: int = 0) -> Optional[cst.Call]:
    """The ``.to(<fixed device>)`` / ``.cuda()`` call that placed ``node`` (through reshapes and names), when the device
    is fixed: a string, ``torch.device(...)``, a name bound to one of them, or ``<model>.device``. Not a device read
    from another tensor (``logits.device``) or anything the file does not show."""
    if depth > _MAX_DEPTH:
        return None
    node, moved = _strip(node)
    if moved:
        method = node.func.attr.value
        if method == "cuda":
            return node
        if method != "to":
            return None
        target = call_arg(node, 0, "device")
        return node if target is not None and _fixed_device(facts, target, order, scope) else None
    if isinstance(node, cst.Name):
        sources = facts.follow_name(node, order, scope, params=False)
        if sources and len(sources) == 1:
            return _fixed_device_move(facts, *sources[0], depth + 1)
    return None


def _fixed_device(facts: FileFacts, node, order, scope, depth: int = 0) -> bool:
    text = string_value(node)
    if text is not None:
        return text.startswith("cuda")
    if isinstance(node, cst.Call) and facts.qualname(node.func) == "torch.device":
        return _fixed_device(facts, call_arg(node, 0, "type"), order, scope, depth + 1)
    if isinstance(node, cst.Attribute) and node.attr.value == "device":
        return facts.value(node.value, order, scope).kind == "model"  # ``model.device``: the first GPU of a map
    if isinstance(node, cst.Name) and depth < 3:
        sources = facts.follow_name(node, order, scope, params=False)
        if sources and len(sources) == 1:
            return _fixed_device(facts, *sources[0], depth + 1)
    return False
