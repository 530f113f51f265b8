from __future__ import annotations

import libcst as cst

from gpudoctor.check.facts import TRAIT_CAST, TRAIT_EMPTY, FileFacts, call_arg, is_true
from gpudoctor.check.finding import Applicability, Edit, Fix, Severity
from gpudoctor.check.queries import snippet, with_kwarg
from gpudoctor.check.rule import Rule

_TORCH_DTYPE = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32", "float64": "float64"}


class CastBeforeDispatchWithoutDtype(Rule):
    """An ``init_empty_weights`` model cast with ``.half()``/``.to(dtype)`` and then loaded by
    ``load_checkpoint_and_dispatch`` without ``dtype=``: weights offloaded to disk (and to cpu when
    ``offload_state_dict`` is on, the default with disk) keep the *checkpoint's* dtype, so the cast is
    silently undone for them, and mixed with resident half weights the forward raises."""

    code = "GD202"
    name = "cast-before-dispatch-without-dtype"
    summary = "Casting an empty model before load_checkpoint_and_dispatch instead of passing dtype="
    severity = Severity.WARNING
    fixable = "safe"
    triggers = ("load_checkpoint_and_dispatch",)

    def check(self, facts: FileFacts):
        for site in facts.calls_to("accelerate.load_checkpoint_and_dispatch"):
            call = site.node
            if any(a.star for a in call.args) or call_arg(call, 7, "dtype") is not None:
                continue
            model = call_arg(call, 0, "model")
            value = facts.value(model, site.order, site.scope)
            if value.kind != "model" or not value.has(TRAIT_EMPTY):
                continue
            cast = value.trait(TRAIT_CAST)
            if cast is None or cast[0] == "float32":
                continue
            dtype, cast_node = cast
            device_map = facts.device_map(call_arg(call, 2, "device_map"), site.order, site.scope)
            offload_state_dict = call_arg(call, keyword="offload_state_dict")
            disk = device_map is not None and "disk" in device_map.devices
            maybe_disk = device_map is not None and device_map.strategy == "auto" and call_arg(call, 5, "offload_folder") is not None
            if disk or maybe_disk or is_true(offload_state_dict):
                severity = Severity.WARNING
                effect = (
                    (
                        "the map offloads weights to disk (and, with the default `offload_state_dict`, its cpu "
                        "entries too)"
                        if disk
                        else "`offload_state_dict=True` offloads the cpu entries of the map"
                        if is_true(offload_state_dict)
                        else "with `offload_folder=` the automatic map offloads to disk when memory is short"
                    )
                    + ", and those weights are loaded in the "
                    f"checkpoint's dtype, not {dtype}: unless the checkpoint is already {dtype}, the cast is silently "
                    "undone for them, and where half weights stay resident the forward raises e.g. \"RuntimeError: "
                    "expected m1 and m2 to have the same dtype, but got: float != c10::Half\""
                )
            else:
                severity = Severity.INFO
                effect = (
                    "resident weights are cast to the empty model's dtype, so as written the cast holds; but weights "
                    "offloaded to disk (or to cpu with `offload_state_dict=True`) keep the checkpoint's dtype, which "
                    "silently undoes it or mixes dtypes (\"expected m1 and m2 to have the same dtype\")"
                )
            fix = None
            torch_names = [local for local, q in facts.imports.items() if q == "torch"]
            if torch_names and dtype in _TORCH_DTYPE:
                fix = Fix(
                    f"Add `dtype={torch_names[0]}.{_TORCH_DTYPE[dtype]}`",
                    Applicability.SAFE,
                    (Edit(call, with_kwarg(call, "dtype", cst.Attribute(value=cst.Name(torch_names[0]), attr=cst.Name(_TORCH_DTYPE[dtype])))),),
                )
            yield self.report(
                call,
                f"`{snippet(facts, cast_node)}` casts the empty model, then `{snippet(facts, call)}` loads it without "
                f"`dtype=`; {effect}.",
                fix_hint=f"Pass `dtype=torch.{_TORCH_DTYPE.get(dtype, dtype)}` to `load_checkpoint_and_dispatch` "
                "(the cast before it is then unnecessary).",
                severity=severity,
                fix=fix,
                related=((cast_node, "the empty model is cast here"),),
            )
