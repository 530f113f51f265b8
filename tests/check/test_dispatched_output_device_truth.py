"""Why gpudoctor has no rule for "labels on the first GPU, logits of a device_map model on the last": checked against
the installed transformers 5.24 / accelerate 1.16 on virtual GPUs. ``from_pretrained(device_map=...)`` dispatches
through ``accelerate.dispatch_model``, whose root hook moves the whole model's outputs back to the device of its
inputs (``io_same_device=True``), so a hand-written loss between ``model(ids).logits`` and labels on the inputs'
device runs. Only a submodule called directly (``model.lm_head(hidden)``) returns on its own GPU."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")
import torch.nn.functional as F  # noqa: E402

from gpudoctor.virtual import VirtualGPUs, dispatch  # noqa: E402

SPLIT = {"model.embed_tokens": "gpu:0", "model.rotary_emb": "gpu:0", "model.layers.0": "gpu:0",
         "model.layers.1": "gpu:1", "model.norm": "gpu:1", "lm_head": "gpu:1"}


def test_a_dispatched_model_returns_its_outputs_on_the_inputs_device():
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with VirtualGPUs():
        model = dispatch(model, SPLIT)
        assert model._hf_hook.io_same_device
        ids = torch.randint(0, 128, (2, 8), device="gpu:0")
        logits = model(input_ids=ids, use_cache=False).logits
        assert str(logits.device) == "gpu:0"
        F.cross_entropy(logits[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1))  # labels on gpu:0: runs
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        assert str(model.lm_head(hidden).device) == "gpu:1"  # a submodule called directly stays on its GPU
