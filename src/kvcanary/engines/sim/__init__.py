"""A simulated paged-KV engine without a model (docs/design.md §5): allocator, request table, block-granular
prefix cache, chunked prefill, decode, a sliding-window group, eviction, retraction and abort.

Its "KV" bytes derive from (token, position, layer, side), so any misplaced or damaged slot is
visible; it drives the runtime exactly as a real adapter does. Deterministic given a seed.
"""
from kvcanary.engines.sim.engine import SimConfig, SimEngine, SimRequest
from kvcanary.engines.sim.pool import RequestTable, SlotAllocator
from kvcanary.engines.sim.radix import RadixCache
from kvcanary.engines.sim.workload import SimWorkload

__all__ = ["SimConfig", "SimEngine", "SimRequest", "RequestTable", "SlotAllocator", "RadixCache", "SimWorkload"]
