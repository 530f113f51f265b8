"""The device-map builder, with made-up memory budgets: no GPU needed."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

from gpudoctor.reference.model import lora_config, planning_blocks  # noqa: E402
from gpudoctor.reference.placement import (  # noqa: E402
    OFFLOAD_DEVICES,
    Block,
    PlacementError,
    check_trainable_resident,
    model_blocks,
    plan_placement,
    torch_device,
)

BIG = 10**12


@pytest.fixture(scope="module")
def blocks(tiny_checkpoint):
    return planning_blocks(tiny_checkpoint, lora_config(), torch.float32)


def sizes(blocks):
    return {b.name: b.size for b in blocks}


def test_blocks_of_the_tiny_model(blocks):
    names = [b.name for b in blocks]
    assert names == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "model.rotary_emb", "lm_head"]
    # LoRA targets every linear layer of the decoder layers, and nothing outside them.
    assert {b.name for b in blocks if b.trainable} == {"model.layers.0", "model.layers.1"}
    assert all(b.size > 0 for b in blocks)


def test_trainable_bytes_count_grads_and_adam_state(tiny_checkpoint):
    lora = lora_config()
    fp32 = sizes(planning_blocks(tiny_checkpoint, lora, torch.float32))
    bf16 = sizes(planning_blocks(tiny_checkpoint, lora, torch.bfloat16))
    # Frozen weights halve in bf16; LoRA weights (fp32 weight + grad + 2 AdamW moments) do not.
    assert bf16["lm_head"] * 2 == fp32["lm_head"]
    assert fp32["model.layers.0"] - bf16["model.layers.0"] < fp32["model.layers.0"] / 2


def test_everything_on_one_gpu_when_it_fits(blocks):
    placement = plan_placement(blocks, {0: BIG, 1: BIG, "cpu": BIG})
    assert placement.device_map == {"": 0}
    assert not placement.dispatched


def test_cpu_only_machine_puts_everything_on_cpu_and_says_so(blocks):
    placement = plan_placement(blocks, {"cpu": BIG})
    assert placement.device_map == {"": "cpu"}
    assert placement.input_device == torch.device("cpu")
    assert "every block on cpu" in placement.describe()[0]


def test_budget_that_forces_offload_keeps_trained_blocks_on_gpus(blocks):
    layer = sizes(blocks)["model.layers.0"]
    budgets = {0: layer, 1: layer, "cpu": BIG}  # room for one decoder layer per GPU, nothing else
    assert sum(b.size for b in blocks) > budgets[0] + budgets[1]  # something has to leave the GPUs

    placement = plan_placement(blocks, budgets)
    assert placement.blocks["model.layers.0"] == 0 and placement.blocks["model.layers.1"] == 1
    assert placement.blocks["model.embed_tokens"] == "cpu" and placement.blocks["lm_head"] == "cpu"
    assert placement.dispatched
    assert placement.input_device.index == 0  # never model.device, which is meta with embed offloaded
    described = "\n".join(placement.describe())
    assert "model.embed_tokens → cpu (offloaded, frozen)" in described
    # indices name the machine's accelerator (cuda here; the virtual `gpu` backend once a test registered it)
    assert f"model.layers.0 → {torch_device(0)}" in described and f"model.layers.1 → {torch_device(1)}" in described


def test_frozen_blocks_stay_next_to_their_neighbour_when_there_is_room(blocks):
    s = sizes(blocks)
    frozen_head = s["model.embed_tokens"] + s["model.layers.0"]
    budgets = {0: frozen_head, 1: BIG, "cpu": BIG}
    placement = plan_placement(blocks, budgets)
    assert placement.blocks["model.embed_tokens"] == 0 == placement.blocks["model.layers.0"]
    assert placement.blocks["lm_head"] == 1 == placement.blocks["model.layers.1"]


def test_trained_blocks_that_do_not_fit_raise_instead_of_offloading(blocks):
    layer = sizes(blocks)["model.layers.0"]
    with pytest.raises(PlacementError, match="never train"):
        plan_placement(blocks, {0: layer + 1, "cpu": BIG, "disk": BIG})


def test_frozen_blocks_may_go_to_disk(blocks):
    layer = sizes(blocks)["model.layers.0"]
    placement = plan_placement(blocks, {0: 2 * layer, "disk": 0})
    assert {placement.blocks[n] for n in ("model.embed_tokens", "lm_head")} == {"disk"}
    assert placement.blocks["model.layers.1"] == 0


def test_random_budgets_never_offload_a_trained_block_nor_overfill_a_device(blocks):
    rng = random.Random(0)
    total = sum(b.size for b in blocks)
    placed = 0
    for _ in range(300):
        budgets = {i: rng.randint(0, total) for i in range(rng.randint(1, 3))}
        if rng.random() < 0.8:
            budgets["cpu"] = rng.randint(0, total)
        try:
            placement = plan_placement(blocks, budgets)
        except PlacementError:
            continue
        placed += 1
        for block in blocks:
            if block.trainable:
                assert placement.blocks[block.name] not in OFFLOAD_DEVICES
        for device, budget in budgets.items():
            assert sum(b.size for b in blocks if placement.blocks[b.name] == device) <= budget
    assert placed > 50  # the loop did test placements, not only errors


def test_tied_weights_share_a_device():
    from accelerate import init_empty_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    with init_empty_weights():
        model = LlamaForCausalLM(config)
    model.tie_weights()
    for name, p in model.named_parameters():
        p.requires_grad = name.startswith("model.layers.1.")
    blocks = model_blocks(model, model._no_split_modules, torch.float32)
    by_name = {b.name: b for b in blocks}
    assert by_name["lm_head"].tied_to == "model.embed_tokens" and by_name["lm_head"].size == 0
    layer = by_name["model.layers.1"].size
    embed = by_name["model.embed_tokens"].size
    placement = plan_placement(blocks, {0: layer, 1: embed + layer, "cpu": BIG})
    assert placement.blocks["lm_head"] == placement.blocks["model.embed_tokens"]


def test_check_trainable_resident_catches_a_meta_trainable_parameter():
    resident = torch.nn.Linear(2, 2)
    check_trainable_resident(resident)
    offloaded = torch.nn.Linear(2, 2, device="meta")
    offloaded.weight.requires_grad_(False)
    with pytest.raises(PlacementError, match="offloaded"):
        check_trainable_resident(offloaded)  # the bias is trainable and on meta
    offloaded.bias.requires_grad_(False)
    check_trainable_resident(offloaded)  # frozen weights may be offloaded


def test_block_is_plain_data():
    assert Block("x", 1, True) == Block("x", 1, True, None)
