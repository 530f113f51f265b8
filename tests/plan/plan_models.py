"""Model configs for the plan tests."""

import json

# Llama-2-7B's layer shapes at a smaller depth and vocabulary: tensors as large as the real model's (so
# the allocator rounds them as it would), few layers (fake tensors cost no memory; time grows with depth).
WIDE = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 11008,
        "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float16"}
TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 688,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 4096,
        "max_position_embeddings": 1024, "torch_dtype": "float32", "tie_word_embeddings": False}

# A 1024-wide decoder with a 64,000-token tied vocabulary: under fp16 AMP at batch 1 x 512 its backward pass
# peaks up to 4 layers and its optimizer step from 6 on (phases that grow at different rates).
TIED_VOCAB = {**TINY, "hidden_size": 1024, "intermediate_size": 2752, "num_attention_heads": 8, "num_key_value_heads": 8,
              "vocab_size": 64000, "tie_word_embeddings": True, "num_hidden_layers": 16}


def write_config(folder, data):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(data))
    return str(folder)
