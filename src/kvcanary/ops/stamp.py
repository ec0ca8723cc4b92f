"""`launch_stamp_violation_rows`: after a step's launches under one launch tag, write beside each ring row
the step and batch row it belongs to, so rows can be drained and attributed later (no host sync).

Contract (all keyword arguments):
* ``violation_ring`` int64 [cap, 8], ``violation_write_index`` int32 [1]: one tag's ring and index as the
  step's launches left them. ``rows_from`` int32 [1]: the index before the step's first launch under the
  tag. ``stamps`` int64 [cap, 3] (output). ``step`` int64 [1].
* Rows stamped: ``j in [lo, hi)``, ``lo = clamp(rows_from, 0, cap)``, ``hi = clamp(write_index, 0, cap)``:
  ``stamps[j] = (step, batch_row, expected_position)``. Nothing else changes.
* Write rows (reason bits include WRITE_TOKEN or WRITE_POSITION) are matched to the write entries
  ``[0, write_offsets[a])`` by (slot, position), in ring order after the previous write row's entry (else
  the first match); batch_row is the request whose offset range holds the entry; expected_position -1.
* Verify rows are matched to the verify plan's active entries by slot (and, among several, by the
  expected token and by whether the expected position differs from the stored one), in ring order after
  the previous verify row's entry; batch_row is the row whose prefix range holds the entry (ranges follow
  the plan's entry order, SPEC §3.5); expected_position is the entry's expected position.
* Without a plan (sweep tags), or with no match: ``(step, -1, -1)``.
"""
from __future__ import annotations

from kvcanary.ops.reference.stamp import stamp_violation_rows_torch_reference


def launch_stamp_violation_rows(**kwargs) -> None:
    """Stamp one tag's new ring rows (see the module docstring)."""
    stamp_violation_rows_torch_reference(**kwargs)
