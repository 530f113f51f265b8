from __future__ import annotations

from typing import Optional

import libcst as cst

from gpudoctor.check import apis
from gpudoctor.check.facts import FileFacts, call_arg, is_true, name_key
from gpudoctor.check.finding import Severity
from gpudoctor.check.queries import language_model_kind, model_class_names, snippet
from gpudoctor.check.rule import Rule


class EvalLogitsAccumulation(Rule):
    """A ``Trainer`` for a causal, masked or sequence-to-sequence LM (a vocabulary-sized head) given
    ``compute_metrics`` but no ``preprocess_logits_for_metrics`` (nor, for ``Seq2SeqTrainer``,
    ``predict_with_generate=True``):
    evaluation keeps the full logits of every eval batch (batch x sequence x vocabulary) on the device
    until the end of the loop (transformers#8476), then hands them all to ``compute_metrics`` at once."""

    code = "GD505"
    name = "eval-logits-accumulation"
    summary = "Trainer(compute_metrics=...) for a causal/masked/seq2seq LM without preprocess_logits_for_metrics: eval keeps all logits"
    severity = Severity.WARNING
    triggers = ("compute_metrics",)

    def check(self, facts: FileFacts):
        evaluates = any(True for _ in facts.method_calls("evaluate", "predict"))
        for site in facts.calls_to(*apis.TRAINERS):
            metrics = site.arg(keyword="compute_metrics")
            if metrics is None or (isinstance(metrics, cst.Name) and metrics.value == "None"):
                continue
            head = self._lm_head(facts, site)
            if head is None:
                continue
            if site.arg(keyword="preprocess_logits_for_metrics") is not None:
                continue
            if site.arg(keyword="eval_dataset") is None and not evaluates:
                continue
            args = self._training_args(facts, site)
            if args is not None:
                if is_true(call_arg(args, keyword="batch_eval_metrics")) or is_true(call_arg(args, keyword="prediction_loss_only")):
                    continue
            if site.qualname == "transformers.Seq2SeqTrainer" and not self._scores_logits(args):
                continue  # ``predict_with_generate=True`` (or not shown): evaluation keeps generated token ids
            accumulation = args is not None and call_arg(args, keyword="eval_accumulation_steps") is not None
            where = (
                "with `eval_accumulation_steps` they are moved to host memory every few steps, where they still pile up"
                if accumulation
                else "they stay on the GPU until the whole eval set is done"
            )
            seq2seq = head == _SEQ2SEQ
            yield self.report(
                site.node,
                f"`{snippet(facts, site.node.func)}(compute_metrics={snippet(facts, metrics, 30)})` for a {head} without "
                "`preprocess_logits_for_metrics`"
                + (" (and without `predict_with_generate=True`)" if site.qualname == "transformers.Seq2SeqTrainer" else "")
                + ": evaluation gathers the full logits of every batch (vocabulary-sized "
                f"per {'target ' if seq2seq else ''}token: 64-128 KB per token for a 32k vocabulary in 16/32-bit, so ~32-64 MB "
                + ("per 512 target tokens, ~1 MB per token for mT5's 250k vocabulary" if seq2seq else "per 512-token sample")
                + f") and {where} (transformers#8476). "
                "A few hundred eval samples hold gigabytes.",
                fix_hint=(
                    "Generate instead of scoring: `Seq2SeqTrainer` with `Seq2SeqTrainingArguments(predict_with_generate="
                    "True)` (compute_metrics gets token ids), or reduce the logits per batch: "
                    "`preprocess_logits_for_metrics=lambda logits, labels: logits[0].argmax(-1)` (a sequence-to-sequence "
                    "LM's logits come as a tuple with the encoder's last hidden state), or `batch_eval_metrics=True`."
                    if seq2seq else
                    "Reduce the logits per batch: `preprocess_logits_for_metrics=lambda logits, labels: "
                    "logits.argmax(-1)` (then compute_metrics gets token ids), or `batch_eval_metrics=True`."
                ),
                related=((metrics, "this metric function is handed the full logits of every eval batch"),),
            )

    @staticmethod
    def _lm_head(facts: FileFacts, site) -> Optional[str]:
        """"causal LM" / "masked LM" when the trainer's model has a vocabulary-sized head (by its class,
        else by the classes the file uses), None otherwise."""
        model = site.arg(0, "model")
        owner = facts.value(model, site.order, site.scope).origin().trait("class") if model is not None else None
        name = str(owner).split(".")[-1] if owner else ""
        if name and apis.is_model_class(name):
            return _head_of(name)
        heads = {_head_of(n) for n in model_class_names(facts)} - {None}
        if language_model_kind(facts) == "causal" or heads in ({"masked LM"}, {_SEQ2SEQ}):
            return heads.pop() if len(heads) == 1 else "causal LM"
        return None

    @staticmethod
    def _scores_logits(args) -> bool:
        """``Seq2SeqTrainer`` evaluates with the model's logits (``trainer_seq2seq.py`` ``prediction_step``:
        ``super().prediction_step`` unless ``args.predict_with_generate``) when its arguments are built here
        without ``predict_with_generate`` or with it literally False."""
        if args is None:
            return False  # from a parser or a config file: a launch flag may set it
        flag = call_arg(args, keyword="predict_with_generate")
        if any(a.star == "**" for a in args.args):
            return False
        return flag is None or (isinstance(flag, cst.Name) and flag.value == "False")

    @staticmethod
    def _training_args(facts: FileFacts, site):
        node = site.arg(1, "args")
        if isinstance(node, cst.Call):
            return node
        key = name_key(node)
        if key is None:
            return None
        binding = facts.binding_at(key, site.order, site.scope)
        if binding is not None and isinstance(binding.value, cst.Call) and facts.qualname(binding.value.func) in apis.TRAINING_ARGS:
            return binding.value
        return None


_SEQ2SEQ = "sequence-to-sequence LM"


def _head_of(class_name: str) -> Optional[str]:
    if apis.is_causal_lm_class(class_name) or class_name.endswith("LMHeadModel"):
        return "causal LM"
    if class_name in apis.SEQ2SEQ_LM_CLASSES:
        return _SEQ2SEQ
    if class_name.endswith(("ForMaskedLM", "ForPreTraining")):
        return "masked LM"
    return None
