from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check import apis, versions
from gpudoctor.check.facts import FileFacts
from gpudoctor.check.finding import Severity
from gpudoctor.check.rule import Rule

_TRAINER_NAMES = {q.split(".")[-1] for q in apis.TRAINERS}


class ComputeLossWithoutNumItems(Rule):
    """A ``Trainer`` subclass (transformers or trl, directly or through the file's own subclasses) that overrides
    ``compute_loss`` without a ``num_items_in_batch`` parameter or ``**kwargs``: ``Trainer.training_step`` calls
    ``self.compute_loss(model, inputs, num_items_in_batch=...)`` (transformers >= 4.46; 5.24 ``trainer.py:2090``,
    also ``prediction_step``), so the first training step raises ``TypeError``."""

    code = "GD418"
    name = "compute-loss-without-num-items"
    summary = "Trainer subclass overrides compute_loss without num_items_in_batch (TypeError at the first step)"
    severity = Severity.ERROR
    triggers = ("compute_loss",)

    def check(self, facts: FileFacts):
        version, _found = versions.assumed("transformers")
        if (versions.major_minor(version) or (5, 0)) < (4, 46):
            return  # before 4.46 training_step called compute_loss(model, inputs)
        for scope in facts.classes.values():
            node = scope.node
            if not isinstance(node, cst.ClassDef):
                continue
            trainer = self._trainer_base(facts, node, depth=0)
            if trainer is None:
                continue
            methods = {s.name.value: s for s in node.body.body if isinstance(s, cst.FunctionDef)}
            override = methods.get("compute_loss")
            if override is None or "training_step" in methods:
                continue  # an own training_step decides how compute_loss is called
            params = override.params
            if isinstance(params.star_kwarg, cst.Param):
                continue
            names = {p.name.value for p in (*params.posonly_params, *params.params, *params.kwonly_params)}
            if "num_items_in_batch" in names:
                continue
            yield self.report(
                override.name,
                f"`{node.name.value}.compute_loss` overrides `{trainer}.compute_loss` without a `num_items_in_batch` "
                f"parameter, but `Trainer.training_step` ({versions.describe('transformers')}) calls `self.compute_loss(model, inputs, "
                "num_items_in_batch=...)`: the first step raises `TypeError: compute_loss() got an unexpected keyword "
                "argument 'num_items_in_batch'`.",
                fix_hint="Accept it: `def compute_loss(self, model, inputs, return_outputs=False, "
                "num_items_in_batch=None)` (or add `**kwargs`).",
            )

    def _trainer_base(self, facts: FileFacts, node: cst.ClassDef, depth: int) -> Optional[str]:
        """The transformers/trl trainer ``node`` derives from (through the file's own classes), else None."""
        if depth > 5:
            return None
        for base in node.bases:
            q = facts.qualname(base.value) or ""
            head, _, last = q.rpartition(".")
            if q in apis.TRAINERS or (head.split(".")[0] in ("transformers", "trl") and last in _TRAINER_NAMES):
                return last
            if isinstance(base.value, cst.Name) and base.value.value in facts.classes:
                parent = facts.classes[base.value.value].node
                if parent is not node and isinstance(parent, cst.ClassDef):
                    found = self._trainer_base(facts, parent, depth + 1)
                    if found is not None:
                        return found
        return None
