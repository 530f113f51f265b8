"""``from_pretrained`` without downloads or data, for simulated runs.

* A local checkpoint or a cached Hub snapshot: its ``config.json`` gives the architecture; the
  ``*.safetensors`` headers (only the JSON header is read, never the tensors) give the stored dtype.
* A Hub id neither local nor cached: a bundled ``configs/<name>.json`` (see ``configs/index.json``; each
  file names its source), and the report says so.
* The model is built with fake parameters (no memory, no initialisation work), cast to ``dtype``
  (``"auto"``, transformers 5's default, means the checkpoint's dtype), then placed: ``device_map``
  (``"auto"``, ``"balanced"``, ``"sequential"``, a dict, a device) is resolved by accelerate against the
  simulated cards and the weights are created there, so they count on each card; accelerate's hooks are
  attached as ``from_pretrained`` would.
* A tokenizer that is neither local nor cached is a stand-in byte-level tokenizer (one token per UTF-8
  byte, so texts are several times longer than with the real vocabulary; padding/truncation to a fixed
  ``max_length`` are exact).

* ``quantization_config=BitsAndBytesConfig(load_in_4bit/8bit=True)``: :mod:`gpudoctor.simulate.quant`.

Models whose code is on the Hub only (``trust_remote_code``): ChatGLM-6B is built by gpudoctor's rebuild of
its architecture (:mod:`gpudoctor.simulate.chatglm`) with its published config; a cached snapshot runs
its own remote code. Not supported: other quantizers.
"""

from __future__ import annotations

import json
import os
import struct

import torch

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64, "I64": torch.int64,
           "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class NotSimulable(RuntimeError):
    """The simulation cannot build what the script asks for (said plainly, never a gpudoctor traceback)."""


def bundled_config(name: str) -> tuple[dict, str] | None:
    with open(os.path.join(CONFIG_DIR, "index.json"), encoding="utf-8") as fh:
        index = {k.lower(): v for k, v in json.load(fh).items()}
    fname = index.get(name.lower().rstrip("/"))
    if fname is None:
        return None
    with open(os.path.join(CONFIG_DIR, fname), encoding="utf-8") as fh:
        data = json.load(fh)
    return data, data.pop("_source", fname)


def safetensors_dtypes(folder: str) -> dict[str, torch.dtype]:
    """name -> stored dtype, read from the JSON headers of every ``*.safetensors`` in ``folder``."""
    out = {}
    for fname in sorted(os.listdir(folder)):
        if fname.endswith(".safetensors"):
            with open(os.path.join(folder, fname), "rb") as fh:
                (length,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(length))
            for key, info in header.items():
                if key != "__metadata__" and info.get("dtype") in _DTYPES:
                    out[key] = _DTYPES[info["dtype"]]
    return out


def _local_folder(name: str) -> str | None:
    if os.path.isdir(name):
        return name
    try:  # the module's own function: huggingface_hub.snapshot_download is patched during a simulation
        from huggingface_hub._snapshot_download import snapshot_download

        return snapshot_download(name, local_files_only=True)
    except Exception:
        return None


def resolve_config(name, sim, trust_remote_code=False, **config_kwargs):
    """(config, folder or None, where it came from)."""
    from transformers import AutoConfig, CONFIG_MAPPING

    folder = _local_folder(str(name))
    if folder is not None and os.path.exists(os.path.join(folder, "config.json")):
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code, **config_kwargs)
        return config, folder, f"{name}: config.json and safetensors headers from {folder} (no tensor data read)"
    bundled = bundled_config(str(name))
    if bundled is None:
        raise NotSimulable(f"{name} is not a local folder, not in the Hugging Face cache and not among the bundled "
                           f"configs ({', '.join(sorted(_bundled_names()))}). Download its config.json (or the model) once, "
                           "or pass a local folder.")
    data, source = bundled
    data = local_code_config(data, sim)
    model_type = data.pop("model_type")
    for key in ("architectures", "_name_or_path", "transformers_version"):
        data.pop(key, None)
    dtype = data.pop("torch_dtype", None)
    config = CONFIG_MAPPING[model_type](**data, **config_kwargs)
    if dtype:
        config.dtype = getattr(torch, dtype)
    config._name_or_path = str(name)
    return config, None, f"{name}: bundled config ({source}); no download"


