"""`attach(model)` for transformers continuous batching: two module hooks, plus one wrapper in graph mode.

* ``model.register_forward_pre_hook(..., with_kwargs=True)`` — sees the forward's kwargs before any KV is
  written: `ForwardTranslator.describe` (device ops on the engine's buffers), then the canary's
  ``stage`` + ``launch_head`` (plan, HEAD verify + write).
* ``model.register_forward_hook(..., with_kwargs=True, always_call=True)`` — runs after the forward stored
  its K/V: ``launch_tail`` (TAIL verify with real K/V re-hashed + write). ``always_call`` closes the
  bracket even when the forward raises (TAIL checks skipped, the step still ends).

Eager forwards (``use_cuda_graph=False``) are driven by the hooks alone: the pre-hook also runs the host
half (``host_step`` + ``begin_step``), the post-hook ``end_step``. The forward itself is not patched; KV the
engine moves between forwards (fork copies, CPU offload / restore) and blocks it frees to its pool are seen
through instance attributes shadowing methods of the session's cache, pool and offloading manager
(`moves.MoveObserver`, removed when the session closes, so by `detach`). The end of a generation session is
seen the same way, on the running manager's ``stop``: once the engine thread has stopped, every live slot is
swept (KV damaged where no later read and no rotating slice reached it is reported then); a session's close
sweeps too, unless that sweep already saw its final state. On CUDA the canary's
own HEAD / TAIL launches are captured once after the first forward (`Canary.capture_graphs`), and so is the
translation (``describe`` + ``stage``) over fixed-shape copies of the kwargs (`forward_view.StaticKwargs`):
per forward a few copies and three graph replays.

CUDA graphs (``use_cuda_graph=True``, or the GPU default with a flash attention kernel): during capture
the hooks run once and the canary's device work is captured with the forward; a replay runs no Python.
So the host half must run around the replay, where no documented hook exists: the adapter shadows
``processor.model_runner.compute_batch`` with an instance attribute (`compat.install_compute_wrapper`)
that calls ``host_step`` + ``begin_step`` before the original and ``end_step`` after it (whose rotating
sweep slice is not part of the engine's graphs: by default (``capture_sweep=True``) replayed from a graph of
its own after the first wrapped step, else launched from Python), counts
``engine_forwards``, and makes the compute stream wait for the host-side copies. `detach` deletes the
attribute (the class method is visible again) and drops the graphs captured with the canary inside (the
engine recaptures them on demand); graphs captured before attaching are dropped when the session opens,
since their replays would skip the canary. The wrapper is installed by the first forward's pre-hook
(the processor is created inside ``generate_batch``), so that first forward is hook-driven; the step it
opens ends at the next ``compute_batch`` (a capture follows it in the same call).

One canary *session* per ``PagedAttentionCache``: transformers builds a new cache for every
``generate_batch`` call (unless the manager is persistent), so the canary is rebuilt on the first
forward that carries a new cache; the handle keeps the violations and counts of every session.

Log mode never fails a forward. A problem of the canary itself while serving — a limit exceeded
(``max_requests``, ``max_context``: `KvCanaryCapacityError`), an internal error — is logged once per cause,
counted (``canary_errors``), and *suspends* the session: its canary is closed (results kept) and every later
forward on that cache runs unchecked and is counted (``unchecked_forwards``, by cause in
``unchecked_by_cause``) until the engine builds a new cache (the next ``generate_batch``), which gets a fresh
canary. Suspending rather than skipping one forward matters: a forward that ran without the canary wrote KV
with no records, and checking those slots later would report violations that are not there. In ``raise``
mode these errors are raised in the engine thread (the engine fails that step's requests) and re-raised by
the ``with``. Forwards while attached that are not continuous batching (a plain ``model(...)``,
``model.generate``) are counted as unchecked (``plain_forwards``) and warned about once.

A canary failure inside the engine's own CUDA-graph capture (``log`` mode) is not handled there: closing the
canary would read the device and break the engine's capture. The session is marked, the hooks do nothing more,
and once the capture ended the ``compute_batch`` wrapper suspends the session and drops the graphs it made (they
hold part of the canary's work). When the engine's capture itself fails with the canary's work inside (a launch
that the capture forbids invalidates it), the wrapper (for a processor's first ``compute_batch``, which runs
before the wrapper exists: a guard installed when the manager builds the processor) repairs what a failed capture leaves behind
(`kvcanary.runtime.capture.recover_failed_capture`), suspends the session and, in ``log`` mode, runs the forward
again without the canary (a failed capture ran nothing). ``engine_forwards`` is counted by the hooks and the
wrapper before any canary work, so a suspended session shows ``checked_forwards < engine_forwards``.

On CUDA the device path is proved at `attach` and when a session opens (`kvcanary.runtime.device_probe`): a
machine without a working Triton is refused, or with ``allow_eager_fallback=True`` runs the twins eagerly, where
the canary's own graphs stay off and an engine with CUDA graphs is refused (docs/troubleshooting.md).

Checked at `attach` (not at the first forward): option names, ``max_requests`` / ``max_context``, the
device, ``real_kv_layers`` against the model's layers per attention type, one canary per model. A detached
handle keeps its results readable (`counters`, `violations`, `stats`) and refuses to be used again.
"""
from __future__ import annotations

import difflib
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch

