from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check.facts import FileFacts, call_arg, name_key
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.placement._common import (
    LOSS_FUNCTIONS_WITH_WEIGHT as _LOSS_FUNCTIONS,
    LOSS_MODULES_WITH_WEIGHT as _LOSS_MODULES,
    LOSS_MODULE_EXTRA_WEIGHT as _LOSS_EXTRA,
    PLACING_METHODS,
    cpu_computed,
    creation_qualname,
    file_sets_default_device,
    module_classes,
    moves_to_accelerator,
    only_called_in_callee,
    parents,
)


class LossWeightOnCpu(Rule):
    """``nn.CrossEntropyLoss(weight=torch.tensor([...]))`` (or ``F.cross_entropy(..., weight=...)``) with a
    weight created on the CPU, in code whose model runs on an accelerator: the loss kernel receives CUDA
    logits and a CPU weight. Silent when the criterion or the weight is moved (``.to(device)``), created
    with ``device=``, or the criterion is a submodule of an ``nn.Module`` (then ``model.to()`` moves it)."""

    code = "GD604"
    name = "loss-weight-on-cpu"
    summary = "Loss weight/pos_weight created on the CPU while the model runs on an accelerator"
    severity = Severity.WARNING
    triggers = ("weight",)

    def check(self, facts: FileFacts):
        if file_sets_default_device(facts):
            return
        evidence = moves_to_accelerator(facts)
        trainer_classes = self._trainer_classes(facts)
        placed_receivers = {id(s.receiver) for s in facts.calls if s.method in PLACING_METHODS and s.receiver is not None}
        modules = module_classes(facts)
        for site in facts.calls:
            q = site.qualname
            if q in _LOSS_MODULES:
                keyword, position = _LOSS_MODULES[q]
                weights = [(keyword, site.arg(position, keyword))]
                if q in _LOSS_EXTRA:
                    weights.append((_LOSS_EXTRA[q], site.arg(None, _LOSS_EXTRA[q])))
                if id(site.node) in placed_receivers:
                    continue  # nn.CrossEntropyLoss(weight=w).to(device)
                if self._criterion_placed(facts, site, modules, placed_receivers):
                    continue
            elif q in _LOSS_FUNCTIONS:
                weights = [("weight", site.arg(None, "weight")), ("pos_weight", site.arg(None, "pos_weight"))]
            else:
                continue
            for keyword, weight in weights:
                cpu = self._cpu_weight(facts, weight, site)
                if cpu is None:
                    continue
                in_trainer = site.scope.class_name in trainer_classes
                if evidence:
                    why, severity = f"the file puts work on an accelerator ({evidence})", Severity.ERROR
                elif in_trainer:
                    why, severity = "the Trainer moves the model to `args.device` (a GPU when there is one)", Severity.WARNING
                else:
                    why, severity = "once the model and the batch are on an accelerator", Severity.WARNING
                made = "" if cpu is weight else f" by `{snippet(facts, cpu, 40)}`"
                related = [] if cpu is weight else [(cpu, "the weight is made here, on the CPU")]
                related.append((site.node, "the loss receives it here"))
                first_call = next(iter(facts.calls_of_value(site.node)), None) if q in _LOSS_MODULES else None
                if first_call is not None:
                    related.append((first_call.node, "the loss meets the accelerator logits here"))
                yield self.report(
                    weight,
                    f"`{keyword}={snippet(facts, weight, 40)}` is created on the CPU{made} and "
                    f"handed to `{q.replace('torch.nn.functional.', 'F.').replace('torch.nn.', 'nn.')}`; {why}, the "
                    "loss receives accelerator logits with a CPU weight: \"Expected all tensors to be on the same "
                    "device, but found at least two devices, cuda:0 and cpu!\"",
                    fix_hint="Create the weight on the logits' device (`torch.tensor([...], device=logits.device)`) or "
                    "move the criterion with the model (`criterion.to(device)`; its weight is a buffer).",
                    severity=severity,
                    related=tuple(related),
                )

    def _trainer_classes(self, facts: FileFacts) -> set[str]:
        from gpudoctor.check.rules.placement._common import class_defs
        from gpudoctor.check import apis

        out = set()
        for node in class_defs(facts):
            for base in node.bases:
                if facts.qualname(base.value) in apis.TRAINERS:
                    out.add(node.name.value)
        return out

    def _criterion_placed(self, facts: FileFacts, site, modules, placed_receivers) -> bool:
        if site.scope.class_name in modules and _registered_container(facts, site):
            return True  # ``self.losses.append(nn.CrossEntropyLoss(weight=w))`` into an nn.ModuleList: a submodule
        for binding in facts._bindings_of_value(site.node):
            if binding.key.startswith("self.") and binding.scope.class_name in modules:
                return True  # a submodule: model.to() moves its buffers
            for call in facts.calls:
                if call.method in PLACING_METHODS and name_key(call.receiver) == binding.key:
                    return True
            if binding.key.startswith("self.") or binding.kind != "assign":
                continue
            # the criterion is handed to something that may place it (a helper, a Trainer argument)
            for call in facts.calls:
                if call.order > binding.order and any(name_key(a.value) == binding.key for a in call.node.args):
                    if facts.call_site(call.node) is not None and name_key(call.node.func) != binding.key:
                        if not only_called_in_callee(facts, call, binding.key):
                            return True  # ``train(model, loader, criterion)`` that only calls it does not place it
        return False

    def _cpu_weight(self, facts: FileFacts, weight, site) -> Optional[cst.CSTNode]:
        if weight is None:
            return None
        if creation_qualname(facts, weight) and _vector(facts, weight):
            return weight
        computed = cpu_computed(facts, weight, site.order, site.scope)
        if computed is not None:
            origin, vector = computed
            if creation_qualname(facts, origin):
                vector = vector or _vector(facts, origin)  # torch.tensor(weights): a weight has one value a class
            if vector:
                return origin  # through helpers, arithmetic, counts: torch.bincount(labels), torch.from_numpy(w) / s
        key = name_key(weight)
        if key is None:
            return None
        binding = facts.binding_at(key, site.order, site.scope)
        if binding is None or binding.kind != "assign" or binding.value is None:
            return None
        if not (creation_qualname(facts, binding.value) and _vector(facts, binding.value)):
            return None
        for call in facts.calls:
            if call.method in PLACING_METHODS and name_key(call.receiver) == key and call.order > binding.order:
                return None
        return binding.value


