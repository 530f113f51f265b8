from __future__ import annotations

from typing import Iterator

import libcst as cst

from gpudoctor.check.facts import TRAIT_PREPARED, Binding, CallSite, FileFacts, name_key
from gpudoctor.check.queries import multi_process_severity, snippet
from gpudoctor.check.rule import Rule

_EFFECTS = {
    "dataloader": (
        "the raw loader does not move batches to the device (on a GPU: \"Expected all tensors to be on the same "
        "device\"), does not shard data between processes, and never signals the end of an epoch, so the last "
        "accumulated gradients leak into the next one"
    ),
    "optimizer": (
        "the raw optimizer steps and zeroes on every micro-batch (gradient accumulation is lost) and, with fp16, "
        "applies updates computed from scaled gradients (65536x too large at the start)"
    ),
}


class UnpreparedObjectUsed(Rule):
    """After ``a2 = accelerator.prepare(a)`` the loop still uses ``a`` (or never uses what prepare
    returned while it iterates/steps another loader/optimizer): accumulation, sharding, device
    placement and fp16 unscaling are silently lost."""

    code = "GD103"
    name = "unprepared-object-used"
    summary = "The training loop uses a dataloader/optimizer/model that accelerator.prepare did not return"
    triggers = ("prepare",)

    def check(self, facts: FileFacts):
        reported: set[int] = set()
        for site in facts.prepare_calls():
            yield from self._wrapped_loaders(facts, site)
            outputs = [b for b in facts._bindings_of_value(site.node) if b.kind in ("unpack", "assign")]
            # ``prepared = accelerator.prepare(a, b)`` then ``a2, b2 = prepared``: the unpacking is the output.
            for held in [b for b in outputs if b.kind == "assign" and len(site.node.args) > 1]:
                outputs += [
                    b for bindings in held.scope.bindings.values() for b in bindings
                    if b.kind == "unpack" and b.order > held.order and name_key(b.value) == held.key
                ]
            for binding in outputs:
                index = binding.index if binding.kind == "unpack" else 0
                if binding.kind == "assign" and len(site.node.args) != 1:
                    continue
                if index is None or index >= len(site.node.args):
                    continue
                source = site.node.args[index].value
                kind = facts.value(source, site.order, site.scope).kind
                for finding in self._stale_uses(facts, site, binding, source, kind, outputs):
                    if id(finding.node) not in reported:
                        reported.add(id(finding.node))
                        yield finding

    def _stale_uses(
        self, facts: FileFacts, site: CallSite, out: Binding, source: cst.BaseExpression, kind: str,
        outputs: list[Binding],
    ) -> Iterator:
        prepared = out.key
        raw = name_key(source)
        prepared_used = bool(facts.loads_of(prepared, after=out.order))
        where = snippet(facts, site.node.func)
        for use_node, receiver, stale, stale_kind, use_order, use_scope in self._training_uses(facts, out.order, kind, site.scope):
            if stale == prepared:
                continue
            if stale == raw and facts.binding_at(stale, use_order, use_scope) is not facts.binding_at(raw, site.order, site.scope):
                continue  # another variable of the same name (a parameter, a local, a rebinding)
            if stale != raw and use_scope is not site.scope:
                continue
            if stale == raw and raw != prepared:
                reason = f"`{raw}` was replaced by `{where}(...)`, which returned `{prepared}`"
            elif not prepared_used and stale_kind == kind and not facts.value(receiver).has(TRAIT_PREPARED):
                reason = f"`{where}(...)` returned `{prepared}`, which is never used afterwards"
            elif (
                kind == "unknown" and not prepared_used and _undefined_here(facts.value(receiver))
                and not facts.value(receiver).has(TRAIT_PREPARED)
                and stale not in self._prepared_arguments(facts)
                and prepared == self._closest_unused(facts, outputs, stale)
                and not self._trains_with_outputs(facts, site, outputs)
            ):
                # A fragment: neither what was prepared nor what the loop uses is defined in the file, but prepare's
                # output is dead while the loop trains with another object that never went through prepare.
                reason = f"`{where}(...)` returned `{prepared}`, which is never used afterwards"
            else:
                continue
            effect = _EFFECTS.get(stale_kind, "")
            yield self.report(
                use_node,
                f"The loop uses `{stale}`, not the prepared object: {reason}; {effect}.",
                fix_hint=f"Use `{prepared}` (what prepare returned) here.",
                related=((site.node, f"`{where}(...)` returns the prepared object as `{prepared}` here"),),
            )
        if kind == "model" and raw and raw != prepared:
            severity, why = multi_process_severity(facts)
            if severity.fails:
                for call in facts.calls:
                    if (
                        call.order > out.order
                        and name_key(call.node.func) == raw
                        and not facts.under_no_grad(call.context)
                        and facts.binding_at(raw, call.order, call.scope) is facts.binding_at(raw, site.order, site.scope)
                    ):
                        yield self.report(
                            call.node,
                            f"`{raw}(...)` calls the unwrapped model after prepare returned `{prepared}`; {why}, so "
                            "gradients are not all-reduced and the replicas drift apart.",
                            fix_hint=f"Call `{prepared}(...)`.",
                            related=((site.node, f"`{where}(...)` returns the wrapped model as `{prepared}` here"),),
                        )

    def _wrapped_loaders(self, facts: FileFacts, site: CallSite) -> Iterator:
        """``prepare(cycle(dl))``: prepare only converts DataLoader/Module/Optimizer/scheduler objects and hands
        anything else back unchanged, so a generator over a DataLoader keeps feeding the raw loader."""
        for arg in site.node.args:
            wrapper = arg.value
            if not isinstance(wrapper, (cst.Call, cst.GeneratorExp)):
                continue
            loader = facts.source_of(wrapper, site.order, site.scope)
            if loader is wrapper or facts.value(loader, site.order, site.scope).kind != "dataloader":
                continue
            shown = snippet(facts, wrapper)
            yield self.report(
                wrapper,
                f"`{snippet(facts, site.node.func)}(...)` hands `{shown}` back unchanged (it only converts DataLoader, "
                f"model, optimizer and scheduler objects), so training iterates the raw `{snippet(facts, loader)}`: "
                f"{_EFFECTS['dataloader']}.",
                fix_hint=f"Prepare the DataLoader itself and wrap what prepare returns: `dl = {snippet(facts, site.node.func)}"
                f"({snippet(facts, loader)})`, then iterate `{shown.replace(snippet(facts, loader), 'dl')}`.",
            )

    def _trains_with_outputs(self, facts: FileFacts, site: CallSite, outputs: list[Binding]) -> bool:
        """The loop already iterates or steps one of this prepare call's outputs: a dead output is then for
        later (an eval loader), and the fragment's other objects may have been prepared in an earlier cell."""
        keys = {b.key for b in outputs}
        return any(use[2] in keys for use in self._training_uses(facts, site.order, "unknown", site.scope))

    @staticmethod
    def _prepared_arguments(facts: FileFacts) -> set[str]:
        return {name_key(a.value) for site in facts.prepare_calls() for a in site.node.args} - {None}

    @staticmethod
    def _closest_unused(facts: FileFacts, outputs: list[Binding], stale: str) -> str:
        """Among prepare's unused outputs, the one whose name shares the longest prefix with ``stale`` (so the
        message names ``train_dataloader`` for ``train_dl`` and ``optimizer`` for ``optim``)."""
        def shared(name: str) -> int:
            n = 0
            while n < min(len(name), len(stale)) and name[n] == stale[n]:
                n += 1
            return n
        unused = [b.key for b in outputs if not facts.loads_of(b.key, after=b.order)]
        return max(unused, key=shared) if unused else ""

    def _training_uses(self, facts: FileFacts, after: int, kind: str, where):
        """(node to report, receiver, stale key, inferred kind, order, scope) for loader iterations and optimizer
        steps after ``after``. When the loop or the step is in a helper and uses its parameter
        (``def train_one_epoch(model, loader, ...)``), the use is what each later call passes, reported at that
        argument: the caller chose the object. A parameter of the function that calls prepare (``where``) is the
        prepared object's own source and is not followed further."""
        for node, receiver, key, found_kind, order, scope in self._direct_training_uses(facts, kind):
            binding = facts.binding_at(key, order, scope)
            if binding is not None and binding.kind == "param" and binding.scope is not where:
                for argument, call_order, call_scope in facts._param_arguments(binding):
                    passed = name_key(argument)
                    if passed is not None and call_order > after:
                        yield argument, argument, passed, found_kind, call_order, call_scope
                continue
            if order > after:
                yield node, receiver, key, found_kind, order, scope

    def _direct_training_uses(self, facts: FileFacts, kind: str):
        if kind in ("dataloader", "unknown"):
            for loop in facts.loops:
                found = facts.iterated(loop)  # through tqdm/enumerate, iter()/next(), generators
                if found is None:
                    continue
                iterated = found[0]
                key = name_key(iterated)
                if key and self._loop_trains(facts, loop):
                    # A helper's loop over its parameter is followed to the argument a call passes: the use
                    # happens at that call.
                    order, scope = _argument_position(facts, iterated) or (loop.order, loop.scope)
                    yield iterated, iterated, key, "dataloader", order, scope
        if kind in ("optimizer", "unknown"):
            zeroed = {name_key(c.receiver) for c in facts.method_calls("zero_grad") if c.receiver is not None}
            stepped = {name_key(c.receiver) for c in facts.method_calls("step") if c.receiver is not None}
            for call in facts.method_calls("step", "zero_grad"):
                key = name_key(call.receiver) if call.receiver is not None else None
                if key is None:
                    continue
                value_kind = facts.value(call.receiver, call.order, call.scope).kind
                if value_kind == "optimizer" or (value_kind == "unknown" and key in zeroed and key in stepped):
                    yield call.node, call.receiver, key, "optimizer", call.order, call.scope

    @staticmethod
    def _loop_trains(facts: FileFacts, loop) -> bool:
        return any(
            c.method == "backward" and any(f is loop for f in c.context) for c in facts.calls
        )


def _argument_position(facts: FileFacts, node: cst.CSTNode):
    """(order, scope) of the call that passes ``node`` as an argument; None when ``node`` is no argument."""
    for site in facts.calls:
        if any(arg.value is node for arg in site.node.args):
            return site.order, site.scope
    return None


def _undefined_here(value) -> bool:
    """Nothing in the file defines the object: unknown, or only assumed from its name in a snippet
    (``train_dl`` iterated in a cell whose loader came from an earlier one)."""
    return value.kind == "unknown" or value.has("assumed")
