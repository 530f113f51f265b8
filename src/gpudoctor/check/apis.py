"""The library APIs the rules reason about, as data (qualified names after alias resolution).

Keeping these lists here, not inside rules, means a renamed or re-exported API is one edit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

# Re-exports and deep paths -> the canonical public name used in the tables below.
CANONICAL = {
    "torch.nn.parallel.DataParallel": "torch.nn.DataParallel",
    "torch.nn.parallel.data_parallel.DataParallel": "torch.nn.DataParallel",
    "torch.nn.DistributedDataParallel": "torch.nn.parallel.DistributedDataParallel",
    "torch.nn.parallel.distributed.DistributedDataParallel": "torch.nn.parallel.DistributedDataParallel",
    "torch.nn.utils.clip_grad.clip_grad_norm_": "torch.nn.utils.clip_grad_norm_",
    "torch.nn.utils.clip_grad.clip_grad_value_": "torch.nn.utils.clip_grad_value_",
    "torch.nn.utils.clip_grad_norm": "torch.nn.utils.clip_grad_norm_",
    "torch.utils.data.dataloader.DataLoader": "torch.utils.data.DataLoader",
    "torch.cuda.amp.GradScaler": "torch.amp.GradScaler",
    "torch.cuda.amp.grad_scaler.GradScaler": "torch.amp.GradScaler",
    "torch.amp.grad_scaler.GradScaler": "torch.amp.GradScaler",
    "torch.autograd.no_grad": "torch.no_grad",
    "torch.autograd.grad_mode.no_grad": "torch.no_grad",
    "torch.autograd.grad_mode.inference_mode": "torch.inference_mode",
    "accelerate.big_modeling.load_checkpoint_and_dispatch": "accelerate.load_checkpoint_and_dispatch",
    "accelerate.big_modeling.dispatch_model": "accelerate.dispatch_model",
    "accelerate.big_modeling.init_empty_weights": "accelerate.init_empty_weights",
    "accelerate.utils.infer_auto_device_map": "accelerate.infer_auto_device_map",
    "accelerate.utils.modeling.infer_auto_device_map": "accelerate.infer_auto_device_map",
    "accelerate.accelerator.Accelerator": "accelerate.Accelerator",
    "accelerate.state.PartialState": "accelerate.PartialState",
    "peft.mapping.get_peft_model": "peft.get_peft_model",
    "peft.mapping_func.get_peft_model": "peft.get_peft_model",
    "peft.utils.other.prepare_model_for_kbit_training": "peft.prepare_model_for_kbit_training",
    "transformers.data.data_collator.DataCollatorForLanguageModeling": "transformers.DataCollatorForLanguageModeling",
    "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel": "torch.distributed.fsdp.FullyShardedDataParallel",
    "torch.distributed._composable.fsdp.fully_shard": "torch.distributed.fsdp.fully_shard",
    "torch.distributed._composable.fsdp.fully_shard.fully_shard": "torch.distributed.fsdp.fully_shard",
    "torch.distributed.fsdp._fully_shard.fully_shard": "torch.distributed.fsdp.fully_shard",
    "torch.distributed.fsdp._fully_shard._fully_shard.fully_shard": "torch.distributed.fsdp.fully_shard",
}

ACCELERATOR = {"accelerate.Accelerator"}
DISPATCH = {"accelerate.load_checkpoint_and_dispatch", "accelerate.dispatch_model"}
INIT_EMPTY = {"accelerate.init_empty_weights"}
INFER_DEVICE_MAP = {"accelerate.infer_auto_device_map"}
GET_PEFT_MODEL = {"peft.get_peft_model"}
PEFT_LOADERS = {"peft.PeftModel.from_pretrained", "peft.PeftModelForCausalLM.from_pretrained"}
PASSTHROUGH = {"peft.prepare_model_for_kbit_training"}
# peft 0.21 other.py: ``for name, param in model.named_parameters(): param.requires_grad = False``, then only casts
FREEZE_ALL = {"peft.prepare_model_for_kbit_training"}

# diffusers' helper that upcasts a model's trainable (requires_grad) parameters, float32 by default
# (diffusers training_utils.cast_training_params(model, dtype=torch.float32)): the examples' fix for fp16 LoRA layers.
UPCAST_TRAINABLE = {"diffusers.training_utils.cast_training_params"}
DATA_PARALLEL = {"torch.nn.DataParallel"}
DISTRIBUTED_DATA_PARALLEL = {"torch.nn.parallel.DistributedDataParallel"}
# FSDP wrappers that swap the module's nn.Parameter objects for sharded ones (FSDP1 FlatParameter unless
# use_orig_params=True; FSDP2 DTensor parameters): an optimizer built before them holds orphaned tensors.
FSDP_WRAP = {"torch.distributed.fsdp.FullyShardedDataParallel"}
FSDP2_SHARD = {"torch.distributed.fsdp.fully_shard"}
TORCH_CLIP = {"torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad_value_"}
DATALOADER = {"torch.utils.data.DataLoader"}
GRAD_SCALER = {"torch.amp.GradScaler"}
NO_GRAD = {"torch.no_grad", "torch.inference_mode"}
LM_COLLATOR = {"transformers.DataCollatorForLanguageModeling"}
# Recurrent modules called as ``module(x, state)``: the state they return is computed from the state they are given,
# so it carries the autograd graph of every call it has been through (ncps' CfC/LTC return ``(output, hx)`` alike).
RECURRENT_MODULES = frozenset({
    "torch.nn.RNN", "torch.nn.LSTM", "torch.nn.GRU", "torch.nn.RNNCell", "torch.nn.LSTMCell", "torch.nn.GRUCell",
    "ncps.torch.CfC", "ncps.torch.LTC",
})

# Hub checkpoints whose tokenizer fills the embedding matrix exactly (``len(tokenizer) == config.vocab_size``): a token
# added to the tokenizer gets id ``vocab_size``, one past the last embedding row, until
# ``model.resize_token_embeddings(len(tokenizer))``. (pattern over the model id, family, vocab size, the special tokens
# the vocabulary already holds.) Vocab sizes: the checkpoints' config.json (``simulate/configs/gpt2.json``,
# ``Llama-2-7b-hf.json``, ``Mistral-7B-v0.1.json``); their tokenizers have exactly that many entries. Families whose
# embeddings are padded past the tokenizer (OPT 50272 > 50265, Pythia, Qwen2, Phi-2, T5) are left out: a few added
# tokens still fit there.
FULL_VOCAB_CHECKPOINTS: tuple[tuple[str, str, int, frozenset], ...] = (
    (r"^(openai-community/)?(distil)?gpt2(-medium|-large|-xl)?$", "GPT-2", 50257, frozenset({"<|endoftext|>"})),
    (r"^(EleutherAI/)?gpt-neo-(125m|125M|1\.3B|2\.7B)$", "GPT-Neo", 50257, frozenset({"<|endoftext|>"})),
    (r"(^|/)(Llama-2-\d+b(-chat)?-hf|llama-\d+b(-hf)?)$", "Llama 2 / LLaMA", 32000, frozenset({"<unk>", "<s>", "</s>"})),
    (r"^mistralai/Mistral-7B-(Instruct-)?v0\.[12]$", "Mistral-7B v0.1/v0.2", 32000, frozenset({"<unk>", "<s>", "</s>"})),
)
BNB_CONFIG = "transformers.BitsAndBytesConfig"
# trl's value-head wrappers (trl <= 0.2x; moved to trl.experimental.ppo in Dec 2025, gone from trl 1.16): their
# ``from_pretrained`` passes its keyword arguments on to transformers' ``from_pretrained``.
VALUE_HEAD_WRAPPERS_FROM_PRETRAINED = {
    "trl.AutoModelForCausalLMWithValueHead.from_pretrained",
    "trl.AutoModelForSeq2SeqLMWithValueHead.from_pretrained",
}

TRAINERS = {
    "transformers.Trainer",
    "transformers.Seq2SeqTrainer",
    "trl.SFTTrainer",
    "trl.DPOTrainer",
    "trl.ORPOTrainer",
    "trl.KTOTrainer",
    "trl.RewardTrainer",
    "trl.GRPOTrainer",
}
# Trainer methods a subclass overrides that the Trainer calls with its model as the first argument after ``self``.
TRAINER_MODEL_HOOKS = {"compute_loss", "training_step", "prediction_step"}
TRAINING_ARGS = {
    "transformers.TrainingArguments",
    "transformers.Seq2SeqTrainingArguments",
    "trl.SFTConfig",
    "trl.DPOConfig",
    "trl.GRPOConfig",
}

# Methods of nn.Module that move or cast the module in place (and return it).
MODULE_MOVES = {"to", "cuda", "xpu", "npu", "mps"}
MODULE_CASTS = {"half", "float", "bfloat16", "double"}
CAST_DTYPE = {"half": "float16", "float": "float32", "bfloat16": "bfloat16", "double": "float64"}

AUTO_STRATEGIES = {"auto", "balanced", "balanced_low_0", "sequential"}

_NON_MODEL_SUFFIXES = ("Config", "Tokenizer", "TokenizerFast", "Processor", "FeatureExtractor", "ImageProcessor")
_MODEL_CLASS = re.compile(r"^(AutoModel\w*|\w+For\w+|\w+Model|\w+LMHeadModel)$")


def canonical(qualname: str) -> str:
    if qualname in CANONICAL:
        return CANONICAL[qualname]
    parts = qualname.split(".")
    if parts[0] in ("transformers", "trl", "peft") and len(parts) > 2:
        # transformers.models.llama.modeling_llama.LlamaForCausalLM.from_pretrained
        #   -> transformers.LlamaForCausalLM.from_pretrained
        for i, part in enumerate(parts[1:], start=1):
            if part[:1].isupper():
                return ".".join([parts[0], *parts[i:]])
    return qualname


def is_optimizer(qualname: str) -> bool:
    parts = qualname.split(".")
    if qualname.startswith("torch.optim.") and "lr_scheduler" not in parts:
        return parts[-1][:1].isupper() and parts[-1] != "Optimizer"
    return qualname.startswith("bitsandbytes.optim.") or qualname in {"transformers.Adafactor"}


def is_scheduler(qualname: str) -> bool:
    return qualname.startswith("torch.optim.lr_scheduler.") or qualname in {
        "transformers.get_scheduler",
        "transformers.get_linear_schedule_with_warmup",
        "transformers.get_cosine_schedule_with_warmup",
    }


# torchvision.models helpers that return no model (weights enums, registries, feature-extractor wrappers).
_TORCHVISION_NON_BUILDERS = {"get_weight", "get_model_weights", "list_models", "create_feature_extractor",
                             "get_graph_node_names"}


def is_cpu_model_builder(qualname: str) -> bool:
    """A library call that builds a fresh ``nn.Module`` on the CPU: a torchvision model builder or class
    (``torchvision.models.resnet50(...)``, ``torchvision.models.segmentation.deeplabv3_resnet50(...)``,
    ``torchvision.models.get_model(...)``; weights, when asked for, are loaded on the CPU too) or
    ``timm.create_model(...)``."""
    if qualname == "timm.create_model":
        return True
    parts = qualname.split(".")
    if parts[:2] != ["torchvision", "models"] or len(parts) < 3:
        return False
    last = parts[-1]
    return last not in _TORCHVISION_NON_BUILDERS and not last.endswith("Weights") and not last.startswith("_") \
        and "feature_extraction" not in parts and "_utils" not in parts


def hf_class_method(qualname: str) -> tuple[str, str] | None:
    """``transformers.AutoModelForCausalLM.from_pretrained`` -> ("AutoModelForCausalLM", "from_pretrained")."""
    parts = qualname.split(".")
    if len(parts) == 3 and parts[0] in ("transformers", "peft"):
        return parts[1], parts[2]
    return None


def diffusers_model_load(qualname: str) -> tuple[str, str] | None:
    """``diffusers.UNet2DConditionModel.from_pretrained`` (also through a deep module path) -> (class, method):
    diffusers' model classes (``*Model``, ``Autoencoder*``: ``ModelMixin``, a ``torch.nn.Module``) loaded from a
    checkpoint. Pipelines (``*Pipeline``) hold several models and are not one."""
    parts = qualname.split(".")
    if parts[0] != "diffusers" or len(parts) < 3 or parts[-1] not in ("from_pretrained", "from_single_file"):
        return None
    owner = parts[-2]
    if owner.startswith(("Flax", "Onnx", "OnnxRuntime")):
        return None  # JAX modules and ONNX runtime sessions, not torch modules
    if owner[:1].isupper() and (owner.endswith("Model") or owner.startswith("Autoencoder")):
        return owner, parts[-1]
    return None


def is_model_class(name: str) -> bool:
    return bool(_MODEL_CLASS.match(name)) and not name.endswith(_NON_MODEL_SUFFIXES)


def is_config_class(name: str) -> bool:
    return name.endswith("Config") and name != "BitsAndBytesConfig"


# Older causal LM heads whose loss shifts the labels too (their docstrings in transformers 5.24: "the labels
# **are shifted** inside the model"); XLNetLMHeadModel does not shift and is not one.
_CAUSAL_LM_HEADS = {"GPT2LMHeadModel", "OpenAIGPTLMHeadModel", "CTRLLMHeadModel"}


def is_causal_lm_class(name: str) -> bool:
    return name.endswith("ForCausalLM") or name in {"AutoModelForCausalLM", "AutoPeftModelForCausalLM"} | _CAUSAL_LM_HEADS


# Remote-code checkpoints (``trust_remote_code=True``) whose bare ``AutoModel`` is a decoder-only LM: ChatGLM-6B,
# ChatGLM2/3 and GLM-4 map ``auto_map["AutoModel"]`` to ``modeling_chatglm.ChatGLMForConditionalGeneration``, whose
# forward shifts ``labels`` against its own input ids (a causal loss) despite the class name.
REMOTE_CAUSAL_LM_CHECKPOINT = re.compile(r"chatglm|glm-?4", re.IGNORECASE)


def is_seq2seq_class(name: str) -> bool:
    return "Seq2Seq" in name or name.endswith("ForConditionalGeneration")


# Encoder-decoder (and audio-to-text) language models: their forward returns vocabulary-sized logits per target
# token (``Seq2SeqLMOutput`` or a ``*CausalLMOutput*``). transformers 5.24: the classes of
# ``MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES`` and ``MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES``
# (``models/auto/modeling_auto.py``) except Dia (audio-codebook logits), and their Auto/PEFT loaders.
SEQ2SEQ_LM_CLASSES = frozenset({
    "AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq", "AutoPeftModelForSeq2SeqLM", "EncoderDecoderModel",
    "SpeechEncoderDecoderModel", "MarianMTModel", "SeamlessM4TForTextToText", "SeamlessM4Tv2ForTextToText",
    "SeamlessM4TForSpeechToText", "SeamlessM4Tv2ForSpeechToText", "SpeechT5ForSpeechToText",
    *(f"{m}ForConditionalGeneration" for m in (
        "AudioFlamingo3", "Bart", "BigBirdPegasus", "Blenderbot", "BlenderbotSmall", "Canary", "CohereAsr", "FSMT",
        "FunAsrNano", "GlmAsr", "GraniteSpeech", "GraniteSpeechPlus", "KyutaiSpeechToText", "LED", "LongT5", "M2M100",
        "MBart", "MT5", "Moonshine", "MoonshineStreaming", "MossTranscribeDiarize", "MusicFlamingo", "Mvp",
        "Nemotron3_5Transcribe", "NllbMoe", "OmniASR", "PLBart", "Pegasus", "PegasusX", "Pop2Piano", "ProphetNet",
        "Qwen2Audio", "Qwen3ASR", "Speech2Text", "SwitchTransformers", "T5", "T5Gemma", "T5Gemma2", "UMT5",
        "VibeVoice", "VibeVoiceAsr", "Voxtral", "VoxtralRealtime", "Whisper",
    )),
})


# diffusers pipelines. A pipeline is no module, but the components it registers are: diffusers 0.42.1, the
# ``__init__`` annotations of every ``*Pipeline`` class under ``diffusers/pipelines`` give these names torch
# modules (``UNet2DConditionModel``, ``AutoencoderKL``, ``CLIPTextModel``, ``*Transformer2DModel``,
# ``ControlNetModel``, ``VQModel``, ``MotionAdapter``...) in every torch pipeline; the tokenizers, schedulers
# and feature extractors are not. The ONNX pipelines hold ``OnnxRuntimeModel`` components (not modules).
DIFFUSION_PIPELINE_MODULES = frozenset({
    "unet", "vae", "text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "transformer_2",
    "image_encoder", "controlnet", "prior", "movq", "vqvae", "motion_adapter",
})
# How a pipeline is loaded (``DiffusionPipeline.from_pretrained``; ``from_pipe`` reuses another's components).
DIFFUSION_PIPELINE_LOADERS = frozenset({"from_pretrained", "from_single_file", "from_pipe"})


def is_diffusion_pipeline_load(qualname: Optional[str]) -> bool:
    """``diffusers.StableDiffusionPipeline.from_pretrained`` (any torch pipeline class, ``DiffusionPipeline``,
    ``AutoPipelineForText2Image``...; not ``Onnx*``/``Flax*``)."""
    parts = (qualname or "").split(".")
    if len(parts) < 3 or parts[0] != "diffusers" or parts[-1] not in DIFFUSION_PIPELINE_LOADERS:
        return False
    name = parts[-2]
    return (name.endswith("Pipeline") or name.startswith("AutoPipelineFor")) and "Onnx" not in name and not name.startswith("Flax")


# Well-known module names that scripts also give to an object: ``optim.zero_grad()`` is an optimizer named
# ``optim``, not ``torch.optim``. A member from this table used on the unbound name refutes the module reading
# (the name is then read by what it is used for, see ``FileFacts.assumed_instance``).
MODULE_NAME_REFUTED_BY = {
    "optim": frozenset({"zero_grad", "step", "param_groups", "state_dict", "load_state_dict", "add_param_group", "state"}),
}


# Members only a ``torch.nn.Module`` has (an optimizer has ``state_dict``/``zero_grad`` too, a tensor ``to``/
# ``cuda``, a DataFrame ``eval``): one of ``MODULE_ONLY_MEMBERS``, or one of each ``MODULE_MEMBER_PAIRS`` side, shows
# that an object of a class the file does not show is a module.
MODULE_ONLY_MEMBERS = frozenset({
    "parameters", "named_parameters", "modules", "named_modules", "children", "named_children", "buffers",
    "named_buffers", "register_forward_hook", "register_forward_pre_hook", "register_buffer", "requires_grad_",
})
MODULE_MEMBER_PAIRS = (frozenset({"load_state_dict", "eval", "train"}), frozenset({"to", "cuda", "half", "eval", "train"}))


def used_as_module(members: set[str]) -> bool:
    """``members`` (what a name is used with) show an ``nn.Module``."""
    if members & MODULE_ONLY_MEMBERS:
        return True
    first, second = MODULE_MEMBER_PAIRS
    return any(a != b for a in members & first for b in members & second)


# Names a snippet (a notebook cell, a forum post, a star import) uses without importing them: an unbound
# name from this table is read as the library object it names, and findings say so.
WELL_KNOWN_NAMES = {
    "torch": "torch",
    "nn": "torch.nn",
    "F": "torch.nn.functional",
    "optim": "torch.optim",
    "DataLoader": "torch.utils.data.DataLoader",
    "Dataset": "torch.utils.data.Dataset",
    "DistributedSampler": "torch.utils.data.DistributedSampler",
    "DataParallel": "torch.nn.DataParallel",
    "DistributedDataParallel": "torch.nn.parallel.DistributedDataParallel",
    "DDP": "torch.nn.parallel.DistributedDataParallel",
    "clip_grad_norm_": "torch.nn.utils.clip_grad_norm_",
    "AdamW": "torch.optim.AdamW",
    "Adam": "torch.optim.Adam",
    "SGD": "torch.optim.SGD",
    "Accelerator": "accelerate.Accelerator",
    "PartialState": "accelerate.PartialState",
    "init_empty_weights": "accelerate.init_empty_weights",
    "load_checkpoint_and_dispatch": "accelerate.load_checkpoint_and_dispatch",
    "dispatch_model": "accelerate.dispatch_model",
    "infer_auto_device_map": "accelerate.infer_auto_device_map",
    "get_peft_model": "peft.get_peft_model",
    "prepare_model_for_kbit_training": "peft.prepare_model_for_kbit_training",
    "LoraConfig": "peft.LoraConfig",
    "PeftModel": "peft.PeftModel",
    "TaskType": "peft.TaskType",
    "AutoModel": "transformers.AutoModel",
    "AutoModelForCausalLM": "transformers.AutoModelForCausalLM",
    "AutoModelForSeq2SeqLM": "transformers.AutoModelForSeq2SeqLM",
    "AutoModelForSequenceClassification": "transformers.AutoModelForSequenceClassification",
    "AutoTokenizer": "transformers.AutoTokenizer",
    "AutoConfig": "transformers.AutoConfig",
    "BitsAndBytesConfig": "transformers.BitsAndBytesConfig",
    "Trainer": "transformers.Trainer",
    "TrainingArguments": "transformers.TrainingArguments",
    "Seq2SeqTrainer": "transformers.Seq2SeqTrainer",
    "Seq2SeqTrainingArguments": "transformers.Seq2SeqTrainingArguments",
    "DataCollatorForLanguageModeling": "transformers.DataCollatorForLanguageModeling",
    "DataCollatorForSeq2Seq": "transformers.DataCollatorForSeq2Seq",
    "get_scheduler": "transformers.get_scheduler",
    "get_linear_schedule_with_warmup": "transformers.get_linear_schedule_with_warmup",
    "get_cosine_schedule_with_warmup": "transformers.get_cosine_schedule_with_warmup",
    "SFTTrainer": "trl.SFTTrainer",
    "SFTConfig": "trl.SFTConfig",
    "pipeline": "transformers.pipeline",
    "torchvision": "torchvision",  # ``torchvision.models.resnet18(...)`` pasted without its import
    "UNet2DConditionModel": "diffusers.UNet2DConditionModel",
}

# What ``from torch import *`` / ``from torch.nn import *`` bind that the engine reads (torch 2.13: the names are in
# ``torch.__all__``; ``torch.nn`` has no ``__all__``, so its public names). ``cuda``, ``nn`` and ``optim`` are not in
# ``torch.__all__``: a star import of torch does not bind them.
STAR_EXPORTS = {
    "torch": frozenset("""
        BoolTensor ByteTensor DoubleTensor FloatTensor GradScaler IntTensor LongTensor Size Tensor arange argmax
        as_tensor autocast bernoulli bfloat16 bincount bool cat concat concatenate cos cumsum device diag dtype empty
        empty_like enable_grad exp eye flip float float16 float32 float64 from_numpy full full_like half histc
        inference_mode int int32 int64 is_tensor linspace load log logspace long manual_seed matmul multinomial
        no_grad normal numel ones ones_like outer polar rand rand_like randint randint_like randn randn_like randperm
        save sigmoid sin softmax stack tensor tril tril_indices triu triu_indices uint8 where zeros zeros_like
    """.split()),
    "torch.nn": frozenset("""
        functional init parallel utils
        BCELoss BCEWithLogitsLoss BatchNorm1d BatchNorm2d BatchNorm3d CTCLoss Conv1d Conv2d Conv3d ConvTranspose2d
        CosineEmbeddingLoss CrossEntropyLoss DataParallel Dropout Embedding Flatten GELU GRU GaussianNLLLoss GroupNorm
        HuberLoss Identity KLDivLoss L1Loss LSTM LSTMCell LayerNorm LeakyReLU Linear LogSoftmax MSELoss
        MarginRankingLoss MaxPool1d MaxPool2d Module ModuleDict ModuleList MultiLabelMarginLoss MultiLabelSoftMarginLoss
        MultiMarginLoss MultiheadAttention NLLLoss Parameter ParameterDict ParameterList PoissonNLLLoss ReLU RNN
        Sequential SiLU Sigmoid SmoothL1Loss SoftMarginLoss Softmax SyncBatchNorm Tanh Transformer TransformerEncoder
        TransformerEncoderLayer TripletMarginLoss Upsample
    """.split()),
}


def star_imported(name: str, star_modules: list) -> Optional[str]:
    """The qualname an unbound ``name`` has through the file's star imports (the last one that binds it wins, as in
    Python), or None: also None when a later star import from a module this table does not know may bind it."""
    for module in reversed(star_modules):
        exports = STAR_EXPORTS.get(module)
        if exports is None:
            return None
        if name in exports:
            return f"{module}.{name}"
    return None


# An unbound name spelled like a transformers model class (``LlamaForCausalLM``, ``AutoModelForCausalLM``) is
# read as that class in a snippet; trl's value-head wrappers live in trl.
_HF_MODEL_CLASS_NAME = re.compile(r"^(?:AutoModel\w*|AutoPeftModel\w*|[A-Z][A-Za-z0-9]*For[A-Z]\w*)$")


def well_known_class(name: str) -> Optional[str]:
    """The library class an unbound class-like name in a snippet stands for, or None."""
    if not _HF_MODEL_CLASS_NAME.match(name) or name.endswith(_NON_MODEL_SUFFIXES):
        return None
    if name.endswith("WithValueHead"):
        return f"trl.{name}"
    if name.startswith("AutoPeftModel"):
        return f"peft.{name}"
    return f"transformers.{name}"


@dataclass(frozen=True)
class InstanceProfile:
    """A library object a snippet uses under a name it never binds (``accelerator`` from an earlier cell).

    The name is assumed to be that object when it is used with the object's members: for a ``conventional``
    name one ``distinctive`` or ``common`` member is enough, any other name needs two ``distinctive`` ones.
    With ``members`` (the whole public API) a name also used with anything else is not assumed
    (``scaler.transform(...)`` is scikit-learn's). ``by_name``: an object used by iterating it rather than
    through members (a snippet's ``for data in trainloader``) is assumed from a ``conventional`` name alone."""

    kind: str  # the value kind (facts.Value.kind)
    qualname: str
    conventional: frozenset
    distinctive: frozenset
    common: frozenset = frozenset()
    members: Optional[frozenset] = None
    by_name: bool = False


INSTANCE_PROFILES = (
    InstanceProfile(
        "accelerator",
        "accelerate.Accelerator",
        conventional=frozenset({"accelerator"}),
        distinctive=frozenset({
            "prepare", "prepare_model", "prepare_optimizer", "prepare_data_loader", "prepare_scheduler", "accumulate",
            "unwrap_model", "gather_for_metrics", "wait_for_everyone", "is_main_process", "is_local_main_process",
            "sync_gradients", "main_process_first", "local_main_process_first", "end_training", "init_trackers",
            "save_state", "load_state", "pad_across_processes", "split_between_processes", "unscale_gradients",
            "optimizer_step_was_skipped", "num_processes", "process_index", "local_process_index",
        }),
        # Shared with other objects (a DeepSpeed engine's ``backward``, an FSDP module's ``clip_grad_norm_``).
        common=frozenset({"backward", "clip_grad_norm_", "clip_grad_value_", "print", "device", "gather", "reduce", "log", "save"}),
    ),
    InstanceProfile(
        "grad_scaler",
        "torch.amp.GradScaler",
        conventional=frozenset({"scaler", "grad_scaler", "amp_scaler", "gradscaler"}),
        distinctive=frozenset({"scale", "unscale_", "get_scale"}),
        common=frozenset({"step", "update"}),
        members=frozenset({
            "get_backoff_factor", "get_growth_factor", "get_growth_interval", "get_scale", "is_enabled",
            "load_state_dict", "scale", "set_backoff_factor", "set_growth_factor", "set_growth_interval",
            "state_dict", "step", "unscale_", "update",
        }),
    ),
    # The CIFAR-10 tutorial's ``for i, data in enumerate(trainloader, 0)`` pasted as a cell without the cell that
    # built ``trainloader``: the names torch's tutorials and most posts give a DataLoader. A name also used with
    # anything but a DataLoader attribute (``train_loader.next_batch()``) is not assumed.
    InstanceProfile(
        "dataloader",
        "torch.utils.data.DataLoader",
        conventional=frozenset({
            "trainloader", "testloader", "valloader", "validloader", "evalloader",
            "train_loader", "test_loader", "val_loader", "valid_loader", "eval_loader", "dev_loader",
            "dataloader", "data_loader", "train_dataloader", "test_dataloader", "val_dataloader",
            "valid_dataloader", "eval_dataloader", "train_dl", "test_dl", "val_dl", "valid_dl", "eval_dl",
        }),
        distinctive=frozenset(),
        members=frozenset({
            "dataset", "batch_size", "sampler", "batch_sampler", "num_workers", "collate_fn", "pin_memory",
            "drop_last", "timeout", "worker_init_fn", "generator", "prefetch_factor", "persistent_workers",
            "multiprocessing_context", "pin_memory_device", "in_order",
        }),
        by_name=True,
    ),
)


def instance_profile(name: str, members: set) -> Optional[InstanceProfile]:
    """The profile an unbound ``name`` (``accelerator``, or ``scaler`` of ``self.scaler``) used with ``members``
    matches, or None."""
    for profile in INSTANCE_PROFILES:
        if profile.members is not None and not members <= profile.members:
            continue
        distinctive = members & profile.distinctive
        if len(distinctive) >= 2 or (name in profile.conventional and (distinctive or members & profile.common)):
            return profile
        if profile.by_name and name in profile.conventional:
            return profile
    return None

# The prefilter for files that import none of the libraries: a snippet still counts when it uses ``torch.``
# or calls (or reads an attribute of) one of the distinctive well-known names; generic ones such as
# ``nn``/``F``/``Adam`` are not enough on their own.
_SNIPPET_NAMES = sorted(
    (n for n in WELL_KNOWN_NAMES if len(n) > 6 and n not in ("Dataset", "Trainer")), key=len, reverse=True
)
_INSTANCE_USE = "|".join(
    "(?:" + "|".join(sorted(p.conventional)) + r")\.(?:" + "|".join(sorted(p.distinctive | p.common)) + ")"
    for p in INSTANCE_PROFILES
    if p.distinctive | p.common
)
# A cell that only trains or evaluates what earlier cells built (``net.cuda()``, ``Net(...).cuda()``,
# ``optimizer.zero_grad()``, ``loss.backward()``, ``model.eval()``, ``x.to(device)``) names no library at all: those
# calls count too, and so does a model class pasted on its own (``class Net(nn.Module):``).
SNIPPET_USE = re.compile(
    rb"\btorch\.[a-z]|(?<![\w.])(?:" + "|".join(_SNIPPET_NAMES).encode() + rb")\s*[(.]"
    + rb"|(?<![\w.])(?:self\.)?(?:" + _INSTANCE_USE.encode() + rb")\b"
    + rb"|[\w)\]]\.(?:zero_grad|backward|cuda)\(\s*[)\w]|\w\.eval\(\s*\)|\w\.to\(\s*device\b"
    + rb"|\bclass\s+\w+\s*\(\s*(?:torch\.)?nn\.Module\s*\)"
)
