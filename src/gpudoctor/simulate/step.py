"""``simulate_step``: one model, one batch shape, N optimizer steps on simulated cards -> peaks by category.

The engine under ``gpudoctor trace --simulate`` as a Python API (``gpudoctor plan`` builds on it)::

    from gpudoctor.simulate import simulate_step
    result = simulate_step("bigscience/bloomz-7b1", "1xA100-80GB", batch=8, seq=64,
                           lora={"r": 8, "lora_alpha": 32, "lora_dropout": 0.1}, dtype="float32")
    result["fits"], result["devices"][0]["peak_allocated"], result["devices"][0]["breakdown_at_peak"]
"""

from __future__ import annotations

from typing import Callable

import torch

from gpudoctor.simulate import hub
from gpudoctor.simulate.session import Simulation


def simulate_step(model: str | Callable[[], torch.nn.Module], cards: str, *, batch: int = 1, seq: int = 512,
                  target_len: int | None = None, steps: int = 2, dtype: str | torch.dtype | None = "auto",
                  lora: dict | None = None, device_map=None, gradient_checkpointing: bool = False,
                  optimizer: str = "adamw", foreach: bool | None = None, autocast: str | None = None) -> dict:
    """Simulate ``steps`` training steps; a summary dict (``Simulation.summary()``) plus ``fits`` and ``oom``.

    ``model``: a Hub id / local folder (loaded like ``from_pretrained``, no download), or a factory
    called inside the simulation. ``target_len``: decoder length for encoder-decoder models (default
    ``seq``). ``lora``: ``peft.LoraConfig`` arguments. ``device_map``: as ``from_pretrained`` takes it
    (default: the whole model on ``cuda:0``). ``autocast``: ``"float16"``/``"bfloat16"`` for AMP.
    """
    result: dict = {"fits": True, "oom": None}
    with Simulation(cards) as sim:
        hub.install(sim)
        try:
            net, encoder_decoder = _build(model, dtype, device_map)
            if gradient_checkpointing:
                net.gradient_checkpointing_enable()
            if lora is not None:
                from peft import LoraConfig, get_peft_model

                task = "SEQ_2_SEQ_LM" if encoder_decoder else "CAUSAL_LM"
                net = get_peft_model(net, LoraConfig(task_type=task, **lora))
            if device_map is None:
                net.to("cuda")
            net.train()
            params = [p for p in net.parameters() if p.requires_grad]
            opt = torch.optim.SGD(params, lr=1e-3) if optimizer == "sgd" else torch.optim.AdamW(params, lr=1e-4, foreach=foreach)
            vocab = getattr(getattr(net, "config", None), "vocab_size", 32000)
            first = "cuda:0"
            for _ in range(steps):
                inputs = {"input_ids": torch.randint(0, vocab, (batch, seq), device=first),
                          "attention_mask": torch.ones(batch, seq, dtype=torch.long, device=first)}
                labels_len = (target_len or seq) if encoder_decoder else seq
                inputs["labels"] = torch.randint(0, vocab, (batch, labels_len), device=first)
                amp = torch.autocast("cuda", dtype=getattr(torch, autocast)) if autocast else torch.autocast("cuda", enabled=False)
                with amp:
                    loss = net(**inputs).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                del loss, inputs
        except torch.OutOfMemoryError as exc:
            result.update(fits=False, oom=str(exc))
        result.update(sim.summary())
    return result


def _build(model, dtype, device_map):
    if callable(model):
        net = model()
        return net, bool(getattr(getattr(net, "config", None), "is_encoder_decoder", False))
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    config, _, _ = hub.resolve_config(model, None)
    cls = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
    kwargs = {"dtype": getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype}
    if device_map is not None:
        kwargs["device_map"] = device_map
    return cls.from_pretrained(model, **kwargs), bool(config.is_encoder_decoder)
