"""Heuristic bugs seen when running `check` on real training scripts (issue 9, item 8): each test failed
before its fix."""

from __future__ import annotations

import textwrap

import pytest

from gpudoctor.check.engine import check_source
from gpudoctor.check.registry import rule_by_code


def _run(code: str, source: str):
    return check_source(textwrap.dedent(source) if source.startswith(" ") else source, "t.py", rules=[rule_by_code(code)])


def test_gd504_output_dir_is_not_a_tpu_guard():
    findings = _run(
        "GD504",
        """\
        from transformers import AutoTokenizer, TrainingArguments

        tokenizer = AutoTokenizer.from_pretrained("gpt2")
        args = TrainingArguments(output_dir="out")
        enc = tokenizer(texts, padding="max_length", max_length=2048, truncation=True)
        """,
    )
    assert len(findings) == 1


def test_gd504_still_quiet_for_tpu():
    assert not _run(
        "GD504",
        """\
        import torch_xla.core.xla_model as xm
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained("gpt2")
        enc = tokenizer(texts, padding="max_length", max_length=2048)
        """,
    )


_GD107_HEAD = """\
# accelerate launch --num_processes 2 train.py
import argparse
from transformers import AutoModelForCausalLM
"""


def test_gd107_same_map_assigned_twice_is_not_a_choice():
    findings = _run(
        "GD107",
        _GD107_HEAD
        + """\
device_map = "auto"
if args.big:
    device_map = "auto"
model = AutoModelForCausalLM.from_pretrained("m", device_map=device_map)
""",
    )
    assert len(findings) == 1


def test_gd107_preprocess_flag_is_not_a_launch_test():
    findings = _run(
        "GD107",
        _GD107_HEAD
        + """\
if args.preprocess:
    model = AutoModelForCausalLM.from_pretrained("m", device_map="auto")
""",
    )
    assert len(findings) == 1


def test_gd107_rank_test_still_counts():
    assert not _run(
        "GD107",
        _GD107_HEAD
        + """\
if args.local_rank == -1:
    model = AutoModelForCausalLM.from_pretrained("m", device_map="auto")
""",
    )


def test_gd301_eval_gold_answers_decoded_after_generate():
    assert not _run(
        "GD301",
        """\
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained("gpt2")
        model = AutoModelForCausalLM.from_pretrained("gpt2")

        def evaluate(questions, answers):
            prompts = tokenizer(questions, return_tensors="pt", padding=True)
            gold = tokenizer(answers, return_tensors="pt", padding=True)
            batch = {"input_ids": prompts["input_ids"], "labels": gold["input_ids"]}
            out = model.generate(input_ids=batch["input_ids"], max_new_tokens=32)
            predictions = tokenizer.batch_decode(out, skip_special_tokens=True)
            references = tokenizer.batch_decode(batch["labels"], skip_special_tokens=True)
            return sum(p == r for p, r in zip(predictions, references))
        """,
    )


def test_gd301_trained_labels_still_flagged():
    findings = _run(
        "GD301",
        """\
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained("gpt2")
        model = AutoModelForCausalLM.from_pretrained("gpt2")
        prompts = tokenizer(questions, return_tensors="pt", padding="max_length", max_length=64)
        gold = tokenizer(answers, return_tensors="pt", padding="max_length", max_length=64)
        loss = model(input_ids=prompts["input_ids"], labels=gold["input_ids"]).loss
        loss.backward()
        """,
    )
    assert len(findings) == 1


_LOAD = """\
from transformers import AutoModelForCausalLM, pipeline
FLAG = True
"""


def test_gd201_literal_false_fix_deletes_the_argument():
    (finding,) = _run("GD201", _LOAD + 'model = AutoModelForCausalLM.from_pretrained("m", load_in_8bit=False)\n')
    import libcst as cst

    assert finding.fix is not None and not finding.fix.imports
    assert [e.node.keyword.value for e in finding.fix.edits if e.replacement is None] == ["load_in_8bit"]
    kept = [cst.Module([]).code_for_node(e.replacement) for e in finding.fix.edits if e.replacement is not None]
    assert not any("BitsAndBytesConfig" in code or "load_in" in code for code in kept)


def test_gd201_variable_has_no_automatic_fix():
    (finding,) = _run("GD201", _LOAD + 'model = AutoModelForCausalLM.from_pretrained("m", load_in_8bit=FLAG)\n')
    assert finding.fix is None


def test_gd201_true_and_false_keeps_only_the_true_one():
    (finding,) = _run(
        "GD201", _LOAD + 'model = AutoModelForCausalLM.from_pretrained("m", load_in_4bit=True, load_in_8bit=False)\n'
    )
    import libcst as cst

    replaced = [e.replacement for e in finding.fix.edits if e.replacement is not None]
    assert len(replaced) == 1
    code = cst.Module([]).code_for_node(replaced[0])
    assert "load_in_4bit=True" in code and "load_in_8bit" not in code


def test_gd201_pipeline_model_kwargs():
    findings = _run("GD201", _LOAD + 'pipe = pipeline("text-generation", model="m", model_kwargs={"load_in_8bit": True})\n')
    assert len(findings) == 1 and "model_kwargs" in findings[0].message


def test_gd201_dict_splat():
    findings = _run(
        "GD201",
        _LOAD + 'kwargs = {"load_in_4bit": True, "device_map": "auto"}\nmodel = AutoModelForCausalLM.from_pretrained("m", **kwargs)\n',
    )
    assert len(findings) == 1


def test_gd201_second_argument_named():
    (finding,) = _run(
        "GD201", _LOAD + 'model = AutoModelForCausalLM.from_pretrained("m", load_in_8bit=False, load_in_4bit=True)\n'
    )
    assert "load_in_8bit" in finding.message and "load_in_4bit" in finding.message


def test_gd104_message_is_exact_about_fsdp():
    (finding,) = _run(
        "GD104",
        """\
        from accelerate import Accelerator

        accelerator = Accelerator()
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
        """,
    )
    assert "FSDP backward hooks are skipped" not in finding.message
    assert "FSDP" in finding.message and "loss.backward()" in finding.message


def test_gd301_labels_decoded_elsewhere_do_not_excuse_training_data():
    findings = _run(
        "GD301",
        """\
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained("gpt2")
        model = AutoModelForCausalLM.from_pretrained("gpt2")

        def preprocess(example):
            prompt = tokenizer(example["question"], padding="max_length", max_length=64)
            answer = tokenizer(example["answer"], padding="max_length", max_length=64)
            return {"input_ids": prompt["input_ids"], "labels": answer["input_ids"]}

        def compute_metrics(eval_preds):
            preds, labels = eval_preds
            return {"exact": tokenizer.batch_decode(preds) == tokenizer.batch_decode(labels)}

        def sample(prompt):
            return tokenizer.decode(model.generate(**tokenizer(prompt, return_tensors="pt"))[0])
        """,
    )
    assert len(findings) == 1


def test_transformers_picks_4bit_for_a_config_without_load_in_8bit():
    """Why GD201 has no fix for `load_in_8bit=FLAG`: BitsAndBytesConfig(load_in_8bit=False) loads 4-bit."""
    pytest.importorskip("transformers")
    from transformers import BitsAndBytesConfig
    from transformers.quantizers.auto import AutoHfQuantizer

    assert type(AutoHfQuantizer.from_config(BitsAndBytesConfig(load_in_8bit=False))).__name__ == "Bnb4BitHfQuantizer"
    assert type(AutoHfQuantizer.from_config(BitsAndBytesConfig(load_in_8bit=True))).__name__ == "Bnb8BitHfQuantizer"
