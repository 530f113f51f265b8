from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import TRAIT_DISPATCHED, TRAIT_PREPARED, FileFacts
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.placement._common import (
    LOSS_FUNCTIONS_WITH_WEIGHT,
    LOSS_MODULES_WITH_WEIGHT,
    LOSS_WEIGHT_KEYWORDS,
    accelerator_device,
    cpu_computed,
    file_sets_default_device,
    mixing_use,
    module_classes,
    on_accelerator,
    parents,
    wrapper_moves_inputs,
)


class HelperCpuTensorMeetsGpu(Rule):
    """A tensor that the file's own helper function builds on the CPU (a creation without ``device=``,
    ``torch.from_numpy``, arithmetic of those: ``def nopeak_mask(n): return torch.from_numpy(np.triu(...)) == 0``)
    and returns, which the caller then combines with a tensor the file puts on an accelerator
    (``trg_mask & nopeak_mask(n)`` where ``trg_mask`` comes from ``batch.trg.cuda()``). Silent when the result is
    moved, is a 0-dim scalar, ``torch.set_default_device`` is used, or the other operand is not shown to be on an
    accelerator."""

    code = "GD614"
    name = "helper-cpu-tensor-meets-gpu"
    summary = "A CPU tensor returned by the file's own helper is combined with a tensor on an accelerator"
    severity = Severity.ERROR
    triggers = ("def ",)

    def check(self, facts: FileFacts):
        if file_sets_default_device(facts):
            return
        reported: set[int] = set()
        for site in facts.calls:
            if site.qualname is not None or not facts.callee_scopes(site):
                continue
            if isinstance(site.node.func, cst.Name) and site.node.func.value in facts.classes:
                continue  # a class: its instance is no tensor
            computed = cpu_computed(facts, site.node, site.order, site.scope)
            if computed is None or not computed[1]:
                continue
            origin = computed[0]
            if facts._position_of(origin)[1] is site.scope:
                continue  # made by the caller and handed through: not the helper's doing
            root = site.scope.node if site.scope.kind == "function" else facts.module
            use = mixing_use(facts, site.node, root)
            placed = self._accelerator_operand(facts, use) if use is not None else None
            if placed is None and use is not None:
                placed = self._module_on_accelerator(facts, site.scope)  # in forward: meets the weights/inputs
            if placed is None:
                use, placed = self._model_input(facts, site, root)
            if use is None or placed is None or id(use) in reported:
                continue
            if _given_as_loss_weight(facts, site, use):
                continue  # ``F.cross_entropy(..., weight=class_weights(y))``: GD604 reports the CPU loss weight
            reported.add(id(use))
            helper = snippet(facts, site.node.func, 30)
            yield self.report(
                use,
                f"`{helper}(...)` returns a tensor built on the CPU (`{snippet(facts, origin, 50)}`, no `device=`), "
                f"and `{snippet(facts, use, 50)}` combines it with a tensor on an accelerator "
                f"(`{snippet(facts, placed, 40)}`): torch raises \"RuntimeError: Expected all tensors to be on the same "
                "device, but found at least two devices, cuda:0 and cpu!\"",
                fix_hint=f"Build it on the other tensor's device inside `{helper}` (pass `device=x.device` to the "
                "creation, or `.to(x.device)` before returning).",
                related=((origin, "built on the CPU here"), (placed, "the other operand is put on an accelerator here")),
            )

    @staticmethod
    def _module_on_accelerator(facts: FileFacts, scope) -> Optional[cst.CSTNode]:
        """The helper is called in a method of the file's own ``nn.Module`` class, an instance of which the file
        moves to an accelerator (``Encoder(...).cuda()``, ``model.to(device)`` with a GPU ``device``): what the
        method mixes the result with (the module's weights, its inputs) is on that accelerator."""
        class_name = scope.class_name
        if class_name is None or class_name not in module_classes(facts) or not _runs_in_forward(facts, scope):
            return None
        for move in facts.calls:
            if move.method not in apis.MODULE_MOVES or move.receiver is None:
                continue
            value = facts.value(move.receiver, move.order, move.scope)
            if value.kind != "model" or value.trait("class") != class_name:
                continue
            if move.method == "to":
                target = move.arg(0, "device")
                if target is None or not accelerator_device(facts, target, move.order, move.scope):
                    continue
            elif move.method != "cuda":
                continue
            return move.node
        return None

    def _model_input(self, facts: FileFacts, site, root):
        """(the model call, the accelerator tensor) when the helper's result, directly or through a local name,
        is an input of a model call (``model(src, trg, src_mask, make_mask(n))``) that also takes a tensor the
        file puts on an accelerator."""
        up = parents(facts, root)
        nodes = [site.node]
        parent = up.get(id(site.node))
        if isinstance(parent, cst.Assign) and len(parent.targets) == 1 and isinstance(parent.targets[0].target, cst.Name):
            key = parent.targets[0].target.value
            binding = next((b for b in site.scope.bindings.get(key, ()) if b.target is parent.targets[0].target), None)
            for _order, load, scope in facts.name_loads.get(key, ()):
                if scope is site.scope and facts.binding_at(key, *facts._position_of(load)) is binding:
                    nodes.append(load)
        for node in nodes:
            arg = up.get(id(node))
            while isinstance(arg, cst.Element) and isinstance(up.get(id(arg)), (cst.Tuple, cst.List)):
                arg = up.get(id(up.get(id(arg))))  # ``model(x, (h0, c0))``: an element of a tuple argument
            call = up.get(id(arg)) if isinstance(arg, cst.Arg) else None
            if not isinstance(call, cst.Call) or arg.star:
                continue
            order, scope = facts._position_of(call)
            model = facts.value(call.func, order, scope)
            if model.kind != "model" or str(model.trait("class") or "").endswith("Loss"):
                continue
            if model.has(TRAIT_DISPATCHED) or model.has(TRAIT_PREPARED) or wrapper_moves_inputs(model):
                continue  # accelerate's hooks, DataParallel's scatter and DDP move the inputs themselves
            for other in call.args:
                if other is arg:
                    continue
                where = _where(facts, other.value)
                placed = on_accelerator(facts, other.value, *where) if where[0] is not None else None
                if placed is not None:
                    return call, placed
        return None, None

    @staticmethod
    def _accelerator_operand(facts: FileFacts, use: cst.CSTNode) -> Optional[cst.CSTNode]:
        if isinstance(use, cst.BinaryOperation):
            operands = [use.left, use.right]
        elif isinstance(use, cst.Call):
            operands = [a.value for a in use.args]
            if isinstance(use.func, cst.Attribute):
                operands.append(use.func.value)
            flat = []
            for operand in operands:
                if isinstance(operand, (cst.List, cst.Tuple)):
                    flat.extend(e.value for e in operand.elements)
                else:
                    flat.append(operand)
            operands = flat
        else:
            return None
        for operand in operands:
            order, scope = _where(facts, operand)
            if order is None:
                continue
            placed = on_accelerator(facts, operand, order, scope)
            if placed is not None:
                return placed
        return None


