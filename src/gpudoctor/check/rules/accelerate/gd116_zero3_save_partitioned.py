from __future__ import annotations

import re
from typing import Optional

from gpudoctor.check.facts import FileFacts, call_arg
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import snippet, trained_models
from gpudoctor.check.rule import Rule

# What shows a DeepSpeed ZeRO stage-3 run: a config file named for it (``ds_z3_config.json``, ``ds_config_zero3.json``,
# ``zero_stage3_offload.json``, in code or in the launch command a comment gives), a config dict with ``"stage": 3``,
# or a ``zero_stage=3`` / ``--zero_stage 3`` option.
_ZERO3 = re.compile(
    r"(?i)[\w./-]*(?:\bz3|_z3|zero[_-]?3|zero[_-]?stage[_-]?3|ds[_-]?stage[_-]?3|stage[_-]?3[_-]?config)[\w.-]*\.(?:json|ya?ml)"
    r"|[\"']stage[\"']\s*:\s*3\b|zero_stage\s*=\s*3\b|--zero_stage[= ]3\b"
)
# What gathers the partitioned weights before a save (or saves them gathered): then the save is deliberate.
_GATHERS = re.compile(
    r"GatheredParameters|zero_to_fp32|get_fp32_state_dict_from_zero_checkpoint|_zero3_consolidated_16bit_state_dict"
    r"|\.get_state_dict\(|save_16bit_model|zero3_save|save_zero_three"
)


class Zero3SavePartitioned(Rule):
    """``model.save_pretrained(...)`` (or ``torch.save(model.state_dict(), ...)``) on the model a Trainer or a training
    loop trains, in a file that runs DeepSpeed ZeRO stage 3 (a ``ds_z3_config.json``-style config named in code or in
    the launch command, ``"stage": 3``, ``zero_stage=3``), without ``state_dict=``: ZeRO-3 partitions every parameter
    over the ranks and leaves an empty placeholder in the module, so the saved weights (a LoRA adapter too) are
    zero-size tensors and the "fine-tuned" model loads as the base model or fails to load. ``trainer.save_model()``
    gathers them; silent when the file gathers them itself (``GatheredParameters``, ``get_state_dict``, zero_to_fp32)."""

    code = "GD116"
    name = "zero3-save-partitioned"
    summary = "save_pretrained/state_dict of a ZeRO-3 trained model without gathering: the saved weights are empty"
    severity = Severity.WARNING
    triggers = ("save_pretrained", "state_dict")

    def check(self, facts: FileFacts):
        evidence = _ZERO3.search(facts.source)
        if evidence is None or _GATHERS.search(facts.source):
            return
        trained = {}
        for node, site, _how in trained_models(facts):
            value = facts.value(node, site.order, site.scope)
            if value.kind == "model":
                trained.setdefault(id(value.origin().node), site)
        if not trained:
            return
        for save in self._saves(facts):
            receiver, site = save
            value = facts.value(receiver, site.order, site.scope)
            if value.kind != "model":
                continue
            trainer_site = trained.get(id(value.origin().node))
            if trainer_site is None or trainer_site.order > site.order:
                continue
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node, 50)}` saves `{snippet(facts, receiver, 30)}`, which is trained under DeepSpeed "
                f"ZeRO-3 (`{evidence.group(0).strip()}`): ZeRO-3 partitions every parameter over the ranks and leaves an "
                "empty placeholder in the module, so its state dict holds zero-size tensors and the saved weights (the "
                "LoRA adapter too) are empty: the result loads as the base model, or fails with a size mismatch.",
                fix_hint="Save through the Trainer, which gathers the shards: `trainer.save_model(output_dir)` (with "
                "`stage3_gather_16bit_weights_on_model_save: true` in the DeepSpeed config), or gather them yourself "
                "(`deepspeed.zero.GatheredParameters`, `accelerator.get_state_dict(model)` passed as `state_dict=`).",
                related=((trainer_site.node, "the model is trained here"),),
            )

    @staticmethod
    def _saves(facts: FileFacts):
        """(the saved model expression, the save call): ``m.save_pretrained(dir)`` without ``state_dict=``, and
        ``torch.save(m.state_dict(), path)``."""
        for site in facts.method_calls("save_pretrained"):
            if site.receiver is not None and call_arg(site.node, keyword="state_dict") is None:
                yield site.receiver, site
        for site in facts.calls_to("torch.save"):
            obj = site.arg(0, "obj")
            receiver: Optional[object] = None
            if obj is not None and hasattr(obj, "func") and getattr(obj.func, "attr", None) is not None:
                if obj.func.attr.value == "state_dict":
                    receiver = obj.func.value
            if receiver is not None:
                yield receiver, site
