"""ChatGLM-6B rebuilt for simulated runs: the Hub's remote code (``THUDM/chatglm-6b``, ``modeling_chatglm.py``
and ``configuration_chatglm.py``, loaded with ``trust_remote_code=True``) is not available offline, so
``--simulate`` builds this rebuild of its architecture instead, with the published ``config.json``
(``configs/chatglm-6b.json``), and says so in the report.

What is the same as the remote code, because memory depends on it:

* the modules and their names (``transformer.word_embeddings``, ``transformer.layers.N`` = ``GLMBlock``
  with ``input_layernorm``, ``attention.query_key_value`` (hidden -> 3 x hidden, bias),
  ``attention.dense``, ``post_attention_layernorm``, ``mlp.dense_h_to_4h`` / ``mlp.dense_4h_to_h``,
  ``transformer.final_layernorm``, ``lm_head``), so device maps (``no_split_module_classes=["GLMBlock"]``)
  and peft targets (``query_key_value``) resolve as for the real model;
* the dtypes: embeddings and every Linear are created in fp16 whatever the default dtype (the remote code
  passes ``dtype=torch.half`` to them); LayerNorms follow the default dtype; the rotary ``inv_freq`` buffer
  is fp16;
* ``lm_head`` shares the word embeddings' weight (transformers ties them when it loads the checkpoint:
  ``tie_word_embeddings`` defaults to true there), so the model has 6,173,286,400 parameters, the
  published "6.2B";
* the forward pass's tensors: 2-D rotary position encoding on half of each head, the attention scores
  made by ``baddbmm`` in fp16, scaled by ``layer_id + 1``, upcast to fp32 for the softmax and cast back,
  the residuals scaled by ``sqrt(2 * num_layers)``, the GELU MLP (tanh form; jit-fused on a GPU: one
  output), the logits permuted to batch-first and upcast to fp32 for the loss, the per-layer
  ``(key, value)`` returned when ``use_cache`` (the config's default: true);
* gradient checkpointing wraps each ``GLMBlock`` (transformers' ``gradient_checkpointing_enable``).

What differs (values, not memory): the attention mask and 2-D position ids are computed with tensor
operations from the positions of ``[gMASK]``/``[MASK]`` and ``<sop>`` (the remote code reads them with
``.tolist()``, which a simulated tensor cannot answer); a 2-D ``[batch, seq]`` padding mask (what a
stand-in tokenizer returns; ChatGLM's own tokenizer returns the ``[batch, 1, seq, seq]`` boolean mask)
is replaced by ChatGLM's mask built from the input ids.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

SOURCE = ("architecture: gpudoctor's rebuild of THUDM/chatglm-6b's remote code (modeling_chatglm.py, "
          "gpudoctor.simulate.chatglm), the Hub code itself is not run")


class ChatGLMConfig(PretrainedConfig):
    """The remote ``configuration_chatglm.ChatGLMConfig``: same arguments and defaults."""

    model_type = "chatglm"
    attribute_map = {"num_hidden_layers": "num_layers"}

    def __init__(self, vocab_size=150528, hidden_size=4096, num_layers=28, num_attention_heads=32, layernorm_epsilon=1e-5,
                 use_cache=False, bos_token_id=150004, eos_token_id=150005, mask_token_id=150000, gmask_token_id=150001,
                 pad_token_id=0, max_sequence_length=2048, inner_hidden_size=16384, position_encoding_2d=True,
                 quantization_bit=0, pre_seq_len=None, prefix_projection=False, tie_word_embeddings=True, **kwargs):
        self.num_layers = num_layers
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.max_sequence_length = max_sequence_length
        self.layernorm_epsilon = layernorm_epsilon
        self.inner_hidden_size = inner_hidden_size
        self.use_cache = use_cache
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.mask_token_id = mask_token_id
        self.gmask_token_id = gmask_token_id
        self.position_encoding_2d = position_encoding_2d
        self.quantization_bit = quantization_bit
        self.pre_seq_len = pre_seq_len
        self.prefix_projection = prefix_projection
        # transformers 4 (which the remote code targets) tied lm_head to the word embeddings by default
        self.tie_word_embeddings = tie_word_embeddings
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for ``dim`` rotary features; ``inv_freq`` is an fp16 buffer as in the remote code."""

    def __init__(self, dim: int, base: int = 10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq.half())

    def forward(self, seq_len: int, device):
        t = torch.arange(seq_len, device=device, dtype=self.inv_freq.dtype)
        freqs = torch.outer(t, self.inv_freq.to(device))
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, None, :], emb.sin()[:, None, :]  # [seq, 1, dim]


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=x.ndim - 1)