from kvcanary.engines.transformers_cb import compat
from kvcanary.engines.transformers_cb.forward_view import ContextFn, ForwardTranslator, StaticKwargs, TokenOracleFn
from kvcanary.engines.transformers_cb.graph_driver import GraphDriver
from kvcanary.engines.transformers_cb.layout import build_layouts, layer_kv_views
from kvcanary.engines.transformers_cb.moves import MoveObserver
from kvcanary.runtime.weights import WeightsWatch
from kvcanary.engines.transformers_cb.session import (
    CAUSE_CAPACITY,
    CAUSE_INTERNAL,
    CAUSE_PLAIN,
    DEFERRED_END,
    HOOK_STEP,
    IDLE,
    WRAPPED_STEP,
    _Session,
    _SessionResult,
    _Suspended,
    merge_counters,
    session_result,
)
from kvcanary.errors import (
    KvCanaryCapacityError,
    KvCanaryError,
    KvCanaryRuntimeError,
    KvCanaryTypeError,
    KvCanaryValueError,
)
from kvcanary.runtime import Canary, CanaryConfig, CanaryHealthError, CanaryViolationError, GroupSpec, Violation
from kvcanary.runtime.capture import capture_graph
from kvcanary.runtime.cuda_host import capturing as _capturing
from kvcanary.runtime.device_probe import prove_device_path

logger = logging.getLogger("kvcanary")

SUPPORTED_TRANSFORMERS = compat.VERSION_READ
DEFAULT_MAX_REQUESTS = 256
DEFAULT_MAX_CONTEXT = 32768

ADAPTER_OPTIONS = ("max_requests", "max_context", "device", "config", "capture_canary", "static_translation",
                   "token_oracle", "capture_sweep", "context_of", "committed_tokens", "watch_weights", "graph_driver")

_ATTACHED: "weakref.WeakKeyDictionary[torch.nn.Module, TransformersCbHandle]" = weakref.WeakKeyDictionary()


def check_transformers_version() -> str:
    """The installed transformers version; raises unless it is the pinned one."""
    try:
        import transformers
    except ImportError:
        raise KvCanaryRuntimeError(
            f"kv-canary: the transformers adapter needs transformers=={SUPPORTED_TRANSFORMERS} "
            f"(pip install 'kvcanary[transformers]')"
        ) from None
    if transformers.__version__ != SUPPORTED_TRANSFORMERS:
        raise KvCanaryRuntimeError(
            f"kv-canary: transformers {transformers.__version__} is not supported; the continuous-batching "
            f"adapter is pinned to transformers=={SUPPORTED_TRANSFORMERS} (its cache internals change "
            f"between minor versions)"
        )
    return transformers.__version__


