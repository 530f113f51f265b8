"""Higher-level questions several rules ask (built on :mod:`gpudoctor.check.facts`)."""

from __future__ import annotations

from typing import Iterator, Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import CallSite, FileFacts, Scope, Value, call_arg, name_key, string_value
from gpudoctor.check.finding import Severity


_SALIENT = ("device_map", "dtype", "torch_dtype", "offload_folder", "load_in_8bit", "load_in_4bit", "mixed_precision")


def snippet(facts: FileFacts, node: cst.CSTNode, limit: int = 70) -> str:
    """Short source text for messages; a call shows its callee and its placement keywords only."""
    if isinstance(node, cst.Call) and len(facts.module.code_for_node(node)) > limit:
        callee = facts.module.code_for_node(node.func)
        shown = [
            f"{a.keyword.value}={_plain(facts, a.value)}" for a in node.args if a.keyword and a.keyword.value in _SALIENT
        ]
        text = f"{callee}(" + ", ".join(["...", *shown]) + ")"
    else:
        text = _plain(facts, node)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _plain(facts: FileFacts, node: cst.CSTNode) -> str:
    code = facts.module.code_for_node(node)
    # Drop comments and join lines: messages are one line.
    code = "\n".join(line.split("  #")[0] if "  #" in line else line for line in code.splitlines())
    return " ".join(code.split())


def multi_process_severity(facts: FileFacts) -> tuple[Severity, str]:
    """ERROR with the evidence when the file shows it runs as several processes, else INFO."""
    hints = facts.launch_hints
    if hints:
        return Severity.ERROR, "the file shows a multi-process launch (" + ", ".join(f"`{h}`" for h in hints[:3]) + ")"
    return Severity.INFO, "nothing in the file shows a multi-process launch"


def accelerator_calls(facts: FileFacts, scope: Optional[Scope] = None) -> Iterator[CallSite]:
    """Method calls on an Accelerator (``accelerator.backward(...)``), optionally in one scope."""
    for site in facts.calls:
        if site.receiver is None or (scope is not None and site.scope is not scope):
            continue
        if facts.value(site.receiver, site.order, site.scope).kind == "accelerator":
            yield site


def accelerator_for(facts: FileFacts, site: CallSite) -> Optional[CallSite]:
    """An accelerator method call in the same scope as ``site`` (the one nearest before it, else after)."""
    candidates = list(accelerator_calls(facts, site.scope))
    before = [c for c in candidates if c.order < site.order]
    if before:
        return before[-1]
    return candidates[0] if candidates else None


def accelerator_kwargs(facts: FileFacts, receiver: cst.BaseExpression, order: int, scope: Scope) -> dict[str, cst.BaseExpression]:
    value = facts.value(receiver, order, scope)
    call = value.origin().node
    if isinstance(call, cst.Call):
        return {a.keyword.value: a.value for a in call.args if a.keyword is not None}
    return {}


def mixed_precision_fp16(facts: FileFacts, kwargs: dict[str, cst.BaseExpression]) -> bool:
    return string_value(kwargs.get("mixed_precision")) == "fp16"


def trained_models(facts: FileFacts) -> Iterator[tuple[cst.BaseExpression, CallSite, str]]:
    """Expressions that are trained, with the call that trains them and how:

    ``Trainer(model=m)``, ``accelerator.prepare(..., m, ...)`` with an optimizer, an optimizer over
    ``m.parameters()``, ``get_peft_model(m, ...)`` (LoRA training).
    """
    for site in facts.calls_to(*apis.TRAINERS):
        model = site.arg(0, "model")
        if model is not None:
            yield model, site, f"`{site.qualname.split('.')[-1]}(model=...)`"
    for site in facts.calls:
        if site.qualname and apis.is_optimizer(site.qualname):
            params = site.arg(0, "params")
            owner = _parameters_owner(params)
            if owner is not None:
                yield owner, site, f"an optimizer over `{snippet(facts, params, 40)}`"
    for site in facts.calls_to(*apis.GET_PEFT_MODEL):
        model = site.arg(0, "model")
        if model is not None:
            yield model, site, "`get_peft_model(...)` (LoRA training)"


def _parameters_owner(params: Optional[cst.BaseExpression]) -> Optional[cst.BaseExpression]:
    """``model.parameters()`` / ``filter(..., model.parameters())`` / ``[p for p in model.parameters() ...]`` -> model."""
    if params is None:
        return None
    if isinstance(params, cst.Call) and isinstance(params.func, cst.Attribute):
        if params.func.attr.value in ("parameters", "named_parameters"):
            return params.func.value
    if isinstance(params, cst.Call) and isinstance(params.func, cst.Name) and params.func.value in ("filter", "list"):
        return _parameters_owner(params.args[-1].value if params.args else None)
    if isinstance(params, (cst.ListComp, cst.GeneratorExp)):
        for_in = params.for_in
        return _parameters_owner(for_in.iter)
    return None


def is_model_value(value: Value) -> bool:
    return value.kind == "model"


def key_text(node: cst.CSTNode) -> str:
    return name_key(node) or ""


def kwarg(site: CallSite, name: str) -> Optional[cst.BaseExpression]:
    return call_arg(site.node, keyword=name)