def _apply_rotary(q, k, cos, sin, positions):
    # positions: [seq, batch]; cos/sin: [max_pos, 1, dim] -> [seq, batch, 1, dim]
    cos = F.embedding(positions, cos.squeeze(1)).unsqueeze(2)
    sin = F.embedding(positions, sin.squeeze(1)).unsqueeze(2)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class SelfAttention(nn.Module):
    def __init__(self, config: ChatGLMConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.position_encoding_2d = config.position_encoding_2d
        rotary_dim = self.head_dim // 2 if self.position_encoding_2d else self.head_dim
        self.rotary_emb = RotaryEmbedding(rotary_dim)
        inner = self.num_heads * self.head_dim
        self.query_key_value = nn.Linear(config.hidden_size, 3 * inner, bias=True, dtype=torch.half)
        self.dense = nn.Linear(inner, config.hidden_size, bias=True, dtype=torch.half)

    def forward(self, hidden_states, position_ids, attention_mask, layer_past=None, use_cache=False):
        seq, batch = hidden_states.shape[:2]
        mixed = self.query_key_value(hidden_states).view(seq, batch, self.num_heads, 3 * self.head_dim)
        query, key, value = torch.split(mixed, self.head_dim, dim=-1)
        max_position = seq + 1 if layer_past is None else seq + layer_past[0].shape[0] + 1
        if self.position_encoding_2d:
            q1, q2 = query.chunk(2, dim=query.ndim - 1)
            k1, k2 = key.chunk(2, dim=key.ndim - 1)
            cos, sin = self.rotary_emb(max_position, hidden_states.device)
            positions = position_ids[:, 0, :].transpose(0, 1).contiguous()
            block_positions = position_ids[:, 1, :].transpose(0, 1).contiguous()
            q1, k1 = _apply_rotary(q1, k1, cos, sin, positions)
            q2, k2 = _apply_rotary(q2, k2, cos, sin, block_positions)
            query = torch.cat([q1, q2], dim=q1.ndim - 1)
            key = torch.cat([k1, k2], dim=k1.ndim - 1)
        else:
            cos, sin = self.rotary_emb(max_position, hidden_states.device)
            query, key = _apply_rotary(query, key, cos, sin, position_ids.transpose(0, 1))
        if layer_past is not None:
            key = torch.cat((layer_past[0], key), dim=0)
            value = torch.cat((layer_past[1], value), dim=0)
        present = (key, value) if use_cache else None
        context = self._attention(query, key, value, attention_mask)
        return self.dense(context), present

    def _attention(self, query, key, value, attention_mask):
        coeff = float(self.layer_id + 1)
        query = query / (math.sqrt(self.head_dim) * coeff)
        sq, batch, heads, _ = query.shape
        sk = key.shape[0]
        query = query.view(sq, batch * heads, -1)
        key = key.view(sk, batch * heads, -1)
        scores = torch.zeros(1, 1, 1, dtype=query.dtype, device=query.device)
        scores = torch.baddbmm(scores, query.transpose(0, 1), key.transpose(0, 1).transpose(1, 2), beta=0.0, alpha=1.0)
        scores = scores.view(batch, heads, sq, sk)
        scores.masked_fill_(attention_mask, -10000.0)
        dtype = scores.dtype
        probs = F.softmax(scores.float() * coeff, dim=-1).type(dtype)
        value = value.view(sk, batch * heads, -1)
        context = torch.bmm(probs.view(batch * heads, sq, -1), value.transpose(0, 1))
        context = context.view(batch, heads, sq, -1).permute(2, 0, 1, 3).contiguous()
        return context.view(sq, batch, self.hidden_size)


class GLU(nn.Module):
    def __init__(self, config: ChatGLMConfig):
        super().__init__()
        inner = config.inner_hidden_size or 4 * config.hidden_size
        self.dense_h_to_4h = nn.Linear(config.hidden_size, inner, bias=True, dtype=torch.half)
        self.dense_4h_to_h = nn.Linear(inner, config.hidden_size, bias=True, dtype=torch.half)

    def forward(self, hidden_states):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(hidden_states), approximate="tanh"))


