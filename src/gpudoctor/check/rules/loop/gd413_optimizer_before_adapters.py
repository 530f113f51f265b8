from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import FileFacts, name_key
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import parameters_owner, snippet
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
            # params = model.parameters(), parameter groups, lists filled from model.named_parameters()
            owner = parameters_owner(facts, site.arg(0, "params"), site.order, site.scope)
            if owner is None or name_key(owner) is None:
                continue
            # Where the optimizer object is held: ``opt = SGD(...)``, ``self.optimizer = ...``, and names it
            # reaches through temporaries and the file's own helpers (``optimizer = make_optimizer()``).
            holders = facts.bindings_built_by(site.node)
            for holder in holders:
                model_key = _model_key_in(facts, owner, site, holder)
                if model_key is None:
                    continue
                change = self._change_after(facts, holder, model_key)
                if change is not None:
                    node, what, order = change
                    aliases = {b.key for b in holders if b.scope is holder.scope}
                    rebound = [b for key in aliases for b in holder.scope.bindings.get(key, ()) if b.order > order and b not in holders]
                    if rebound or not any(facts.loads_of(key, after=order, scope=holder.scope) for key in aliases):
                        continue  # rebuilt after the change, or never used again
                else:
                    change = self._change_in_later_method(facts, holder, model_key)
                    if change is None:
                        continue
                    node, what, order = change
                yield self._report(facts, site, holder, model_key, node, what)
                break

    def _report(self, facts: FileFacts, site, holder, model_key: str, node, what: str):
        # Reported where the user fixes it (the optimizer moves below the change), the change as related.
        related = [(node, f"{what} here, after the optimizer was built")]
        if holder.value is not site.node:
            related.append((site.node, "the optimizer is built here"))
        resized = isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value == "resize_token_embeddings"
        effect = (
            "transformers keeps the input embedding's Parameter (its data is swapped), but when the output "
            "embeddings are not tied to it the resized output head is a new Parameter the optimizer does not hold: "
            "the output layer never trains (and an optimizer that already stepped holds state of the old shape)"
            if resized else
            "the optimizer still holds the old parameter tensors, so it updates tensors the model no longer uses (or "
            "frozen ones with no gradient) and the new parameters never change"
        )
        return self.report(
            holder.value,
            f"`{holder.key}` is built over `{model_key}.parameters()` (`{snippet(facts, site.node)}`) before "
            f"{what}: {effect}.",
            fix_hint=f"Create `{holder.key}` after `{snippet(facts, node, 50)}`, over the final trainable parameters.",
            related=tuple(related),
            # Tied embeddings (GPT-2) keep every Parameter: the file cannot show whether the model ties them.
            severity=Severity.WARNING if resized else None,
        )

    def _change_in_later_method(self, facts: FileFacts, holder, model_key: str) -> Optional[tuple[cst.CSTNode, str, int]]:
        """Instance timelines: ``self.optimizer`` is built over ``self.model.parameters()`` in one method, another
        method that runs later on the same instance changes ``self.model`` (``exp.setup_lora()`` after the
        constructor), and a method after that uses ``self.optimizer``."""
        class_name = holder.scope.class_name
        if not (class_name and holder.key.startswith("self.") and model_key.startswith("self.")):
            return None
        methods = [f for f in facts.functions if f.class_name == class_name and f.parent is facts.classes.get(class_name)]
        changes = []
        for method in methods:
            if method is not holder.scope:
                change = self._change_after(facts, holder, model_key, scope=method, after=-1)
                if change is not None:
                    changes.append((method, change))
        if not changes:
            return None
        loads = [(u[2], u[0]) for u in facts.name_loads.get(holder.key, ()) if u[2].class_name == class_name]
        rebinds = [(b.scope, b.order) for b in facts.class_attrs.get(class_name, {}).get(holder.key, ()) if b is not holder]
        for timeline in _timelines(facts, class_name, methods):
            start = _position(timeline, holder.scope, holder.order)
            if start is None:
                continue
            for method, (node, what, order) in changes:
                at = _position(timeline, method, order)
                if at is None or at < start:
                    continue
                uses = [p for p in (_position(timeline, s, o) for s, o in loads) if p is not None and p > at]
                if not uses:
                    continue
                first_use = min(uses)
                if any(start < p < first_use for p in (_position(timeline, s, o) for s, o in rebinds) if p is not None):
                    continue  # the optimizer is rebuilt after the change
                return node, what, order
        return None

    def _change_after(self, facts: FileFacts, holder, model_key, scope=None, after=None) -> Optional[tuple[cst.CSTNode, str, int]]:
        scope = holder.scope if scope is None else scope
        after = holder.order if after is None else after
        for site in facts.calls:
            if site.order <= after or site.scope is not scope:
                continue
            if site.qualname in apis.GET_PEFT_MODEL or site.qualname in _INJECT:
                if name_key(site.arg(0, "model")) == model_key:
                    return site.node, f"`{snippet(facts, site.node)}` adds new adapter weights and freezes the base", site.order
            if site.method in _REPLACING_METHODS and name_key(site.receiver) == model_key:
                return site.node, f"`{snippet(facts, site.node)}` replaces parameters", site.order
            if _shards_parameters(facts, site) and name_key(site.arg(0, "module")) == model_key:
                return (
                    site.node,
                    f"`{snippet(facts, site.node)}` replaces the module's parameters with sharded ones (the optimizer's "
                    "old Parameter objects get no gradient)",
                    site.order,
                )
        # model.head = nn.Linear(...) / model.fc.weight = nn.Parameter(...), also through a temporary
        for assign in facts.attribute_assigns:
            if assign.order <= after or assign.scope is not scope or _root(assign.target) != model_key:
                continue
            value = facts.value(assign.value, assign.order, assign.scope)
            origin = value.origin().node
            q = facts.qualname(origin.func) if isinstance(origin, cst.Call) else None
            if (value.kind == "model" and value.trait("module")) or q in ("torch.nn.Parameter",):
                text = facts.module.code_for_node(assign.target)
                return assign.value, f"`{text} = {snippet(facts, assign.value, 40)}` replaces parameters", assign.order
        return None