def local_code_config(data: dict, sim) -> dict:
    """A bundled config without ``auto_map`` (the Hub's remote code is not run): its ``model_type`` is built
    by gpudoctor's rebuild (ChatGLM-6B: :mod:`gpudoctor.simulate.chatglm`), registered with the Auto classes
    for the simulation (for good in a process without one, e.g. ``gpudoctor plan``)."""
    data = {k: v for k, v in data.items() if k != "auto_map"}
    if data.get("model_type") == "chatglm":
        from gpudoctor.simulate import chatglm

        chatglm.register(sim._stack if sim is not None else None)
        if sim is not None and chatglm.SOURCE not in sim.notes:
            sim.notes.append(chatglm.SOURCE)
    return data


def _bundled_names() -> list[str]:
    with open(os.path.join(CONFIG_DIR, "index.json"), encoding="utf-8") as fh:
        return list(json.load(fh))


def _resolve_dtype(dtype, config, folder) -> torch.dtype:
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    if dtype is None or dtype == "auto":
        stored = safetensors_dtypes(folder) if folder else {}
        floating = [d for d in stored.values() if d.is_floating_point]
        if floating:
            return max(set(floating), key=floating.count)
        config_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(config_dtype, str):
            config_dtype = getattr(torch, config_dtype)
        return config_dtype or torch.float32
    return dtype


def build(model_cls, name, sim, *, auto: bool, **kwargs):
    """The simulated ``from_pretrained``."""
    quantization = kwargs.pop("quantization_config", None)
    if quantization is not None and getattr(quantization, "quant_method", None) not in ("bitsandbytes", None) and \
            not (getattr(quantization, "load_in_4bit", False) or getattr(quantization, "load_in_8bit", False)):
        raise NotSimulable(f"{type(quantization).__name__} loads are not simulated (only bitsandbytes 8/4-bit are)")
    config = kwargs.pop("config", None)
    trust = bool(kwargs.pop("trust_remote_code", False))
    dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None)
    device_map = kwargs.pop("device_map", None)
    max_memory = kwargs.pop("max_memory", None)
    folder = None
    if config is None or isinstance(config, str):
        config, folder, source = resolve_config(config or name, sim, trust_remote_code=trust)
    else:
        source = f"{name}: the config object passed by the script"
        folder = _local_folder(str(name))
    dtype = _resolve_dtype(dtype, config, folder)
    if auto:
        from transformers.models.auto.auto_factory import _get_model_class

        model_cls = _get_model_class(config, model_cls._model_mapping)
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = model_cls._from_config(config, dtype=dtype)
    model.tie_weights()  # from_pretrained ties embeddings after loading; _from_config under no_init_weights does not
    if quantization is not None:
        from gpudoctor.simulate.quant import quantize

        sim.weights_source.append(quantize(model, quantization))
    model.eval()
    model.name_or_path = str(name)
    sim.weights_source.append(f"{source}; {dtype}".replace("torch.", ""))
    if device_map is not None:
        place(model, device_map, max_memory, dtype)
    return model


def place(model, device_map, max_memory, dtype, no_split=None) -> None:
    from accelerate import dispatch_model
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    from gpudoctor.simulate import devices
    from gpudoctor.virtual import fake_place

    if isinstance(device_map, (int, str, torch.device)) and device_map not in ("auto", "balanced", "balanced_low_0", "sequential"):
        device_map = {"": device_map}
    if isinstance(device_map, str):
        no_split = list(no_split or getattr(model, "_no_split_modules", None) or [])
        if device_map != "sequential":
            max_memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype,
                                             low_zero=device_map == "balanced_low_0")
        device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype)
    offloaded = [k or "(the whole model)" for k, v in device_map.items() if str(v) in ("cpu", "disk")]
    on_gpus = [k for k, v in device_map.items() if str(v) not in ("cpu", "disk", "meta")]
    if offloaded and (on_gpus or any(str(v) == "disk" for v in device_map.values())):
        where = sorted({str(v) for v in device_map.values() if str(v) in ("cpu", "disk")})
        shown = ", ".join(offloaded[:4]) + (f" and {len(offloaded) - 4} more" if len(offloaded) > 4 else "")
        raise NotSimulable(
            f"the device map offloads {len(offloaded)} module(s) to {' and '.join(where)} ({shown}): the model does not fit "
            f"the simulated GPUs' memory{' with the max_memory given' if max_memory else ''}. Offloaded weights stay on "
            "the CPU and accelerate's hooks copy them to the GPU with real data at every forward, which gpudoctor "
            "--simulate does not model, so it stops here. With offload a run is slow and fragile (trainable "
            "weights on offloaded layers are a known failure: LoRA or an optimizer over them raises device errors, "
            "gpudoctor check GD102). Simulate more or larger cards, a smaller dtype or 8/4-bit, or give max_memory so "
            "every module stays on a GPU.")
    virtual = {k: (f"{devices.BACKEND}:{v}" if isinstance(v, int) else devices.translate(v)) for k, v in device_map.items()}
    resident = {k: v for k, v in virtual.items() if str(v).startswith(devices.BACKEND)}
    fake_place(model, resident)
    if len(set(map(str, virtual.values()))) > 1:
        import accelerate.big_modeling as big_modeling

        main = next(iter(resident.values()), "cpu")
        # accelerate keys tied weights by data_ptr(), which is 0 for every fake tensor: with a tied group it would
        # substitute the first tied weight for every parameter placed after it. fake_place kept them shared.
        find_tied = big_modeling.find_tied_parameters
        big_modeling.find_tied_parameters = lambda *a, **k: []
        try:
            dispatch_model(model, device_map=virtual, main_device=main, force_hooks=True)
        finally:
            big_modeling.find_tied_parameters = find_tied
    model.hf_device_map = dict(device_map)


