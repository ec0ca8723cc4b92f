"""Every read of transformers' continuous-batching internals, in one place, each with its source.

All of it was read from ``transformers==5.24.0`` (``transformers/generation/continuous_batching/``); the
adapter refuses any other version (`attach.check_transformers_version`). Nothing here writes engine
state except `install_compute_wrapper` / `restore_compute_batch`, `shadow_method` / `unshadow_method` (the KV-move
wrappers), `drop_graphs` and `append_cb_logits_processor` (the token oracle's sampler, a fault-injection tool), which the handle's ``detach()`` undoes or accounts for (see the package docstring). When transformers changes, this file
and ``layout.py``'s arithmetic are what to re-read.

Public, documented surfaces are used directly elsewhere: the forward's keyword arguments
(``PagedAttentionArgs`` in ``input_outputs.py``) and ``nn.Module`` forward hooks.
"""
from __future__ import annotations

import gc
from typing import Callable, Optional

import torch

from kvcanary.errors import KvCanaryRuntimeError

VERSION_READ = "5.24.0"

# requests.py :: create_warmup_future_states — warmup requests are named f"__warmup_{status}_{i}__"
WARMUP_PREFIX = "__warmup_"


def _holders(target) -> list:
    """The objects that refer to ``target``. An instance whose ``__dict__`` has been materialised (``vars(obj)``, an
    instance attribute set on it) refers to ``target`` through that dict: the dict's owner is returned instead."""
    found = []
    for ref in gc.get_referrers(target):
        if type(ref) is dict:
            found.extend(o for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref)
        else:
            found.append(ref)
    return found


# ---- the processor that owns a cache ---------------------------------------------------------------
def find_batch_processor(cache):
    """The ``ContinuousBatchProcessor`` (continuous_api.py) that owns ``cache`` — found once per cache.

    The forward's kwargs carry the cache but not the request states; the processor holds them. It has
    ``cache``, ``inputs_and_outputs`` and ``scheduler`` attributes (5.24.0 ``__init__``).
    """
    for obj in _holders(cache):
        if getattr(obj, "cache", None) is cache and hasattr(obj, "inputs_and_outputs") and hasattr(obj, "scheduler"):
            return obj
    raise KvCanaryRuntimeError(
        "kv-canary: could not find the continuous-batching processor that owns this PagedAttentionCache; "
        "kvcanary supports model.generate_batch / init_continuous_batching of transformers==5.24.0"
    )


MANAGER_STOP_METHOD = "stop"
MANAGER_CREATE_PROCESSOR_METHOD = "_create_batch_processor"  # the manager builds its ContinuousBatchProcessor
INIT_CB_METHOD = "init_continuous_batching"  # the model method generate_batch and users call for a manager


def find_manager(processor):
    """The ``ContinuousBatchingManager`` (continuous_api.py) running ``processor``, or None.

    The generation thread sets ``manager.batch_processor`` before its first forward. ``manager.stop(block, timeout,
    keep_for_next_session, hard_stop)`` ends a generation session (``generate_batch``, the context manager, or a
    direct call): it joins the thread when ``block`` (``is_running()`` is False once joined), then keeps the
    processor and its cache for the next session (``keep_for_next_session``) or drops them.
    """
    return next((obj for obj in _holders(processor) if getattr(obj, "batch_processor", None) is processor
                 and callable(getattr(obj, "is_running", None)) and callable(getattr(obj, MANAGER_STOP_METHOD, None))),
                None)


def batch_io(processor):
    """``processor.inputs_and_outputs``: a ``ContinuousBatchingIOs`` (sync) or ``ContinuousBatchingAsyncIOs``."""
    return processor.inputs_and_outputs


def requests_in_batch(processor) -> list:
    """The ``FutureRequestState`` list of the batch just prepared, in the forward's sequence order.

    Set by ``ContinuousBatchingIOs.prepare_batch_tensors`` (input_outputs.py). After it ran,
    ``fs.state.position_offset`` already includes the batch (``+= query_length``), so the first position
    of row i is ``position_offset - query_length``.
    """
    return processor.inputs_and_outputs.requests_in_batch