def _shards_parameters(facts: FileFacts, site) -> bool:
    """FSDP wrapping that swaps the module's Parameter objects: ``FullyShardedDataParallel(m)`` with the default
    ``use_orig_params=False`` (FlatParameter) and FSDP2's ``fully_shard(m)`` (DTensor parameters). With
    ``use_orig_params=True`` FSDP1 keeps the original objects (torch 2.13, verified)."""
    if site.qualname in apis.FSDP2_SHARD:
        return True
    if site.qualname in apis.FSDP_WRAP:
        keep = site.arg(keyword="use_orig_params")
        return keep is None or (isinstance(keep, cst.Name) and keep.value == "False")
    return False


def _model_key_in(facts: FileFacts, owner: cst.BaseExpression, site, holder) -> Optional[str]:
    """The model the optimizer ``site`` covers, named as in the scope that holds it: ``build_optimizer(net)``
    builds over its parameter ``net``; in ``optimizer = build_optimizer(model)`` that is ``model`` (the argument
    the holder's scope passes)."""
    key = name_key(owner)
    if holder.scope is site.scope or key is None:
        return key
    binding = facts.binding_at(key, site.order, site.scope)
    if binding is None or binding.kind != "param":
        # ``model, optimizer = load_pretrain(...)``: the helper returns its model next to the optimizer
        return _unpacked_with(facts, owner, site, holder) or key
    passed = [name_key(arg) for arg, _, scope in facts._param_arguments(binding) if scope is holder.scope]
    return passed[0] if len(set(passed)) == 1 else None


def _unpacked_with(facts: FileFacts, owner: cst.BaseExpression, site, holder) -> Optional[str]:
    """``net, opt = load_pretrain(...)`` where the helper ends ``return model, optimizer``: the name the holder's
    scope unpacks the helper's model into (the element returned next to the optimizer)."""
    owner_key = name_key(owner)
    call = facts.call_site(holder.value) if holder.kind == "unpack" and isinstance(holder.value, cst.Call) else None
    if call is None or owner_key is None:
        return None
    siblings = [
        b for bindings in holder.scope.bindings.values() for b in bindings
        if b is not holder and b.kind == "unpack" and b.value is holder.value and b.index is not None
    ]
    for callee in facts.callee_scopes(call):
        if callee is not site.scope:
            continue
        for ret in facts.returns.get(id(callee), ()):
            if not isinstance(ret.value, cst.Tuple):
                continue
            elements = [e.value for e in ret.value.elements]
            for other in siblings:
                if other.index < len(elements) and name_key(elements[other.index]) == owner_key:
                    return other.key
    return None


def _timelines(facts: FileFacts, class_name: str, methods) -> list[list[tuple]]:
    """Orders in which the methods of ``class_name`` run: each method as an entry point, and each instance
    (``exp = Experiment(...)``: ``__init__``, then ``exp.setup_lora()``, ``exp.train(...)`` in source order).
    A timeline is a list of segments (method scope, from order, to order); a ``self.m()`` call splices
    ``m``'s segments in where it is called."""
    by_name = {m.name: m for m in methods}

    def flatten(method, depth=0, stack=()):
        if depth > 4 or method in stack:
            return []
        segments, previous = [], -1
        for call in facts.calls:
            if (call.scope is method and isinstance(call.receiver, cst.Name) and call.receiver.value == "self"
                    and call.method in by_name):
                segments.append((method, previous, call.order))
                segments += flatten(by_name[call.method], depth + 1, (*stack, method))
                previous = call.order
        segments.append((method, previous, 1 << 30))
        return segments

    timelines = [flatten(m) for m in methods]
    init = by_name.get("__init__")
    for made in facts.calls:
        if not (isinstance(made.node.func, cst.Name) and made.node.func.value == class_name and made.qualname is None):
            continue
        timeline = flatten(init) if init is not None else []
        for holder in facts._bindings_by_value.get(id(made.node), []):
            for call in facts._calls_on_key.get(holder.key, ()):
                if call.scope is holder.scope and call.order > holder.order and call.method in by_name:
                    timeline += flatten(by_name[call.method])
        timelines.append(timeline)
    return timelines


def _position(timeline, scope, order) -> Optional[tuple[int, int]]:
    for i, (method, low, high) in enumerate(timeline):
        if method is scope and low < order <= high:
            return i, order
    return None


def _root(node: cst.BaseExpression) -> Optional[str]:
    while isinstance(node, cst.Attribute):
        node = node.value
    return node.value if isinstance(node, cst.Name) else None
