from __future__ import annotations

import libcst as cst

from gpudoctor.check.facts import CallSite, FileFacts, call_arg, name_key
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.loop._common import is_backward, reach

_SAMPLER = {"torch.utils.data.DistributedSampler", "torch.utils.data.distributed.DistributedSampler"}
_BUILTINS = {"print", "len", "iter", "list", "isinstance", "repr", "str", "id", "type", "hasattr", "getattr"}
_LOADER = {"torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader"}


class SamplerWithoutSetEpoch(Rule):
    """A shuffling ``DistributedSampler`` in a multi-epoch loop, and ``set_epoch`` is never called: the
    sampler seeds its shuffle with the epoch, so every epoch sees the same order."""

    code = "GD409"
    name = "sampler-without-set-epoch"
    summary = "DistributedSampler without sampler.set_epoch(epoch): every epoch uses the same shuffle"
    severity = Severity.WARNING
    triggers = ("DistributedSampler",)

    def check(self, facts: FileFacts):
        epoch_loop = None if "set_epoch" in facts.source else self._epoch_loop(facts)
        if epoch_loop is None:
            return
        if facts.prepare_calls():
            return  # prepared loaders call set_epoch on their sampler themselves
        for site in facts.calls_to(*_SAMPLER):
            shuffle = call_arg(site.node, keyword="shuffle")
            if isinstance(shuffle, cst.Name) and shuffle.value == "False":
                continue
            if shuffle is not None and not (isinstance(shuffle, cst.Name) and shuffle.value == "True"):
                continue
            if not self._may_train_unseeded(facts, site):
                continue
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node)}` shuffles with a seed derived from its epoch, and `set_epoch(epoch)` "
                "is never called: every epoch sees the samples in the same order.",
                fix_hint="Call `sampler.set_epoch(epoch)` at the start of every epoch (before iterating the loader).",
                related=(
                    (_loop_head(epoch_loop), "each epoch starts here: call set_epoch(epoch) at its top"),
                    *((user.node, "this loader draws every epoch's batches from the sampler")
                      for user in self._users(facts, site.node) or () if user.qualname in _LOADER),
                ),
            )

    def _may_train_unseeded(self, facts: FileFacts, site: CallSite) -> bool:
        """False when what the sampler feeds shows the shuffle cannot matter or is seeded elsewhere: its
        loaders are only iterated by evaluation loops (no backward, forward under no_grad: a loss or metric
        averaged over the shard does not depend on order), or the sampler or its loader is handed to a function defined outside
        the file, which may call ``set_epoch`` itself (``train(..., sampler=sampler)`` from a utils module)."""
        loaders: list[cst.Call] = []
        sampler_users = self._users(facts, site.node)
        if sampler_users is None:
            return True
        for user in sampler_users:
            if user.qualname in _LOADER:
                loaders.append(user.node)
            elif self._external(facts, user):
                return False
        if not loaders:
            return True
        loops = []
        for loader in loaders:
            iterated = self._loops_over(facts, loader)
            if not iterated and any(self._external(facts, u) for u in self._users(facts, loader) or ()):
                return False  # the loader is consumed by code this file does not show
            loops.extend(iterated)
        if not loops:
            return True
        return not all(self._evaluates(facts, loop) for loop in loops)

    @staticmethod
    def _evaluates(facts: FileFacts, loop) -> bool:
        """The loop evaluates: no backward runs in it (directly or in the file's helpers) and its forward runs
        with gradients off (``with torch.no_grad():`` inside it, or around it)."""
        reached = [inner for inner, _ in reach(facts, loop, depth=3)]
        if any(is_backward(facts, inner) for inner in reached):
            return False
        return any(facts.under_no_grad(inner.context) for inner in reached)

    @staticmethod
    def _bindings_of(facts: FileFacts, value: cst.CSTNode) -> list:
        """The ``name = value`` bindings whose value is ``value``, or a dict display holding ``value`` (or a
        name bound to it) as an entry."""
        out = []
        for scope in [facts.module_scope, *facts.functions]:
            for bindings in scope.bindings.values():
                for binding in bindings:
                    if binding.kind == "assign" and binding.value is value:
                        out.append(binding)
        for binding in list(out):
            for scope in [facts.module_scope, *facts.functions]:
                for bindings in scope.bindings.values():
                    for holder in bindings:
                        if holder.kind == "assign" and isinstance(holder.value, cst.Dict) and any(
                            isinstance(e, cst.DictElement) and (e.value is value or name_key(e.value) == binding.key)
                            for e in holder.value.elements
                        ):
                            out.append(holder)
        return out

    def _users(self, facts: FileFacts, value: cst.CSTNode) -> list[CallSite] | None:
        """Calls that take ``value`` as an argument: inline, through the name it is bound to, or through a
        dict of keyword arguments (``kw = {"sampler": s}; DataLoader(ds, **kw)``); None when it is unnamed."""
        inline = [c for c in facts.calls if any(a.value is value for a in c.node.args)]
        if inline:
            return inline
        bindings = self._bindings_of(facts, value)
        if not bindings:
            return None
        out = []
        for binding in bindings:
            for call in facts.calls:
                if call.order > binding.order and any(
                    name_key(arg.value) == binding.key and facts.binding_at(binding.key, call.order, call.scope) is binding
                    for arg in call.node.args
                ):
                    out.append(call)
        return out

    @staticmethod
    def _external(facts: FileFacts, call: CallSite) -> bool:
        """A call into code the file does not show (an imported or unknown function), not a builtin."""
        if facts.callee_scopes(call):
            return False
        if call.qualname is not None:
            return not call.qualname.startswith(("torch.", "torch_xla.", "builtins."))  # wrappers, never set_epoch
        return call.method is None and isinstance(call.node.func, cst.Name) and call.node.func.value not in _BUILTINS

    def _loops_over(self, facts: FileFacts, loader: cst.Call) -> list:
        """Loops that iterate ``loader`` (through names, enumerate/tqdm, and the file's own functions' parameters)."""
        keys = {b.key for b in self._bindings_of(facts, loader) if b.value is loader}
        out = []
        for loop in facts.loops:
            found = facts.iterated(loop)
            if found is not None and (found[0] is loader or name_key(found[0]) in keys) and not _yields_items(facts, loop):
                out.append(loop)
        return out

    @staticmethod
    def _epoch_loop(facts: FileFacts):
        """The first loop whose head names epochs, or that runs a loop over a DataLoader (directly or through a
        call of the file's own function that has one); None when there is none."""
        loader_loops = [loop for loop in facts.loops if _iterates_loader(facts, loop)]
        loader_functions = {id(loop.scope) for loop in loader_loops if loop.scope is not None and loop.scope.kind == "function"}
        for loop in facts.loops:
            node = loop.node
            if isinstance(node, cst.For):
                head = facts.module.code_for_node(node.target) + " " + facts.module.code_for_node(node.iter)
                if "epoch" in head.lower():
                    return node
            if any(inner is not loop and loop.order < inner.order < loop.end_order for inner in loader_loops):
                return node
            for site in facts.calls:
                if loop.order < site.order < loop.end_order and any(id(s) in loader_functions for s in facts.callee_scopes(site)):
                    return node
        return None


def _yields_items(facts: FileFacts, loop) -> bool:
    """A generator's loop that yields what it iterates: the loop that consumes the generator is the one that
    trains or evaluates (``for x, y in batches(loader)`` over ``def batches(it): for b in it: yield b``)."""
    return any(loop.order < y.order < loop.end_order for y in facts.yields.get(id(loop.scope), ()))


def _iterates_loader(facts: FileFacts, loop) -> bool:
    """The loop runs over a DataLoader, whatever names it: ``for x, y in loader``, ``for i, (x, y) in
    enumerate(tqdm(loader))``, ``while True: batch = next(it)`` over ``iter(loader)``, the file's generators."""
    if isinstance(loop.node, cst.For) and facts.item_of(loop.iter, loop.order, loop.scope, ()).kind == "batch":
        return True
    found = facts.iterated(loop)
    return found is not None and facts.value(found[0], loop.order, loop.scope).kind == "dataloader"


def _loop_head(loop: cst.CSTNode) -> cst.CSTNode:
    """What names a loop on its first line: a ``for`` loop's iterable, a ``while`` loop's test."""
    return loop.iter if isinstance(loop, cst.For) else getattr(loop, "test", loop)
