from __future__ import annotations

from gpudoctor.check import apis
from gpudoctor.check.facts import (
    TRAIT_DISPATCHED,
    TRAIT_OFFLOADED,
    TRAIT_PEFT,
    TRAIT_PREPARED,
    FileFacts,
    Value,
)
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule


def _dispatch_source(value: Value):
    """(the value that carries the dispatch, whether a wrapper (peft/DataParallel/prepare) sits above it)."""
    wrapped = False
    current = value
    while current is not None:
        if TRAIT_DISPATCHED in current.traits:
            return current, wrapped
        if TRAIT_PEFT in current.traits or "wrapper" in current.traits or TRAIT_PREPARED in current.traits:
            wrapped = True
        current = current.base
    return None, wrapped


class MoveDispatchedModel(Rule):
    """``model.to(...)`` / ``model.cuda()`` on a model that accelerate dispatched with hooks. With CPU/disk
    offload it raises; over several GPUs the move succeeds but the hooks still send activations to the old
    devices. ``model.half()`` after dispatch is fine (the hooks cast offloaded weights); a dtype-only
    ``.to(torch.float16)`` is fine without offload."""

    code = "GD110"
    name = "move-dispatched-model"
    summary = "Moving a dispatched (device_map) model with .to()/.cuda()"
    triggers = ("device_map", "dispatch")

    def check(self, facts: FileFacts):
        for site in facts.method_calls(*apis.MODULE_MOVES):
            if site.receiver is None or site.qualname is not None:
                continue
            value = facts.value(site.receiver, site.order, site.scope)
            if value.kind != "model":
                continue
            source, wrapped = _dispatch_source(value)
            if source is None:
                continue
            if facts.on_another_path(value, site.context):
                continue  # under a test of what decided the loading kwargs (``if device_map is None:``)
            moved = facts.value(site.node, site.order + 1, site.scope)
            moves_device = "moved" in moved.traits
            casts = "cast" in moved.traits
            if not (moves_device or casts):
                continue
            device_map = source.trait(TRAIT_DISPATCHED)
            offload = source.trait(TRAIT_OFFLOADED)
            certain_offload = offload is not None and device_map.strategy == "explicit"
            dispatch = source.trait("dispatch_call") or source.node
            placed = snippet(facts, dispatch)
            call_text = snippet(facts, site.node)
            if offload is not None:
                if wrapped:
                    effect = (
                        "the wrapper's `.to` does not go through accelerate, and copying the offloaded `meta` "
                        "placeholders fails (\"NotImplementedError: Cannot copy out of meta tensor; no data!\")"
                    )
                else:
                    effect = (
                        "accelerate raises \"RuntimeError: You can't move a model that has some modules offloaded to "
                        "cpu or disk.\"" + (" (a dtype-only `.to` too)" if casts and not moves_device else "")
                    )
                severity = Severity.ERROR if certain_offload else Severity.WARNING
                where = f"it is offloaded ({offload})"
            elif moves_device:
                effect = (
                    "the move succeeds (with the log \"You shouldn't move a model that is dispatched using accelerate "
                    "hooks.\"), but the hooks still send each block's inputs to its old execution device, so forward "
                    "fails with \"Expected all tensors to be on the same device, but found at least two devices\""
                )
                if device_map.certainly_dispatched:
                    severity = Severity.ERROR
                    where = "it is spread over several devices"
                else:
                    severity = Severity.WARNING
                    where = "an automatic map spreads it over several GPUs when there are several"
            else:
                continue  # dtype-only .to() on a model without offload behaves like .half(): fine
            yield self.report(
                site.node,
                f"`{call_text}` moves a model dispatched by `{placed}`; {where}, so {effect}.",
                fix_hint="Don't move a dispatched model: choose the placement at load time (`device_map=...`, "
                "`dtype=...`), or `accelerate.hooks.remove_hook_from_module(model, recurse=True)` before moving a "
                "model that has no offload.",
                severity=severity,
                related=((dispatch, "the model is dispatched here"),),
            )
