from __future__ import annotations

import re
from typing import Optional

import libcst as cst

from gpudoctor.check.facts import CallSite, FileFacts, IfFrame, int_value
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule

# Collectives: every process of the group must call them, in the same order.
_TORCH_COLLECTIVES = {
    f"torch.distributed.{name}" for name in (
        "barrier", "monitored_barrier", "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
        "reduce", "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "gather",
        "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single",
    )
}
_ACCELERATE_UTILS = {f"accelerate.utils.{name}" for name in ("gather", "gather_object", "broadcast", "reduce",
                                                             "pad_across_processes", "wait_for_everyone")}
_ACCELERATOR_METHODS = {"wait_for_everyone", "gather", "gather_for_metrics", "reduce", "pad_across_processes"}
# Tests that select some processes: the main-process flags, and comparisons of a rank with a number.
_MAIN_FLAG = re.compile(r"\bis_(local_)?main_process\b|\bis_world_process_zero\b|\bis_main\b")
_RANK_NAME = re.compile(r"(^|[._])(local_|global_)?rank(\(\))?$|get_rank\(\)$|(local_)?process_index$|gpu_id$")


class CollectiveUnderRankGuard(Rule):
    """A collective (``dist.barrier``/``all_reduce``/..., ``accelerator.wait_for_everyone``/``gather``/
    ``gather_for_metrics``/``reduce``) inside ``if accelerator.is_main_process:`` / ``if rank == 0:``, or in a
    helper only called there: the other processes never reach it, so every process waits forever."""

    code = "GD419"
    name = "collective-under-rank-guard"
    summary = "A collective (barrier, gather, all_reduce, wait_for_everyone) runs only on the main rank: the job hangs"
    severity = Severity.ERROR
    triggers = ("rank", "main_process", "process_index", "is_main")

    def check(self, facts: FileFacts):
        collectives = [site for site in facts.calls if self._is_collective(facts, site)]
        severity = Severity.ERROR if facts.launch_hints else Severity.WARNING
        for site in collectives:
            guard = _rank_guard(facts, site.context)
            if guard is not None:
                if _paired(facts, site, collectives):
                    continue  # the other ranks call the same collective under the opposite test
                yield self._report(facts, site, site.node, guard, severity)
                continue
            # A helper that gathers, called only where one rank runs: ``if is_main_process: evaluate(...)``.
            if site.scope.kind != "function" or _rank_guard_in_scope(facts, site):
                continue
            callers = facts.call_sites_of(site.scope)
            guards = [_rank_guard(facts, caller.context) for caller in callers]
            if not callers or any(g is None for g in guards):
                continue
            if len({(id(g.node), g.branch) for g in guards}) > 1:
                continue  # called under opposite tests (accelerate's ``_goes_first``): every process gets there
            yield self._report(facts, site, callers[0].node, guards[0], severity, helper=site)

    def _report(self, facts: FileFacts, site: CallSite, node, guard: IfFrame, severity, helper: Optional[CallSite] = None):
        test = snippet(facts, guard.test, 60)
        where = "" if helper is None else f", through `{snippet(facts, node, 40)}` which calls it"
        related = [(guard.test, "only the selected process passes this test")]
        if helper is not None:
            related.append((helper.node, "the collective inside the helper"))
        return self.report(
            node,
            f"`{snippet(facts, site.node, 50)}` is a collective: every process must call it, but it runs only when "
            f"`{test}` holds{where}. The selected process waits for the others, which never arrive (they go on to the "
            "next collective), so the job hangs until the process group's timeout kills it (torch watchdog "
            "\"Watchdog caught collective operation timeout\").",
            fix_hint="Call it outside the rank test, on every process (keep only the saving/printing under the test), "
            "or use `with accelerator.main_process_first():` for work the main process must do first.",
            related=tuple(related),
            severity=severity,
        )

    @staticmethod
    def _is_collective(facts: FileFacts, site: CallSite) -> bool:
        if site.qualname in _TORCH_COLLECTIVES or site.qualname in _ACCELERATE_UTILS:
            return True
        return (
            site.method in _ACCELERATOR_METHODS and site.receiver is not None
            and facts.value(site.receiver, site.order, site.scope).kind == "accelerator"
        )


def _rank_guard(facts: FileFacts, context) -> Optional[IfFrame]:
    """The innermost ``if`` around a call whose branch only some processes take."""
    for frame in reversed(context):
        if isinstance(frame, IfFrame) and _selects_ranks(facts, frame.test):
            return frame
    return None


def _rank_guard_in_scope(facts: FileFacts, site: CallSite) -> bool:
    return _rank_guard(facts, site.context) is not None


def _selects_ranks(facts: FileFacts, test: cst.BaseExpression) -> bool:
    """``accelerator.is_main_process``, ``not is_local_main_process``, ``rank == 0``, ``dist.get_rank() != 0``,
    ``args.local_rank in [-1, 0]`` (also inside ``and``/``or``). A comparison with -1 alone (``local_rank != -1``:
    distributed or not) is the same on every process."""
    if isinstance(test, cst.UnaryOperation):
        return _selects_ranks(facts, test.expression)
    if isinstance(test, cst.BooleanOperation):
        return _selects_ranks(facts, test.left) or _selects_ranks(facts, test.right)
    text = facts.module.code_for_node(test)
    if isinstance(test, (cst.Attribute, cst.Name, cst.Call)):
        return bool(_MAIN_FLAG.search(text))
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
        left, target = test.left, test.comparisons[0].comparator
        left_text = facts.module.code_for_node(left)
        if not _RANK_NAME.search(left_text):
            return False
        if isinstance(target, (cst.List, cst.Tuple, cst.Set)):
            numbers = [int_value(e.value) for e in target.elements]
            return any(n is not None and n >= 0 for n in numbers)
        number = int_value(target)
        return number is not None and number >= 0
    return False


def _paired(facts: FileFacts, site: CallSite, collectives: list[CallSite]) -> bool:
    """Another call of the same collective in the same function that the other processes reach: under another
    rank test (the ``local_rank not in [-1, 0]`` / ``local_rank == 0`` barrier pair), or on the other branch of the
    same ``if``."""
    kind = site.qualname or site.method
    guard = _rank_guard(facts, site.context)
    for other in collectives:
        if other is site or other.scope is not site.scope or (other.qualname or other.method) != kind:
            continue
        other_guard = _rank_guard(facts, other.context)
        if other_guard is not None and (other_guard.node is not guard.node or other_guard.branch != guard.branch):
            return True
        if other_guard is None and any(isinstance(f, IfFrame) and f.node is guard.node and f.branch != guard.branch
                                       for f in other.context):
            return True
    return False
