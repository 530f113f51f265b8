"""Parsers for PyTorch's device-mismatch and out-of-memory messages, every version we know of.

Pure string work (no torch import) so it is cheap to test. The forms are listed in
shared research (runtime-anchors §6); each regex below names the era it matches.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

DEVICE = r"[a-z_]+(?::\d+)?"


@dataclass
class MessageInfo:
    """What a known error message tells by itself."""

    kind: str  # device_mismatch | meta_tensor | dtype_mismatch | dataparallel | optimizer_state | generator | oom | cpu_oom | other
    form: str = ""  # which variant matched
    devices: list[str] = field(default_factory=list)  # devices named, offending one last when known
    argument: str | None = None
    method: str | None = None  # kernel wrapper, e.g. wrapper_CUDA_addmm
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


_MISMATCH = [
    # torch >= 2.8 (pytorch#155085): names the argument and the devices
    ("got_arg", re.compile(
        rf"Expected all tensors to be on the same device, but got (?P<arg>\w+(?:\[\d+\])?) is on (?P<dev>{DEVICE}), "
        rf"different from other tensors on (?P<common>{DEVICE})(?: \(when checking argument in method (?P<method>[\w.:]+)\))?"
    )),
    # torch ~1.10-2.7 ("arugment" typo in ~1.9-1.10); FakeTensor and TensorIterator omit the parenthesis
    ("found_two", re.compile(
        rf"Expected all tensors to be on the same device, but found at least two devices, (?P<common>{DEVICE}) and "
        rf"(?P<dev>{DEVICE})!(?: \(when checking (?:argument|arugment) for argument (?P<arg>\w+) in method (?P<method>[\w.:]+)\))?"
    )),
    # torch <= 1.8
    ("legacy_arg", re.compile(
        r"Tensor for argument #\d+ '(?P<arg>\w+)' is on (?P<dev>CPU|GPU|CUDA)(?:\s*\d+)?, but expected (?:it|them) to be on "
        r"(?P<common>CPU|GPU|CUDA)(?:\s*\d+)? \(while checking arguments for (?P<method>\w+)\)"
    )),
    ("legacy_device_type", re.compile(
        r"Expected object of device type (?P<common>\w+) but got device type (?P<dev>\w+) for argument #\d+ '(?P<arg>\w+)'"
        r"(?: in call to (?P<method>\w+))?"
    )),
]

_INPUT_WEIGHT_TYPE = re.compile(
    r"Input type \((?P<input>[\w.]+)\) and (?P<what>weight|bias) type \((?P<weight>[\w.]+)\) should be the same"
)
_INDICES = re.compile(r"indices should be either on cpu or on the same device as the indexed tensor \((?P<dev>" + DEVICE + r")\)")
_DATAPARALLEL = re.compile(
    rf"module must have its parameters and buffers on device (?P<common>{DEVICE}) \(device_ids\[0\]\) but found one of them on device: (?P<dev>{DEVICE})"
)
_META = [
    ("copy_out_of_meta", re.compile(r"Cannot copy out of meta tensor; no data!")),
    ("meta_expected_device", re.compile(rf"Tensor on device meta is not on the expected device (?P<dev>{DEVICE})!")),
    ("item_on_meta", re.compile(r"Tensor\.item\(\) cannot be called on meta tensors")),
    ("invalid_gradient_device", re.compile(
        rf"Function (?P<node>\w+) returned an invalid gradient at index (?P<index>\d+) - expected device (?P<common>{DEVICE}) but got (?P<dev>{DEVICE})"
    )),
]
_FOREACH_SAME_INDEX = re.compile(r"Tensors of the same index must be on the same device and the same dtype")
_GENERATOR = re.compile(r"Expected a '(?P<common>\w+)' device type for generator but found '(?P<dev>\w+)'")
_DTYPE = [
    ("m1_m2", re.compile(r"expected m1 and m2 to have the same dtype, but got: (?P<a>[\w:]+) != (?P<b>[\w:]+)")),
    ("mat1_mat2", re.compile(r"expected mat1 and mat2 to have the same dtype, but got: (?P<a>[\w:]+) != (?P<b>[\w:]+)")),
    ("scalar_type", re.compile(r"expected scalar type (?P<a>\w+) but found (?P<b>\w+)")),
]


def parse_device_message(message: str) -> MessageInfo | None:
    """Recognise every device-related message form; ``None`` when it isn't one."""
    for form, regex in _MISMATCH:
        match = regex.search(message)
        if match:
            return MessageInfo("device_mismatch", form, [_norm(match["common"]), _norm(match["dev"])], match["arg"], match["method"])
    match = _INPUT_WEIGHT_TYPE.search(message)
    if match:
        input_dev, weight_dev = _device_of_type(match["input"]), _device_of_type(match["weight"])
        kind = "device_mismatch" if input_dev != weight_dev else "dtype_mismatch"
        return MessageInfo(kind, "input_weight_type", [weight_dev, input_dev], "input", "convolution",
                           {"input_type": match["input"], f"{match['what']}_type": match["weight"]})
    match = _INDICES.search(message)
    if match:
        return MessageInfo("device_mismatch", "indices", [_norm(match["dev"])], "indices", "index")
    match = _DATAPARALLEL.search(message)
    if match:
        return MessageInfo("dataparallel", "dataparallel", [_norm(match["common"]), _norm(match["dev"])])
    for form, regex in _META:
        match = regex.search(message)
        if match:
            groups = match.groupdict()
            devices = [d for d in (groups.get("common"), groups.get("dev")) if d]
            details = {k: v for k, v in groups.items() if k in ("node", "index") and v}
            return MessageInfo("meta_tensor", form, ["meta", *[_norm(d) for d in devices if d != "meta"]], details=details)
    if _FOREACH_SAME_INDEX.search(message):
        return MessageInfo("optimizer_state", "foreach_same_index")
    match = _GENERATOR.search(message)
    if match:
        return MessageInfo("generator", "generator", [match["common"], match["dev"]], "generator")
    for form, regex in _DTYPE:
        match = regex.search(message)
        if match:
            return MessageInfo("dtype_mismatch", form, details={"dtypes": [match["a"], match["b"]]})
    return None


