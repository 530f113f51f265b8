"""End-to-end behaviour of the reference trainer on the tiny model, CPU only."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

from gpudoctor.reference.data import PadToLongest, prompt_ids  # noqa: E402
from gpudoctor.reference.model import (  # noqa: E402
    add_lora,
    build_optimizer,
    enable_checkpointing,
    load_base,
    load_tokenizer,
    lora_config,
)
from gpudoctor.reference.placement import Placement  # noqa: E402
from gpudoctor.reference.trainer import generate_answer, load_trained, prompt_logits  # noqa: E402

CPU = Placement({"": "cpu"}, {})


def test_loss_falls(trained):
    config, result = trained
    assert len(result.losses) == config.steps
    first, last = statistics.mean(result.losses[:5]), statistics.mean(result.losses[-5:])
    assert first - last > 0.5, result.losses
    assert result.eval_loss_after < result.eval_loss_before - 0.3


def test_run_reports_cpu_placement_and_lora_sized_training(trained):
    _, result = trained
    assert result.device_map == {"": "cpu"}
    assert "every block on cpu" in result.placement[0]
    assert 0 < result.trainable_params < result.total_params / 5
    assert result.optimizer_params == result.trainable_params


def test_optimizer_holds_only_trainable_params(tiny_checkpoint):
    model = add_lora(load_base(tiny_checkpoint, CPU, torch.float32), lora_config())
    optimizer = build_optimizer(model, lr=1e-3)
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert in_optimizer == trainable
    assert trainable and len(trainable) < len(list(model.parameters()))


def test_adapter_is_saved_and_reloads_to_the_same_logits(trained):
    config, result = trained
    adapter = Path(result.adapter_dir)
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    assert result.reload_max_abs_diff < 1e-5

    model, tokenizer = load_trained(adapter)
    reloaded = prompt_logits(model, tokenizer, config.prompt, "cpu")
    torch.testing.assert_close(reloaded, result.probe_logits, atol=1e-5, rtol=1e-5)

    # And the adapter matters: the base alone answers differently.
    base = load_base(result.base_model, CPU, torch.float32)
    base_only = prompt_logits(base, tokenizer, config.prompt, "cpu")
    assert (base_only - result.probe_logits).abs().max() > 0.1


def test_generation_runs_on_the_reloaded_model(trained):
    config, result = trained
    assert isinstance(result.answer, str)
    model, tokenizer = load_trained(result.adapter_dir)
    ids = torch.tensor([prompt_ids(tokenizer, config.prompt)])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                             min_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape == (1, ids.shape[1] + 6)
    assert torch.equal(out[0, : ids.shape[1]], ids[0])
    # Greedy decoding is deterministic: the run's answer is what generate_answer gives again.
    assert generate_answer(model, tokenizer, config.prompt, "cpu", config.max_new_tokens) == result.answer


@pytest.mark.parametrize("train_mode", [True, False])
def test_checkpointing_acts_only_in_train_mode(tiny_checkpoint, dialogs, train_mode):
    from gpudoctor.reference.data import DialogDataset

    model = load_base(tiny_checkpoint, CPU, torch.float32)
    assert not model.training  # from_pretrained returns eval mode: the pitfall the trainer avoids
    enable_checkpointing(model)
    model = add_lora(model, lora_config())
    model.train(train_mode)
    calls = []
    layers = model.get_base_model().model.layers
    for layer in layers:
        func = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *a, _f=func, **k: calls.append(1) or _f(*a, **k)

    tokenizer = load_tokenizer(tiny_checkpoint)
    batch = PadToLongest(tokenizer.pad_token_id)(list(DialogDataset(dialogs[:2], tokenizer, 256)))
    model(**batch).loss.backward()
    assert len(calls) == (len(layers) if train_mode else 0)
    # Non-reentrant checkpointing: the LoRA weights get gradients, the frozen base none.
    for name, p in model.named_parameters():
        assert (p.grad is not None) == p.requires_grad, name


def test_cli_trains_a_local_checkpoint_with_accumulation_and_rejects_bad_input(tiny_checkpoint, tmp_path, capsys):
    from peft import PeftConfig

    from gpudoctor.reference.cli import main

    out = tmp_path / "out"
    args = ["--model", str(tiny_checkpoint), "--steps", "2", "--grad-accum", "2", "--batch-size", "2",
            "--output", str(out), "--prompt", "My ear hurts."]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "placement" in printed and "My ear hurts." in printed
    assert "over 2 steps" in printed  # optimizer steps, not micro-batches
    assert not (out / "base").exists()  # a given checkpoint is used in place, not rebuilt
    assert PeftConfig.from_pretrained(str(out / "adapter")).base_model_name_or_path == str(tiny_checkpoint)
    assert main(["--steps", "0"]) == 2
    assert main(["--model", str(tmp_path / "missing"), "--output", str(tmp_path / "x"), "--quiet"]) == 1
    assert "reference-train failed" in capsys.readouterr().out
