from __future__ import annotations

import re

import libcst as cst

from gpudoctor.check.facts import TRAIT_PREPARED, FileFacts, name_key
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import multi_process_severity, snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.loop._common import in_loop, is_backward

# Callee names that combine values across processes: ``accelerator.gather_for_metrics``, ``dist.all_reduce``,
# ``accelerator.reduce``, ``gather_object``, a helper ``reduce_tensor``/``reduce_mean``, ``sync_across_processes``
# (whole snake_case words: ``ReduceLROnPlateau`` and ``reduced_size`` are not a reduction across processes).
_GATHERS = re.compile(r"(?:^|_)(?:all)?(?:gather|reduce)(?:_|$)|sync_across")


class ShardedEvalMetrics(Rule):
    """An evaluation loop over a sharded loader (``accelerator.prepare``-d, or with a
    ``DistributedSampler``) that accumulates a metric without gathering it across processes: each rank
    reports the metric of its own shard only."""

    code = "GD408"
    name = "sharded-eval-metrics"
    summary = "Metrics computed over a sharded eval loader without gather/all_reduce"
    severity = Severity.WARNING
    preview = True
    triggers = ("prepare", "DistributedSampler")

    def check(self, facts: FileFacts):
        if _gathers_across_processes(facts):
            return
        severity, why = multi_process_severity(facts)
        if not severity.fails:
            return
        for loop in facts.loops:
            found = facts.iterated(loop)
            if found is None:
                continue
            loader, shown = found
            if name_key(loader) is None:
                continue
            scope = self._scope(facts, loop)
            # ``loader`` is read where it is written: the loop's own iterable, or the argument a call of the file
            # passes for the parameter the loop iterates (``evaluate(model, test_loader)``).
            value = facts.value(loader)
            looks_like_loader = value.kind == "dataloader" or bool(re.search(r"loader|dl\b|_dl|data", name_key(loader), re.I))
            sharded = value.has(TRAIT_PREPARED) and looks_like_loader
            if not sharded and value.kind == "dataloader" and isinstance(value.origin().node, cst.Call):
                sampler = value.origin().node
                text = facts.module.code_for_node(sampler)
                sharded = "DistributedSampler" in text
            if not sharded:
                continue
            inside = [c for c in facts.calls if in_loop(c, loop)]
            if any(is_backward(facts, c) for c in inside):
                continue
            evaluating = any(facts.under_no_grad(c.context) for c in inside) or any(
                c.method == "eval" and c.order < loop.order and c.scope is scope for c in facts.calls
            )
            if not evaluating:
                continue
            metric = next((a for a in facts.aug_assigns if in_loop(a, loop)), None) or next(
                (c for c in inside if c.method in ("append", "extend") and self._local_list(facts, c)), None
            )
            if metric is None:
                continue
            yield self.report(
                shown,
                f"This evaluation loop iterates `{snippet(facts, loader)}`, which is sharded across processes ({why}), "
                f"and accumulates `{snippet(facts, metric.node)}` without any gather/all_reduce: each process reports "
                "the metric of its own shard only.",
                fix_hint="Gather predictions and labels (`accelerator.gather_for_metrics(...)`) or all_reduce the "
                "counts before computing the metric.",
                related=((metric.node, "the metric of this process's shard is accumulated here"),),
            )

    @staticmethod
    def _local_list(facts: FileFacts, site) -> bool:
        """``preds.extend(...)`` on a list the function created (``preds, labels = [], []``): predictions collected
        from this process's shard, for a metric computed afterwards."""
        binding = facts.binding_at(name_key(site.receiver), site.order, site.scope) if name_key(site.receiver) else None
        if binding is None or binding.scope is not site.scope or binding.kind not in ("assign", "unpack"):
            return False
        value = binding.value
        if binding.kind == "unpack" and isinstance(value, cst.Tuple) and binding.index is not None:
            elements = value.elements
            value = elements[binding.index].value if binding.index < len(elements) else None
        return isinstance(value, cst.List) and not value.elements

    @staticmethod
    def _scope(facts: FileFacts, loop):
        site = next((c for c in facts.calls if in_loop(c, loop)), None)
        return site.scope if site is not None else facts.module_scope


def _gathers_across_processes(facts: FileFacts) -> bool:
    """The file calls something that gathers or reduces across processes (read from its calls, not its text: a
    docstring or comment that mentions ``accelerator.gather()`` gathers nothing)."""
    for site in facts.calls:
        if site.qualname == "functools.reduce":
            continue
        indexing = site.arg(1, "index") is not None and not (site.qualname or "").startswith("torch.distributed.")
        if (site.method == "gather" or site.qualname == "torch.gather") and indexing:
            continue  # ``logits.gather(1, index)``: indexing this process's tensor (a process gather takes one tensor)
        func = site.node.func
        spelled = func.attr.value if isinstance(func, cst.Attribute) else func.value if isinstance(func, cst.Name) else ""
        resolved = (site.qualname or "").rpartition(".")[2]
        if _GATHERS.search(spelled) or _GATHERS.search(resolved):
            return True
    return False
