"""Simulated peaks for ``gpudoctor plan``: :func:`gpudoctor.simulate.simulate_step` on the model, cached.

A 7B model's full step takes the engine about 40 s here, and a plan needs a dozen of them, so a plan
simulates copies of the architecture with fewer decoder layers and extrapolates by layer:

* one GPU: the model with ``K1`` and ``K2`` layers on one card; every number (peak allocated and
  reserved, each category at the peak, trainable bytes) is ``a + b * layers`` through those two points;
* a ``device_map`` pipeline (accelerate's balanced map for the real cards, computed on a meta model as
  the engine's ``from_pretrained`` does): one copy on four devices, the first card's modules, a middle
  card with ``K1`` and one with ``K2`` layers, the last card's modules (the embeddings and the head where
  the real map puts them); each middle card is the line through the two middle devices at the layers it
  holds, the first and last cards their own device continued along that line (a layer adds the same
  bytes to whichever card holds it); see :meth:`gpudoctor.plan.planner.Planner.pipeline`.

Every layer of a decoder is the same shape, so weights, gradients, optimizer state and saved
activations grow by the same bytes per layer within each phase of the step; the phases grow at different
rates, so each phase's peak is extrapolated on its own and the highest taken (:func:`extrapolate`). The
extrapolation is checked against full simulations in ``tests/plan/test_extrapolation.py``. Encoder-
decoder models and shallow models are simulated whole.

The simulations run on cards like the real ones but without a memory limit, so a configuration that
does not fit still gets its full peak (what it *would* need); ``fits`` compares that with the card.
Results are cached as JSON under ``$GPUDOCTOR_CACHE_DIR/plan`` (default ``~/.cache/gpudoctor/plan``),
keyed by the engine's source, the installed library versions, the model config and the case.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

K1, K2 = 1, 2


def depths(method: "Method") -> tuple[int, int]:
    """The two depths a method is simulated at. Under AMP the one-layer copies are off the line (the
    fp16 casts autocast keeps for the head and the first layer peak at another moment): 2 and 3 layers."""
    return (2, 3) if method.autocast else (K1, K2)
UNBOUNDED = 1 << 45  # a card no simulated step fills: the simulation reports what the step needs
NUMBERS = ("peak_allocated", "peak_reserved", "trainable_bytes")
CATEGORIES = ("weights", "gradients", "optimizer_state", "activations", "temporaries", "other")


@dataclass(frozen=True)
class Method:
    """How the model is trained: weight dtype, AMP, LoRA, quantized base."""

    key: str
    label: str
    dtype: str  # the dtype the weights are loaded in
    autocast: str | None = None
    lora: bool = False
    quant_bits: int | None = None

    @property
    def compute_dtype(self) -> str:
        return self.autocast or self.dtype


@dataclass(frozen=True)
class Workload:
    batch: int = 4
    seq: int = 512
    target_len: int | None = None
    lora_r: int = 16
    lora_alpha: int = 32
    lora_targets: str | tuple[str, ...] | None = "all-linear"  # None: peft's default for the architecture
    optimizer: str = "adamw"
    foreach: bool | None = None  # AdamW's multi-tensor implementation (None: torch's default, on for CUDA)

    def lora_kwargs(self) -> dict:
        targets = self.lora_targets if isinstance(self.lora_targets, str) or self.lora_targets is None else list(self.lora_targets)
        return {"r": self.lora_r, "lora_alpha": self.lora_alpha, "lora_dropout": 0.05, "target_modules": targets}


# -------------------------------------------------------------------------------------------------
# the model's architecture


@dataclass
class ModelInfo:
    name: str
    config: object
    source: str
    encoder_decoder: bool
    num_layers: int
    layers_path: str | None  # "model.layers"; None when the model has no single stack of decoder layers
    no_split: list[str]
    num_params: int
    layer_params: int  # parameters of one decoder layer
    remote_code: bool = False  # the architecture is the Hub's remote code (loaded with trust_remote_code=True)

    def config_key(self) -> str:
        """The config as part of a cache key. Without its dtype: building a model from the config
        (``_from_config(config, dtype=...)``, e.g. each method's meta model for its device map) writes that
        dtype into the shared config, so the key would depend on which model was built last (a cache miss,
        or a prefetched result simulated twice); the case's dtype is the method's, keyed on its own."""
        data = {k: v for k, v in self.config.to_dict().items() if k not in ("dtype", "torch_dtype")}
        return json.dumps(data, sort_keys=True, default=str)


def resolve(model: str) -> ModelInfo:
    """The architecture of ``model`` (Hub id, local folder or config.json), from the engine's resolver."""
    from gpudoctor.simulate import hub

    path = model
    if os.path.isfile(model) and model.endswith(".json"):
        path = os.path.dirname(os.path.abspath(model))
    config, _, source = hub.resolve_config(path, None)
    meta = _meta_model(config)
    layers_path = _layers_path(meta, config)
    import peft  # noqa: F401  (imported once here, not in every forked simulation)

    layer_params = 0
    if layers_path:
        layer_params = max(sum(p.numel() for p in layer.parameters()) for layer in meta.get_submodule(layers_path))
    return ModelInfo(name=model, config=config, source=source, encoder_decoder=bool(getattr(config, "is_encoder_decoder", False)),
                     num_layers=int(getattr(config, "num_hidden_layers", 0) or 0), layers_path=layers_path,
                     no_split=list(getattr(meta, "_no_split_modules", None) or []),
                     num_params=sum(p.numel() for p in _unique_params(meta)), layer_params=layer_params,
                     remote_code=is_remote_code(config))


def is_remote_code(config) -> bool:
    """Whether transformers itself lacks the architecture: the checkpoint ships it (``auto_map``) and
    ``from_pretrained`` needs ``trust_remote_code=True``."""
    from transformers import CONFIG_MAPPING

    model_type = getattr(config, "model_type", None)
    if model_type in CONFIG_MAPPING and CONFIG_MAPPING[model_type].__module__.startswith("transformers."):
        return False
    return bool(getattr(config, "auto_map", None)) or model_type is not None


def _unique_params(model):
    seen = set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            yield p


def _model_class(config):
    """The class ``from_pretrained`` would build: the Seq2SeqLM mapping's, then the CausalLM mapping's, then
    AutoModel's (e.g. a remote-code model registered only there, as ChatGLM's ``AutoModel``)."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM
    from transformers.models.auto.auto_factory import _get_model_class

    autos = (AutoModelForSeq2SeqLM, AutoModelForCausalLM, AutoModel)
    if not getattr(config, "is_encoder_decoder", False):
        autos = autos[1:]
    for auto in autos:
        try:
            return _get_model_class(config, auto._model_mapping)
        except (KeyError, ValueError):
            continue
    from gpudoctor.simulate.hub import NotSimulable

    raise NotSimulable(f"transformers has no model class for {type(config).__name__} "
                            f"(model_type {getattr(config, 'model_type', '?')!r})")


def auto_class_name(info: "ModelInfo") -> str:
    """The Auto class a script loads this model with (what the printed code imports)."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    cls = _model_class(info.config)
    for auto in (AutoModelForSeq2SeqLM, AutoModelForCausalLM):
        if cls in auto._model_mapping.values():
            return auto.__name__
    return "AutoModel"


def cast_floating(model, dtype) -> None:
    """Cast every floating parameter to ``dtype``: some architectures pin their own (ChatGLM-6B's remote
    code creates its Linears and embeddings in fp16 whatever ``dtype`` says), but a plan's strategy is
    the dtype the weights train in (e.g. fp32 master weights under AMP, after ``.float()``)."""
    import torch

    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None and param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)