class GLMBlock(nn.Module):
    def __init__(self, config: ChatGLMConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_layers = config.num_layers
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.attention = SelfAttention(config, layer_id)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.mlp = GLU(config)

    def forward(self, hidden_states, position_ids, attention_mask, layer_id=None, layer_past=None, use_cache=False,
                output_attentions=False):
        attention_input = self.input_layernorm(hidden_states)
        attention_output, present = self.attention(attention_input, position_ids, attention_mask, layer_past, use_cache)
        alpha = (2 * self.num_layers) ** 0.5
        hidden_states = attention_input * alpha + attention_output
        mlp_input = self.post_attention_layernorm(hidden_states)
        output = mlp_input * alpha + self.mlp(mlp_input)
        return (output, present) if use_cache else (output,)


class ChatGLMPreTrainedModel(PreTrainedModel):
    config_class = ChatGLMConfig
    base_model_prefix = "transformer"
    supports_gradient_checkpointing = True
    _no_split_modules = ["GLMBlock"]

    def _init_weights(self, module):
        return  # the remote code initialises nothing (skip_init): the checkpoint provides every weight

    def get_masks(self, input_ids, device):
        """``[batch, 1, seq, seq]``, True where attention is masked: causal after ``<sop>``, full before it."""
        batch, seq = input_ids.shape
        context = _first_index(input_ids, self.config.bos_token_id)
        mask = torch.ones((batch, seq, seq), device=device)
        mask.tril_()
        prefix = torch.arange(seq, device=device)[None, None, :] < context[:, None, None]
        mask = torch.where(prefix, torch.ones_like(mask), mask)
        mask.unsqueeze_(1)
        return (mask < 0.5).bool()

    def get_position_ids(self, input_ids, device):
        """``[batch, 2, seq]``: positions (the mask token's after the context) and block positions."""
        batch, seq = input_ids.shape
        context = _first_index(input_ids, self.config.bos_token_id)[:, None]
        has_gmask = (input_ids == self.config.gmask_token_id).any(dim=-1, keepdim=True)
        mask_token = torch.where(has_gmask, torch.full_like(context, self.config.gmask_token_id),
                                 torch.full_like(context, self.config.mask_token_id))
        mask_position = _first_index(input_ids, mask_token)[:, None]
        arange = torch.arange(seq, dtype=torch.long, device=device).unsqueeze(0).repeat(batch, 1)
        if not self.config.position_encoding_2d:
            return torch.where(arange >= context, mask_position, arange)
        positions = torch.where(arange >= context, mask_position, arange)
        block = torch.where(arange >= context, arange - context + 1, torch.zeros_like(arange))
        return torch.stack((positions, block), dim=1)


def _first_index(input_ids, token) -> torch.Tensor:
    """Index of the first ``token`` in each row (``token``: an int or a ``[batch, 1]`` tensor); 0 if absent."""
    return (input_ids == token).int().argmax(dim=-1)


class ChatGLMModel(ChatGLMPreTrainedModel):
    def __init__(self, config: ChatGLMConfig, empty_init=True):
        super().__init__(config)
        self.num_layers = config.num_layers
        self.position_encoding_2d = config.position_encoding_2d
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, dtype=torch.half)
        self.layers = nn.ModuleList([GLMBlock(config, i) for i in range(config.num_layers)])
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.word_embeddings

    def set_input_embeddings(self, new_embeddings):
        self.word_embeddings = new_embeddings

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, past_key_values=None, inputs_embeds=None,
                use_cache=None, output_attentions=None, output_hidden_states=None, return_dict=None, **kwargs):
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        output_hidden_states = bool(output_hidden_states)
        return_dict = True if return_dict is None else return_dict
        if self.gradient_checkpointing and self.training:
            use_cache = False
        if input_ids is None and inputs_embeds is None:
            raise ValueError("You have to specify either input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        device = inputs_embeds.device
        if past_key_values is None:
            past_key_values = tuple([None] * len(self.layers))
        if input_ids is not None:
            if attention_mask is None or attention_mask.dim() != 4:
                attention_mask = self.get_masks(input_ids, device=device)
            if position_ids is None:
                position_ids = self.get_position_ids(input_ids, device=device)
        if attention_mask is None:
            attention_mask = torch.zeros(1, 1, device=device).bool()
        hidden_states = inputs_embeds.transpose(0, 1)  # [seq, batch, hidden]
        presents = () if use_cache else None
        all_hidden_states = () if output_hidden_states else None
        for i, layer in enumerate(self.layers):
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            if self.gradient_checkpointing and self.training:
                out = self._gradient_checkpointing_func(layer, hidden_states, position_ids, attention_mask, torch.tensor(i),
                                                        past_key_values[i], use_cache, bool(output_attentions))
            else:
                out = layer(hidden_states, position_ids=position_ids, attention_mask=attention_mask, layer_id=torch.tensor(i),
                            layer_past=past_key_values[i], use_cache=use_cache)
            hidden_states = out[0]
            if use_cache:
                presents += (out[1],)
        hidden_states = self.final_layernorm(hidden_states)
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        if not return_dict:
            return tuple(v for v in (hidden_states, presents, all_hidden_states) if v is not None)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=presents, hidden_states=all_hidden_states)


