"""The message parser on every known form (runtime-anchors §6)."""

import pytest

from gpudoctor.trace.messages import classify_oom, parse_device_message, parse_oom_message

DEVICE_CASES = [
    # torch >= 2.8
    ("Expected all tensors to be on the same device, but got mat2 is on cpu, different from other tensors on cuda:0 "
     "(when checking argument in method wrapper_CUDA_mm)", "device_mismatch", "got_arg", ["cuda:0", "cpu"], "mat2", "wrapper_CUDA_mm"),
    ("Expected all tensors to be on the same device, but got index is on cuda:1, different from other tensors on cuda:0 "
     "(when checking argument in method wrapper_CUDA__index_select)", "device_mismatch", "got_arg", ["cuda:0", "cuda:1"], "index",
     "wrapper_CUDA__index_select"),
    # ~1.10-2.7 with the argument
    ("Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! (when checking argument "
     "for argument mat1 in method wrapper_addmm)", "device_mismatch", "found_two", ["cuda:0", "cpu"], "mat1", "wrapper_addmm"),
    # the ~1.9 typo
    ("Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! (when checking arugment "
     "for argument index in method wrapper__index_select)", "device_mismatch", "found_two", ["cuda:0", "cpu"], "index", "wrapper__index_select"),
    # TensorIterator / FakeTensor: no parenthesis
    ("Expected all tensors to be on the same device, but found at least two devices, gpu:1 and gpu:0!", "device_mismatch",
     "found_two", ["gpu:1", "gpu:0"], None, None),
    # <= 1.8
    ("Tensor for argument #2 'mat1' is on CPU, but expected it to be on GPU (while checking arguments for addmm)",
     "device_mismatch", "legacy_arg", ["cuda", "cpu"], "mat1", "addmm"),
    ("Expected object of device type cuda but got device type cpu for argument #1 'self' in call to _th_index_select",
     "device_mismatch", "legacy_device_type", ["cuda", "cpu"], "self", "_th_index_select"),
    ("Input type (torch.FloatTensor) and weight type (torch.cuda.FloatTensor) should be the same or input should be a MKLDNN "
     "tensor and weight is a dense tensor", "device_mismatch", "input_weight_type", ["cuda", "cpu"], "input", "convolution"),
    ("Input type (torch.cuda.HalfTensor) and weight type (torch.cuda.FloatTensor) should be the same", "dtype_mismatch",
     "input_weight_type", ["cuda", "cuda"], "input", "convolution"),
    ("indices should be either on cpu or on the same device as the indexed tensor (cuda:0)", "device_mismatch", "indices",
     ["cuda:0"], "indices", "index"),
    ("module must have its parameters and buffers on device cuda:0 (device_ids[0]) but found one of them on device: cuda:1",
     "dataparallel", "dataparallel", ["cuda:0", "cuda:1"], None, None),
    ("Cannot copy out of meta tensor; no data!", "meta_tensor", "copy_out_of_meta", ["meta"], None, None),
    ("Tensor on device meta is not on the expected device cpu!", "meta_tensor", "meta_expected_device", ["meta", "cpu"], None, None),
    ("Tensor.item() cannot be called on meta tensors", "meta_tensor", "item_on_meta", ["meta"], None, None),
    ("Function MmBackward0 returned an invalid gradient at index 1 - expected device meta but got cpu", "meta_tensor",
     "invalid_gradient_device", ["meta", "cpu"], None, None),
    ("Tensors of the same index must be on the same device and the same dtype except `step` tensors that can be CPU and "
     "float32/64, and optimizer states that can be bfloat16 for mixed-precision training", "optimizer_state", "foreach_same_index", [], None, None),
    ("Expected a 'cuda' device type for generator but found 'cpu'", "generator", "generator", ["cuda", "cpu"], "generator", None),
    ("expected m1 and m2 to have the same dtype, but got: float != c10::Half", "dtype_mismatch", "m1_m2", [], None, None),
]


