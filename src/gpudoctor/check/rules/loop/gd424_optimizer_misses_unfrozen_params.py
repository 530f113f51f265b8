from __future__ import annotations

from typing import NamedTuple, Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import FileFacts, Scope, call_arg, name_key
from gpudoctor.check.queries import parameters_owner, snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.loop._common import parameters_held_by


class Toggle(NamedTuple):
    order: int  # where it happens in the scope asked about (the helper call, for a helper's toggle)
    trainable: bool
    path: str  # the module whose parameters change, spelled from the scope asked about: "model.encoder.layer[i]"
    node: cst.CSTNode


class OptimizerMissesUnfrozenParams(Rule):
    """Gradual unfreezing with an optimizer built over ``filter(lambda p: p.requires_grad, model.parameters())``
    (or ``[p for p in model.parameters() if p.requires_grad]``) while part of the model was frozen: parameters
    unfrozen later get gradients but are in no parameter group, so the optimizer never updates them."""

    code = "GD424"
    name = "optimizer-misses-unfrozen-params"
    summary = "Optimizer built over the requires_grad parameters, then more parameters unfrozen: they never train"
    triggers = ("requires_grad",)

    def check(self, facts: FileFacts):
        if any(site.method == "add_param_group" for site in facts.calls):
            return  # the script hands unfrozen parameters to the optimizer itself
        for site in facts.calls:
            if not (site.qualname and apis.is_optimizer(site.qualname)):
                continue
            params = site.arg(0, "params")
            if not _filters_on_requires_grad(params):
                continue
            owner = name_key(parameters_owner(facts, params, site.order, site.scope))
            if owner is None:
                continue
            holder = _holder(facts, site, owner)
            if holder is None:
                continue
            built_at = site.order if holder.scope is site.scope else holder.order  # a helper's call: where it is called
            toggles = _toggles(facts, holder.scope, owner)
            frozen = [t for t in toggles if not t.trainable and t.order < built_at]
            unfrozen = next((t for t in toggles if t.trainable and t.order > built_at
                             and any(_within(t.path, f.path) for f in frozen)), None)
            if unfrozen is None or not _steps_after(facts, holder, unfrozen.order):
                continue
            yield self.report(
                holder.value,
                f"`{holder.key}` is built over the parameters of `{owner}` that require grad right now "
                f"(`{snippet(facts, params, 60)}`), while `{frozen[0].path}` is frozen; "
                f"`{snippet(facts, unfrozen.node, 60)}` later makes `{unfrozen.path}` trainable, but those parameters "
                "are in no parameter group of the optimizer: they get gradients and are never updated, so the "
                "unfreezing changes nothing (silently).",
                fix_hint=f"Build `{holder.key}` over all of `{owner}.parameters()` (frozen ones without a gradient are "
                f"skipped), or call `{holder.key}.add_param_group(...)` with the unfrozen parameters.",
                related=((unfrozen.node, "these parameters become trainable after the optimizer was built"),),
            )


def _holder(facts: FileFacts, site, owner: str):
    """The binding that keeps the optimizer ``site`` builds: in its own scope, or where one of the file's helpers
    returning it is called (``optimizer = make_optimizer()``) when ``owner`` names the same model there (a
    global, not one of the helper's own names)."""
    holders = facts.bindings_built_by(site.node)
    same_scope = next((b for b in holders if b.scope is site.scope), None)
    if same_scope is not None:
        return same_scope
    owner_binding = facts.binding_at(owner, site.order, site.scope)
    if owner_binding is not None and owner_binding.scope is site.scope:
        return None  # the helper's parameter or local: another name where the helper is called
    return next((b for b in holders if b.scope is not site.scope and facts.binding_at(owner, b.order, b.scope) is owner_binding), None)


