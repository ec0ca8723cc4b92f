"""Shared by the benchmarks: count the launches the Triton launchers hand to the torch twins (a slow host
path that should not happen on a GPU)."""
from __future__ import annotations


def count_twin_fallbacks(fn):
    """(fn(), launches the Triton verify / write launchers handed to their torch twins while it ran)."""
    from kvcanary.ops.triton import verify as tverify, write as twrite

    calls = [0]
    saved = (tverify.launch_canary_verify_kernel_torch_reference, twrite.launch_canary_write_kernel_torch_reference)

    def counted(real):
        def wrapper(**kw):
            calls[0] += 1
            return real(**kw)
        return wrapper

    tverify.launch_canary_verify_kernel_torch_reference = counted(saved[0])
    twrite.launch_canary_write_kernel_torch_reference = counted(saved[1])
    try:
        return fn(), calls[0]
    finally:
        tverify.launch_canary_verify_kernel_torch_reference, twrite.launch_canary_write_kernel_torch_reference = saved
