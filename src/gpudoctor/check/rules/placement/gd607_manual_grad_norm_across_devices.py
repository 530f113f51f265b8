from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check.facts import TRAIT_DISPATCHED, TRAIT_OFFLOADED, FileFacts, call_arg, name_key
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
    triggers = ("parameters()", "param_groups")

    def check(self, facts: FileFacts):
        for site in facts.calls_to("torch.stack", "torch.cat", "torch.concat", "torch.concatenate"):
            first = site.arg(0, "tensors")
            comp = self._comprehension(facts, first, site)
            if comp is None:
                continue
            owner = self._owner(facts, comp, site)
            where = (site.order, site.scope)
            if owner is None:
                owner = self._param_groups_owner(facts, comp, site)
                if owner is None:
                    continue
                where = facts._position_of(owner)
            value = facts.value(owner, *where)
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
            placer = value.trait("dispatch_call") or value.origin().node
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node, 60)}` gathers one tensor per parameter of `{snippet(facts, owner, 30)}`, "
                f"and {how}: each term stays on its parameter's device, so `{site.qualname}` raises \"Expected all "
                "tensors to be on the same device, but found at least two devices, cuda:0 and cuda:1!\".",
                fix_hint="Use `torch.nn.utils.get_total_norm(grads)` / `clip_grad_norm_` (they group by device), or "
                "move each term: `torch.stack([g.norm().to(first_device) for g in grads])`.",
                severity=severity,
                related=((placer, "the model is dispatched over several devices here"),) if placer is not None else (),
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

    def _param_groups_owner(self, facts: FileFacts, comp, site) -> Optional[cst.BaseExpression]:
        """``[p.grad.norm() for group in opt.param_groups for p in group["params"]]``: the model whose
        parameters the optimizer was built over (``opt = AdamW(model.parameters())``; inside an optimizer
        class of the file, ``self.param_groups`` are the parameters its instances are built with)."""
        for_in = comp.for_in
        while for_in is not None:
            iterable = for_in.iter
            if isinstance(iterable, cst.Attribute) and iterable.attr.value == "param_groups":
                return self._optimizer_params_owner(facts, iterable.value, site)
            for_in = for_in.inner_for_in
        return None

    def _optimizer_params_owner(self, facts: FileFacts, optimizer, site) -> Optional[cst.BaseExpression]:
        if isinstance(optimizer, cst.Name) and optimizer.value == "self":
            class_name = site.scope.class_name
            scope = facts.classes.get(class_name) if class_name else None
            if scope is None or not any((facts.qualname(b.value) or "").startswith("torch.optim.") for b in scope.node.bases):
                return None
            owners = [
                _parameters_owner(call_arg(c.node, 0, "params")) for c in facts.calls
                if isinstance(c.node.func, cst.Name) and c.node.func.value == class_name
            ]
            return owners[0] if owners and all(o is not None for o in owners) else None
        made = facts.built_by(optimizer, site.order, site.scope)
        if made is None:
            return None
        q = facts.qualname(made.func) or ""
        own_class = isinstance(made.func, cst.Name) and made.func.value in facts.classes
        if not (q.startswith("torch.optim.") or own_class):
            return None
        return _parameters_owner(call_arg(made, 0, "params"))

    def _placed_terms(self, comp) -> bool:
        stack = [comp.elt]
        while stack:
            node = stack.pop()
            if isinstance(node, cst.Attribute) and node.attr.value in PLACING_METHODS:
                return True
            stack.extend(node.children)
        return False
