from __future__ import annotations

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import FileFacts, call_arg, name_key
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import device_map_chosen_per_launch, snippet, trained_models
from gpudoctor.check.rule import Rule

# An ``if`` that picks the map per launch mode: the author already handles several processes.
# Whole identifier parts only: `local_rank`, `is_main_process`, `num_processes`, but not `preprocess`.
class DeviceMapAutoMultiprocess(Rule):
    """``device_map="auto"`` (or balanced/sequential/an inferred map) in a file launched as several
    processes: every rank spreads its own copy over all visible GPUs, and training it raises in
    ``prepare``/``trainer.train()``."""

    code = "GD107"
    name = "device-map-auto-multiprocess"
    summary = 'device_map="auto" in a script launched with several processes (each rank spreads a copy over all GPUs)'
    triggers = ("device_map",)

    def check(self, facts: FileFacts):
        hints = facts.launch_hints
        if not hints:
            return
        why = ", ".join(f"`{h}`" for h in hints[:3])
        trained = {id(node) for node, _site, _how in trained_models(facts)}
        trained_keys = {name_key(node) for node, _site, _how in trained_models(facts)} - {None}
        for site in facts.calls:
            q = site.qualname
            if q is None:
                continue
            owner_method = apis.hf_class_method(q)
            is_load = bool(owner_method and owner_method[1] == "from_pretrained" and apis.is_model_class(owner_method[0]))
            if not (is_load or q == "accelerate.load_checkpoint_and_dispatch"):
                continue
            expr = facts.keyword_argument(site.node, "device_map", site.order, site.scope)
            if expr is None:
                continue
            direct = call_arg(site.node, keyword="device_map") is expr  # else it comes in a ``**kwargs`` dict
            device_map = facts.device_map(expr, site.order, site.scope)
            if device_map is None or device_map.strategy != "auto":
                continue
            if device_map_chosen_per_launch(facts, site, expr):
                continue
            label = device_map.label or snippet(facts, expr)
            bound = [b for b in facts._bindings_of_value(site.node) if b.kind == "assign"]
            is_trained = any(b.key in trained_keys for b in bound) or id(site.node) in trained
            if prepared_or_trained := is_trained or self._prepared(facts, bound):
                effect = (
                    "and training it raises \"ValueError: You can't train a model that has been loaded with "
                    "`device_map='auto'` in any distributed mode.\" in `accelerator.prepare`/`trainer.train()`"
                )
            else:
                effect = "so N processes each hold a full copy spread over the same GPUs (OOM or contention)"
            yield self.report(
                expr if direct else site.node,
                f"`device_map={label}`{'' if direct else ' (in the `**` keyword arguments)'} in a file that runs as several processes ({why}): every rank computes its own "
                "map over all visible GPUs and places a whole copy there, " + effect + ".",
                fix_hint='Give each process one full copy on its own GPU: `device_map={"": PartialState().process_index}` '
                "(from accelerate), or keep `device_map=\"auto\"` and launch one process.",
                severity=Severity.ERROR if prepared_or_trained else Severity.WARNING,
                related=(
                    *(() if direct else ((expr, "the automatic map is set here"),)),
                    *(((device_map.node, "the automatic map is chosen here"),) if device_map.node is not None else ()),
                    (site.node, "the model is loaded with it here"),
                ),
            )

    @staticmethod
    def _prepared(facts: FileFacts, bound) -> bool:
        keys = {b.key for b in bound}
        for site in facts.prepare_calls():
            for arg in site.node.args:
                if name_key(arg.value) in keys:
                    return True
        return False
