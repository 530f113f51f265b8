"""GD411's transformers path, checked on CPU with a tiny Whisper (transformers 5.24, peft 0.21): LoRA added before
reentrant checkpointing is turned on leaves no input requiring grad (Whisper's main input is input_features), so
backward fails; use_reentrant=False trains."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _whisper_lora():
    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=37, decoder_ffn_dim=37, num_mel_bins=8, max_source_positions=16,
        max_target_positions=16, decoder_start_token_id=1, pad_token_id=0, eos_token_id=2, bos_token_id=1,
    )
    model = transformers.WhisperForConditionalGeneration(config)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def _loss(model):
    model.train()
    return model(input_features=torch.randn(2, 8, 32), labels=torch.randint(3, 100, (2, 5))).loss


def test_reentrant_after_lora_fails():
    model = _whisper_lora()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(RuntimeError, match="does not require grad and does not have a grad_fn"):
        _loss(model).backward()


def test_non_reentrant_trains_the_adapters():
    model = _whisper_lora()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _loss(model).backward()
    assert any(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
