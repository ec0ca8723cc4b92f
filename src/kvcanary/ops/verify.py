"""Verify op (SPEC §3.7): public launcher; checks arguments, then runs Triton or the twin."""
from __future__ import annotations

from kvcanary.ops.checks import check_context, check_verify_plan
from kvcanary.ops.dispatch import triton_backend
from kvcanary.ops.records import VerifyOrWriteContext, VerifyPlan
from kvcanary.ops.reference.verify import launch_canary_verify_kernel_torch_reference

_OP = "launch_canary_verify_kernel"


def launch_canary_verify_kernel(
    *, context: VerifyOrWriteContext, plan: VerifyPlan, check_verify_expected_token: bool
) -> None:
    """Verify the plan's entries against ``context.canary_buf``.

    Mutates the two counters, the violation ring and its write index; never the buffer.
    Raises before touching anything on bad arguments (dtype, shape, device, > 4 sources).
    """
    dev = check_context(_OP, context)
    check_verify_plan(_OP, plan, dev)
    backend = triton_backend(dev)
    impl = backend.launch_verify if backend else launch_canary_verify_kernel_torch_reference
    impl(context=context, plan=plan, check_verify_expected_token=bool(check_verify_expected_token))
