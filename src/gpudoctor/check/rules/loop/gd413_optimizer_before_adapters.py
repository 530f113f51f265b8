from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import FileFacts, name_key
from gpudoctor.check.queries import _parameters_owner, snippet
from gpudoctor.check.rule import Rule

_INJECT = {"peft.inject_adapter_in_model"}
_REPLACING_METHODS = {"resize_token_embeddings", "add_adapter", "load_adapter"}


class OptimizerBeforeAdapters(Rule):
    """The optimizer is built over ``model.parameters()`` and *then* the model's parameters change
    (reported at the optimizer, where it is fixed; the change is the related location):
    ``get_peft_model`` (base weights frozen, new LoRA weights the optimizer never sees), a replaced
    ``nn.Parameter`` or sub-module, ``resize_token_embeddings``. The optimizer keeps updating the old
    tensors, the new ones never change."""

    code = "GD413"
    name = "optimizer-before-adapters"
    summary = "The optimizer is created before adapters are added or parameters are replaced"
    triggers = ("parameters",)

    def check(self, facts: FileFacts):
        for site in facts.calls:
            if not (site.qualname and apis.is_optimizer(site.qualname)):
                continue
            params = site.arg(0, "params")
            built = facts.assignment_of(params, site.order, site.scope)  # params = model.parameters()
            owner = _parameters_owner(built.value if built is not None else params)
            model_key = name_key(owner) if owner is not None else None
            if model_key is None:
                continue
            # Where the optimizer object is held: ``opt = SGD(...)``, and names it reaches through
            # temporaries and the file's own helpers (``optimizer = make_optimizer()``).
            holders = [b for b in _bindings(facts) if b.value is not None and b.kind == "assign"
                       and isinstance(b.value, (cst.Name, cst.Call)) and facts.value(b.value, b.order, b.scope).origin().node is site.node]
            for holder in holders:
                change = self._change_after(facts, holder, model_key)
                if change is None:
                    continue
                node, what, order = change
                aliases = {b.key for b in holders if b.scope is holder.scope}
                rebound = [b for key in aliases for b in holder.scope.bindings.get(key, ()) if b.order > order and b not in holders]
                if rebound or not any(facts.loads_of(key, after=order, scope=holder.scope) for key in aliases):
                    continue  # rebuilt after the change, or never used again
                # Reported where the user fixes it (the optimizer moves below the change), the change as related.
                related = [(node, f"{what} here, after the optimizer was built")]
                if holder.value is not site.node:
                    related.append((site.node, "the optimizer is built here"))
                yield self.report(
                    holder.value,
                    f"`{holder.key}` is built over `{model_key}.parameters()` (`{snippet(facts, site.node)}`) before "
                    f"{what}: the optimizer still holds the old parameter tensors, so it updates tensors the model no "
                    "longer uses (or frozen ones with no gradient) and the new parameters never change.",
                    fix_hint=f"Create `{holder.key}` after `{snippet(facts, node, 50)}`, over the final trainable parameters.",
                    related=tuple(related),
                )
                break

    def _change_after(self, facts: FileFacts, holder, model_key) -> Optional[tuple[cst.CSTNode, str, int]]:
        for site in facts.calls:
            if site.order <= holder.order or site.scope is not holder.scope:
                continue
            if site.qualname in apis.GET_PEFT_MODEL or site.qualname in _INJECT:
                if name_key(site.arg(0, "model")) == model_key:
                    return site.node, f"`{snippet(facts, site.node)}` adds new adapter weights and freezes the base", site.order
            if site.method in _REPLACING_METHODS and name_key(site.receiver) == model_key:
                return site.node, f"`{snippet(facts, site.node)}` replaces parameters", site.order
        # model.head = nn.Linear(...) / model.fc.weight = nn.Parameter(...), also through a temporary
        for assign in facts.attribute_assigns:
            if assign.order <= holder.order or assign.scope is not holder.scope or _root(assign.target) != model_key:
                continue
            value = facts.value(assign.value, assign.order, assign.scope)
            origin = value.origin().node
            q = facts.qualname(origin.func) if isinstance(origin, cst.Call) else None
            if (value.kind == "model" and value.trait("module")) or q in ("torch.nn.Parameter",):
                text = facts.module.code_for_node(assign.target)
                return assign.value, f"`{text} = {snippet(facts, assign.value, 40)}` replaces parameters", assign.order
        return None


def _bindings(facts: FileFacts):
    cached = getattr(facts, "_gd413_bindings", None)
    if cached is None:
        scopes = [facts.module_scope, *facts.functions]
        cached = facts._gd413_bindings = [b for scope in scopes for bindings in scope.bindings.values() for b in bindings]
    return cached


def _root(node: cst.BaseExpression) -> Optional[str]:
    while isinstance(node, cst.Attribute):
        node = node.value
    return node.value if isinstance(node, cst.Name) else None