_REGISTERING_CONTAINERS = {"torch.nn.ModuleList", "torch.nn.ModuleDict", "torch.nn.Sequential"}


def _registered_container(facts: FileFacts, site) -> bool:
    """The loss module built at ``site`` (in an nn.Module's method) goes straight into a container that registers
    it: ``nn.ModuleList([nn.CrossEntropyLoss(weight=w), ...])``, ``self.losses.append(...)``/``.extend``/
    ``.insert`` or ``self.losses[k] = ...`` where the class binds ``self.losses`` to an nn.ModuleList/ModuleDict."""
    up = parents(facts, site.scope.node)
    if _goes_into_registering_container(facts, site, site.node, up):
        return True
    # through a local temporary: ``loss = nn.CrossEntropyLoss(weight=w)`` then ``self.losses.append(loss)``
    for binding in facts._bindings_of_value(site.node):
        if binding.kind != "assign" or binding.scope is not site.scope or "." in binding.key:
            continue
        for _order, load, scope in facts.name_loads.get(binding.key, ()):
            if scope is site.scope and facts.binding_at(binding.key, *facts._position_of(load)) is binding \
                    and _goes_into_registering_container(facts, site, load, up):
                return True
    return False


def _goes_into_registering_container(facts: FileFacts, site, node, up) -> bool:
    """The expression ``node`` is handed straight to a registering container (see ``_registered_container``)."""
    for _ in range(6):
        parent = up.get(id(node))
        if parent is None:
            return False
        if isinstance(parent, cst.Call) and parent.func is not node:
            if facts.qualname(parent.func) in _REGISTERING_CONTAINERS:
                return True
            func = parent.func
            if isinstance(func, cst.Attribute) and func.attr.value in ("append", "extend", "insert"):
                return _registering_attribute(facts, func.value, parent, site)
            return False
        if isinstance(parent, cst.Assign) and len(parent.targets) == 1 and isinstance(parent.targets[0].target, cst.Subscript):
            return _registering_attribute(facts, parent.targets[0].target.value, parent, site)
        if isinstance(parent, (cst.SimpleStatementLine, cst.IndentedBlock, cst.FunctionDef)):
            return False
        node = parent
    return False


def _registering_attribute(facts: FileFacts, container: cst.CSTNode, at: cst.CSTNode, site) -> bool:
    """``container`` is a ``self.x`` that the class binds (every time) to an nn.ModuleList/ModuleDict/Sequential,
    directly or through temporaries, or a local name for one (``losses = self.losses``)."""
    key = name_key(container)
    if key is None:
        return False
    if key.startswith("self."):
        bindings = facts.class_attrs.get(site.scope.class_name or "", {}).get(key, [])
        return bool(bindings) and all(
            b.kind == "assign" and _registering_built(facts, b.value, b.order, b.scope) for b in bindings
        )
    order, scope = facts._position_of(container)
    return _registering_built(facts, container, order, scope)


def _registering_built(facts: FileFacts, node, order: int, scope) -> bool:
    built = facts.built_by(node, order, scope)
    return isinstance(built, cst.Call) and facts.qualname(built.func) in _REGISTERING_CONTAINERS


def _vector(facts: FileFacts, call: cst.Call) -> bool:
    q = facts.qualname(call.func) or ""
    if q in ("torch.tensor", "torch.as_tensor", "torch.FloatTensor", "torch.Tensor"):
        first = call_arg(call, 0, "data")
        return first is not None and not isinstance(first, (cst.Integer, cst.Float))
    return True
