"""Write op (docs/design.md §3.6): public launcher; checks arguments, then runs Triton or the twin."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from kvcanary.errors import KvCanaryTypeError, KvCanaryValueError
from kvcanary.ops.checks import INDEX_DTYPES, check_context, check_tensor, check_write_plan
from kvcanary.ops.dispatch import triton_backend
from kvcanary.ops.jitter import KernelJitter, check_jitter
from kvcanary.ops.records import VerifyOrWriteContext, WritePlan
from kvcanary.ops.reference.write import launch_canary_write_kernel_torch_reference

_OP = "launch_canary_write_kernel"


def launch_canary_write_kernel(
    *,
    context: VerifyOrWriteContext,
    plan: WritePlan,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    enable_write_input_assert: bool,
    expected_input_tokens: Optional[torch.Tensor],
    expected_input_positions: Optional[torch.Tensor],
    jitter: Optional[KernelJitter] = None,
) -> None:
    """Write canary records for the plan's requests (sequential chain per request).

    Mutates the canary buffer, both counters, the ring and its write index.

    Counters moved when it raises:

    * argument errors (type, dtype, shape, device, lengths, > 4 sources) — none: raised before
      dispatch, nothing touched;
    * lazy errors (canary stride, the input-assert tensors rule, a narrow real-KV row; docs/design.md §3.6,
      only when the write has work) — ``kernel_run_counter`` +1 only (``slot_run_counter``, ring,
      index and buffer unchanged); on CUDA while a graph is being captured these are raised before
      anything is launched, so no counter moves.

    Slots ``>= num_slots`` in ``out_cache_loc`` never raise: each is a
    ``FailReason.WRITE_SLOT_OUT_OF_RANGE`` row and is not stored; a seed past the buffer reads as
    an all-zero record (see ``FailReason``). Negative slots are skipped, as before.

    ``jitter`` (*extension*, docs/design.md §3.11): a `KernelJitter` stalls seeded entries on the GPU (on the
    CPU the twin stalls the calling thread) and counts them in its counters; nothing else changes. None
    (default): the launch is the one without jitter.
    """
    dev = check_context(_OP, context)
    _check_write_args(_OP, dev, plan, input_ids, positions, out_cache_loc, expected_input_tokens,
                      expected_input_positions)
    check_jitter(_OP, jitter, dev)
    backend = triton_backend(dev)
    impl = backend.launch_write if backend else launch_canary_write_kernel_torch_reference
    impl(
        context=context,
        plan=plan,
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=out_cache_loc,
        enable_write_input_assert=bool(enable_write_input_assert),
        expected_input_tokens=expected_input_tokens,
        expected_input_positions=expected_input_positions,
        jitter=jitter,
    )


def launch_canary_write_kernels(
    *,
    contexts: Sequence[VerifyOrWriteContext],
    plan: WritePlan,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    enable_write_input_assert: bool,
    expected_input_tokens: Optional[torch.Tensor],
    expected_input_positions: Optional[torch.Tensor],
    jitter: Optional[KernelJitter] = None,
) -> None:
    """`launch_canary_write_kernel` for each of ``contexts`` in order, on the same entries: the same buffers,
    counters and rings as one call per context. On CUDA a decode-sized write stores two contexts per launch
    (other buffers of as many rows, other rings). Every context and argument is checked before anything
    runs; a lazy error stops the sequence at its context, as the loop would. ``jitter``: as for
    `launch_canary_write_kernel`, drawn per context (each under its own tag)."""
    op = "launch_canary_write_kernels"
    if isinstance(contexts, (VerifyOrWriteContext, str, bytes)) or not isinstance(contexts, Sequence):
        raise KvCanaryTypeError(f"kv-canary: {op} contexts must be a sequence of VerifyOrWriteContext, "
                                f"got {type(contexts).__name__}")
    if not contexts:
        raise KvCanaryValueError(f"kv-canary: {op} needs at least one context")
    devices = [check_context(op, c) for c in contexts]
    if any(d != devices[0] for d in devices):
        raise KvCanaryValueError(f"kv-canary: {op} contexts must share one device, got {sorted(set(map(str, devices)))}")
    _check_write_args(op, devices[0], plan, input_ids, positions, out_cache_loc, expected_input_tokens,
                      expected_input_positions)
    check_jitter(op, jitter, devices[0])
    kw = dict(plan=plan, input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
              enable_write_input_assert=bool(enable_write_input_assert), expected_input_tokens=expected_input_tokens,
              expected_input_positions=expected_input_positions, jitter=jitter)
    backend = triton_backend(devices[0])
    if backend is not None:
        backend.launch_write_many(contexts=tuple(contexts), **kw)
        return
    for ctx in contexts:
        launch_canary_write_kernel_torch_reference(context=ctx, **kw)


def _check_write_args(op, dev, plan, input_ids, positions, out_cache_loc, expected_input_tokens,
                      expected_input_positions) -> None:
    check_write_plan(op, plan, dev)
    n = None
    for name, t in (("input_ids", input_ids), ("positions", positions), ("out_cache_loc", out_cache_loc)):
        check_tensor(op, name, t, dtypes=INDEX_DTYPES, ndim=1, device=dev, contiguous=True)
        if n is None:
            n = t.shape[0]
        elif t.shape[0] != n:
            raise KvCanaryValueError(f"kv-canary: {op} {name} has {t.shape[0]} entries, input_ids has {n}")
    for name, t in (("expected_input_tokens", expected_input_tokens), ("expected_input_positions", expected_input_positions)):
        if t is not None:
            check_tensor(op, name, t, dtypes=INDEX_DTYPES, ndim=1, device=dev, contiguous=True)
            if t.shape[0] < n:
                raise KvCanaryValueError(f"kv-canary: {op} {name} has {t.shape[0]} entries, fewer than input_ids ({n})")
