"""Verify op (docs/design.md §3.7): public launcher; checks arguments, then runs Triton or the twin."""
from __future__ import annotations

from typing import Optional, Sequence

from kvcanary.errors import KvCanaryTypeError, KvCanaryValueError
from kvcanary.ops.checks import check_context, check_verify_plan
from kvcanary.ops.dispatch import triton_backend
from kvcanary.ops.jitter import KernelJitter, check_jitter
from kvcanary.ops.records import VerifyOrWriteContext, VerifyPlan
from kvcanary.ops.reference.verify import launch_canary_verify_kernel_torch_reference

_OP = "launch_canary_verify_kernel"


def launch_canary_verify_kernel(
    *, context: VerifyOrWriteContext, plan: VerifyPlan, check_verify_expected_token: bool,
    jitter: Optional[KernelJitter] = None,
) -> None:
    """Verify the plan's entries against ``context.canary_buf``.

    Mutates the two counters, the violation ring and its write index; never the buffer.

    Counters moved when it raises:

    * argument errors (type, dtype, shape, device, > 4 sources: ``KvCanaryTypeError`` /
      ``KvCanaryValueError``) — none: raised before dispatch, nothing touched;
    * lazy errors (canary stride, a narrow real-KV row; docs/design.md §3.3, only when the plan has work) —
      ``kernel_run_counter`` +1 and ``slot_run_counter`` + the active entries, nothing else
      (ring, index, buffer unchanged); on CUDA while a graph is being captured these are raised
      before anything is launched, so no counter moves.

    Slots or predecessors outside the canary buffer never raise: they are
    ``FailReason.VERIFY_SLOT_OUT_OF_RANGE`` rows (see ``FailReason``).

    ``jitter`` (*extension*, docs/design.md §3.11): a `KernelJitter` stalls seeded entries on the GPU (on the
    CPU the twin stalls the calling thread) and counts them in its counters; nothing else changes. None
    (default): the launch is the one without jitter.
    """
    dev = check_context(_OP, context)
    check_verify_plan(_OP, plan, dev)
    check_jitter(_OP, jitter, dev)
    backend = triton_backend(dev)
    impl = backend.launch_verify if backend else launch_canary_verify_kernel_torch_reference
    impl(context=context, plan=plan, check_verify_expected_token=bool(check_verify_expected_token), jitter=jitter)


def launch_canary_verify_kernels(
    *, contexts: Sequence[VerifyOrWriteContext], plan: VerifyPlan, check_verify_expected_token: bool,
    jitter: Optional[KernelJitter] = None,
) -> None:
    """`launch_canary_verify_kernel` for each of ``contexts`` in order, on one plan: the same counters, rings
    and bytes as one call per context (rows of one ring may land in another order, as within one launch).
    On CUDA the Triton kernel takes two contexts per launch (the plan is read once). Every context and the
    plan are checked before anything runs; a lazy error stops the sequence at its context, as the loop would.
    ``jitter``: as for `launch_canary_verify_kernel`, drawn per context (each under its own tag)."""
    if isinstance(contexts, (VerifyOrWriteContext, str, bytes)) or not isinstance(contexts, Sequence):
        raise KvCanaryTypeError(
            f"kv-canary: launch_canary_verify_kernels contexts must be a sequence of VerifyOrWriteContext, "
            f"got {type(contexts).__name__}"
        )
    if not contexts:
        raise KvCanaryValueError("kv-canary: launch_canary_verify_kernels needs at least one context")
    devices = [check_context("launch_canary_verify_kernels", c) for c in contexts]
    if any(d != devices[0] for d in devices):
        raise KvCanaryValueError(
            f"kv-canary: launch_canary_verify_kernels contexts must share one device, got {sorted(set(map(str, devices)))}"
        )
    check_verify_plan("launch_canary_verify_kernels", plan, devices[0])
    check_jitter("launch_canary_verify_kernels", jitter, devices[0])
    check = bool(check_verify_expected_token)
    backend = triton_backend(devices[0])
    if backend is not None:
        backend.launch_verify_many(contexts=tuple(contexts), plan=plan, check_verify_expected_token=check, jitter=jitter)
        return
    for ctx in contexts:
        launch_canary_verify_kernel_torch_reference(context=ctx, plan=plan, check_verify_expected_token=check,
                                                    jitter=jitter)