@dataclass
class TransformersCbHandle:
    """What `attach` returns. A context manager: leaving it detaches, then re-raises in the caller's
    thread the first canary error the engine thread hit (violations in ``raise`` mode; ``kv-canary:``
    usage errors in any mode).

    ``generate_batch`` runs the model in a background thread and turns exceptions raised there into
    failed requests; the handle keeps them in ``errors`` so they are never lost.
    """

    model: torch.nn.Module
    config: CanaryConfig
    max_requests: int
    max_context: Optional[int]
    device: Optional[torch.device]
    capture_canary: Optional[bool] = None
    static_translation: Optional[bool] = None
    token_oracle: Optional[TokenOracleFn] = None
    capture_sweep: bool = True
    context_of: Optional[ContextFn] = None
    committed_tokens: bool = True
    watch_weights: bool = True
    graph_driver: bool = False
    errors: list = field(default_factory=list)
    _hooks: list = field(default_factory=list)
    _sessions: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._current: Optional[_Session] = None
        self._closed: list[_SessionResult] = []
        self._detached = False
        self._suspended: Optional[_Suspended] = None  # a cache whose forwards run unchecked (log mode)
        self._unchecked: dict[str, int] = {}  # cause -> forwards that ran unchecked
        self._canary_errors = 0
        self._logged_causes: set[str] = set()
        # continuous-batching forwards the engine ran while attached, counted before any canary work (an eager
        # forward's pre-hook, or one compute_batch call in graph mode): a failing canary cannot silence it
        self._engine_forwards = 0
        self._in_compute = False  # inside a wrapped compute_batch (graph mode): the wrapper counted this forward
        self._init_cb_wrapper = None  # compat.stack_method's wrapper of model.init_continuous_batching
        self._capture_hooks = 0  # pre-hooks run inside the engine's CUDA-graph captures (see graph_driver)
        self._last_suspension: Optional[str] = None  # cause of the latest suspension (kept after it ends)
        self._device_path: Optional[str] = None  # the latest session's device path (kept after it ends)
        self._graphs = GraphDriver(self)  # graph mode: the compute_batch wrappers and the capture repair
        self.weights = WeightsWatch(self.model, auto=self.watch_weights)  # kept across sessions (runtime/weights.py)

    # ---- hooks ---------------------------------------------------------------------------------
    def _install(self) -> None:
        pre = self.model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        post = self.model.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True)
        self._hooks = [pre, post]
        self.weights.install()  # load_state_dict / optimizer-step hooks and sentinel counters (runtime/weights.py)
        try:
            self._init_cb_wrapper = compat.stack_method(self.model, compat.INIT_CB_METHOD, self._graphs.wrap_init_cb)
        except Exception as exc:  # noqa: BLE001 — without it only the very first capture's failure goes unrepaired
            logger.debug("kv-canary: could not wrap %s: %s", compat.INIT_CB_METHOD, exc)

    def _pre_forward(self, module, args, kwargs):
        cache = kwargs.get("cache")
        if cache is None or not hasattr(cache, "cache_allocators"):  # not a continuous-batching forward
            if not _capturing():
                self._count_unchecked(CAUSE_PLAIN)
                if CAUSE_PLAIN not in self._logged_causes:
                    self._logged_causes.add(CAUSE_PLAIN)
                    logger.warning("kv-canary: a forward of %s ran outside continuous batching (a plain model(...) or "
                                   "model.generate) while the canary is attached; such forwards are not checked, "
                                   "counted in plain_forwards / unchecked_forwards", type(module).__name__)
            return None
        if _capturing():
            self._capture_hooks += 1  # the engine is capturing with the canary inside (see graph_driver)
        if not self._in_compute and not _capturing():
            self._engine_forwards += 1
        sus = self._suspended
        if sus is not None and sus.cache is cache:
            if not sus.graphs and not _capturing():  # graph mode: the counting wrapper counts
                self._count_unchecked(sus.cause)
            return None
        s: Optional[_Session] = None
        try:
            s = self._session_for(cache)
            if s.failed_in_capture is not None:  # failed inside the engine's capture: nothing more until it ends
                return None
            if not _capturing():
                if s.phase in (IDLE, DEFERRED_END):  # not inside a wrapped step: this hook drives it
                    self._end_deferred(s)
                    self._begin(s, HOOK_STEP)
            # eager, or captured once into the graph (the replays re-run these device ops). A warmup forward
            # runs it too, on padding rows only (nothing planned, written or verified): the kernels compile
            # and the static buffers learn the adapter's tables before the capture that follows.
            if not _capturing() and s.statics is not None and s.statics.load(kwargs):
                if s.translation is not None:
                    s.translation.replay()  # describe + stage, captured over the fixed-shape copies
                else:
                    s.canary.stage(s.translator.describe(s.statics.kwargs))
            else:
                s.canary.stage(s.translator.describe(kwargs))
            s.canary.launch_head()
            s.head_open = True
        except Exception as exc:
            self._canary_failed(s, cache, exc)  # raise mode: raises; log mode: this forward runs unchecked
        return None

    def _post_forward(self, module, args, kwargs, output):
        s = self._current
        if s is None or not s.head_open:
            return None
        s.head_open = False
        capturing = _capturing()
        try:
            s.canary.launch_tail(run_checks=output is not None)  # output None: the forward raised
            if capturing:
                s.graphs_captured += 1
            elif s.phase == HOOK_STEP:
                if s.graphs:
                    s.phase = DEFERRED_END  # a capture may follow in this compute_batch call
                else:
                    s.phase = IDLE
                    s.canary.end_step()
                    if s.canary_graphs_due:  # the tables are known now: replay HEAD / TAIL from here on
                        s.canary_graphs_due = False
                        s.canary.capture_graphs()
                        self._capture_translation(s)
        except Exception as exc:
            self._canary_failed(s, s.cache, exc, forward_counted=True)
        return None

    # ---- log mode: canary errors never fail a forward ----------------------------------------------
    def _canary_failed(self, s: Optional[_Session], cache, exc: Exception, *, forward_counted: bool = False) -> None:
        """A canary or translation error during a forward. ``raise`` mode (and violations / health errors,
        which only ``raise`` mode raises): keep it in ``errors`` and re-raise — the engine fails that step.
        ``log`` mode: log once per cause, count, suspend the session (see the module docstring) and return,
        so the engine's forward proceeds unchecked."""
        if self.config.mode == "raise" or isinstance(exc, (CanaryViolationError, CanaryHealthError)):
            own_failure = not isinstance(exc, (CanaryViolationError, CanaryHealthError))
            if not isinstance(exc, KvCanaryError):  # the canary's own failure: one clear kv-canary error, cause chained
                wrapped = KvCanaryRuntimeError(f"kv-canary: the canary failed ({type(exc).__name__}: {exc})")
                wrapped.__cause__ = exc
                exc = wrapped
            self.errors.append(exc)
            if own_failure:  # raised once: the session is suspended, later forwards and moves pass through
                cause = CAUSE_CAPACITY if isinstance(exc, KvCanaryCapacityError) else CAUSE_INTERNAL
                if s is not None and s.graphs and _capturing():
                    s.head_open = False
                    s.failed_in_capture = s.failed_in_capture or (cause, f"{type(exc).__name__}: {exc}")
                else:
                    try:
                        self._suspend(s, cache, cause, reason=f"{type(exc).__name__}: {exc}")
                    except Exception as again:  # noqa: BLE001 — the first error is the one to raise
                        logger.debug("kv-canary: suspending after the error failed: %s", again)
            raise exc
        cause = CAUSE_CAPACITY if isinstance(exc, KvCanaryCapacityError) else CAUSE_INTERNAL
        if s is not None and s.graphs and _capturing():
            # inside the engine's capture: closing the canary now would read the device and break the engine's
            # capture; the compute_batch wrapper suspends once the capture ended and drops the graph it made
            self._canary_errors += 1
            s.head_open = False
            if s.failed_in_capture is None:
                s.failed_in_capture = (cause, f"{type(exc).__name__}: {exc}")
                logger.error("kv-canary: %s (%s) inside the engine's CUDA graph capture; log mode: that graph is "
                             "dropped and the rest of this engine session runs unchecked (counted in "
                             "unchecked_forwards), serving goes on", exc, type(exc).__name__)
            return
        self._canary_errors += 1
        if cause not in self._logged_causes:
            self._logged_causes.add(cause)
            logger.error("kv-canary: %s (%s); log mode: the rest of this engine session runs unchecked "
                         "(counted in unchecked_forwards), serving goes on", str(exc).removeprefix("kv-canary: "),
                         type(exc).__name__)
        else:
            logger.debug("kv-canary: again (%s): %s", cause, exc)
        self._suspend(s, cache, cause, reason=f"{type(exc).__name__}: {exc}")
        self._count_unchecked(cause)

    def _suspend(self, s: Optional[_Session], cache, cause: str, *, reason: str = "") -> None:
        processor = s.processor if s is not None else _processor_of(cache)
        graphs = bool(s.graphs) if s is not None else processor is not None and self._graph_mode(processor)
        if s is not None and s in self._sessions:
            try:
                self._close_session(s, final_sweep=False)  # its records no longer match what the engine wrote
            except Exception as exc:  # noqa: BLE001 — closing a broken canary may fail too; results are kept
                logger.debug("kv-canary: closing the suspended session failed: %s", exc)
                if s in self._sessions:
                    self._sessions.remove(s)
                    self._closed.append(_SessionResult(forwards=0, stats=None, violations=[], counters={}))
        if self._current is s:
            self._current = None
        self._end_suspension()
        self._suspended = _Suspended(cache=cache, processor=processor, graphs=graphs, cause=cause, reason=reason)
        self._last_suspension = f"{cause}: {reason}"
        if graphs:
            try:
                compat.install_compute_wrapper(processor, lambda original: self._graphs.count_wrapper(cache, original))
            except Exception:  # noqa: BLE001 — without the wrapper, replays cannot be counted
                self._suspended = _Suspended(cache=cache, processor=processor, graphs=False, cause=cause,
                                             reason=reason)

    def _end_suspension(self) -> None:
        sus, self._suspended = self._suspended, None
        if sus is not None and sus.graphs:
            compat.restore_compute_batch(sus.processor)

    def _count_unchecked(self, cause: str) -> None:
        self._unchecked[cause] = self._unchecked.get(cause, 0) + 1
        interval = self.config.stats_interval
        sus = self._suspended
        if interval > 0 and sus is not None and sus.cause != CAUSE_PLAIN and self._engine_forwards % interval == 0:
            # the periodic stats line goes on while suspended (the session's canary, which logged it, is closed)
            checked = sum(int(r.counters.get("checked_forwards", 0)) for r in self._closed)
            logger.warning("kv_canary stats: engine_forwards=%d checked_forwards=%d unchecked_forwards=%d "
                           "state=suspended: %s: %s", self._engine_forwards, checked, sum(self._unchecked.values()),
                           sus.cause, sus.reason)

    def _require_attached(self) -> None:
        if self._detached:
            raise KvCanaryRuntimeError(
                "kv-canary: this canary handle was detached; its results stay readable (counters, violations, "
                "stats), but it checks nothing: attach again for a new one"
            )

    def _graph_mode(self, processor) -> bool:
        """Whether the steps of ``processor``'s sessions are driven by the ``compute_batch`` wrapper (graph mode):
        when the engine captures CUDA graphs, or always with ``graph_driver=True``."""
        return self.graph_driver or any(compat.graph_flags(processor))

    # ---- steps ---------------------------------------------------------------------------------
    def _begin(self, s: _Session, phase: str) -> None:
        """Host half of one engine forward: bookkeeping, static inputs, ``begin_step``."""
        s.step = s.translator.host_step()
        s.warmup_forwards += s.step.warmup
        s.canary.begin_step(request_ids=s.step.request_ids, request_rows=s.step.rows,
                            forward_kind=s.step.forward_kind)
        s.engine_forwards += 1
        s.phase = phase

    def _capture_translation(self, s: _Session) -> None:
        """Capture ``describe`` + ``stage`` over the fixed-shape kwargs copies (eager engine, CUDA); on
        failure keep translating eagerly (same result, more launches)."""
        if s.statics is None or torch.device(s.translator.device).type != "cuda":
            return
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: re-stages the forward just done (idempotent)
                s.canary.stage(s.translator.describe(s.statics.kwargs))
            torch.cuda.current_stream().wait_stream(side)
            s.translation = capture_graph(lambda: s.canary.stage(s.translator.describe(s.statics.kwargs)))
        except Exception as exc:  # noqa: BLE001 — the eager path is always correct
            logger.warning("kv-canary: could not capture the translation graph (%s); translating eagerly", exc)

    def _capture_sweep(self, s: _Session) -> None:
        """Graph mode: the engine's graphs hold HEAD / TAIL, but the sweep slice runs between forwards; capture it
        alone so `end_step` replays it instead of launching its kernels from Python each step. On failure the
        slice keeps launching eagerly (same result, more host time)."""
        s.sweep_graph_due = False
        try:
            s.canary.capture_sweep_graph()
        except Exception as exc:  # noqa: BLE001 — the eager slice is always correct
            logger.warning("kv-canary: could not capture the sweep slice (%s); launching it eagerly", exc)

    def _end_deferred(self, s: _Session) -> None:
        if s.phase == DEFERRED_END:
            s.phase = IDLE
            s.canary.end_step()

    def _abandon(self, s: _Session) -> None:
        """Close a step whose forward raised before the post-hook could (TAIL checks skipped)."""
        try:
            if s.head_open:
                s.head_open = False
                s.canary.launch_tail(run_checks=False)
            if s.phase in (HOOK_STEP, WRAPPED_STEP, DEFERRED_END):
                s.canary.end_step()
        except CanaryViolationError as exc:
            self.errors.append(exc)
        finally:
            s.phase = IDLE

    # ---- sessions ------------------------------------------------------------------------------
    def _session_for(self, cache) -> _Session:
        current = self._current
        if current is not None and current.cache is cache:
            return current
        with self._lock:
            if current is not None:
                self._current = None
                try:
                    self._close_session(current)
                except CanaryViolationError as exc:  # the old session's final sweep (raise mode): not this forward's
                    self.errors.append(exc)
            self._end_suspension()  # a new cache: a fresh canary checks it
            self._current = self._open_session(cache)
            return self._current

    def _open_session(self, cache) -> _Session:
        processor = compat.find_batch_processor(cache)
        _refuse_unobservable_paths(processor)
        layouts = build_layouts(cache)
        device = self.device or cache.cache_tensor.device
        max_batch_tokens, max_read = compat.cache_limits(cache)
        max_rows = max(1, compat.max_requests_per_batch(processor))
        translator = ForwardTranslator(
            cache=cache, processor=processor, layouts=layouts, max_requests=self.max_requests,
            max_context=self.max_context or min(max_read, DEFAULT_MAX_CONTEXT), max_rows=max_rows, device=device,
            token_oracle=self.token_oracle, context_of=self.context_of,
            committed_tokens=self.committed_tokens and self.config.write_input_assert,
            weights_version=self.weights.current if self.watch_weights else None,
        )
        graphs = self._graph_mode(processor)
        path = prove_device_path(device, allow_eager_fallback=self.config.allow_eager_fallback)  # refuses, or falls back
        if path.degraded and graphs:
            raise KvCanaryRuntimeError(path.refusal("continuous batching with the engine's CUDA graphs (use_cuda_graph)"))
        canary = self._session_canary(cache, translator, max_batch_tokens=max_batch_tokens)
        cuda = torch.device(device).type == "cuda"
        own_graphs = ((self.capture_canary if self.capture_canary is not None else cuda) and cuda and not graphs
                      and path.graphs)
        session = _Session(cache=cache, processor=processor, canary=canary, translator=translator, graphs=graphs,
                           canary_graphs_due=own_graphs, sweep_graph_due=graphs and cuda and self.capture_sweep)
        if not graphs and (self.static_translation if self.static_translation is not None else own_graphs):
            session.statics = StaticKwargs(layouts=layouts, max_rows=max_rows, max_tokens=max_batch_tokens,
                                           max_reads=max_read + max_batch_tokens, device=device)
        if graphs:
            # graphs captured before attaching replay without the canary: drop them (recaptured on demand)
            session.graphs_dropped += compat.drop_graphs(processor, list(compat.graph_store(processor)))
            compat.install_compute_wrapper(processor, lambda original: self._graphs.wrap_compute_batch(session, original))
        self._observe_moves(session)
        self._observe_stop(session)
        self._sessions.append(session)
        return session

    def _session_canary(self, cache, translator: ForwardTranslator, *, max_batch_tokens: int) -> Canary:
        """The canary of a new session, sized from the translator and wired to the cache's KV views and live
        slots; identities issued from now on are named in its reports."""
        layouts, config = translator.layouts, self.config
        if any(g.sliding_window and max_batch_tokens >= g.sliding_window for g in layouts) and (
            config.chain_position_warmup >= 0
        ):
            # A chunk of >= W tokens recycles every ring slot, including the one the write chains
            # from: the chain restarts from the padding slot there, which the chain-position assert
            # would flag. Positions are still checked by the write-input assert (prefix_len + i).
            logger.info("kv-canary: chain-position assert off (sliding window %s <= max_batch_tokens %s)",
                        min(g.sliding_window for g in layouts if g.sliding_window), max_batch_tokens)
            config = config.with_options(chain_position_warmup=-1)
        canary = Canary(
            config,
            groups=[
                GroupSpec(name=g.name, num_slots=g.num_slots, sliding_window=g.sliding_window, layer_ids=g.layer_ids,
                          ring_window=bool(g.sliding_window))
                for g in layouts
            ],
            max_requests=translator.max_rows,
            max_context=translator.max_context,
            max_batch_tokens=max_batch_tokens,
            device=translator.device,
        )
        self._device_path = canary.device_path.path
        translator.issue = canary.identities.issue
        for g in layouts:
            canary.set_kv_cache(g.name, lambda layer, g=g: layer_kv_views(cache, g, layer)[:2], page_size=g.page_size)
        canary.set_live_slots_provider(translator.live_slots)
        return canary

    def _observe_stop(self, s: _Session) -> None:
        """Shadow the running manager's ``stop`` (removed when the session closes): once the engine has stopped
        (its generation thread joined), sweep every live slot of the session (`_engine_stopped`)."""
        manager = compat.find_manager(s.processor)
        if manager is None or compat.MANAGER_STOP_METHOD in vars(manager):
            return

        def make(original):
            def stop(*args, **kwargs):
                result = original(*args, **kwargs)
                self._engine_stopped(s, manager)
                return result

            return stop

        compat.shadow_method(manager, compat.MANAGER_STOP_METHOD, make)
        s.manager = manager

    def _engine_stopped(self, s: _Session, manager) -> None:
        """The end of a generation session (``generate_batch`` returning, the manager stopped): a full sweep of
        the session's live slots — KV damaged after the last rotating slice reached it, and read by no later
        forward, is reported now, against the slot's last writer. The session stays open (a persistent manager
        reuses the cache; results stay readable); its close skips a second sweep of the same state. Nothing is
        swept while the generation thread still runs (``stop(block=False)``): the close sweeps instead. Errors go
        to ``errors`` (raise mode) or the log; the engine's stop never fails because of the canary."""
        if self._current is not s or self._detached or manager.is_running():
            return
        try:
            self._end_deferred(s)
            if s.phase == IDLE and not s.head_open and s.canary._sweeping():
                s.canary.sweep()
                s.final_swept_at = s.canary.step
        except CanaryViolationError as exc:
            s.final_swept_at = s.canary.step
            self.errors.append(exc)
        except Exception as exc:  # noqa: BLE001 — the canary's failure, never the engine's
            self._canary_errors += 1
            if self.config.mode == "raise":
                self.errors.append(exc)
            logger.error("kv-canary: the sweep at the end of the generation session failed (%s: %s)",
                         type(exc).__name__, exc)

    def _observe_moves(self, s: _Session) -> None:
        """Install the KV-move wrappers of a new session (moves.py); `_close_session` removes them."""
        s.moves = MoveObserver(cache=s.cache, processor=s.processor, layouts=s.translator.layouts,
                               enter=lambda: self._enter_move(s),
                               failed=lambda exc: self._canary_failed(s, s.cache, exc),
                               context_id=s.translator.context_id if s.translator.keyed else None)
        s.moves.install()

    def _enter_move(self, s: _Session) -> Optional[Canary]:
        """The canary a KV move between forwards is recorded in: None when ``s`` is no longer the live
        session (pass through); a step left open by the hooks (graph mode) is ended first."""
        if self._current is not s or self._detached:
            return None
        if s.phase not in (IDLE, DEFERRED_END) or s.head_open:
            raise KvCanaryRuntimeError(f"kv-canary: the engine moved KV inside an open forward (phase {s.phase})")
        self._end_deferred(s)
        return s.canary

    def _close_session(self, session: _Session, *, final_sweep: bool = True) -> None:
        """Close a session's canary and keep only its results. In graph mode the compute_batch wrapper is
        removed and the graphs captured with the canary are dropped (their replays would write into the
        closed canary's buffers). ``final_sweep``: sweep every live slot first (`Canary.close`), unless a forward
        was left open (its records are incomplete) or the sweep at the engine's stop already saw this state."""
        final_sweep = (final_sweep and session.phase in (IDLE, DEFERRED_END) and not session.head_open
                       and session.final_swept_at != session.canary.step)
        try:
            self._abandon(session)
        finally:
            if session.graphs:
                compat.restore_compute_batch(session.processor)
                session.graphs_dropped += compat.drop_graphs(session.processor, list(compat.graph_store(session.processor)))
            if session.moves is not None:
                session.moves.remove()
            if session.manager is not None:
                compat.unshadow_method(session.manager, compat.MANAGER_STOP_METHOD)
                session.manager = None
            try:
                session.canary.close(final_sweep=final_sweep)
            finally:
                self._closed.append(session_result(session))
                self._sessions.remove(session)

    # ---- user API ------------------------------------------------------------------------------
    def _results(self) -> list:
        return self._closed + [session_result(s) for s in self._sessions]

    @property
    def sessions(self) -> int:
        """Engine caches seen so far (one canary each)."""
        return len(self._closed) + len(self._sessions)

    @property
    def forwards(self) -> int:
        """Steps the canary opened (engine forwards with real requests)."""
        return sum(r.forwards for r in self._results())

    def violations(self) -> list[Violation]:
        """Every violation so far, over every session, oldest first."""
        return [v for r in self._results() for v in r.violations]

    def counters(self) -> dict:
        """Counts summed over sessions: ``total``, ``by_reason``, ``by_tag``, ``checked_forwards`` (HEAD
        checks that ran on the device, graph replays included), ``engine_forwards`` (forwards the engine
        ran with real requests, eager or replayed — equal to ``checked_forwards`` when nothing escaped),
        ``warmup_forwards`` and graph counts; the runtime's ``coverage`` account (summed) where it has one.
        The adapter's own account of what was *not* checked (all zero in a healthy run):
        ``unchecked_forwards`` (every forward that ran while attached without the canary),
        ``unchecked_by_cause`` (``capacity``: a limit given at attach was exceeded; ``internal``: the canary
        failed; ``plain_forward``: not continuous batching), ``plain_forwards``, ``canary_errors`` (errors
        that suspended a session in ``log`` mode)."""
        out = merge_counters([r.counters for r in self._results()])
        out["unchecked_forwards"] = sum(self._unchecked.values())
        out["unchecked_by_cause"] = dict(self._unchecked)
        out["plain_forwards"] = self._unchecked.get(CAUSE_PLAIN, 0)
        out["canary_errors"] = self._canary_errors
        out["engine_forwards"] = self._engine_forwards
        out.setdefault("checked_forwards", 0)  # no session opened (e.g. refused when it would have): none checked
        out.setdefault("total", 0)
        if self._device_path is not None:
            out["device_path"] = self._device_path  # kept after detach: which path the checks ran on
        sus = self._suspended
        out["suspended"] = f"{sus.cause}: {sus.reason}" if sus is not None and sus.cause != CAUSE_PLAIN else None
        out["last_suspension"] = self._last_suspension
        return out

    def stats(self) -> list:
        """One `CanaryStats` per session."""
        return [r.stats for r in self._results() if r.stats is not None]

    def sweep(self):
        """Verify every live slot of the current cache now."""
        self._require_attached()
        if self._current is None:
            return None
        return self._current.canary.sweep()

    def bump_weights_version(self) -> int:
        """The manual fallback for weight changes the watch cannot see (writes through ``param.data``, or from
        outside Python): requests that appear from now on are produced by new weights, so a prefix-cache hit on KV
        cached before is a violation. Returns the new version. Needs ``watch_weights`` (the default) at attach."""
        if not self.watch_weights:
            raise KvCanaryRuntimeError("kv-canary: bump_weights_version() needs attach(..., watch_weights=True)")
        return self.weights.bump()

    @property
    def weights_version(self) -> int:
        """The weights version requests appearing now are keyed with (0 until the weights change)."""
        return self.weights.current()

    def raise_if_failed(self) -> None:
        """Raise the first error the canary hit in the engine thread: a `CanaryViolationError` (only
        raised in ``raise`` mode) or a ``kv-canary:`` usage error (any mode — the engine failed the
        requests of that step, so checking did not silently stop)."""
        if self.errors:
            raise self.errors[0]

    def detach(self) -> None:
        """Remove both hooks (and, in graph mode, the compute_batch wrapper) and close every canary. The
        model and the engine classes are left exactly as they were; graphs captured with the canary are
        dropped and recaptured by the engine when needed. Idempotent."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.weights.remove()
        if self._init_cb_wrapper is not None:  # left in place (passing through) when another wrapper sits on top
            compat.unstack_method(self.model, compat.INIT_CB_METHOD, self._init_cb_wrapper)
            self._init_cb_wrapper = None
        self._detached = True
        if _ATTACHED.get(self.model) is self:
            del _ATTACHED[self.model]
        self._end_suspension()
        if self._current is not None:
            try:
                self._close_session(self._current)
            except CanaryViolationError as exc:
                self.errors.append(exc)
            self._current = None

    def __enter__(self) -> "TransformersCbHandle":
        self._require_attached()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.detach()
        if exc_type is None:
            self.raise_if_failed()


def check_attach_options(options: dict) -> None:
    """Unknown keyword arguments of `attach`: a ``kv-canary:`` `TypeError` naming the valid ones."""
    valid = ADAPTER_OPTIONS + CanaryConfig.option_names()
    for name in options:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise KvCanaryTypeError(
                f"kv-canary: attach() got an unknown keyword argument {name!r}{hint}; valid: "
                f"{', '.join(ADAPTER_OPTIONS)} and the CanaryConfig options {', '.join(CanaryConfig.option_names())}"
            )


def check_limits(max_requests: object, max_context: object) -> None:
    if isinstance(max_requests, bool) or not isinstance(max_requests, int) or max_requests < 1:
        raise KvCanaryValueError(f"kv-canary: max_requests must be a positive integer, got {max_requests!r}")
    if max_context is not None and (isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 1):
        raise KvCanaryValueError(f"kv-canary: max_context must be a positive integer (or None), got {max_context!r}")


def check_device(device: object) -> Optional[torch.device]:
    """``device`` as a `torch.device`, refused unless usable now (a CUDA device needs a visible GPU)."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise KvCanaryValueError(f"kv-canary: device {device!r} is not a torch device (e.g. 'cpu', 'cuda', 'cuda:1')") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise KvCanaryRuntimeError(f"kv-canary: device {str(device)!r} is not usable: no CUDA GPU is visible "
                                       "to torch (torch.cuda.is_available() is False)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise KvCanaryRuntimeError(f"kv-canary: device {str(device)!r} is not usable: only "
                                       f"{torch.cuda.device_count()} CUDA device(s)")
    return dev


