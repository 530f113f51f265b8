from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check.facts import TRAIT_DISPATCHED, TRAIT_OFFLOADED, FileFacts, name_key
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import _parameters_owner, snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.placement._common import PLACING_METHODS

_ACCELERATORS_ONLY = lambda devices: {d for d in devices if d not in ("cpu", "disk", "meta")}  # noqa: E731


class ManualGradNormAcrossDevices(Rule):
    """A hand-written global norm, ``torch.stack([p.grad.norm() for p in model.parameters()])`` (or
    ``torch.cat``), over a model dispatched on several accelerators (``device_map``): each per-parameter
    norm lives on its parameter's GPU and ``torch.stack``/``torch.cat`` refuse tensors on different
    devices. ``torch.nn.utils.clip_grad_norm_`` and ``get_total_norm`` group by device and are fine.
    Silent when each term is moved (``.to(...)``) or the map is a single device."""

    code = "GD607"
    name = "manual-grad-norm-across-devices"
    summary = "torch.stack/cat of per-parameter norms over a model dispatched on several devices"
    severity = Severity.ERROR
    triggers = ("parameters()",)

    def check(self, facts: FileFacts):
        for site in facts.calls_to("torch.stack", "torch.cat", "torch.concat", "torch.concatenate"):
            first = site.arg(0, "tensors")
            comp = self._comprehension(facts, first, site)
            if comp is None:
                continue
            owner = self._owner(facts, comp, site)
            if owner is None:
                continue
            value = facts.value(owner, site.order, site.scope)
            device_map = value.trait(TRAIT_DISPATCHED)
            if value.kind != "model" or device_map is None:
                continue
            gpus = _ACCELERATORS_ONLY(device_map.devices)
            if device_map.strategy == "explicit" and len(gpus) >= 2:
                severity, how = Severity.ERROR, f"its device map puts parameters on {', '.join(sorted(gpus))}"
            elif device_map.strategy == "auto" and not value.has(TRAIT_OFFLOADED):
                severity, how = Severity.WARNING, f"`device_map={device_map.label or 'auto'}` spreads it over every visible GPU"
            else:
                continue
            if self._placed_terms(comp):
                continue
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node, 60)}` gathers one tensor per parameter of `{snippet(facts, owner, 30)}`, "
                f"and {how}: each term stays on its parameter's device, so `{site.qualname}` raises \"Expected all "
                "tensors to be on the same device, but found at least two devices, cuda:0 and cuda:1!\".",
                fix_hint="Use `torch.nn.utils.get_total_norm(grads)` / `clip_grad_norm_` (they group by device), or "
                "move each term: `torch.stack([g.norm().to(first_device) for g in grads])`.",
                severity=severity,
            )

    def _comprehension(self, facts: FileFacts, node, site) -> Optional[cst.BaseExpression]:
        if isinstance(node, (cst.ListComp, cst.GeneratorExp)):
            return node
        key = name_key(node)
        if key is not None:
            binding = facts.binding_at(key, site.order, site.scope)
            if binding is not None and binding.kind == "assign" and isinstance(binding.value, (cst.ListComp, cst.GeneratorExp)):
                return binding.value
        return None

    def _owner(self, facts: FileFacts, comp, site) -> Optional[cst.BaseExpression]:
        iterable = comp.for_in.iter
        owner = _parameters_owner(iterable)
        if owner is not None:
            return owner
        key = name_key(iterable)
        if key is None:
            return None
        binding = facts.binding_at(key, site.order, site.scope)
        if binding is None or binding.kind != "assign":
            return None
        value = binding.value
        if isinstance(value, (cst.ListComp, cst.GeneratorExp)):
            return _parameters_owner(value.for_in.iter)
        if isinstance(value, cst.Call) and isinstance(value.func, cst.Name) and value.func.value == "list" and value.args:
            return _parameters_owner(value.args[0].value)
        return _parameters_owner(value)

    def _placed_terms(self, comp) -> bool:
        stack = [comp.elt]
        while stack:
            node = stack.pop()
            if isinstance(node, cst.Attribute) and node.attr.value in PLACING_METHODS:
                return True
            stack.extend(node.children)
        return False