def _filters_on_requires_grad(params: Optional[cst.BaseExpression]) -> bool:
    """``filter(lambda p: p.requires_grad, ...)`` or a comprehension ``if p.requires_grad`` (not negated)."""
    if isinstance(params, cst.Call) and isinstance(params.func, cst.Name) and params.func.value == "filter" and params.args:
        test = params.args[0].value
        return isinstance(test, cst.Lambda) and _is_requires_grad(test.body)
    if isinstance(params, (cst.ListComp, cst.GeneratorExp)):
        return any(_is_requires_grad(condition.test) for condition in params.for_in.ifs)
    return False


def _is_requires_grad(test: cst.BaseExpression) -> bool:
    return isinstance(test, cst.Attribute) and test.attr.value == "requires_grad"


def _toggles(facts: FileFacts, scope: Scope, model_key: str, depth: int = 0) -> list[Toggle]:
    """Every change of ``requires_grad`` on parameters of ``model_key`` (or its sub-modules) in ``scope``, in order:
    ``for p in model.x.parameters(): p.requires_grad = False``, ``model.x.requires_grad_(True)``, and the same in
    the file's own helpers ``scope`` calls with the model (``freeze(model)``)."""
    if depth > 3:
        return []
    found = []
    for assign in facts.attribute_assigns:
        if assign.scope is not scope or assign.target.attr.value != "requires_grad":
            continue
        trainable = _literal_bool(assign.value)
        module = parameters_held_by(facts, assign.target.value, assign.order, scope)
        path = _path_under(facts, module, model_key)
        if trainable is not None and path is not None:
            found.append(Toggle(assign.order, trainable, path, assign.node))
    for site in facts.calls:
        if site.scope is not scope:
            continue
        if site.method == "requires_grad_":
            path = _path_under(facts, site.receiver, model_key)
            flag = call_arg(site.node, 0, "requires_grad")
            trainable = True if flag is None else _literal_bool(flag)
            if path is not None and trainable is not None:
                found.append(Toggle(site.order, trainable, path, site.node))
        elif site.qualname is None:
            for callee in facts.callee_scopes(site):
                for inner_key, passed in _params_passed(facts, site, callee, model_key):
                    for toggle in _toggles(facts, callee, inner_key, depth + 1):
                        path = passed + toggle.path[len(inner_key):]
                        found.append(Toggle(site.order, toggle.trainable, path, toggle.node))
    return sorted(found, key=lambda t: t.order)


def _params_passed(facts: FileFacts, site, callee: Scope, model_key: str):
    """(parameter name, argument text) for the parameters of ``callee`` that the call ``site`` passes
    ``model_key`` or one of its sub-modules to (``freeze(model.backbone)``)."""
    if not isinstance(callee.node, cst.FunctionDef):
        return
    for param in (*callee.node.params.posonly_params, *callee.node.params.params):
        path = _path_under(facts, facts.argument_for(site, callee, param), model_key)
        if path is not None:
            yield param.name.value, path


def _path_under(facts: FileFacts, module: Optional[cst.BaseExpression], model_key: str) -> Optional[str]:
    """The source text of ``module`` when it is ``model_key`` or one of its sub-modules."""
    module = facts.through_temporary(module)  # ``tmp = model.encoder`` ... ``tmp.requires_grad_(False)``
    if module is None:
        return None
    text = facts.module.code_for_node(module)
    return text if _within(text, model_key) else None


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root + ".") or path.startswith(root + "[")


def _literal_bool(node: Optional[cst.BaseExpression]) -> Optional[bool]:
    if isinstance(node, cst.Name) and node.value in ("True", "False"):
        return node.value == "True"
    return None


def _steps_after(facts: FileFacts, holder, order: int) -> bool:
    """The optimizer steps after the unfreezing (later in the scope, or in a loop around both) and is not rebuilt."""
    if any(b.order > order for b in holder.scope.bindings.get(holder.key, ())):
        return False
    for site in facts.calls:
        if site.method != "step" or name_key(site.receiver) != holder.key or site.scope is not holder.scope:
            continue
        if site.order > order:
            return True
    return False