def _norm(device: str | None) -> str:
    if device is None:
        return ""
    device = device.strip()
    legacy = {"CPU": "cpu", "GPU": "cuda", "CUDA": "cuda"}
    return legacy.get(device, device)


def _device_of_type(type_name: str) -> str:
    # "torch.cuda.FloatTensor" -> cuda, "torch.FloatTensor" -> cpu, "CUDABFloat16Type" -> cuda
    if ".cuda." in type_name or type_name.startswith("CUDA") or "cuda" in type_name.lower():
        return "cuda"
    if "mps" in type_name.lower():
        return "mps"
    return "cpu"


# ---------------------------------------------------------------------------------------------
# Out of memory
# ---------------------------------------------------------------------------------------------

_SIZE = r"([\d.]+) ?(bytes|B|KiB|MiB|GiB|TiB|KB|MB|GB)"
_SCALE = {"bytes": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 2**10, "MB": 2**20, "GB": 2**30}


def _bytes(match: re.Match | None, group: int = 1) -> int | None:
    if not match:
        return None
    return int(float(match.group(group)) * _SCALE[match.group(group + 1)])


@dataclass
class OomInfo:
    device_type: str  # cuda | cpu | mps | xpu | hip | unknown
    form: str
    device_index: int | None = None
    requested: int | None = None  # X: the rounded request that failed
    total: int | None = None  # T
    free: int | None = None  # F
    process_in_use: int | None = None  # P: NVML, includes context/cuBLAS/NCCL
    other_processes: list[dict] = field(default_factory=list)  # [{"pid", "bytes"}]
    allowed: int | None = None  # Z: set_per_process_memory_fraction
    allocated: int | None = None  # A
    private_pools: int | None = None  # G
    reserved_unallocated: int | None = None  # R

    def to_dict(self) -> dict:
        return asdict(self)


