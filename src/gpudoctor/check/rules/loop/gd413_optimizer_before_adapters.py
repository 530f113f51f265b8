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
        optimizers = []
        for site in facts.calls:
            if site.qualname and apis.is_optimizer(site.qualname):
                owner = _parameters_owner(site.arg(0, "params"))
                key = name_key(owner) if owner is not None else None
                if key is not None:
                    bindings = facts._bindings_of_value(site.node)
                    opt_key = bindings[0].key if bindings else None
                    if opt_key is not None:
                        optimizers.append((site, key, opt_key))
        for opt_site, model_key, opt_key in optimizers:
            change = self._change_after(facts, opt_site, model_key)
            if change is None:
                continue
            node, what, order = change
            rebound = [b for b in opt_site.scope.bindings.get(opt_key, ()) if b.order > order]
            if rebound or not facts.loads_of(opt_key, after=order, scope=opt_site.scope):
                continue  # rebuilt after the change, or never used again
            # Reported where the user fixes it (the optimizer moves below the change), the change as related.
            yield self.report(
                opt_site.node,
                f"`{opt_key}` is built over `{model_key}.parameters()` (`{snippet(facts, opt_site.node)}`) before "
                f"{what}: the optimizer still holds the old parameter tensors, so it updates tensors the model no "
                "longer uses (or frozen ones with no gradient) and the new parameters never change.",
                fix_hint=f"Create `{opt_key}` after `{snippet(facts, node, 50)}`, over the final trainable parameters.",
                related=((node, f"{what} here, after the optimizer was built"),),
            )

    def _change_after(self, facts: FileFacts, opt_site, model_key) -> Optional[tuple[cst.CSTNode, str]]:
        for site in facts.calls:
            if site.order <= opt_site.order or site.scope is not opt_site.scope:
                continue
            if site.qualname in apis.GET_PEFT_MODEL or site.qualname in _INJECT:
                if name_key(site.arg(0, "model")) == model_key:
                    return site.node, f"`{snippet(facts, site.node)}` adds new adapter weights and freezes the base", site.order
            if site.method in _REPLACING_METHODS and name_key(site.receiver) == model_key:
                return site.node, f"`{snippet(facts, site.node)}` replaces parameters", site.order
            # model.head = nn.Linear(...) / model.fc.weight = nn.Parameter(...)
            q = site.qualname or ""
            if q.startswith("torch.nn.") and q.split(".")[-1][:1].isupper() and len(q.split(".")) == 3:
                statement = facts.statement_of(site.node)
                assign = statement.body[0] if statement is not None and statement.body else None
                if isinstance(assign, cst.Assign) and assign.value is site.node:
                    for target in assign.targets:
                        t = target.target
                        if isinstance(t, cst.Attribute) and _root(t) == model_key:
                            text = facts.module.code_for_node(t)
                            return site.node, f"`{text} = {snippet(facts, site.node, 40)}` replaces parameters", site.order
        return None


def _root(node: cst.BaseExpression) -> Optional[str]:
    while isinstance(node, cst.Attribute):
        node = node.value
    return node.value if isinstance(node, cst.Name) else None
