from __future__ import annotations

import libcst as cst

from gpudoctor.check.facts import TRAIT_DISPATCHED, TRAIT_OFFLOADED, FileFacts
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import device_map_chosen_per_launch, multi_process_severity, snippet
from gpudoctor.check.rule import Rule


class PrepareDispatchedModel(Rule):
    """A model dispatched over several devices (``device_map``, ``load_checkpoint_and_dispatch``,
    ``dispatch_model``) handed to ``accelerator.prepare`` or a Trainer. Fatal with several processes,
    allowed in one: the severity follows what the file shows about its launch."""

    code = "GD101"
    name = "prepare-dispatched-model"
    summary = "Dispatched (device_map) model passed to accelerator.prepare or a Trainer in a multi-process run"
    triggers = ("prepare", "Trainer")

    def check(self, facts: FileFacts):
        severity, why = multi_process_severity(facts)
        targets = []
        for site in facts.prepare_calls():
            targets += [(arg.value, site, "accelerator.prepare") for arg in site.node.args]
        for site in facts.trainer_calls():
            model = site.arg(0, "model")
            if model is not None:
                targets.append((model, site, (site.qualname or snippet(facts, site.node.func)).split(".")[-1]))
        for node, site, where in targets:
            value = facts.value(node, site.order, site.scope)
            device_map = value.trait(TRAIT_DISPATCHED)
            if value.kind != "model" or device_map is None:
                continue
            if severity is Severity.INFO and not (device_map.certainly_dispatched or value.has(TRAIT_OFFLOADED)):
                continue  # "auto" in one process may well be a single device: nothing to say
            placer = value.trait("dispatch_call") or value.origin().node or node
            load = facts.call_site(placer) if isinstance(placer, cst.Call) else None
            if load is not None and device_map_chosen_per_launch(facts, load):
                continue  # ``device_map = None if ddp else "auto"``: each process gets a full copy when launched as several
            placed = snippet(facts, placer)
            if severity is Severity.ERROR:
                message = (
                    f"`{snippet(facts, node)}` is dispatched over several devices by `{placed}` and is passed to "
                    f"{where}; {why}, so accelerate raises \"ValueError: You can't train a model that has been "
                    "loaded with `device_map='auto'` in any distributed mode.\""
                )
            else:
                message = (
                    f"`{snippet(facts, node)}` is dispatched over several devices by `{placed}` and is passed to "
                    f"{where}. In a single process this is allowed (the model is left where it is); with several "
                    "processes (accelerate launch / torchrun) it raises \"You can't train a model that has been "
                    "loaded with `device_map='auto'` in any distributed mode.\""
                )
            yield self.report(
                node,
                message,
                fix_hint=(
                    "Keep model parallelism in one process (`python train.py` or `--num_processes=1`), or give each "
                    "process a full copy: `device_map={\"\": PartialState().process_index}`."
                ),
                severity=severity,
                related=(
                    (placer, "the model is dispatched over several devices here"),
                    (site.node, f"and handed to {where} here"),
                ),
            )