def uses_block_table(processor) -> bool:
    """True when the prepared batch runs the decode fast path (``io.use_block_table``)."""
    return bool(processor.inputs_and_outputs.use_block_table)


def active_requests(processor) -> dict:
    """``scheduler.active_requests``: request id -> ``RequestState`` of every running request (scheduler.py)."""
    return processor.scheduler.active_requests


def max_requests_per_batch(processor) -> int:
    """``cb_config.max_requests_per_batch`` (resolved): the padded batch never has more sequences."""
    return int(processor.cb_config.max_requests_per_batch)


def compute_stream(processor):
    """The stream the forward runs on (``io.compute_stream``; None on CPU)."""
    return processor.inputs_and_outputs.compute_stream


# ---- execution paths -----------------------------------------------------------------------------
def graph_flags(processor) -> tuple[bool, bool]:
    """(varlen, decode) CUDA-graph switches of the ``ModelRunner`` (model_runner.py ``__init__``)."""
    runner = processor.model_runner
    return bool(runner.use_cuda_graph_varlen), bool(runner.use_cuda_graph_decode)


def compiled_paths(processor) -> tuple[bool, bool]:
    """Whether the varlen / decode forwards are ``torch.compile``'d (``runner._compiled_varlen/_decode``)."""
    runner = processor.model_runner
    return runner._compiled_varlen is not None, runner._compiled_decode is not None


def uses_async_batching(processor) -> bool:
    """``processor.use_async_batching`` (two IO pairs; inputs of batch N+1 carried over on the device)."""
    return bool(getattr(processor, "use_async_batching", False))


def graph_pool(processor):
    """The memory pool id the runner captures its graphs into (``ModelRunner.graph_pool_id``; None without graphs)."""
    return getattr(processor.model_runner, "graph_pool_id", None)


def renew_graph_pool(processor) -> bool:
    """Give the runner a fresh memory pool for its later captures (``ModelRunner.mem_pool`` / ``graph_pool_id``,
    set in ``ModelRunner.__init__`` from ``get_memory_pools``): after a failed capture the old pool id cannot be
    captured into again (`kvcanary.runtime.capture`). False without graphs (no pool)."""
    runner = processor.model_runner
    if getattr(runner, "graph_pool_id", None) is None:
        return False
    pool = torch.cuda.MemPool()
    runner.mem_pool, runner.graph_pool_id = pool, pool.id
    return True


def graph_store(processor) -> dict:
    """The captured graphs, key -> graph (``io.graphs._storage`` of the ``CudaGraphBuffer``, utils.py)."""
    return processor.inputs_and_outputs.graphs._storage


def drop_graphs(processor, keys) -> int:
    """Reset and forget the captured graphs under ``keys`` (the engine recaptures a missing key on its
    next batch of that shape: ``ModelRunner.compute_batch`` -> ``_capture_graph``). Returns how many."""
    store = graph_store(processor)
    dropped = 0
    for key in list(keys):
        graph = store.pop(key, None)
        if graph is not None:
            graph.reset()
            dropped += 1
    return dropped


# ---- the one wrapper (graph mode only) --------------------------------------------------------------
def install_compute_wrapper(processor, make: Callable[[Callable], Callable]) -> Callable:
    """Shadow ``processor.model_runner.compute_batch`` with an instance attribute ``make(original)``.

    ``ModelRunner.compute_batch(model, batch_data)`` (model_runner.py) is called once per engine step by
    ``ContinuousBatchProcessor._generation_step`` and once per warmup forward; it runs the eager forward,
    replays the step's CUDA graph, or captures it. Returns the original bound method.
    """
    runner = processor.model_runner
    if getattr(vars(runner).get("compute_batch"), "_kvcanary_guard", False):
        del runner.compute_batch  # the first-call guard (install_compute_guard) gives way to the wrapper
    if "compute_batch" in vars(runner):
        raise KvCanaryRuntimeError("kv-canary: ModelRunner.compute_batch is already wrapped on this runner (attached twice?)")
    original = runner.compute_batch
    runner.compute_batch = make(original)
    return original


def install_compute_guard(processor, make: Callable[[Callable], Callable]) -> None:
    """Like `install_compute_wrapper`, for a guard that `install_compute_wrapper` replaces without complaint."""
    runner = processor.model_runner
    if "compute_batch" in vars(runner):
        return
    guard = make(runner.compute_batch)
    guard._kvcanary_guard = True
    runner.compute_batch = guard


