"""ChatGLM-6B under ``--simulate``: gpudoctor's rebuild of the Hub's remote code with the published config."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpudoctor.simulate import Simulation, hub
from gpudoctor.simulate.chatglm import ChatGLMConfig, ChatGLMForConditionalGeneration, parameter_count

ROOT = Path(__file__).resolve().parents[2]
SEEDS = ROOT / "fixtures" / "seeds"


def _published_config() -> ChatGLMConfig:
    data, source = hub.bundled_config("THUDM/chatglm-6b")
    assert "THUDM/chatglm-6b config.json" in source
    data = {k: v for k, v in data.items() if k not in ("model_type", "architectures", "auto_map", "_name_or_path",
                                                        "transformers_version", "torch_dtype")}
    return ChatGLMConfig(**data)


def test_parameter_count_is_the_published_6_2b_and_layer_shapes():
    config = _published_config()
    assert (config.vocab_size, config.hidden_size, config.num_layers, config.inner_hidden_size) == (130528, 4096, 28, 16384)
    assert config.num_hidden_layers == 28  # attribute_map, as the remote config declares it
    with torch.device("meta"):  # (accelerate's init_empty_weights re-creates lm_head's weight: untied until tie_weights)
        model = ChatGLMForConditionalGeneration(config)
    # by arithmetic: embeddings, 28 x (2 LayerNorms, QKV, dense, h->4h, 4h->h with biases), final LayerNorm; lm_head tied
    h, f, v = 4096, 16384, 130528
    layer = 2 * 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
    expected = v * h + 28 * layer + 2 * h
    assert expected == 6_173_286_400 == parameter_count(config)  # "6.2B" (ChatGLM-6B's README: 62亿参数)
    assert sum(p.numel() for p in model.parameters()) == expected
    assert model.lm_head.weight is model.transformer.word_embeddings.weight
    assert model.transformer.word_embeddings.weight.shape == (130528, 4096)
    assert len(model.transformer.layers) == 28 and type(model.transformer.layers[0]).__name__ == "GLMBlock"
    block = model.transformer.layers[0]
    assert block.attention.query_key_value.weight.shape == (3 * 4096, 4096)
    assert block.attention.dense.weight.shape == (4096, 4096)
    assert block.mlp.dense_h_to_4h.weight.shape == (16384, 4096) and block.mlp.dense_4h_to_h.weight.shape == (4096, 16384)
    # the remote code pins embeddings and Linear layers to fp16 whatever the default dtype; LayerNorms follow it
    assert block.attention.query_key_value.weight.dtype == torch.float16
    assert model.transformer.word_embeddings.weight.dtype == torch.float16
    assert block.input_layernorm.weight.dtype == torch.float32
    assert block.attention.rotary_emb.inv_freq.dtype == torch.float16 and block.attention.rotary_emb.inv_freq.numel() == 32
    assert set(model._no_split_modules) == {"GLMBlock"}


def _small_config() -> ChatGLMConfig:
    return ChatGLMConfig(vocab_size=1000, hidden_size=256, num_layers=4, num_attention_heads=4, inner_hidden_size=1024,
                         bos_token_id=5, eos_token_id=6, mask_token_id=7, gmask_token_id=8, pad_token_id=3, use_cache=True)


def _lora_step(checkpointing: bool) -> dict:
    from peft import LoraConfig, TaskType, get_peft_model

    with Simulation("2x4GB") as sim:
        model = ChatGLMForConditionalGeneration(_small_config())
        hub.place(model, {"transformer.word_embeddings": 0, "transformer.layers.0": 0, "transformer.layers.1": 0,
                          "transformer.layers.2": 1, "transformer.layers.3": 1,
                          "transformer.final_layernorm": 1, "lm_head": 0}, None, torch.float16)
        assert model.lm_head.weight is model.transformer.word_embeddings.weight
        if checkpointing:
            model.gradient_checkpointing_enable()
        model = get_peft_model(model, LoraConfig(task_type=TaskType.CAUSAL_LM, r=8, lora_alpha=32,
                                                 target_modules=["query_key_value"]))
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable and all("query_key_value.lora_" in n for n in trainable)
        model.train()
        ids = torch.randint(0, 1000, (2, 128), device="cuda:0")
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)  # a 2-D mask is replaced
        assert out.logits.shape == (2, 128, 1000) and out.loss.device.type == "gpu"
        out.loss.backward()
        assert all(p.grad is not None for n, p in model.named_parameters() if n in trainable)
        return sim.summary()


def test_lora_on_query_key_value_with_and_without_checkpointing_over_two_cards():
    plain, checkpointed = _lora_step(False), _lora_step(True)
    for summary in (plain, checkpointed):
        assert all(d["peak_allocated"] > 0 for d in summary["devices"])
    # checkpointing per GLMBlock keeps only each block's input: less activation memory on both cards
    for index in (0, 1):
        assert checkpointed["devices"][index]["peak_allocated"] < plain["devices"][index]["peak_allocated"]


def test_auto_model_from_pretrained_uses_the_bundled_config_and_says_so():
    from transformers import AutoModel

    with Simulation("1xA100-80GB") as sim:
        hub.install(sim)
        model = AutoModel.from_pretrained("THUDM/chatglm-6b", trust_remote_code=True, device_map="cuda:0")
        assert type(model).__name__ == "ChatGLMForConditionalGeneration"
        assert model.config.num_hidden_layers == 28 and model.config.vocab_size == 130528
        weights = 6_173_286_400 * 2  # fp16 (the config's torch_dtype); plus 512-byte rounding and the tiny buffers
        assert weights <= torch.cuda.memory_allocated(0) < weights + 2**20
        text = " ".join(sim.weights_source + sim.notes)
        assert "bundled config (huggingface.co/THUDM/chatglm-6b config.json" in text and "rebuild" in text


def _seed000(tmp_path: Path, name: str, spec: str) -> tuple[subprocess.CompletedProcess, dict]:
    subprocess.run([sys.executable, "-c", "import torch\n"
                    "ds = [{'input_ids': torch.randint(0, 130000, (256,)), 'labels': torch.randint(0, 130000, (256,))} for _ in range(4)]\n"
                    "torch.save(ds, 'train_ds.pt'); torch.save(ds[:1], 'val_ds.pt')"], cwd=tmp_path, check=True)
    (tmp_path / name).write_text((SEEDS / name).read_text())
    report = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "gpudoctor", "trace", "--simulate", spec, "--no-check", "--json", str(report), name],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    return proc, json.loads(report.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["seed000_kaggle_chatglm_lora.py", "seed000_kaggle_chatglm_lora.fixed.py"])
def test_seed000_fits_on_two_t4s(tmp_path, name):
    # Field report 000: the 12.3 GB fp16 model fits over two T4s (device_map="auto" offloads nothing), LoRA on
    # query_key_value trains; the report's RuntimeError needs layers offloaded to the CPU (which its Kaggle
    # session did and two free T4s do not), so both the script and its fixed twin fit here.
    proc, report = _seed000(tmp_path, name, "2xT4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    sim = report["simulated"]
    assert sim["verdict"]["fits"] is True and sim["optimizer_steps"] == 2
    assert all(d["peak_allocated"] > 4 << 30 for d in sim["devices"])  # the layers are spread over both cards
    assert 4 << 30 < sim["verdict"]["left_bytes"] < 9 << 30
    assert any("rebuild of THUDM/chatglm-6b" in note for note in sim["notes"])
