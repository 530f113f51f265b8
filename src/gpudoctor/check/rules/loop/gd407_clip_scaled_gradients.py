from __future__ import annotations

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import FileFacts, call_arg
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import exclusive_branches, snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.loop._common import innermost_loop

_XLA_DEVICE = ("torch_xla.core.xla_model.xla_device", "torch_xla.device")


class ClipScaledGradients(Rule):
    """``torch.nn.utils.clip_grad_norm_`` in a GradScaler loop without ``scaler.unscale_(optimizer)``
    first: the gradients are still multiplied by the loss scale (65536 at the start), so the norm is
    measured at the wrong scale and clipping shrinks every update to almost nothing."""

    code = "GD407"
    name = "clip-scaled-gradients"
    summary = "Gradient clipping of GradScaler-scaled gradients without scaler.unscale_(optimizer)"
    triggers = ("GradScaler", ".scale(")  # a snippet's ``scaler.scale(loss)`` on a scaler made elsewhere

    def check(self, facts: FileFacts):
        if not facts.calls_to(*apis.GRAD_SCALER) and not any(
            self._scaler(facts, site) is not None for site in facts.method_calls("scale")
        ):
            return
        if facts.calls_to(*_XLA_DEVICE):
            return  # runs on a TPU: without CUDA, GradScaler disables itself and scale() is the identity
        for clip in facts.calls_to(*apis.TORCH_CLIP):
            loop = innermost_loop(clip)
            scaled = self._scaled_backward(facts, clip, loop)
            if scaled is None:
                continue
            scaler, backward = scaled
            if self._unscaled_before(facts, clip, loop, scaler):
                continue
            key = snippet(facts, backward.receiver)
            # An assumed scaler (a snippet: made where we cannot see) has no constructor call to read.
            enabled = call_arg(scaler, keyword="enabled") if isinstance(scaler, cst.Call) else None
            if enabled is not None and getattr(enabled, "value", None) == "False":
                continue
            severity = Severity.ERROR
            condition = ""
            if enabled is not None and getattr(enabled, "value", None) != "True":
                severity = Severity.WARNING
                condition = f" when `enabled={snippet(facts, enabled)}` is true"
            yield self.report(
                clip.node,
                f"`{snippet(facts, clip.node)}` clips gradients that `{snippet(facts, backward.node)}` produced "
                f"from a scaled loss, and `{key}.unscale_(...)` is not called first{condition}: the norm is measured "
                "in scaled units (65536x at the start; 52370 vs a true 0.80 in our repro), so clipping shrinks every "
                "update by the loss scale and the model barely trains.",
                fix_hint=f"Call `{key}.unscale_(optimizer)` right before clipping (once per optimizer step).",
                severity=severity,
                related=((backward.node, "the scaled gradients are produced here"),),
            )

    @staticmethod
    def _scaler(facts: FileFacts, site):
        """The ``GradScaler(...)`` call the receiver of ``site`` evaluates to."""
        if site.receiver is None:
            return None
        value = facts.value(site.receiver, site.order, site.scope)
        return value.origin().node if value.kind == "grad_scaler" else None

    @classmethod
    def _scaled_backward(cls, facts: FileFacts, clip, loop):
        for site in facts.method_calls("scale"):
            scaler = cls._scaler(facts, site)
            if scaler is None or site.scope is not clip.scope:
                continue
            if loop is not None and innermost_loop(site) is not loop and not any(f is loop for f in site.context):
                continue
            if exclusive_branches(site.context, clip.context):
                continue  # ``if use_amp: scaler.scale(loss).backward() ... else: loss.backward(); clip(...)``
            return scaler, site
        return None

    @classmethod
    def _unscaled_before(cls, facts: FileFacts, clip, loop, scaler) -> bool:
        for site in facts.method_calls("unscale_"):
            if cls._scaler(facts, site) is not scaler or site.scope is not clip.scope:
                continue
            if loop is None or any(f is loop for f in site.context):
                if site.order < clip.order:
                    return True
        return False
