from __future__ import annotations

import re

import libcst as cst

from gpudoctor.check.facts import FileFacts
from gpudoctor.check.finding import Applicability, Edit, Fix, Severity
from gpudoctor.check.queries import (
    accelerator_for, accelerator_kwargs, accelerator_trains, mixed_precision_fp16, snippet, string_value,
)
from gpudoctor.check.rule import Rule

# fp16 named outside the Accelerator call (a launch comment, a config flag): the file hints at fp16 AMP.
_FP16_TEXT = re.compile(r"\bfp16\b|mixed_precision", re.IGNORECASE)
# The file shows FSDP (a plugin, a launch flag, a config key): FSDP1 shards gradients, which torch's clip cannot see.
_FSDP_TEXT = re.compile(r"\bfsdp|FullyShardedDataParallel", re.IGNORECASE)


class TorchClipWithAccelerator(Rule):
    """``torch.nn.utils.clip_grad_norm_`` in an Accelerator loop clips the *scaled* gradients when
    fp16 is on (set in code or by ``accelerate config``), and measures a per-shard norm under FSDP1.
    Clipping parameters spread over several devices is *not* the problem: torch handles that."""

    code = "GD105"
    name = "torch-clip-with-accelerator"
    summary = "torch.nn.utils.clip_grad_norm_ under an Accelerator instead of accelerator.clip_grad_norm_"
    severity = Severity.WARNING
    fixable = "safe"
    triggers = ("clip_grad",)

    def check(self, facts: FileFacts):
        if not accelerator_trains(facts):
            return
        for site in facts.calls_to("torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad_value_"):
            accelerator = accelerator_for(facts, site)
            if accelerator is None:
                # The file's own helper that clips (``def clip(model): torch.nn.utils.clip_grad_norm_(...)``),
                # called where the accelerator is used.
                callers = (accelerator_for(facts, caller) for caller in facts.call_sites_of(site.scope))
                accelerator = next((c for c in callers if c is not None), None) if site.scope.kind == "function" else None
            if accelerator is None:
                continue
            kwargs = accelerator_kwargs(facts, accelerator.receiver, accelerator.order, accelerator.scope)
            fp16 = mixed_precision_fp16(facts, kwargs)
            function = site.qualname.split(".")[-1]
            acc_name = snippet(facts, accelerator.receiver)
            replacement = cst.Attribute(
                value=accelerator.receiver.deep_clone(), attr=cst.Name(function)
            )
            precision = string_value(kwargs.get("mixed_precision"))
            hint = _FP16_TEXT.search(facts.source) if not fp16 else None
            if precision in ("bf16", "no"):
                # The argument wins over `accelerate launch --mixed_precision` (state.py reads the environment only
                # when it is None), so text hints do not matter. No loss scaling: torch's clip sees the true gradients
                # in one process and under DDP; DeepSpeed clips inside its step from its own config either way
                # (accelerate's clip only returns the norm there). Only FSDP1's sharded gradients differ.
                if not _FSDP_TEXT.search(facts.source):
                    continue
                message = (
                    f"`{site.qualname}` under an Accelerator: `mixed_precision=\"{precision}\"` needs no unscaling, but "
                    "this file uses FSDP, and with FSDP1 each rank holds only its shard of the flattened gradients: torch "
                    "measures a per-shard norm, so the threshold is compared with the wrong norm and the ranks clip "
                    "differently (`accelerator.clip_grad_norm_` calls FSDP's own `clip_grad_norm_`)."
                )
                severity = Severity.WARNING
            elif fp16:
                why = "`mixed_precision=\"fp16\"` is set, so the gradients are still multiplied by the loss scale"
                severity = Severity.ERROR
            else:
                # Not set in code: `accelerate launch` applies the config file's mixed precision.
                severity = Severity.WARNING if hint or "mixed_precision" not in kwargs else Severity.INFO  # not a literal
                why = (
                    "if fp16 is enabled (here or by `accelerate config`), the gradients are still multiplied by the "
                    "loss scale"
                )
            if precision not in ("bf16", "no"):
                message = (
                    f"`{site.qualname}` runs before the optimizer step unscales gradients: {why} (65536 at the start), so "
                    "the norm is compared with the threshold at the wrong scale; under FSDP1 it would also be a per-shard "
                    "norm. "
                    "(Parameters on several devices are fine: torch groups them by device.)"
                )
            yield self.report(
                site.node,
                message,
                fix_hint=f"Use `{acc_name}.{function}(...)`, once per optimizer step under `if {acc_name}.sync_gradients:`.",
                severity=severity,
                fix=Fix(f"Call `{acc_name}.{function}` instead", Applicability.SAFE, (Edit(site.node.func, replacement),)),
                related=(
                    ((kwargs["mixed_precision"], "fp16 mixed precision (a GradScaler) is turned on here"),)
                    if fp16 and "mixed_precision" in kwargs else ()
                ),
            )