def _processor_of(cache) -> Optional[object]:
    """The batch processor of ``cache`` (None when it cannot be found): a session that failed to open."""
    try:
        return compat.find_batch_processor(cache)
    except Exception:  # noqa: BLE001 — only used to count the forwards of a suspended cache
        return None


def _model_device(model: torch.nn.Module) -> Optional[torch.device]:
    """The device of the model's first parameter (None without parameters)."""
    for p in model.parameters():
        return p.device
    return None


def model_layer_types(model: torch.nn.Module) -> dict[str, int]:
    """Layers per attention type of a transformers model, from its config (``layer_types`` when present,
    else every layer full attention); empty when the config does not say."""
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    types = getattr(cfg, "layer_types", None)
    if types:
        out: dict[str, int] = {}
        for t in types:
            out[t] = out.get(t, 0) + 1
        return out
    n = getattr(cfg, "num_hidden_layers", None)
    return {"full_attention": int(n)} if isinstance(n, int) and n > 0 else {}


def check_real_kv_layers(model: torch.nn.Module, config: CanaryConfig) -> None:
    """Every ``real_kv_layers`` index in range for each attention type's layers (docs/design.md §4.1: indices
    into a group's layer ids; negative counts from the end)."""
    for layer_type, n in model_layer_types(model).items():
        for pick in config.real_kv_layers:
            if not -n <= pick < n:
                raise KvCanaryValueError(
                    f"kv-canary: real_kv_layers index {pick} is out of range for the model's {layer_type} layers "
                    f"({n} layers: valid {-n}..{n - 1})"
                )


