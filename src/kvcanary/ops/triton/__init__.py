"""Triton GPU kernels behind the public launchers (docs/design.md §3.9).

``AVAILABLE`` is True when Triton imports; ``kvcanary.ops.dispatch`` then routes CUDA tensors
here. Each op lives in its own module (private ``@triton.jit`` kernels + one launcher):
``launch_plan``, ``launch_write`` / ``launch_write_many``, ``launch_verify`` / ``launch_verify_many``, ``launch_scatter``, ``launch_stamp``,
``launch_block_table_slots``, ``launch_mark_written``, ``launch_padding_read_check`` take the
public launcher's keyword arguments, already validated (plus an optional launch configuration). Importing this package never fails when
Triton is missing: it only sets ``AVAILABLE = False``.
"""
from __future__ import annotations

try:  # Triton is optional: CPU-only installs use the torch twins.
    import triton  # noqa: F401
    import triton.language  # noqa: F401
except Exception:  # pragma: no cover - depends on the environment
    AVAILABLE = False
else:
    AVAILABLE = True

if AVAILABLE:
    from kvcanary.ops.triton.padding_reads import launch_padding_read_check
    from kvcanary.ops.triton.paged import launch_block_table_slots, launch_mark_written
    from kvcanary.ops.triton.plan import launch_plan
    from kvcanary.ops.triton.scatter import launch_scatter
    from kvcanary.ops.triton.stamp import launch_stamp
    from kvcanary.ops.triton.verify import launch_verify, launch_verify_many
    from kvcanary.ops.triton.write import launch_write, launch_write_many

    __all__ = ["AVAILABLE", "launch_plan", "launch_write", "launch_write_many", "launch_verify", "launch_verify_many", "launch_scatter", "launch_stamp",
               "launch_block_table_slots", "launch_mark_written", "launch_padding_read_check"]
else:  # pragma: no cover
    __all__ = ["AVAILABLE"]
