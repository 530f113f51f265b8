"""GD505 for sequence-to-sequence LMs, checked against the installed transformers (5.24): the class table is
the seq2seq-LM and speech-seq2seq auto mappings (Dia aside), and evaluation keeps vocabulary-sized logits
(a tuple with the encoder's last hidden state) unless Seq2SeqTrainer generates."""

import pytest

from gpudoctor.check import apis

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_seq2seq_lm_classes_are_the_installed_auto_mappings():
    from transformers.models.auto import modeling_auto

    mapped = set()
    for mapping in (modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, modeling_auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES):
        for names in mapping.values():
            mapped.update([names] if isinstance(names, str) else names)
    loaders = {"AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq", "AutoPeftModelForSeq2SeqLM"}
    assert apis.SEQ2SEQ_LM_CLASSES - loaders == mapped - {"DiaForConditionalGeneration"}


def _tiny_t5():
    config = transformers.T5Config(
        vocab_size=40, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    return transformers.T5ForConditionalGeneration(config)


def _step(tmp_path, generate: bool):
    torch.manual_seed(0)
    args = transformers.Seq2SeqTrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, predict_with_generate=generate, generation_max_length=5,
    )
    trainer = transformers.Seq2SeqTrainer(model=_tiny_t5(), args=args)
    inputs = {"input_ids": torch.tensor([[5, 6, 7, 1]]), "labels": torch.tensor([[8, 9, 1]])}
    return trainer.prediction_step(trainer.model, inputs, prediction_loss_only=False)


def test_seq2seq_trainer_scores_vocabulary_logits_without_generate(tmp_path):
    _loss, logits, _labels = _step(tmp_path, generate=False)
    assert isinstance(logits, tuple)  # (LM logits, encoder_last_hidden_state)
    assert logits[0].shape == (1, 3, 40)  # batch x target x vocabulary
    assert logits[1].shape == (1, 4, 8)


def test_seq2seq_trainer_keeps_token_ids_with_generate(tmp_path):
    _loss, tokens, _labels = _step(tmp_path, generate=True)
    assert tokens.dtype == torch.long and tokens.dim() == 2
