"""The data-flow layer: aliases, bindings (names and self attributes), values and in-place changes."""

from __future__ import annotations

import textwrap

import libcst as cst

from gpudoctor.check.facts import (
    TRAIT_CAST,
    TRAIT_DISPATCHED,
    TRAIT_EMPTY,
    TRAIT_OFFLOADED,
    TRAIT_PEFT,
    TRAIT_PREPARED,
    collect,
)


def facts_of(source: str):
    source = textwrap.dedent(source)
    return collect(cst.parse_module(source), source)


def calls_named(facts, name: str):
    return [s for s in facts.calls if getattr(s.node.func, "value", None) == name or s.method == name]


def value_at_call(facts, name: str, arg: int = 0):
    site = calls_named(facts, name)[0]
    return facts.value(site.node.args[arg].value, site.order, site.scope)


def test_qualified_names_through_aliases():
    facts = facts_of(
        """
        import torch.nn as nn
        import torch
        from accelerate import Accelerator as Acc
        from torch.nn.utils import clip_grad_norm_
        from transformers.models.llama.modeling_llama import LlamaForCausalLM
        nn.utils.clip_grad_norm_(p, 1)
        clip_grad_norm_(p, 1)
        torch.nn.parallel.DataParallel(m)
        Acc()
        LlamaForCausalLM.from_pretrained("x")
        """
    )
    assert [s.qualname for s in facts.calls] == [
        "torch.nn.utils.clip_grad_norm_",
        "torch.nn.utils.clip_grad_norm_",
        "torch.nn.DataParallel",
        "accelerate.Accelerator",
        "transformers.LlamaForCausalLM.from_pretrained",
    ]


def test_dispatch_through_peft_and_prepare_unpacking():
    facts = facts_of(
        """
        from accelerate import Accelerator, init_empty_weights, load_checkpoint_and_dispatch
        from peft import get_peft_model
        from transformers import AutoModel
        with init_empty_weights():
            model = AutoModel.from_config(cfg).half()
        model = load_checkpoint_and_dispatch(model, path, device_map={"a": 0, "b": "cpu"})
        model = get_peft_model(model, lora)
        acc = Accelerator()
        loader, model2 = acc.prepare(loader, model)
        use(model2)
        """
    )
    value = value_at_call(facts, "use")
    assert value.kind == "model"
    assert value.has(TRAIT_PREPARED) and value.has(TRAIT_PEFT) and value.has(TRAIT_EMPTY)
    assert value.trait(TRAIT_DISPATCHED).certainly_dispatched
    assert "cpu" in value.trait(TRAIT_OFFLOADED)
    assert value.trait(TRAIT_CAST)[0] == "float16"


def test_in_place_dispatch_and_device_map_mutation():
    facts = facts_of(
        """
        from accelerate import dispatch_model
        from transformers import AutoModelForCausalLM
        device_map = {"model.embed": 0}
        device_map["lm_head"] = "disk"
        model = AutoModelForCausalLM.from_pretrained("m")
        use(model)
        dispatch_model(model, device_map)
        use(model)
        """
    )
    uses = calls_named(facts, "use")
    before = facts.value(uses[0].node.args[0].value, uses[0].order, uses[0].scope)
    after = facts.value(uses[1].node.args[0].value, uses[1].order, uses[1].scope)
    assert not before.has(TRAIT_DISPATCHED)
    device_map = after.trait(TRAIT_DISPATCHED)
    assert device_map.certainly_dispatched and device_map.devices == {"0", "disk"}


def test_self_attributes_flow_between_methods():
    facts = facts_of(
        """
        from transformers import AutoModelForCausalLM
        class Runner:
            def __init__(self):
                self.model = AutoModelForCausalLM.from_pretrained("m", device_map="auto")
            def run(self):
                use(self.model)
        """
    )
    value = value_at_call(facts, "use")
    assert value.kind == "model" and value.trait(TRAIT_DISPATCHED).strategy == "auto"


def test_function_locals_shadow_globals():
    facts = facts_of(
        """
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained("m", device_map="auto")
        def f():
            model = make()
            use(model)
        """
    )
    assert value_at_call(facts, "use").kind == "unknown"


def test_single_device_map_is_not_dispatch():
    facts = facts_of(
        """
        from transformers import AutoModelForCausalLM
        from accelerate import PartialState
        model = AutoModelForCausalLM.from_pretrained("m", device_map={"": PartialState().process_index})
        use(model)
        """
    )
    assert not value_at_call(facts, "use").has(TRAIT_DISPATCHED)


def test_launch_hints_need_real_evidence_of_several_processes():
    assert facts_of("n = accelerator.num_processes\n").launch_hints == []  # read for logging, one process too
    assert facts_of("# run: accelerate launch --num_processes 2 train.py\n").launch_hints == ["accelerate launch", "num_processes"]
    assert facts_of("import os\nrank = int(os.environ['LOCAL_RANK'])\n").launch_hints == ["LOCAL_RANK"]
