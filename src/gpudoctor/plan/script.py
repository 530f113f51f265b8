"""``gpudoctor plan --script train.py``: the model, batch, sequence length and LoRA settings a training
script states, read with ``gpudoctor check``'s facts (the script is parsed, never imported or run).

* model: the checkpoint string of the first model ``from_pretrained`` (not a tokenizer, config or
  processor), through one name binding, as ``check`` resolves it;
* batch: ``per_device_train_batch_size=`` (``TrainingArguments``) or a ``DataLoader``'s ``batch_size=``;
* sequence length: ``max_length=`` / ``max_seq_length=`` / ``block_size=`` / ``cutoff_len=`` given to a call
  or as a parameter's default (``def __init__(self, data, tokenizer, max_length=512)``);
* LoRA: ``LoraConfig(r=, lora_alpha=, target_modules=)``.

Integers bound to a name (``BATCH = 8`` ... ``batch_size=BATCH``) are followed one binding back.
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst

from gpudoctor.check.facts import collect, int_value, name_key, string_value
from gpudoctor.check.queries import checkpoint_name

SEQ_NAMES = ("max_length", "max_seq_length", "block_size", "cutoff_len", "max_source_length", "seq_len", "seq_length")
_NOT_MODELS = ("Tokenizer", "Processor", "Config", "FeatureExtractor", "ImageProcessor")


def read_script(path: str) -> dict:
    source = Path(path).read_text(encoding="utf-8")
    facts = collect(cst.parse_module(source), source, path)
    found: dict = {}

    def integer(site, node):
        value = int_value(node)
        if value is None and name_key(node) is not None:
            binding = facts.binding_at(name_key(node), site.order, site.scope)
            if binding is not None and binding.kind == "assign":
                value = int_value(binding.value)
        return value

    def checkpoint(site):
        name = checkpoint_name(facts, site.node, site.order, site.scope)
        arg = site.arg(0, "pretrained_model_name_or_path")
        if name is None and name_key(arg) is not None:  # FilePath = snapshot_download(repo_id="THUDM/chatglm-6b")
            binding = facts.binding_at(name_key(arg), site.order, site.scope)
            if binding is not None and binding.kind == "assign" and isinstance(binding.value, cst.Call):
                if facts.module.code_for_node(binding.value.func).endswith("snapshot_download"):
                    from gpudoctor.check.facts import call_arg

                    name = string_value(call_arg(binding.value, 0, "repo_id"))
        return name

    config_name = None
    for site in facts.calls:
        callee = facts.module.code_for_node(site.node.func)
        if site.method == "from_pretrained" and "model" not in found:
            if not any(w in callee for w in _NOT_MODELS):
                found["model"] = checkpoint(site) or found.get("model")
            elif "Config" in callee:
                config_name = config_name or checkpoint(site)
        short = callee.rsplit(".", 1)[-1]
        if short in ("TrainingArguments", "Seq2SeqTrainingArguments", "SFTConfig"):
            value = integer(site, site.arg(keyword="per_device_train_batch_size"))
            if value:
                found["batch"] = value
        if short == "DataLoader" and "batch" not in found:
            value = integer(site, site.arg(keyword="batch_size"))
            if value:
                found["batch"] = value
        if short == "LoraConfig":
            for key, field in (("r", "lora_r"), ("lora_alpha", "lora_alpha")):
                value = integer(site, site.arg(keyword=key))
                if value:
                    found[field] = value
            targets = site.arg(keyword="target_modules")
            if isinstance(targets, (cst.List, cst.Tuple)):
                names = [string_value(e.value) for e in targets.elements]
                if names and all(names):
                    found["lora_targets"] = tuple(names)
            elif string_value(targets):
                found["lora_targets"] = string_value(targets)
        for keyword in SEQ_NAMES:
            value = integer(site, site.arg(keyword=keyword))
            if value and "seq" not in found:
                found["seq"] = value
    if not found.get("model"):
        found.pop("model", None)
        if config_name:  # the model is built from this config (from_config + load_checkpoint_and_dispatch)
            found["model"] = config_name
    if "seq" not in found:
        for node in _walk(facts.module):
            if isinstance(node, cst.Param) and node.name.value in SEQ_NAMES and node.default is not None:
                value = int_value(node.default)
                if value:
                    found["seq"] = value
                    break
    return found


def _walk(node: cst.CSTNode):
    yield node
    for child in node.children:
        yield from _walk(child)