_META: dict = {}  # (config, dtype, bits) -> meta model, built once per process (a 7B one takes seconds)


def _meta_model(config, dtype=None, quant_bits=None, fresh: bool = False):
    """The model on the meta device (no memory); shared per config, dtype and bits unless ``fresh``:
    callers only read it."""
    key = (id(config), str(dtype), quant_bits)
    if not fresh and key in _META and _META[key][0] is config:
        return _META[key][1]
    model = _build_meta(config, dtype, quant_bits)
    if not fresh:
        _META[key] = (config, model)
    return model


def _build_meta(config, dtype=None, quant_bits=None):
    import torch
    from accelerate import init_empty_weights

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with init_empty_weights():
        model = _model_class(config)._from_config(config, dtype=dtype or torch.float32)
    model.tie_weights()
    cast_floating(model, dtype or torch.float32)
    if quant_bits:
        quantize(model, quant_bits, dtype)
    return model


def quantize(model, bits: int, compute_dtype) -> None:
    """The engine's bitsandbytes storage model (:mod:`gpudoctor.simulate.quant`), as the printed code loads
    it: NF4 with double quantization and ``bnb_4bit_compute_dtype`` = the base dtype, or LLM.int8."""
    from types import SimpleNamespace

    import torch

    from gpudoctor.simulate.quant import quantize as engine_quantize

    compute_dtype = getattr(torch, compute_dtype) if isinstance(compute_dtype, str) else compute_dtype
    engine_quantize(model, SimpleNamespace(load_in_4bit=bits == 4, load_in_8bit=bits == 8, bnb_4bit_quant_type="nf4",
                                           bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute_dtype))