def install(sim) -> None:
    """Route transformers' ``from_pretrained`` (models, auto classes, tokenizers) through the simulation."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return
    from transformers import AutoTokenizer, PreTrainedModel
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    def model_from_pretrained(cls, name, *args, **kwargs):
        return build(cls, name, sim, auto=False, **kwargs)

    def auto_from_pretrained(cls, name, *args, **kwargs):
        return build(cls, name, sim, auto=True, **kwargs)

    original_tokenizer = AutoTokenizer.from_pretrained.__func__

    def tokenizer_from_pretrained(cls, name, *args, **kwargs):
        try:
            return original_tokenizer(cls, name, *args, **{**kwargs, "local_files_only": True})
        except Exception:
            sim.notes.append(f"tokenizer of {name} is neither local nor cached: a byte-level stand-in is used "
                             "(one token per byte, so unpadded sequences are longer than with the real tokenizer)")
            return stand_in_tokenizer()

    import huggingface_hub

    original_snapshot = huggingface_hub.snapshot_download

    def snapshot_download(repo_id, *args, **kwargs):
        try:
            return original_snapshot(repo_id, *args, **{**kwargs, "local_files_only": True})
        except Exception:
            pass  # not cached: fall through, outside the handler, so the user sees one clear error
        return bundled_snapshot(repo_id, sim)

    def load_checkpoint_and_dispatch(model, checkpoint, device_map=None, max_memory=None, no_split_module_classes=None,
                                     dtype=None, **kwargs):
        sim.weights_source.append(f"load_checkpoint_and_dispatch({checkpoint}): placed by device_map, no tensor data read")
        if dtype is not None:
            model.to(dtype)
        if device_map is not None:
            place(model, device_map, max_memory, dtype or next(model.parameters()).dtype, no_split_module_classes)
        return model

    sim._set(huggingface_hub, "snapshot_download", snapshot_download)
    try:
        import accelerate

        sim._set(accelerate, "load_checkpoint_and_dispatch", load_checkpoint_and_dispatch)
        sim._set(accelerate.big_modeling, "load_checkpoint_and_dispatch", load_checkpoint_and_dispatch)
    except ImportError:
        pass
    sim._set(PreTrainedModel, "from_pretrained", classmethod(model_from_pretrained))
    from transformers.models.auto import modeling_auto

    for value in vars(modeling_auto).values():  # each Auto class carries its own copy of from_pretrained
        if isinstance(value, type) and issubclass(value, _BaseAutoModelClass) and "from_pretrained" in vars(value):
            sim._set(value, "from_pretrained", classmethod(auto_from_pretrained))
    sim._set(_BaseAutoModelClass, "from_pretrained", classmethod(auto_from_pretrained))
    sim._set(AutoTokenizer, "from_pretrained", classmethod(tokenizer_from_pretrained))


def bundled_snapshot(repo_id: str, sim) -> str:
    """``snapshot_download`` of a repo neither local nor cached: a folder holding only its bundled config.json."""
    import tempfile

    if bundled_config(repo_id) is None:
        resolve_config(repo_id, sim)  # raises NotSimulable with the reason
    data, source = bundled_config(repo_id)
    data = local_code_config(data, sim)
    folder = tempfile.mkdtemp(prefix="gpudoctor-simulated-snapshot-")
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(data, fh)
    sim.notes.append(f"snapshot_download({repo_id}) returned a folder with the bundled config.json only ({source})")
    return folder


def stand_in_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
