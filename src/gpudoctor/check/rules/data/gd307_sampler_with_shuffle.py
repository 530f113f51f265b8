from __future__ import annotations

from typing import Iterator

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import FileFacts, IfFrame, is_true, name_key
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule

_MAX_DEPTH = 4


class SamplerWithShuffle(Rule):
    """``DataLoader(..., shuffle=True, sampler=<a sampler>)`` (or ``batch_sampler=``): torch refuses the
    combination when the loader is built. A sampler that is ``None`` on one branch (single GPU) and a
    ``DistributedSampler`` on the other (several GPUs) fails only on the multi-GPU run."""

    code = "GD307"
    name = "sampler-with-shuffle"
    summary = "DataLoader given both shuffle=True and a sampler/batch_sampler (ValueError: mutually exclusive)"
    severity = Severity.ERROR
    triggers = ("Sampler", "sampler")

    def check(self, facts: FileFacts):
        for site in facts.calls_to(*apis.DATALOADER):
            shuffle = site.arg(2, "shuffle")
            if not is_true(shuffle):
                continue
            for keyword in ("sampler", "batch_sampler"):
                given = site.arg(3 if keyword == "sampler" else 4, keyword)
                made = next(_sampler_constructions(facts, given, site.order, site.scope), None)
                if made is None:
                    continue
                message = (
                    "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last"
                    if keyword == "batch_sampler" else "sampler option is mutually exclusive with shuffle"
                )
                conditional = made is not given and _conditional(facts, given, site)
                when = " on the branch where it is a sampler (the multi-process run)" if conditional else ""
                yield self.report(
                    shuffle,
                    f"`{snippet(facts, site.node.func)}(...)` gets `shuffle=True` and `{keyword}="
                    f"{snippet(facts, given, 30)}`, a sampler (`{snippet(facts, made, 50)}`){when}: building the loader "
                    f"raises \"ValueError: {message}\". The sampler decides the order (`DistributedSampler` shuffles "
                    "itself, reseeded by `set_epoch`).",
                    fix_hint=f"Drop `shuffle=True` when a sampler is given: `shuffle=({snippet(facts, given, 30)} is None)`"
                    if conditional else "Drop `shuffle=True` (let the sampler shuffle).",
                    related=((made, "the sampler is built here"), (site.node, "the loader is built here")),
                )
                break


def _sampler_constructions(facts: FileFacts, node, order: int, scope, depth: int = 0) -> Iterator[cst.Call]:
    """The sampler constructions ``node`` may hold at ``order``: a call of a ``*Sampler`` class, through
    conditional expressions, names bound on either branch of an ``if`` before the loader, and parameters
    (each later call's argument)."""
    if node is None or depth > _MAX_DEPTH:
        return
    if isinstance(node, cst.IfExp):
        yield from _sampler_constructions(facts, node.body, order, scope, depth + 1)
        yield from _sampler_constructions(facts, node.orelse, order, scope, depth + 1)
        return
    if isinstance(node, cst.Call):
        if _is_sampler_class(facts, node.func):
            yield node
        return
    key = name_key(node)
    if key is None:
        return
    for binding in _reaching_bindings(facts, key, order, scope):
        if binding.kind == "param":
            for argument, at, where in facts.param_arguments(binding):
                yield from _sampler_constructions(facts, argument, at, where, depth + 1)
            if binding.value is not None:
                yield from _sampler_constructions(facts, binding.value, binding.order, binding.scope, depth + 1)
        elif binding.kind == "assign":
            yield from _sampler_constructions(facts, binding.value, binding.order, binding.scope, depth + 1)


def _reaching_bindings(facts: FileFacts, key: str, order: int, scope):
    """The bindings of ``key`` that may hold at ``order``: the latest one, and before it the ones on other
    branches of ``if`` statements, back to the last binding made unconditionally."""
    latest = facts.binding_at(key, order, scope)
    if latest is None:
        return []
    found = [latest]
    if not any(isinstance(f, IfFrame) for f in latest.context):
        return found
    earlier = [b for b in latest.scope.bindings.get(key, ()) if b.order < latest.order]
    for binding in sorted(earlier, key=lambda b: b.order, reverse=True):
        found.append(binding)
        if not any(isinstance(f, IfFrame) for f in binding.context):
            break
    return found


def _conditional(facts: FileFacts, given, site) -> bool:
    """``given`` may also be ``None`` (a conditional expression or a binding on another branch)."""
    if isinstance(given, cst.IfExp):
        return True
    key = name_key(given)
    return key is not None and len(_reaching_bindings(facts, key, site.order, site.scope)) > 1


def _is_sampler_class(facts: FileFacts, func) -> bool:
    qualname = facts.qualname(func) or ""
    name = qualname.rsplit(".", 1)[-1] if qualname else (func.value if isinstance(func, cst.Name) else "")
    return name.endswith("Sampler") and name not in ("Sampler",)