def prepare_kbit(model) -> None:
    """peft's ``prepare_model_for_kbit_training`` without its checkpointing (the step enables that): freezes
    the base and upcasts the 16-bit parameters left (norms, embeddings, the head) to fp32."""
    from peft import prepare_model_for_kbit_training

    prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def _layers_path(model, config) -> str | None:
    n = getattr(config, "num_hidden_layers", None)
    if not n or getattr(config, "is_encoder_decoder", False):
        return None
    import torch.nn as nn

    stacks = [name for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    return stacks[0] if len(stacks) == 1 else None


def reduced_config(config, layers: int):
    data = config.to_dict()
    data["num_hidden_layers"] = layers
    if isinstance(data.get("layer_types"), list):
        data["layer_types"] = data["layer_types"][:layers]
    for key in ("n_layer", "num_layers"):  # configs that store the depth under their own name
        if key in data and key != "num_hidden_layers":
            data[key] = layers
    return type(config).from_dict(data)


# -------------------------------------------------------------------------------------------------
# device maps


def device_map_for(info: ModelInfo, method: Method, cards) -> dict:
    """accelerate's balanced map for ``cards``, as the engine's simulated ``from_pretrained(device_map="auto")``
    computes it (budgets = each card's free memory before the first tensor)."""
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    import torch

    from gpudoctor.simulate import Simulation

    meta = _meta_model(info.config, method.dtype, method.quant_bits)
    max_memory = {i: card.usable for i, card in enumerate(cards)}
    max_memory["cpu"] = 1 << 50
    dtype = getattr(torch, method.dtype)
    with Simulation(list(cards)):  # accelerate checks the devices against torch.cuda: the simulated cards
        balanced = get_balanced_memory(meta, max_memory=max_memory, no_split_module_classes=info.no_split, dtype=dtype)
        return infer_auto_device_map(meta, max_memory=balanced, no_split_module_classes=info.no_split, dtype=dtype)


def module_bytes(info: ModelInfo, method: Method, names: list[str]) -> int:
    """Bytes of the weights under the given module names (e.g. the ones a map offloads), with the
    quantization constants bitsandbytes keeps as buffers."""
    import torch

    meta = _meta_model(info.config, method.dtype, method.quant_bits)
    total = 0
    for name in names:
        module = meta.get_submodule(name) if name else meta
        total += sum(p.numel() * p.element_size() for p in module.parameters())
        total += sum(b.numel() * b.element_size() for b in module.buffers() if b.is_floating_point() or b.dtype == torch.uint8)
    return total


def layer_index(info: ModelInfo, key: str) -> int | None:
    if not info.layers_path:
        return None
    match = re.match(rf"^{re.escape(info.layers_path)}\.(\d+)(\.|$)", key)
    return int(match.group(1)) if match else None


def layers_per_device(info: ModelInfo, device_map: dict) -> dict:
    counts: dict = {}
    for key, device in device_map.items():
        index = layer_index(info, key)
        if index is not None:
            counts.setdefault(device, set()).add(index)
    return {device: len(indices) for device, indices in counts.items()}


# -------------------------------------------------------------------------------------------------
# simulations


def _cache_dir() -> Path:
    root = os.environ.get("GPUDOCTOR_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "gpudoctor")
    return Path(root) / "plan"


_FINGERPRINT: list[str] = []
# Part of every cache key with the engine's source: bump it when what ``_run`` builds or measures changes
# (this file's other edits, e.g. scheduling, keep the cache).
RESULT_FORMAT = 3  # 3: each device's per-phase peaks ("phases")


def _engine_fingerprint() -> str:
    if not _FINGERPRINT:
        import gpudoctor.simulate as simulate_pkg
        from gpudoctor.check import versions

        digest = hashlib.sha256(f"format={RESULT_FORMAT}".encode())
        for path in sorted(Path(simulate_pkg.__file__).parent.glob("*.py")):
            digest.update(path.read_bytes())
        for lib in ("torch", "transformers", "peft", "accelerate"):
            digest.update(f"{lib}={versions.installed(lib)}".encode())
        _FINGERPRINT.append(digest.hexdigest()[:16])
    return _FINGERPRINT[0]


def simulate(info: ModelInfo, method: Method, workload: Workload, checkpointing: bool, card,
             layers: tuple[int, ...] | None, device_map: dict | None = None, use_cache: bool = True) -> dict:
    """One simulated training step (2 optimizer steps) on unbounded copies of ``card``.

    ``layers``: decoder layers per device of a reduced copy (``(k,)`` one card, ``(k, k, k)`` first /
    middle / last device of a pipeline), with ``device_map`` giving where the other modules go
    (``{name: role index}``); ``None``: the whole model, on one card or on ``device_map``.
    Returns ``{"devices": [{numbers, "breakdown": {category: bytes}}], "trainable_bytes": ...}``.
    """
    args = (info, method, workload, checkpointing, card, layers, device_map)
    key = request_key(*args)
    result = _FAILED.get(key) or _FRESH.get(key) or (_load(key) if use_cache else None)
    if result is None:
        result = _run_isolated(*args)
        _keep(key, result, use_cache)
    if "error" in result:
        raise SimulationFailed(result["error"])
    return result


def prefetch(requests: list[tuple], jobs: int | None = None, use_cache: bool = True, progress=None) -> None:
    """Run the simulations ``simulate`` would run for ``requests`` (its argument tuples), ``jobs`` at a time
    (default: the number of cores), each in its own forked child."""
    from multiprocessing.connection import wait

    jobs = jobs or os.cpu_count() or 1
    pending, seen = [], set()
    for args in requests:
        key = request_key(*args)
        if key not in seen and key not in _FAILED and key not in _FRESH and not (use_cache and _load(key) is not None):
            seen.add(key)
            pending.append((key, args))
    total, running = len(pending), {}
    while pending or running:
        while pending and len(running) < jobs:
            key, args = pending.pop(0)
            receive, child = _launch(args)
            running[receive] = (key, args, child)
        for receive in wait(list(running)):
            key, args, child = running.pop(receive)
            result = _collect(receive, child)
            if _fork_refused(result, child):
                pending.append((key, args))
                continue
            _keep(key, result, use_cache)
            if progress:
                progress(f"simulated {total - len(pending) - len(running)}/{total}")


_FAILED: dict[str, dict] = {}  # failures are not cached on disk (a fixed engine should get another try)


def request_key(info, method, workload, checkpointing, card, layers, device_map) -> str:
    key_data = {"engine": _engine_fingerprint(), "config": info.config_key(), "method": dataclasses.asdict(method),
                "workload": dataclasses.asdict(workload), "checkpointing": checkpointing, "context": card.context,
                "layers": layers, "device_map": device_map}
    return hashlib.sha256(json.dumps(key_data, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _load(key: str) -> dict | None:
    path = _cache_dir() / f"{key}.json"
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except (OSError, ValueError):
        return None


def _keep(key: str, result: dict, use_cache: bool) -> None:
    if "error" in result:
        _FAILED[key] = result
        return
    if not use_cache:
        _FRESH[key] = result
        return
    path = _cache_dir() / f"{key}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(path)
    except OSError:
        _FRESH[key] = result


_FRESH: dict[str, dict] = {}  # results of this process when the disk cache is off or not writable


class SimulationFailed(RuntimeError):
    """The engine could not simulate a case (the message says why)."""


def _run_isolated(*args) -> dict:
    """``_run`` in a child process: the engine's global patches stay out of this process, and an engine
    failure (an exception inside autograd on the virtual backend aborts the process) costs one case."""
    while True:
        receive, child = _launch(args)
        result = _collect(receive, child)
        if not _fork_refused(result, child):
            return result


_START = ["fork"]  # fork: no second import of torch; spawn once this process has run autograd itself


def _launch(args):
    import multiprocessing

    context = multiprocessing.get_context(_START[0])
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(send, args))
    child.start()
    send.close()
    return receive, child


def _collect(receive, child) -> dict:
    try:
        result = receive.recv()
    except EOFError:
        result = None
    child.join()
    return result or {"error": f"the simulation stopped without a result (exit code {child.exitcode})"}


def _fork_refused(result: dict, child) -> bool:
    """torch refuses autograd in a child forked from a process that ran autograd (e.g. a test that called
    the engine directly): switch to spawned children and run the case again. Every child forked before the
    switch was refused too (``prefetch`` runs several at a time), so it is the child's start method that says
    whether to run its case again, not the current one."""
    if "autograd's threading" in result.get("error", "") and getattr(child, "_start_method", None) == "fork":
        _START[0] = "spawn"
        return True
    return False


def _child(send, args) -> None:
    import warnings

    warnings.simplefilter("ignore")  # library deprecation chatter from a simulated step is not the user's
    try:
        from transformers.utils import logging

        logging.set_verbosity_error()
        from gpudoctor.simulate import hub

        # a spawned child has not registered gpudoctor's rebuilds of remote-code architectures (e.g. ChatGLM-6B)
        # with the Auto classes the way the parent's config resolution did
        hub.local_code_config({"model_type": getattr(args[0].config, "model_type", None)}, None)
        result = _run(*args)
    except BaseException as exc:  # reported to the parent, which says which case failed
        result = {"error": f"{type(exc).__name__}: {exc}"}
    send.send(result)
    send.close()


def _run(info, method, workload, checkpointing, card, layers, device_map) -> dict:
    import torch

    from gpudoctor.simulate import simulate_step
    from gpudoctor.simulate.cards import Card

    n_devices = len(layers) if layers else (len({d for d in device_map.values()}) if device_map else 1)
    unbounded = [Card(f"{card.name} (no limit)", UNBOUNDED, card.context, card.arch, card.bf16, card.source)] * max(n_devices, 1)
    config = reduced_config(info.config, sum(layers)) if layers else info.config
    dtype = getattr(torch, method.dtype)
    built: list = []

    def factory():
        from transformers.initialization import no_init_weights

        from gpudoctor.simulate import hub

        with no_init_weights():
            model = _model_class(config)._from_config(config, dtype=dtype)
        model.tie_weights()
        cast_floating(model, dtype)
        if method.quant_bits:
            quantize(model, method.quant_bits, dtype)
        if placement:
            hub.place(model, placement, None, dtype)
        if method.quant_bits:
            prepare_kbit(model)  # after loading, as the printed code does
        if checkpointing and method.autocast:
            # the engine aborts when non-reentrant recompute runs under its emulated autocast; reentrant
            # checkpointing keeps the same tensors (each layer's input) and runs there
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        built.append(model)
        return model

    placement = _reduced_map(info, config, layers, device_map) if layers and len(layers) > 1 else device_map
    out = simulate_step(factory, unbounded, batch=workload.batch, seq=workload.seq, target_len=workload.target_len,
                        dtype=method.dtype, lora=workload.lora_kwargs() if method.lora else None,
                        device_map=placement or None,
                        gradient_checkpointing=checkpointing and not method.autocast,
                        optimizer=workload.optimizer, foreach=workload.foreach, autocast=method.autocast)
    trainable = sum(p.numel() * p.element_size() for p in _unique_params(built[0]) if p.requires_grad) if built else 0
    devices = []
    for row in out["devices"]:
        breakdown = {c: int(row["breakdown_at_peak"].get(c, 0)) for c in CATEGORIES}
        phases = {name: {"peak_allocated": int(p["allocated"]), "peak_reserved": int(p["reserved"]),
                         "breakdown": {c: int((p.get("by_category") or {}).get(c, 0)) for c in CATEGORIES}}
                  for name, p in (row.get("phase_peaks") or {}).items()}
        devices.append({"peak_allocated": int(row["peak_allocated"]), "peak_reserved": int(row["peak_reserved"]),
                        "breakdown": breakdown, "phases": phases})
    return {"devices": devices, "trainable_bytes": trainable, "oom": out.get("oom")}


def _reduced_map(info: ModelInfo, config, layers: tuple[int, ...], roles: dict) -> dict:
    """The device map of a reduced copy: ``layers[r]`` layers on device ``r``; other modules by ``roles``."""
    placement = {name: role for name, role in roles.items()}
    index = 0
    for device, count in enumerate(layers):
        for _ in range(count):
            placement[f"{info.layers_path}.{index}"] = device
            index += 1
    return placement


def linear(v1: float, v2: float, n: float, k1: int = K1, k2: int = K2) -> float:
    """The value at ``n`` layers on the line through (k1, v1) and (k2, v2)."""
    return v1 + (v2 - v1) * (n - k1) / (k2 - k1)


def extrapolate(first: dict, second: dict, n: float, k1: int = K1, k2: int = K2) -> dict:
    """One device's numbers at ``n`` layers from its numbers at ``k1`` and ``k2`` layers.

    Each phase of the step (forward, backward, optimizer step, ...) is its own line: the phases grow by
    different bytes per layer (the backward pass carries fixed temporaries such as the logits' gradient; the
    optimizer step grows by a layer's weights, gradients and AdamW state), so the phase that peaks can
    change with depth, and the line through the two copies' overall peaks would join two different phases
    (ChatGLM-6B under fp16 AMP: the backward pass peaks at 2 layers, the optimizer step from 3 on). The
    device's peak allocated is the highest phase at ``n`` layers, its breakdown that phase's, its peak
    reserved the highest phase's reserved; ``phases`` has every phase's line at ``n``. Points without
    per-phase peaks are one line.

    Reserved memory is never below allocated plus the allocator's slack (the smaller of the two copies'
    reserved - allocated), overall and in each phase: the two lines can cross when the copies' slack
    differs (a 20 MiB segment more in one of them), and a reserved figure under the allocated one would be
    impossible; and a phase that overtakes another reserves its own segments (its reserved figure at the
    shallow copies is the earlier phase's, which those segments covered)."""
    shared = [name for name in first.get("phases") or {} if name in (second.get("phases") or {})]
    lines = [_line(first["phases"][name], second["phases"][name], n, k1, k2) for name in shared]
    overall = _line(first, second, n, k1, k2)
    out = dict(max(lines, key=lambda line: line["peak_allocated"]) if lines else overall)
    out["peak_reserved"] = max(line["peak_reserved"] for line in lines or [overall])
    out["peak_reserved"] = max(out["peak_reserved"], out["peak_allocated"] + _slack(first, second))
    if lines:
        out["phases"] = dict(zip(shared, lines))
    return out


def _slack(first: dict, second: dict) -> int:
    return max(min(first["peak_reserved"] - first["peak_allocated"], second["peak_reserved"] - second["peak_allocated"]), 0)


def _line(first: dict, second: dict, n: float, k1: int, k2: int) -> dict:
    """Peak allocated, reserved (at least allocated plus the slack) and the breakdown at ``n`` layers, on the
    lines through two points."""
    out = {key: int(round(linear(first[key], second[key], n, k1, k2))) for key in ("peak_allocated", "peak_reserved")}
    out["peak_allocated"] = max(out["peak_allocated"], 0)
    out["peak_reserved"] = max(out["peak_reserved"], out["peak_allocated"] + _slack(first, second))
    out["breakdown"] = {c: max(int(round(linear(first["breakdown"].get(c, 0), second["breakdown"].get(c, 0), n, k1, k2))), 0)
                        for c in CATEGORIES}
    return out
