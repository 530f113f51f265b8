from __future__ import annotations

import libcst as cst

from gpudoctor.check.facts import FileFacts, call_arg
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule

_SAMPLER = {"torch.utils.data.DistributedSampler", "torch.utils.data.distributed.DistributedSampler"}


class SamplerWithoutSetEpoch(Rule):
    """A shuffling ``DistributedSampler`` in a multi-epoch loop, and ``set_epoch`` is never called: the
    sampler seeds its shuffle with the epoch, so every epoch sees the same order."""

    code = "GD409"
    name = "sampler-without-set-epoch"
    summary = "DistributedSampler without sampler.set_epoch(epoch): every epoch uses the same shuffle"
    severity = Severity.WARNING
    triggers = ("DistributedSampler",)

    def check(self, facts: FileFacts):
        if "set_epoch" in facts.source or not self._has_epoch_loop(facts):
            return
        if facts.prepare_calls():
            return  # prepared loaders call set_epoch on their sampler themselves
        for site in facts.calls_to(*_SAMPLER):
            shuffle = call_arg(site.node, keyword="shuffle")
            if isinstance(shuffle, cst.Name) and shuffle.value == "False":
                continue
            if shuffle is not None and not (isinstance(shuffle, cst.Name) and shuffle.value == "True"):
                continue
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node)}` shuffles with a seed derived from its epoch, and `set_epoch(epoch)` "
                "is never called: every epoch sees the samples in the same order.",
                fix_hint="Call `sampler.set_epoch(epoch)` at the start of every epoch (before iterating the loader).",
            )

    @staticmethod
    def _has_epoch_loop(facts: FileFacts) -> bool:
        """A loop whose head names epochs, or a loop around a loop over a DataLoader (directly or through a
        call of the file's own function that has one)."""
        loader_loops = [
            loop for loop in facts.loops
            if isinstance(loop.node, cst.For) and facts.item_of(loop.iter, loop.order, loop.scope, ()).kind == "batch"
        ]
        loader_functions = {id(loop.scope) for loop in loader_loops if loop.scope is not None and loop.scope.kind == "function"}
        for loop in facts.loops:
            node = loop.node
            if isinstance(node, cst.For):
                head = facts.module.code_for_node(node.target) + " " + facts.module.code_for_node(node.iter)
                if "epoch" in head.lower():
                    return True
            if any(inner is not loop and loop.order < inner.order < loop.end_order for inner in loader_loops):
                return True
            for site in facts.calls:
                if loop.order < site.order < loop.end_order and any(id(s) in loader_functions for s in facts.callee_scopes(site)):
                    return True
        return False
