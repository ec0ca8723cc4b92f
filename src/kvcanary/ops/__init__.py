"""kvcanary.ops — the canary record format and its plan / write / verify / scatter ops (docs/design.md §3).

Public launchers check their arguments and run the Triton kernels on CUDA tensors (when Triton
imports) or the vectorised torch twins (``*_torch_reference``) everywhere else.
"""
from kvcanary.ops.constants import (
    CANARY_CHAIN_ANCHOR,
    CANARY_FIELD_POSITION,
    CANARY_FIELD_PREV_HASH,
    CANARY_FIELD_REAL_KV_HASH,
    CANARY_FIELD_TOKEN,
    CANARY_FIELDS_PER_SLOT,
    MAX_REAL_KV_SOURCES,
    REQ_POOL_IDX_PADDING,
    TOKEN_TO_KV_SLOT_PADDING,
    VIOLATION_FIELD_EXPECTED_AUX,
    VIOLATION_FIELD_EXPECTED_TOKEN,
    VIOLATION_FIELD_FAIL_REASON_BITS,
    VIOLATION_FIELD_KERNEL_KIND,
    VIOLATION_FIELD_POSITION,
    VIOLATION_FIELD_SLOT_IDX,
    VIOLATION_FIELD_STORED_CHAIN_HASH,
    VIOLATION_FIELD_STORED_TOKEN,
    VIOLATION_FIELDS,
    CanaryLaunchTag,
    FailReason,
    RealKvHashMode,
)
from kvcanary.ops.copy import export_canary_records, import_canary_records, launch_canary_copy_slots_kernel
from kvcanary.ops.copy_format import (
    CANARY_RECORDS_MAGIC,
    CANARY_RECORDS_VERSION,
    canary_records_from_bytes,
    canary_records_to_bytes,
)
from kvcanary.ops.hashing import splitmix64, splitmix64_mix3
from kvcanary.ops.jitter import KernelJitter
from kvcanary.ops.padding_reads import launch_padding_read_check_kernel
from kvcanary.ops.paged import launch_block_table_slots_kernel, launch_mark_written_slots_kernel
from kvcanary.ops.plan import launch_canary_plan_kernels
from kvcanary.ops.records import RealKvSource, VerifyOrWriteContext, VerifyPlan, WritePlan
from kvcanary.ops.reference.copy import (
    canary_copy_slots_torch_reference,
    export_canary_records_torch_reference,
    import_canary_records_torch_reference,
)
from kvcanary.ops.reference.padding_reads import padding_read_check_torch_reference
from kvcanary.ops.reference.paged import block_table_slots_torch_reference, mark_written_slots_torch_reference
from kvcanary.ops.reference.plan import launch_canary_plan_kernels_torch_reference
from kvcanary.ops.reference.scatter import scatter_req_token_ids_torch_reference
from kvcanary.ops.reference.verify import launch_canary_verify_kernel_torch_reference
from kvcanary.ops.reference.write import launch_canary_write_kernel_torch_reference
from kvcanary.ops.scatter import launch_scatter_req_token_ids_kernel
from kvcanary.ops.stamp import launch_stamp_violation_rows
from kvcanary.ops.reference.stamp import stamp_violation_rows_torch_reference
from kvcanary.ops.verify import launch_canary_verify_kernel, launch_canary_verify_kernels
from kvcanary.ops.write import launch_canary_write_kernel, launch_canary_write_kernels

__all__ = [
    "CANARY_CHAIN_ANCHOR", "REQ_POOL_IDX_PADDING", "TOKEN_TO_KV_SLOT_PADDING",
    "CANARY_FIELDS_PER_SLOT", "CANARY_FIELD_TOKEN", "CANARY_FIELD_POSITION",
    "CANARY_FIELD_PREV_HASH", "CANARY_FIELD_REAL_KV_HASH",
    "VIOLATION_FIELDS", "VIOLATION_FIELD_KERNEL_KIND", "VIOLATION_FIELD_SLOT_IDX",
    "VIOLATION_FIELD_POSITION", "VIOLATION_FIELD_STORED_TOKEN", "VIOLATION_FIELD_EXPECTED_TOKEN",
    "VIOLATION_FIELD_STORED_CHAIN_HASH", "VIOLATION_FIELD_EXPECTED_AUX", "VIOLATION_FIELD_FAIL_REASON_BITS",
    "MAX_REAL_KV_SOURCES", "FailReason", "RealKvHashMode", "CanaryLaunchTag",
    "splitmix64", "splitmix64_mix3",
    "RealKvSource", "VerifyOrWriteContext", "VerifyPlan", "WritePlan", "KernelJitter",
    "launch_canary_plan_kernels", "launch_canary_write_kernel", "launch_canary_verify_kernel",
    "launch_canary_verify_kernels", "launch_canary_write_kernels",
    "launch_block_table_slots_kernel", "launch_mark_written_slots_kernel", "block_table_slots_torch_reference",
    "mark_written_slots_torch_reference",
    "launch_padding_read_check_kernel", "padding_read_check_torch_reference",
    "launch_scatter_req_token_ids_kernel", "launch_stamp_violation_rows", "stamp_violation_rows_torch_reference",
    "launch_canary_plan_kernels_torch_reference", "launch_canary_write_kernel_torch_reference",
    "launch_canary_verify_kernel_torch_reference", "scatter_req_token_ids_torch_reference",
    "launch_canary_copy_slots_kernel", "export_canary_records", "import_canary_records",
    "canary_copy_slots_torch_reference", "export_canary_records_torch_reference",
    "import_canary_records_torch_reference",
    "CANARY_RECORDS_MAGIC", "CANARY_RECORDS_VERSION", "canary_records_to_bytes", "canary_records_from_bytes",
]