@pytest.mark.parametrize("message,kind,form,devices,argument,method", DEVICE_CASES)
def test_device_message_forms(message, kind, form, devices, argument, method):
    info = parse_device_message(message)
    assert info is not None
    assert (info.kind, info.form, info.devices, info.argument, info.method) == (kind, form, devices, argument, method)


def test_unrelated_message_is_not_a_device_error():
    assert parse_device_message("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)") is None
    assert parse_oom_message("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)") is None


OLD_OOM = ("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.79 GiB total capacity; 6.47 GiB already allocated; "
           "3.06 MiB free; 6.50 GiB reserved in total by PyTorch) If reserved memory is >> allocated memory try setting "
           "max_split_size_mb to avoid fragmentation.")
TYPO_OOM = ("CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a total capacty of 7.58 GiB of which 17.88 MiB is free. "
            "Including non-PyTorch memory, this process has 7.53 GiB memory in use. Of the allocated memory 7.37 GiB is allocated "
            "by PyTorch, and 5.71 MiB is reserved by PyTorch but unallocated.")
NEW_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 79.15 GiB of which 1.19 GiB is free. "
           "Process 4242 has 30.00 GiB memory in use. Including non-PyTorch memory, this process has 47.93 GiB memory in use. "
           "60.00 GiB allowed; Of the allocated memory 40.10 GiB is allocated by PyTorch, with 1.00 GiB allocated in private pools "
           "(e.g., CUDA Graphs), and 3.50 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
           "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
CPU_OOM = ("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate "
           "4000000000000 bytes. Error code 12 (Cannot allocate memory)")


def test_oom_parenthesised_form():
    info = parse_oom_message(OLD_OOM)
    assert (info.form, info.device_index, info.requested) == ("parenthesised", 0, 20 * 2**20)
    assert info.total == int(7.79 * 2**30) and info.free == int(3.06 * 2**20)
    assert info.reserved_unallocated == int(6.50 * 2**30) - int(6.47 * 2**30)


def test_oom_sentence_form_with_typo():
    info = parse_oom_message(TYPO_OOM)
    assert (info.form, info.device_index, info.requested) == ("sentences", 0, 64 * 2**20)
    assert info.total == int(7.58 * 2**30) and info.process_in_use == int(7.53 * 2**30)
    assert info.allocated == int(7.37 * 2**30) and info.reserved_unallocated == int(5.71 * 2**20)
    assert [c["id"] for c in classify_oom(info)] == ["capacity"]


def test_oom_newest_form_all_fields_and_classification():
    info = parse_oom_message(NEW_OOM)
    assert info.device_index == 1
    assert info.other_processes == [{"pid": 4242, "bytes": 30 * 2**30}]
    assert info.allowed == 60 * 2**30 and info.private_pools == 2**30
    ids = [c["id"] for c in classify_oom(info)]
    assert ids == ["fragmentation", "other_processes", "private_pools", "fraction_cap"]


def test_oom_larger_than_device():
    info = parse_oom_message("CUDA out of memory. Tried to allocate 90.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which "
                             "70.00 GiB is free. Of the allocated memory 1.00 GiB is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated.")
    assert classify_oom(info)[0]["id"] == "single_allocation_too_large"


def test_oom_non_pytorch_memory():
    info = parse_oom_message("CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 24.00 GiB of which "
                             "100.00 MiB is free. Including non-PyTorch memory, this process has 23.80 GiB memory in use. Of the allocated "
                             "memory 12.00 GiB is allocated by PyTorch, and 100.00 MiB is reserved by PyTorch but unallocated.")
    assert [c["id"] for c in classify_oom(info)] == ["non_pytorch_memory"]


def test_cpu_oom():
    info = parse_oom_message(CPU_OOM)
    assert (info.device_type, info.requested) == ("cpu", 4 * 10**12)
    assert [c["id"] for c in classify_oom(info)] == ["host_memory", "single_allocation_too_large"]
