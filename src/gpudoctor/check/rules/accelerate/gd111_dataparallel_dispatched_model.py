from __future__ import annotations

from gpudoctor.check import apis
from gpudoctor.check.facts import TRAIT_DISPATCHED, TRAIT_OFFLOADED, FileFacts, call_arg
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule


class DataParallelDispatchedModel(Rule):
    """``nn.DataParallel`` around a model that accelerate spread over several devices: DataParallel needs
    every parameter on ``device_ids[0]`` and refuses a split model on a multi-GPU machine."""

    code = "GD111"
    name = "dataparallel-dispatched-model"
    summary = "nn.DataParallel around a model dispatched over several devices (device_map)"
    triggers = ("DataParallel",)

    def check(self, facts: FileFacts):
        for site in facts.calls_to(*apis.DATA_PARALLEL):
            module = call_arg(site.node, 0, "module")
            if module is None:
                continue
            value = facts.value(module, site.order, site.scope)
            device_map = value.trait(TRAIT_DISPATCHED)
            if value.kind != "model" or device_map is None:
                continue
            offload = value.trait(TRAIT_OFFLOADED)
            certain = device_map.certainly_dispatched
            if certain:
                where = "it is spread over " + ", ".join(sorted(str(d) for d in device_map.devices))
            elif offload:
                where = f"it is partly offloaded ({offload})"
            else:
                where = "an automatic map spreads it over all GPUs when there are several"
            dispatch = value.trait("dispatch_call") or value.origin().node or module
            placed = snippet(facts, dispatch)
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node)}` wraps a model dispatched by `{placed}`; {where}. DataParallel "
                "replicates a module that lives entirely on `device_ids[0]`, so with several GPUs the first forward "
                "raises \"RuntimeError: module must have its parameters and buffers on device cuda:0 (device_ids[0]) "
                "but found one of them on device: cuda:1\" (or `cpu`/`meta` for offloaded layers).",
                fix_hint="Drop DataParallel: a dispatched model already uses all GPUs (model parallelism, one "
                "process). For data parallelism load one full copy per process "
                "(`device_map={\"\": PartialState().process_index}`) and launch with `accelerate launch`/`torchrun`.",
                severity=Severity.ERROR if certain or offload else Severity.WARNING,
                related=((dispatch, "the model is dispatched here"),),
            )
