from pathlib import Path

from gpudoctor.plan.script import read_script

SEEDS = Path(__file__).resolve().parents[2] / "fixtures" / "seeds"


def test_seed003_dataparallel_script():
    assert read_script(str(SEEDS / "seed003_llama_dataparallel.py")) == {
        "model": "meta-llama/Llama-2-7b-chat-hf", "batch": 3, "seq": 512}


def test_seed000_model_through_snapshot_download_and_lora_settings():
    found = read_script(str(SEEDS / "seed000_kaggle_chatglm_lora.py"))
    assert found["model"] == "THUDM/chatglm-6b"
    assert (found["lora_r"], found["lora_alpha"], found["lora_targets"], found["batch"]) == (32, 32, ("query_key_value",), 1)


def test_training_arguments_and_bound_names(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments\n"
        "from peft import LoraConfig\n"
        "NAME = 'mistralai/Mistral-7B-v0.1'\nBATCH = 8\n"
        "tok = AutoTokenizer.from_pretrained('other/tokenizer')\n"
        "model = AutoModelForCausalLM.from_pretrained(NAME)\n"
        "cfg = LoraConfig(r=64, lora_alpha=16, target_modules='all-linear')\n"
        "args = TrainingArguments('out', per_device_train_batch_size=BATCH)\n"
        "enc = tok(texts, truncation=True, max_length=1024)\n")
    assert read_script(str(script)) == {"model": "mistralai/Mistral-7B-v0.1", "lora_r": 64, "lora_alpha": 16,
                                        "lora_targets": "all-linear", "batch": 8, "seq": 1024}