def _refuse_unobservable_paths(processor) -> None:
    """torch.compile'd forwards do not run the hooks as Python (and the compiled graph would bake in the
    canary's host-side choices); async batching prepares batch N+1 while N runs, from a second IO pair
    whose inputs are carried over on the device (and its CPU offload rolls a token back after the copy). The
    canary refuses them rather than silently stop checking. CUDA graphs, forks and synchronous CPU offload are
    supported (see the module docstring)."""
    if any(compat.compiled_paths(processor)):
        raise KvCanaryRuntimeError(
            "kv-canary: torch.compile is on for continuous batching (varlen/decode_compile_config); compiled "
            "forwards do not run the canary's hooks. Leave the compile configs unset to run checked"
        )
    if compat.uses_async_batching(processor):
        raise KvCanaryRuntimeError(
            "kv-canary: async batching is on; the canary supports synchronous continuous batching (CUDA graphs "
            "included). Pass ContinuousBatchingConfig(use_async_batching=False)"
        )


def attach(
    model: torch.nn.Module, *, max_requests: int = DEFAULT_MAX_REQUESTS, max_context: Optional[int] = None,
    device: Optional[torch.device] = None, config: Optional[CanaryConfig] = None,
    capture_canary: Optional[bool] = None, static_translation: Optional[bool] = None,
    token_oracle: Optional[TokenOracleFn] = None, capture_sweep: bool = True, context_of: Optional[ContextFn] = None,
    committed_tokens: bool = True, watch_weights: bool = True, graph_driver: bool = False, **options: object,
) -> TransformersCbHandle:
    """Check every continuous-batching forward of ``model`` (``generate_batch`` / the manager), eager or
    CUDA-graphed. In mode ``none`` nothing is attached.

    ``options`` are `CanaryConfig` fields (``mode="raise"``, ``sweep_interval=...``); unset ones come
    from ``KVCANARY_*`` environment variables. ``max_requests``: live requests tracked at once;
    ``max_context``: longest request (default: the cache's capacity, at most 32768).
    ``capture_canary``: when the engine runs eagerly on CUDA, capture the canary's own HEAD / TAIL work in
    CUDA graphs after the first forward (`Canary.capture_graphs`; default on; off = launch per forward).
    ``capture_sweep``: when the engine captures its own graphs (HEAD / TAIL inside them), replay the sweep slice
    that runs between forwards from a graph of its own (`Canary.capture_sweep_graph`; default on; off = its
    kernels launched from Python each step, about 1.3 ms of a replayed decode step on an H200).
    ``static_translation``: translate eager forwards from fixed-shape copies of their kwargs, with the
    translation captured once in a CUDA graph alongside (default: with ``capture_canary``).
    ``token_oracle``: ``(request_id, position) -> token`` the engine's sampler is known to emit past the prompt
    (e.g. `kvcanary.faults.tf_oracle.OracleSampler.token`): the write-input assert then checks each written token
    against it. ``committed_tokens`` (default on, with the config's ``write_input_assert``): without an oracle,
    each written token is checked against the tokens its request committed (prompt and generated tokens, read
    from the engine's request states), so a forward fed another token is a ``write_token`` violation of that
    request at once; off: against the forward's own input ids (positions only).
    ``context_of``: ``request_id -> key`` naming the context a request's KV belongs to (LoRA adapter, tenant,
    cache salt; any hashable, or a `kvcanary.runtime.identity.ProducerIdentity`; None = no context), asked once
    per request (a forked child takes its parent's): KV computed under one context and served to a request of
    another is a ``verify_chain_hash`` violation of that request at position 0 (full attention; a sliding window
    past position 0 does not see it); a `ProducerIdentity` violation names the field that differed.
    ``watch_weights`` (default on): the weights version is part of every request's identity, taken when the
    request first appears (`runtime/weights.py`: ``load_state_dict``, optimizer steps and sentinel parameters
    are watched), so a prefix-cache hit on KV computed by older weights is an ``identity_weights_version``
    violation; writes the watch cannot see need ``handle.bump_weights_version()``. Off: no weights version.
    ``graph_driver``: drive the steps from the ``compute_batch`` wrapper as in CUDA-graph mode even when the engine
    runs eagerly (graph mode without the capture: reproduces the graph-mode path on a machine without graphs).
    """
    check_transformers_version()
    check_attach_options(options)
    settings = dict(max_requests=max_requests, max_context=max_context, capture_canary=capture_canary,
                    static_translation=static_translation, token_oracle=token_oracle, capture_sweep=capture_sweep,
                    context_of=context_of, committed_tokens=committed_tokens, watch_weights=watch_weights,
                    graph_driver=graph_driver)
    check_adapter_arguments(settings)
    dev = check_device(device)
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "generate_batch"):
        raise KvCanaryTypeError(
            f"kv-canary: attach() needs a transformers model with continuous batching (generate_batch), "
            f"got {type(model).__name__}"
        )
    cfg = resolve_config(config, options)
    if not cfg.enabled:  # mode "none": nothing attached, nothing checked
        return TransformersCbHandle(model=model, config=cfg, device=dev, **settings)
    _check_attachable(model, cfg, dev)
    handle = TransformersCbHandle(model=model, config=cfg, device=dev, **settings)
    handle._install()
    _ATTACHED[model] = handle
    return handle