def parse_oom_message(message: str) -> OomInfo | None:
    """Fields of any CUDA caching-allocator OOM text (<=2.0 parenthesised, 2.1+ sentences) or CPU OOM."""
    if "DefaultCPUAllocator: can't allocate memory" in message:
        match = re.search(r"you tried to allocate (\d+) bytes", message)
        return OomInfo("cpu", "cpu_allocator", requested=int(match.group(1)) if match else None)
    if "MPS backend out of memory" in message:
        return OomInfo("mps", "mps")
    cuda_like = re.search(r"(CUDA|HIP|XPU) out of memory", message)
    if not cuda_like:
        if "CUDA error: out of memory" in message or "CUBLAS_STATUS_ALLOC_FAILED" in message:
            return OomInfo("cuda", "cuda_error")
        return None
    info = OomInfo(cuda_like.group(1).lower(), "")
    info.requested = _bytes(re.search(r"Tried to allocate " + _SIZE, message))
    old = re.search(r"\(GPU (\d+); " + _SIZE + r" total capacity; " + _SIZE + r" already allocated; " + _SIZE + r" free; "
                    + _SIZE + r" reserved in total by PyTorch\)", message)
    if old:
        info.form = "parenthesised"
        info.device_index = int(old.group(1))
        info.total, info.allocated, info.free = _bytes(old, 2), _bytes(old, 4), _bytes(old, 6)
        reserved = _bytes(old, 8)
        if reserved is not None and info.allocated is not None:
            info.reserved_unallocated = max(reserved - info.allocated, 0)
        return info
    info.form = "sentences"
    cap = re.search(r"GPU (\d+) has a total capac(?:i)?ty of " + _SIZE + r" of which " + _SIZE + r" is free", message)
    if cap:
        info.device_index = int(cap.group(1))
        info.total, info.free = _bytes(cap, 2), _bytes(cap, 4)
    for pid, size, unit in re.findall(r"Process (\d+) has " + _SIZE + r" memory in use", message):
        info.other_processes.append({"pid": int(pid), "bytes": int(float(size) * _SCALE[unit])})
    info.process_in_use = _bytes(re.search(r"this process has " + _SIZE + r" memory in use", message))
    info.allowed = _bytes(re.search(_SIZE + r" allowed;", message))
    info.allocated = _bytes(re.search(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch", message))
    info.private_pools = _bytes(re.search(r"with " + _SIZE + r" allocated in private pools", message))
    info.reserved_unallocated = _bytes(re.search(_SIZE + r" is reserved by PyTorch but unallocated", message))
    return info


def classify_oom(info: OomInfo) -> list[dict]:
    """Apply the field rules (runtime-anchors §6.2). Each entry: {id, title, detail}."""
    out: list[dict] = []
    if info.device_type == "cpu":
        out.append({"id": "host_memory", "title": "host RAM exhausted",
                    "detail": "the CPU allocator could not get the memory from the OS (no cap, no fragmentation to blame)"})
        if info.requested and info.requested > 2**40:
            out.append({"id": "single_allocation_too_large", "title": "one allocation is absurdly large",
                        "detail": "a single tensor of more than 1 TiB was requested: check the shape that produced it"})
        return out
    X, T = info.requested, info.total
    if X is not None and T is not None and X > T:
        out.append({"id": "single_allocation_too_large", "title": "one allocation is larger than the whole device",
                    "detail": "no amount of freeing helps: the tensor itself must shrink (batch, sequence length, vocab logits) or be sharded"})
    if X is not None and info.reserved_unallocated is not None and info.reserved_unallocated >= X:
        out.append({"id": "fragmentation", "title": "fragmentation",
                    "detail": "PyTorch holds enough reserved-but-unallocated memory for the request, in pieces too small: "
                              "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"})
    other = sum(p["bytes"] for p in info.other_processes)
    if T and other > 0.1 * T:
        out.append({"id": "other_processes", "title": "other processes hold device memory",
                    "detail": f"{len(info.other_processes)} other process(es) use {other} bytes of this GPU: stop them or pick another GPU"})
    if info.process_in_use is not None and info.allocated is not None:
        non_torch = info.process_in_use - info.allocated - (info.reserved_unallocated or 0)
        if T and non_torch > 0.15 * T:
            out.append({"id": "non_pytorch_memory", "title": "memory outside PyTorch's allocator",
                        "detail": f"{non_torch} bytes of this process are not PyTorch tensors (CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers, other libraries)"})
    if info.private_pools:
        out.append({"id": "private_pools", "title": "CUDA-graph / compile private pools",
                    "detail": "memory is held in private pools (CUDA graphs, torch.compile mode='reduce-overhead'): disable cudagraphs to get it back"})
    if info.allowed is not None:
        out.append({"id": "fraction_cap", "title": "per-process memory fraction cap",
                    "detail": "set_per_process_memory_fraction limits this process below the device size"})
    if not out:
        out.append({"id": "capacity", "title": "the working set does not fit",
                    "detail": "the tensors PyTorch holds for this step exceed the device: shrink one of the categories below"})
    return out
