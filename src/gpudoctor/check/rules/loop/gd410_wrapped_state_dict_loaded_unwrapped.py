from __future__ import annotations

from typing import Iterator, Optional

import libcst as cst

from gpudoctor.check.facts import TRAIT_PREPARED, CallSite, FileFacts, call_arg, name_key, string_value
from gpudoctor.check.queries import multi_process_severity, snippet
from gpudoctor.check.rule import Rule

class WrappedStateDictLoadedUnwrapped(Rule):
    """``torch.save(model.state_dict(), path)`` where ``model`` is a DataParallel/DDP wrapper (keys start
    with ``module.``), later loaded into an unwrapped model from the same path: ``load_state_dict``
    raises "Missing key(s) ... Unexpected key(s) in state_dict: "module...."", or with ``strict=False``
    silently loads nothing."""

    code = "GD410"
    name = "wrapped-state-dict-loaded-unwrapped"
    summary = "A DataParallel/DDP state_dict (module. prefixes) is loaded into an unwrapped model"
    triggers = ("load_state_dict",)

    def check(self, facts: FileFacts):
        saves = list(self._wrapped_saves(facts))
        if not saves:
            return
        for load in facts.method_calls("load_state_dict"):
            if load.receiver is None:
                continue
            loaded = self._loaded_path(facts, load)
            if loaded is None:
                continue
            path, filtered = loaded
            match = next((s for s in saves if s[0] == path and s[4] < load.order), None)
            if match is None:
                continue
            _, save, wrapped, wrapper, _ = match
            target = facts.value(load.receiver, load.order, load.scope)
            if target.trait("wrapper") is not None or target.has(TRAIT_PREPARED):
                continue
            if isinstance(load.receiver, cst.Attribute) and load.receiver.attr.value == "module":
                continue
            strict = call_arg(load.node, keyword="strict")
            silent = isinstance(strict, cst.Name) and strict.value == "False"
            effect = (
                "with `strict=False` nothing is loaded and no error is raised"
                if silent
                else "the comprehension that keeps only the keys the model has keeps none of them: the model gets its "
                "own (untrained) weights back and no error is raised"
                if filtered
                else "load_state_dict raises `RuntimeError: Error(s) in loading state_dict ... Missing key(s) in "
                "state_dict: ... Unexpected key(s) in state_dict: \"module....\"`"
            )
            yield self.report(
                load.node,
                f"`{snippet(facts, load.node)}` loads the state dict saved by `{snippet(facts, save.node)}`, which came "
                f"from `{wrapped}`, a `{wrapper}` wrapper: every key starts with `module.`, and "
                f"`{snippet(facts, load.receiver)}` is not wrapped, so {effect}.",
                fix_hint=f"Save `{wrapped}.module.state_dict()` (the unwrapped model), or strip the `module.` prefix "
                "before loading.",
                related=((save.node, f"the `{wrapper}` wrapper's state dict (`module.` keys) is saved here"),),
            )

    def _wrapped_saves(self, facts: FileFacts) -> Iterator[tuple[tuple, CallSite, str, str, int]]:
        """((path text, checkpoint keys), the save, the wrapped model's text, the wrapper, when the file is written:
        the save's position, or the position of the call that hands a helper's ``path`` parameter its argument)."""
        for save in facts.calls:
            if save.qualname != "torch.save" and not (save.method == "save" and save.receiver is not None and facts.value(save.receiver, save.order, save.scope).kind == "accelerator"):
                continue
            obj = call_arg(save.node, 0, "obj")
            path = call_arg(save.node, 1, "f")
            if obj is None or path is None:
                continue
            for state_call, keys in self._state_dict_calls(facts, obj, save):
                owner = state_call.func.value
                value = facts.value(owner, save.order, save.scope)
                wrapper = value.trait("wrapper")
                if wrapper is None:
                    if value.has(TRAIT_PREPARED) and value.kind == "model" and multi_process_severity(facts)[0].fails:
                        wrapper = "DistributedDataParallel (from accelerator.prepare)"
                    else:
                        continue
                for path_text, written in self._path_texts(facts, path, save):
                    yield (path_text, keys), save, snippet(facts, owner), wrapper.split(".")[-1], written

    def _state_dict_calls(
        self, facts: FileFacts, obj: cst.BaseExpression, save: CallSite, keys: tuple = ()
    ) -> Iterator[tuple[cst.Call, tuple]]:
        """The ``.state_dict()`` calls a saved object holds, with the checkpoint keys that lead to each
        (``{"model": net.state_dict()}`` -> ``("model",)``; a dict key that is not a string -> ``None``)."""
        if isinstance(obj, cst.Call) and isinstance(obj.func, cst.Attribute) and obj.func.attr.value == "state_dict":
            yield obj, keys
        elif isinstance(obj, cst.Dict):
            for element in obj.elements:
                if isinstance(element, cst.DictElement):
                    yield from self._state_dict_calls(facts, element.value, save, (*keys, string_value(element.key)))
        else:
            for value, _order, _scope in facts.follow_name(obj, save.order, save.scope, params=False, attributes=True) or ():
                if value is not obj:
                    yield from self._state_dict_calls(facts, value, save, keys)

    def _loaded_path(self, facts: FileFacts, load: CallSite) -> Optional[tuple[tuple[str, tuple], bool]]:
        """((the path ``torch.load`` read, the checkpoint keys the loaded state dict sits under), whether a
        comprehension kept only some keys on the way): ``ckpt = torch.load(p)`` ... ``load_state_dict(ckpt["model"])``
        -> ``((p, ("model",)), False)``. Also through the partial-loading idiom: ``pretrained = {k: v for k, v in
        pretrained.items() if k in model_dict}``, ``model_dict.update(pretrained)``, ``load_state_dict(model_dict)``."""
        return self._trace(facts, call_arg(load.node, 0, "state_dict"), load.order, load.scope, (), False, 0)

    def _trace(self, facts: FileFacts, arg, order: int, scope, keys: tuple, filtered: bool, depth: int):
        if arg is None or depth > 8:
            return None
        if isinstance(arg, cst.Subscript) and len(arg.slice) == 1 and isinstance(arg.slice[0].slice, cst.Index):
            index = string_value(arg.slice[0].slice.value)
            if index is None:
                return None
            return self._trace(facts, arg.value, order, scope, (index, *keys), filtered, depth + 1)
        if isinstance(arg, cst.Call) and facts.qualname(arg.func) == "torch.load":
            path = call_arg(arg, 0, "f")
            return ((self._path_text(facts, path), keys), filtered) if path is not None else None
        if isinstance(arg, cst.Call):  # ``ckpt = load_checkpoint()``: the file's helper that returns ``torch.load(...)``
            built = facts.built_by(arg, order, scope)
            site = facts.call_site(built) if built is not arg and isinstance(built, cst.Call) else None
            if site is not None:
                return self._trace(facts, built, site.order, site.scope, keys, filtered, depth + 1)
        if isinstance(arg, cst.DictComp):
            source = _same_keys_source(arg)
            if source is None:
                return None  # keys renamed (``k.replace("module.", "")``): not the saved keys any more
            return self._trace(facts, source, order, scope, keys, filtered or bool(arg.for_in.ifs), depth + 1)
        binding = facts.assignment_of(arg, order, scope)
        if binding is None:
            return None
        merged = _merged_into(facts, binding.key, binding, order, scope)
        if merged is not None and not keys:
            found = self._trace(facts, merged.arg(0, "other"), merged.order, scope, keys, filtered, depth + 1)
            if found is not None:
                return found
        return self._trace(facts, binding.value, binding.order, binding.scope, keys, filtered, depth + 1)

    def _path_texts(self, facts: FileFacts, path: cst.BaseExpression, save: CallSite) -> Iterator[tuple[str, int]]:
        """The saved path as written, and, when it is a parameter of the helper that saves
        (``def save_checkpoint(net, path): torch.save(net.state_dict(), path)``), as each call passes it
        (``save_checkpoint(model, args.weights)``), with the position of that call. Only for a helper called once:
        the wrapper is the model that call hands in, and another call may save an unwrapped model elsewhere."""
        yield self._path_text(facts, path), save.order
        binding = facts.binding_at(path.value, save.order, save.scope) if isinstance(path, cst.Name) else None
        passed = list(facts.param_arguments(binding)) if binding is not None and binding.kind == "param" else []
        if len(passed) == 1:
            argument, order, _scope = passed[0]
            yield self._path_text(facts, argument), order

    @staticmethod
    def _path_text(facts: FileFacts, node: cst.BaseExpression) -> str:
        text = string_value(node)
        return repr(text) if text is not None else facts.module.code_for_node(node)