def check_adapter_arguments(settings: dict) -> None:
    """The adapter's own options of `attach` (all but ``device`` and ``config``), each refused with a ``kv-canary:``
    error in this order: ``capture_sweep``, the limits, ``token_oracle``, ``committed_tokens``, ``watch_weights``,
    ``context_of``, ``graph_driver``."""
    _check_bool("capture_sweep", settings["capture_sweep"])
    check_limits(settings["max_requests"], settings["max_context"])
    token_oracle, context_of = settings["token_oracle"], settings["context_of"]
    if token_oracle is not None and not callable(token_oracle):
        raise KvCanaryTypeError(f"kv-canary: token_oracle must be a callable (request_id, position) -> token, "
                                f"got {type(token_oracle).__name__}")
    _check_bool("committed_tokens", settings["committed_tokens"])
    _check_bool("watch_weights", settings["watch_weights"])
    if context_of is not None and not callable(context_of):
        raise KvCanaryTypeError(f"kv-canary: context_of must be a callable request_id -> hashable key (or None), "
                                f"got {type(context_of).__name__}")
    _check_bool("graph_driver", settings["graph_driver"])


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise KvCanaryTypeError(f"kv-canary: {name} must be a bool, got {type(value).__name__}")


def resolve_config(config: Optional[CanaryConfig], options: dict) -> CanaryConfig:
    """The canary's config: ``config`` with ``options`` applied over it, or, without one, ``options`` over the
    ``KVCANARY_*`` environment."""
    if config is None:
        return CanaryConfig.from_env(**options)
    return config.with_options(**options) if options else config


def _check_attachable(model: torch.nn.Module, config: CanaryConfig, device: Optional[torch.device]) -> None:
    """What an enabled canary needs before attaching: ``real_kv_layers`` in range, a working device path on CUDA
    (proved now, not at the first forward), no other live canary on ``model``."""
    check_real_kv_layers(model, config)
    target = device if device is not None else _model_device(model)
    if target is not None and target.type == "cuda":
        prove_device_path(target, allow_eager_fallback=config.allow_eager_fallback)
    previous = _ATTACHED.get(model)
    if previous is not None and not previous._detached:
        raise KvCanaryRuntimeError(
            f"kv-canary: a canary is already attached to this {type(model).__name__}; detach() it first "
            "(or leave its `with` block)"
        )