def restore_compute_batch(processor) -> None:
    """Remove the instance attribute: the class method is visible again, exactly as before."""
    vars(processor.model_runner).pop("compute_batch", None)


def is_warmup(batch: list) -> bool:
    """True for the runner's warmup batches (fake requests, KV freed right after; model_runner.py ``warmup``)."""
    return bool(batch) and str(batch[0].state.request_id).startswith(WARMUP_PREFIX)


# ---- cache geometry --------------------------------------------------------------------------------
def allocators(cache) -> dict:
    """``cache.cache_allocators``: layer type -> allocator, in allocator-index order (cache.py)."""
    return cache.cache_allocators


def allocator_geometry(alloc) -> dict:
    """The allocator attributes the slot layout needs (cache_allocators/cache_allocator.py
    ``_before_cache_tensor_init`` / ``_after_cache_tensor_init``; sliding_attention.py ``sliding_window``)."""
    return {
        "index": int(alloc.index),
        "layer_indices": tuple(int(i) for i in alloc.layer_indices),
        "tokens_per_page": int(alloc.tokens_per_page),
        "block_physical_stride": int(alloc.block_physical_stride),
        "blocks_per_sector": int(alloc.blocks_per_sector),
        "bytes_per_block": int(alloc.bytes_per_block),
        "sliding_window": int(getattr(alloc, "sliding_window", 0) or 0),
    }


def layer_cache_tensor(cache, layer_id: int):
    """(allocator cache tensor ``[total_tokens, 2, H, D]``, the layer's rank within its allocator)."""
    alloc = cache.layer_to_allocator[layer_id]
    return alloc.cache_tensor, list(alloc.layer_indices).index(layer_id)


def request_blocks(alloc) -> dict:
    """``alloc.block_table``: request id -> its block ids, in logical order."""
    return alloc.block_table


def cached_blocks(alloc) -> list:
    """Blocks no request references but kept for prefix sharing (``alloc.ledger.cached_blocks``)."""
    return list(alloc.ledger.cached_blocks)


def cache_limits(cache) -> tuple[int, int]:
    """(``max_batch_tokens``, ``max_tokens_read``) of the cache."""
    return int(cache.max_batch_tokens), int(cache.max_tokens_read)


def max_blocks_per_request(cache) -> int:
    """Width of the decode fast path's block table (0 when the path is off)."""
    return int(getattr(cache, "max_blocks_per_request", 0) or 0)


# ---- logits processors (the token oracle's sampler, kvcanary.faults.tf_oracle) -----------------------------
# cb_logits_processors.py: a ``ContinuousBatchingLogitsProcessor`` has ``fill_defaults(int32 row)``,
# ``prepare_tensor_args(requests_with_new_token) -> int32 [n]`` (host, once per batch, from
# ``ContinuousBatchingIOs.prepare_batch_tensors`` after every ``state.position_offset += query_length``) and
# ``__call__(scores [num_logits, vocab], tensor_arg [num_sequences])`` (device, inside the forward that is
# captured in CUDA graph mode). Its per-batch argument lives in one row of the IOs' static bulk input tensor,
# ``static_inputs + tensors_required`` rows allocated when the batch processor is built
# (``ContinuousBatchingIOs._setup_static_tensors``); ``ContinuousBatchingLogitsProcessorList`` counts a row only
# for the processors it converted itself, and sets ``do_processing`` once, in its constructor.
def cb_logits_processor_base():
    """The ``ContinuousBatchingLogitsProcessor`` base class (cb_logits_processors.py)."""
    from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor

    return ContinuousBatchingLogitsProcessor


