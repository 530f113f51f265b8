from __future__ import annotations

import libcst as cst

from gpudoctor.check.facts import FileFacts, name_key
from gpudoctor.check.queries import snippet
from gpudoctor.check.rule import Rule
from gpudoctor.check.finding import Severity

_STOCHASTIC = ("Dropout", "BatchNorm", "AlphaDropout", "FeatureAlphaDropout", "InstanceNorm", "SyncBatchNorm")


class PredictWithoutEval(Rule):
    """A module class defined in the file with dropout or batch norm, whose instance is trained and then
    used for prediction under ``torch.no_grad()``, while nothing in the file ever calls ``.eval()``:
    predictions are made with dropout active and batch statistics of the test batch."""

    code = "GD404"
    name = "predict-without-eval"
    summary = "Prediction with a dropout/batch-norm module that is never switched to eval()"
    severity = Severity.WARNING
    preview = True
    triggers = ("no_grad", "inference_mode")

    def check(self, facts: FileFacts):
        if any(c.method == "eval" or (c.method == "train" and c.node.args) for c in facts.calls):
            return
        classes = self._stochastic_classes(facts)
        if not classes:
            return
        trained = self._trained_keys(facts)
        instances = {}
        for site in facts.calls:
            if isinstance(site.node.func, cst.Name) and site.node.func.value in classes:
                for binding in facts._bindings_of_value(site.node):
                    instances[binding.key] = site.node.func.value
        for site in facts.calls:
            key = name_key(site.node.func)
            if key is None or key not in instances or key not in trained:
                continue
            if not facts.under_no_grad(site.context):
                continue
            layer = classes[instances[key]]
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node)}` predicts under no_grad, but `{key}` (a `{instances[key]}` with "
                f"`{layer}`) is never put in eval mode: no_grad does not switch dropout off or freeze batch-norm "
                "statistics, so predictions are noisy and depend on the batch.",
                fix_hint=f"Call `{key}.eval()` before predicting (and `{key}.train()` before training again).",
            )
            return

    @staticmethod
    def _stochastic_classes(facts: FileFacts) -> dict[str, str]:
        out = {}
        for scope in facts.functions:
            if scope.name != "__init__" or not scope.class_name:
                continue
            for site in facts.calls:
                if site.scope is not scope or not site.qualname:
                    continue
                last = site.qualname.split(".")[-1]
                if site.qualname.startswith("torch.nn.") and last.startswith(_STOCHASTIC):
                    out[scope.class_name] = last
        return out

    @staticmethod
    def _trained_keys(facts: FileFacts) -> set[str]:
        from gpudoctor.check.queries import trained_models

        return {k for k in (name_key(m) for m, _, _ in trained_models(facts)) if k}