def _given_as_loss_weight(facts: FileFacts, site, use: cst.CSTNode) -> bool:
    """The helper's result (directly or through a local name) is the ``weight=``/``pos_weight=`` of the loss call
    ``use``."""
    if not isinstance(use, cst.Call):
        return False
    if facts.qualname(use.func) not in LOSS_FUNCTIONS_WITH_WEIGHT | set(LOSS_MODULES_WITH_WEIGHT):
        return False
    for arg in use.args:
        if arg.keyword is None or arg.keyword.value not in LOSS_WEIGHT_KEYWORDS:
            continue
        if arg.value is site.node:
            return True
        order, scope = _where(facts, arg.value)
        held = facts.assignment_of(arg.value, order, scope) if order is not None else None
        if held is not None and held.value is site.node:
            return True
    return False


def _where(facts: FileFacts, node: cst.CSTNode):
    """(order, scope) of the first name or call inside ``node``."""
    stack = [node]
    while stack:
        current = stack.pop(0)
        order, scope = facts._position_of(current)
        if order != 1 << 30:
            return order, scope
        stack.extend(current.children)
    return None, None


def _runs_in_forward(facts: FileFacts, scope) -> bool:
    """``forward``, or a method of the same class that ``forward`` calls (``self._embed(x)``): code that runs once the
    module is on its device (``__init__`` and its helpers run before any move)."""
    if scope.name == "forward":
        return True
    return any(
        site.scope.name == "forward" and site.scope.class_name == scope.class_name
        for site in facts.call_sites_of(scope)
    )
