import pytest
import torch

from gpudoctor.trace.api import Probe


def tiny_llama(layers: int = 2, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, **overrides)
    return LlamaForCausalLM(config)


def failure_of(run, *models, deep=False):
    """Run ``run()`` under a probe; it must raise. Returns (report, exception)."""
    probe = Probe(*models, deep=deep, print_on_error=False)
    with pytest.raises(Exception) as info:
        with probe:
            run()
    report = probe.report()
    assert report["status"] == "failed"
    assert not probe.installed
    return report, info.value


def cause_id(report):
    return (report["failure"]["cause"] or {}).get("id")
