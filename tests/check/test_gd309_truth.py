"""GD309 checked against the installed peft (0.21) and transformers (5.24) on the CPU: after
``resize_token_embeddings`` for added tokens, ``get_peft_model`` with a LoRA config on the attention projections
leaves the new embedding and output rows frozen (no gradient reaches them), while
``modules_to_save=["embed_tokens", "lm_head"]`` makes trainable copies of both layers."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _resized():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    model.resize_token_embeddings(66)  # two added tokens: ids 64 and 65
    return model


def _new_rows_get_gradients(model) -> bool:
    ids = torch.tensor([[1, 64, 2, 65]])
    model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if p.requires_grad and "embed_tokens" in n and p.grad is not None]
    return any(g[64:].abs().sum() > 0 for g in grads)


def test_lora_on_attention_freezes_the_new_rows():
    model = peft.get_peft_model(_resized(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    embed = model.get_input_embeddings()
    assert not embed.weight.requires_grad
    assert not _new_rows_get_gradients(model)


def test_modules_to_save_trains_the_new_rows():
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["embed_tokens", "lm_head"],
                             task_type="CAUSAL_LM")
    model = peft.get_peft_model(_resized(), config)
    assert _new_rows_get_gradients(model)
