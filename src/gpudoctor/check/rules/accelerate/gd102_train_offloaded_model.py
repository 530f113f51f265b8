from __future__ import annotations

from gpudoctor.check.facts import TRAIT_OFFLOADED, FileFacts
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet, trained_models
from gpudoctor.check.rule import Rule


class TrainOffloadedModel(Rule):
    """A model whose weights are partly offloaded to CPU or disk (``device_map`` with ``"cpu"``/``"disk"``
    entries, or an automatic map that the file says spills over) is trained: by an optimizer over its
    parameters, a Trainer, or LoRA via ``get_peft_model``. Offloaded weights are ``meta`` placeholders
    that never receive gradients."""

    code = "GD102"
    name = "train-offloaded-model"
    summary = "Training a model whose weights are offloaded to CPU/disk (they never update; LoRA on them fails)"
    triggers = ("device_map",)

    def check(self, facts: FileFacts):
        seen: set[int] = set()
        trained = sorted(trained_models(facts), key=lambda t: t[1].order)
        for node, site, how in trained:
            value = facts.value(node, site.order, site.scope)
            if value.kind != "model":
                continue
            source = value.carrier(TRAIT_OFFLOADED)
            if source is None:
                continue
            origin = id(source.origin().node)
            if origin in seen:
                continue  # once per trained model, at its first training call
            seen.add(origin)
            evidence = source.traits[TRAIT_OFFLOADED]
            device_map = source.trait("device_map")
            certain = device_map is not None and device_map.strategy == "explicit"
            loaded = snippet(facts, source.node) if source.node is not None else snippet(facts, node)
            lora = site.qualname is not None and site.qualname.endswith("get_peft_model")
            if lora:
                effect = (
                    "LoRA layers wrapped around offloaded modules are created on `meta`, and the first backward "
                    "raises \"RuntimeError: Function MmBackward0 returned an invalid gradient at index 1 - expected "
                    "device meta but got cpu\" (cuda:0 on a GPU box); adapters on resident modules train, the rest "
                    "cannot"
                )
            else:
                effect = (
                    "offloaded parameters are `meta` placeholders restored by hooks for each forward: they get no "
                    "`.grad`, the optimizer skips them, and they silently never change while the resident layers do "
                    "(the loss still goes down)"
                )
            where = "" if certain else " if the map really offloads on this machine"
            yield self.report(
                site.node,
                f"{how} trains `{snippet(facts, node)}`, loaded with offload by `{loaded}` ({evidence}); {effect}{where}.",
                fix_hint=(
                    "Don't train offloaded weights: load the model so that everything trained is resident on GPUs "
                    "(more GPUs, 8/4-bit quantization, a smaller model), or put LoRA only on modules that stay on a GPU."
                ),
                severity=Severity.ERROR if certain else Severity.WARNING,
                related=(
                    *(((source.node, "the model is loaded with offload here"),) if source.node is not None else ()),
                    *(((device_map.node, "the device map that offloads is written here"),)
                      if certain and device_map.node is not None else ()),
                ),
            )
