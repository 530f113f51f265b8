"""GD310 checked against the installed transformers (5.24) on the CPU: a causal LM's own loss for
``labels=input_ids`` is the cross-entropy of ``logits[:, :-1]`` against ``labels[:, 1:]`` (the next-token shift), so
the same labels scored position by position, unshifted, are another objective; and that objective is minimised by
copying the input (a model that puts all its mass on the token at its own position gets ~0 unshifted loss)."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
F = torch.nn.functional


def test_hf_causal_lm_labels_are_shifted_inside_the_model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 32, (2, 7))
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    shifted = F.cross_entropy(out.logits[:, :-1].reshape(-1, 32), ids[:, 1:].reshape(-1))
    unshifted = F.cross_entropy(out.logits.reshape(-1, 32), ids.reshape(-1))
    assert torch.allclose(out.loss, shifted, atol=1e-5)
    assert not torch.allclose(out.loss, unshifted, atol=1e-3)


def test_unshifted_objective_is_solved_by_copying_the_input():
    ids = torch.randint(0, 32, (2, 7))
    copy_logits = F.one_hot(ids, 32).float() * 50.0  # "predict" the token at the same position
    assert F.cross_entropy(copy_logits.reshape(-1, 32), ids.reshape(-1)) < 1e-6
    assert F.cross_entropy(copy_logits[:, :-1].reshape(-1, 32), ids[:, 1:].reshape(-1)) > 1.0
