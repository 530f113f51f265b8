from __future__ import annotations

from typing import Iterator, Optional

import libcst as cst

from gpudoctor.check.facts import TRAIT_PREPARED, CallSite, FileFacts, call_arg, string_value
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
            path = self._loaded_path(facts, load)
            if path is None:
                continue
            match = next((s for s in saves if s[0] == path and s[1].order < load.order), None)
            if match is None:
                continue
            _, save, wrapped, wrapper = match
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
            )

    def _wrapped_saves(self, facts: FileFacts) -> Iterator[tuple[str, CallSite, str, str]]:
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
                yield (self._path_text(facts, path), keys), save, snippet(facts, owner), wrapper.split(".")[-1]

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

    def _loaded_path(self, facts: FileFacts, load: CallSite) -> Optional[tuple[str, tuple]]:
        """(the path ``torch.load`` read, the checkpoint keys the loaded state dict sits under):
        ``ckpt = torch.load(p)`` ... ``load_state_dict(ckpt["model"])`` -> ``(p, ("model",))``."""
        arg = call_arg(load.node, 0, "state_dict")
        keys: tuple = ()
        order, scope = load.order, load.scope
        for _ in range(6):
            if arg is None:
                return None
            if isinstance(arg, cst.Subscript) and len(arg.slice) == 1 and isinstance(arg.slice[0].slice, cst.Index):
                index = string_value(arg.slice[0].slice.value)
                if index is None:
                    return None
                keys, arg = (index, *keys), arg.value
                continue
            if isinstance(arg, cst.Call) and facts.qualname(arg.func) == "torch.load":
                path = call_arg(arg, 0, "f")
                return (self._path_text(facts, path), keys) if path is not None else None
            sources = facts.follow_name(arg, order, scope, params=False, attributes=True)
            if not sources:
                return None
            [(arg, order, scope)] = sources  # a plain assignment: one source
        return None

    @staticmethod
    def _path_text(facts: FileFacts, node: cst.BaseExpression) -> str:
        text = string_value(node)
        return repr(text) if text is not None else facts.module.code_for_node(node)