def append_cb_logits_processor(manager, processor) -> None:
    """Append ``processor`` (a ``ContinuousBatchingLogitsProcessor``) to a ``ContinuousBatchingManager``'s
    ``logit_processor`` list before its batch processor exists: one more argument row, processing on.
    Raises when the manager already built its batch processor (its static argument rows are allocated)."""
    if getattr(manager, "batch_processor", None) is not None:
        raise KvCanaryRuntimeError(
            "kv-canary: the continuous-batching manager already built its batch processor (a persistent manager); "
            "a logits processor can only be added to a new manager"
        )
    plist = manager.logit_processor
    base = cb_logits_processor_base()
    rows = sum(isinstance(p, base) for p in plist.logits_processor)
    if rows != plist.tensors_required:
        raise KvCanaryRuntimeError(
            f"kv-canary: unexpected logits-processor layout ({rows} per-request processors, "
            f"{plist.tensors_required} argument rows); transformers=={VERSION_READ} was read"
        )
    plist.logits_processor.append(processor)
    plist.tensors_required += 1
    plist.do_processing = True


def persistent_manager(model) -> Optional[object]:
    """The model's cached ``ContinuousBatchingManager`` (``persistent_manager=True``), if any."""
    return getattr(model, "_cached_continuous_batching_manager", None)


# ---- KV moves outside the forward (observed by moves.MoveObserver) ------------------------------------------
# Each move is seen through one method shadowed by an instance attribute (`shadow_method`), removed exactly by
# `unshadow_method` when the session closes. All read from transformers 5.24.0:
#
# * cache.py ``PagedAttentionCache.perform_cache_copy(copy_src_and_dst)``: ``copy_src_and_dst`` maps an allocator
#   name (its layer type) to (source block ids, destination block ids); each allocator's ``copy_blocks`` copies
#   whole blocks (K and V of every layer of the group). Called once per ``update_batch`` that forks
#   (continuous_api.py, ``num_return_sequences > 1``), after ``prepare_fork_request`` gave every child its block
#   table (full blocks shared, the rest fresh), inside ``stream_context(compute_stream)``.
# * offloading_manager.py ``OffloadingManager._offload_to_cpu(victims, victim_block_tables)``: copies the blocks
#   of the victims (``victim_block_tables``: request id -> allocator name -> block ids, in logical order, taken
#   before ``free_blocks`` freed them) to the host pool; returns the set of request ids it copied (the others are
#   soft-reset: re-prefilled from scratch). A copied victim's KV covers positions ``[0, state.position_offset)``
#   (synchronous batching; async batching is refused at attach).
# * offloading_manager.py ``OffloadingManager.restore_scheduled_requests(requests_in_batch)``: for every
#   ``FutureRequestState`` whose ``state.is_cpu_offloaded``, pops ``_request_id_to_cpu_blocks[request_id]``
#   (allocator name -> host block ids) and copies the first ``min(len(host ids), len(block_table[request_id]))``
#   blocks, positionally, into the request's new blocks. Called from ``prepare_next_batch`` before the forward.
# * cache_allocators/cache_pool.py ``CachePool.free_blocks(index, block_ids)``: the blocks ``block_ids`` of the
#   allocator of index ``index`` go back to the free pool (a request's blocks no other request shares nor the
#   ledger keeps cached, a de-duplicated block, evicted cached blocks). A free block's bytes are the engine's to
#   reuse: by the same allocator for another request, or, once its whole sector is free
#   (``try_to_free_sectors``), by another allocator whose blocks cut the same bytes differently.
#   ``CachePool.reset()`` frees every block (``PagedAttentionCache.reset``). ``cache.pool`` is the pool.
FORK_COPY_METHOD = "perform_cache_copy"
POOL_FREE_METHOD = "free_blocks"
POOL_RESET_METHOD = "reset"
OFFLOAD_METHOD = "_offload_to_cpu"
RESTORE_METHOD = "restore_scheduled_requests"


def shadow_method(obj, name: str, make: Callable[[Callable], Callable]) -> Callable:
    """Shadow ``obj.name`` with an instance attribute ``make(original)``; returns the original bound method."""
    if name in vars(obj):
        raise KvCanaryRuntimeError(f"kv-canary: {type(obj).__name__}.{name} is already wrapped on this object (attached twice?)")
    original = getattr(obj, name)
    setattr(obj, name, make(original))
    return original


def unshadow_method(obj, name: str) -> None:
    """Remove the instance attribute: the class method is visible again, exactly as before."""
    vars(obj).pop(name, None)


_NOT_SHADOWED = object()