class ChatGLMForConditionalGeneration(ChatGLMPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "transformer.word_embeddings.weight"}

    def __init__(self, config: ChatGLMConfig, empty_init=True):
        super().__init__(config)
        self.transformer = ChatGLMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=torch.half)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None, position_ids=None, **kwargs):
        return {"input_ids": input_ids, "past_key_values": past_key_values, "position_ids": position_ids,
                "attention_mask": attention_mask}

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, past_key_values=None, inputs_embeds=None,
                labels=None, use_cache=None, output_attentions=None, output_hidden_states=None, return_dict=None, **kwargs):
        outputs = self.transformer(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                   past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                                   output_hidden_states=output_hidden_states, return_dict=True)
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(hidden_states).permute(1, 0, 2).contiguous()
        loss = None
        if labels is not None:
            logits = logits.to(torch.float32)
            shift_logits = logits[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous()
            loss = nn.CrossEntropyLoss(ignore_index=-100)(shift_logits.view(-1, shift_logits.size(-1)),
                                                          shift_labels.view(-1).to(shift_logits.device))
            logits = logits.to(hidden_states.dtype)
            loss = loss.to(hidden_states.dtype)
        if return_dict is False:
            return tuple(v for v in (loss, logits, outputs.cache, outputs.hidden_states) if v is not None)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache,
                                      hidden_states=outputs.hidden_states)


def register(stack=None) -> None:
    """Make ``model_type: chatglm`` build this rebuild through the Auto classes (undone by ``stack``)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "chatglm" not in CONFIG_MAPPING._extra_content:
        AutoConfig.register("chatglm", ChatGLMConfig, exist_ok=True)
        if stack is not None:
            stack.callback(CONFIG_MAPPING._extra_content.pop, "chatglm", None)
    for auto in (AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM):
        mapping = auto._model_mapping
        if ChatGLMConfig not in mapping._extra_content:
            auto.register(ChatGLMConfig, ChatGLMForConditionalGeneration, exist_ok=True)
            if stack is not None:
                stack.callback(mapping._extra_content.pop, ChatGLMConfig, None)


def parameter_count(config: ChatGLMConfig) -> int:
    """The parameter count by arithmetic (tied ``lm_head`` counted once)."""
    h, f, v = config.hidden_size, config.inner_hidden_size, config.vocab_size
    per_layer = 2 * 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
    return v * h + config.num_layers * per_layer + 2 * h
