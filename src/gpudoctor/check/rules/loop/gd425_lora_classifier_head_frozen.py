from __future__ import annotations

import re
from typing import Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import FileFacts, call_arg
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import sets_requires_grad, snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.rules.loop._common import is_backward, trainer_trains

# transformers heads created fresh when the checkpoint has none (or num_labels differs): ``score``/``classifier``
_CLASSIFICATION_CLASS = re.compile(r"For(Sequence|Token|Image|Audio)Classification$")
_NEW_HEAD_KEYWORDS = ("num_labels", "id2label", "label2id")


class LoraClassifierHeadFrozen(Rule):
    """A classification model whose head is created fresh (``*ForSequenceClassification.from_pretrained(...,
    num_labels=N)``) is wrapped by ``get_peft_model`` with a peft config that names no ``task_type`` and no
    ``modules_to_save``: peft builds a plain ``PeftModel`` that freezes everything but the adapters, so the randomly
    initialised head (``score``/``classifier``) is never trained and is not saved with the adapter."""

    code = "GD425"
    name = "lora-classifier-head-frozen"
    summary = "LoRA on a classifier with a new head, without task_type/modules_to_save: the random head stays frozen"
    severity = Severity.WARNING
    triggers = ("get_peft_model",)

    def check(self, facts: FileFacts):
        if sets_requires_grad(facts):
            return  # the head (or anything) may be unfrozen by hand
        if not (trainer_trains(facts) or any(is_backward(facts, c) for c in facts.calls)):
            return
        for site in facts.calls_to(*apis.GET_PEFT_MODEL):
            value = facts.value(site.arg(0, "model"), site.order, site.scope)
            if value.kind != "model":
                continue
            origin = value.origin()
            cls = origin.traits.get("class")
            load = origin.node
            if not cls or not _CLASSIFICATION_CLASS.search(cls) or not isinstance(load, cst.Call):
                continue
            new_head = next(
                (kw for kw in _NEW_HEAD_KEYWORDS if facts.keyword_argument(load, kw, site.order, site.scope) is not None),
                None,
            )
            if new_head is None:
                continue  # a checkpoint that already has its head (a fine-tuned classifier) may be adapted as is
            config = self._peft_config(facts, site.arg(1, "peft_config"), site.order, site.scope)
            if config is None or any(a.star for a in config.args):
                continue
            if call_arg(config, keyword="modules_to_save") is not None:
                continue
            task = call_arg(config, keyword="task_type")
            if task is not None and not (isinstance(task, cst.Name) and task.value == "None"):
                continue
            yield self.report(
                config,
                f"`{snippet(facts, load, 60)}` builds a new, randomly initialised classification head ({new_head}=...), "
                f"and this peft config names no `task_type` and no `modules_to_save`: `get_peft_model` then freezes "
                "everything but the adapters, so the head is never trained and is not saved with the adapter "
                "(accuracy near chance, random predictions after reloading).",
                fix_hint="Pass `task_type=\"SEQ_CLS\"` (`\"TOKEN_CLS\"` for token classification), or "
                "`modules_to_save=[\"classifier\"]` / `[\"score\"]` naming the head.",
                related=((site.node, "the adapters are added here"), (load, "the new head is created here")),
            )

    @staticmethod
    def _peft_config(facts: FileFacts, node: Optional[cst.BaseExpression], order: int, scope) -> Optional[cst.Call]:
        """The ``LoraConfig(...)`` (any ``peft.*Config``) call ``node`` is, directly or through plain names."""
        for _ in range(4):
            if isinstance(node, cst.Call):
                q = facts.qualname(node.func)
                return node if q and q.startswith("peft.") and q.endswith("Config") else None
            sources = facts.follow_name(node, order, scope, params=False)
            if not sources or len(sources) != 1:
                return None
            node, order, scope = sources[0]
        return None