def _same_keys_source(comp: cst.DictComp) -> Optional[cst.BaseExpression]:
    """``X`` for ``{k: v for k, v in X.items() [if ...]}`` (keys and values unchanged, some maybe dropped)."""
    loop = comp.for_in
    if loop.inner_for_in is not None or not isinstance(loop.target, cst.Tuple) or len(loop.target.elements) != 2:
        return None
    k, v = (e.value for e in loop.target.elements)
    same = (
        isinstance(k, cst.Name) and isinstance(comp.key, cst.Name) and comp.key.value == k.value
        and isinstance(v, cst.Name) and isinstance(comp.value, cst.Name) and comp.value.value == v.value
    )
    it = loop.iter
    if same and isinstance(it, cst.Call) and isinstance(it.func, cst.Attribute) and it.func.attr.value == "items" and not it.args:
        return it.func.value
    return None


def _merged_into(facts: FileFacts, key: str, binding, order: int, scope) -> Optional[CallSite]:
    """The last ``key.update(other)`` between ``key``'s binding and ``order`` in the same scope: what was merged in."""
    updates = [
        c for c in facts.method_calls("update")
        if c.scope is scope and binding.order < c.order < order and name_key(c.receiver) == key and c.arg(0, "other") is not None
    ]
    return updates[-1] if updates else None