def stack_method(obj, name: str, make: Callable[[Callable], Callable]) -> Callable:
    """Shadow ``obj.name`` with ``make(current)`` even where another wrapper already shadows it (the canary and a
    fault's sampler both wrap ``init_continuous_batching``). Returns the wrapper, for `unstack_method`."""
    previous = vars(obj).get(name, _NOT_SHADOWED)
    wrapper = make(getattr(obj, name))
    wrapper._kvcanary_previous = previous
    object.__setattr__(obj, name, wrapper)
    return wrapper


def unstack_method(obj, name: str, wrapper: Callable) -> None:
    """Undo `stack_method`. With ``wrapper`` on top, what it shadowed is visible again (and so on down, past wrappers
    already removed). Under a later wrapper it stays in place, marked removed, until that one goes: meanwhile its
    owner must make it pass calls through."""
    wrapper._kvcanary_removed = True
    top = vars(obj).get(name, _NOT_SHADOWED)
    if top is not wrapper:
        return
    while top is not _NOT_SHADOWED and getattr(top, "_kvcanary_removed", False):
        top = top._kvcanary_previous
    if top is _NOT_SHADOWED:
        del vars(obj)[name]
    else:
        object.__setattr__(obj, name, top)


def stacked_methods(obj, name: str) -> list:
    """The wrappers `stack_method` put on ``obj.name``, top first."""
    found, fn = [], vars(obj).get(name, _NOT_SHADOWED)
    while fn is not _NOT_SHADOWED and hasattr(fn, "_kvcanary_previous"):
        found.append(fn)
        fn = fn._kvcanary_previous
    return found


def cache_pool(cache):
    """``cache.pool``: the ``CachePool`` every allocator takes its blocks from and frees them to."""
    return cache.pool


def offloading_manager(processor):
    """``processor.offloading_manager`` (continuous_api.py ``__init__``): the ``OffloadingManager``."""
    return processor.offloading_manager


def cpu_offload_enabled(processor) -> bool:
    """``offloading_manager._cpu_pool`` is set: offloaded requests go to the host pool (``_offload_to_cpu``) and
    come back into other blocks (``restore_scheduled_requests``); None when ``cpu_offload_space`` gave no sector."""
    manager = getattr(processor, "offloading_manager", None)
    return manager is not None and getattr(manager, "_cpu_pool", None) is not None


def offloaded_block_counts(manager, request_id: str) -> Optional[dict]:
    """Allocator name -> host blocks holding ``request_id``'s offloaded KV (``_request_id_to_cpu_blocks``), or None."""
    blocks = manager._request_id_to_cpu_blocks.get(request_id)
    return None if blocks is None else {name: len(ids) for name, ids in blocks.items()}


def host_kv_blocks(manager, request_id: str, layer_type: str):
    """(host pool view ``[blocks, bytes_per_block]`` uint8 of one allocator, ``request_id``'s block ids in it):
    where ``_offload_to_cpu`` put the request's KV (``_cpu_views[name]``, ``_request_id_to_cpu_blocks``)."""
    return manager._cpu_views[layer_type], list(manager._request_id_to_cpu_blocks[request_id][layer_type])


def request_state(future_state):
    """The ``RequestState`` of a ``FutureRequestState`` (requests.py)."""
    return future_state.state


def is_cpu_offloaded(state) -> bool:
    """``state.is_cpu_offloaded`` (requests.py): its KV is in the host pool."""
    return bool(state.is_cpu_offloaded)


def kv_length(state) -> int:
    """Positions whose KV the cache holds for a request between forwards: ``state.position_offset``."""
    return int(state.position_offset)


def request_tokens(state) -> list:
    """The request's tokens by position: ``initial_tokens`` then ``generated_tokens`` (requests.py)."""
    return list(state.initial_tokens) + list(state.generated_tokens)


FORK_CHILD_SEPARATOR = "__child#"  # a forked child's id: f"{parent id}__child#{i}" (continuous_api's fork loop)


def fork_parent(request_id: str) -> Optional[str]:
    """The id of the request ``request_id`` was forked from (``num_return_sequences``), or None."""
    parent, sep, _ = request_id.rpartition(FORK_CHILD_SEPARATOR)
    return parent if sep else None
