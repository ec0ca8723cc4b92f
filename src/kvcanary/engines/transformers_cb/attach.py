"""`attach(model)` for transformers continuous batching: two documented module hooks, nothing patched.

* ``model.register_forward_pre_hook(..., with_kwargs=True)`` — sees the forward's kwargs (input ids,
  positions, per-group write / read indices, the ``PagedAttentionCache``) before any KV is written:
  the adapter builds the `BatchDescription` and opens the canary's forward (plan, HEAD verify + write).
* ``model.register_forward_hook(..., with_kwargs=True, always_call=True)`` — runs after the forward
  stored its K/V in the cache tensor: TAIL verify (real K/V re-hashed from the cache's storage of the
  configured layers) + write, sweep when due. ``always_call`` closes the bracket even when the
  forward raises, so a failed forward never leaves the canary half-open.

One canary *session* per ``PagedAttentionCache``: transformers builds a new cache for every
``generate_batch`` call (unless the manager is persistent), so the canary is rebuilt on the first
forward that carries a new cache; the handle keeps the violations and counts of every session.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Optional

import torch

from kvcanary.engines.transformers_cb.forward_view import ForwardTranslator
from kvcanary.engines.transformers_cb.layout import build_layouts, layer_kv_views
from kvcanary.runtime import Canary, CanaryConfig, CanaryViolationError, GroupSpec, Violation

logger = logging.getLogger("kvcanary")

SUPPORTED_TRANSFORMERS = "5.24.0"
DEFAULT_MAX_REQUESTS = 256
DEFAULT_MAX_CONTEXT = 32768


def check_transformers_version() -> str:
    """The installed transformers version; raises unless it is the pinned one."""
    try:
        import transformers
    except ImportError:
        raise RuntimeError(
            f"kv-canary: the transformers adapter needs transformers=={SUPPORTED_TRANSFORMERS} "
            f"(pip install 'kvcanary[transformers]')"
        ) from None
    if transformers.__version__ != SUPPORTED_TRANSFORMERS:
        raise RuntimeError(
            f"kv-canary: transformers {transformers.__version__} is not supported; the continuous-batching "
            f"adapter is pinned to transformers=={SUPPORTED_TRANSFORMERS} (its cache internals change "
            f"between minor versions)"
        )
    return transformers.__version__


@dataclass
class _Session:
    """The canary of one PagedAttentionCache."""

    cache: object
    canary: Canary
    translator: ForwardTranslator
    open_forward: Optional[object] = None


@dataclass(frozen=True)
class _ClosedSession:
    forwards: int
    stats: object
    violations: list
    counters: dict


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
    errors: list = field(default_factory=list)
    _hooks: list = field(default_factory=list)
    _sessions: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._current: Optional[_Session] = None
        self._closed: list[_ClosedSession] = []

    # ---- hooks ---------------------------------------------------------------------------------
    def _install(self) -> None:
        pre = self.model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        post = self.model.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True)
        self._hooks = [pre, post]

    def _pre_forward(self, module, args, kwargs):
        cache = kwargs.get("cache")
        if cache is None or not hasattr(cache, "cache_allocators"):
            return None  # not a continuous-batching forward
        try:
            session = self._session_for(cache)
            batch = session.translator.describe(kwargs, step=session.canary.step + 1)
            bracket = session.canary.forward(batch)
            bracket.__enter__()
            session.open_forward = bracket
        except Exception as exc:
            self.errors.append(exc)
            raise
        return None

    def _post_forward(self, module, args, kwargs, output):
        session = self._current
        if session is None or session.open_forward is None:
            return None
        bracket, session.open_forward = session.open_forward, None
        if output is None:  # the forward raised: close the bracket without TAIL checks
            failure = RuntimeError("kv-canary: the engine forward raised; TAIL checks skipped")
            bracket.__exit__(RuntimeError, failure, None)
            return None
        try:
            bracket.__exit__(None, None, None)
        except Exception as exc:
            self.errors.append(exc)
            raise
        return None

    # ---- sessions ------------------------------------------------------------------------------
    def _session_for(self, cache) -> _Session:
        current = self._current
        if current is not None and current.cache is cache:
            return current
        with self._lock:
            if current is not None:
                self._close_session(current)
            self._current = self._open_session(cache)
            return self._current

    def _open_session(self, cache) -> _Session:
        layouts = build_layouts(cache)
        device = self.device or cache.cache_tensor.device
        translator = ForwardTranslator(
            cache=cache, layouts=layouts, max_requests=self.max_requests,
            max_context=self.max_context or min(int(cache.max_tokens_read), DEFAULT_MAX_CONTEXT), device=device,
        )
        _refuse_unobservable_paths(translator.processor)
        config = self.config
        if any(g.sliding_window and cache.max_batch_tokens >= g.sliding_window for g in layouts) and (
            config.chain_position_warmup >= 0
        ):
            # A chunk of >= W tokens recycles every ring slot, including the one the write chains
            # from: the chain restarts from the padding slot there, which the chain-position assert
            # would flag. Positions are still checked by the write-input assert (prefix_len + i).
            logger.info("kv-canary: chain-position assert off (sliding window %s <= max_batch_tokens %s)",
                        min(g.sliding_window for g in layouts if g.sliding_window), cache.max_batch_tokens)
            config = config.with_options(chain_position_warmup=-1)
        canary = Canary(
            config,
            groups=[
                GroupSpec(name=g.name, num_slots=g.num_slots, sliding_window=g.sliding_window, layer_ids=g.layer_ids)
                for g in layouts
            ],
            max_requests=self.max_requests,
            max_context=translator.max_context,
            device=device,
        )
        for g in layouts:
            canary.set_kv_cache(g.name, lambda layer, g=g: layer_kv_views(cache, g, layer)[:2], page_size=g.page_size)
        canary.set_live_slots_provider(translator.live_slots)
        session = _Session(cache=cache, canary=canary, translator=translator)
        self._sessions.append(session)
        return session

    def _close_session(self, session: _Session) -> None:
        """Close a session's canary and keep only its results (the engine cache and the canary's
        buffers are released)."""
        if session.open_forward is not None:
            session.open_forward.__exit__(RuntimeError, RuntimeError("kv-canary: detached mid-forward"), None)
            session.open_forward = None
        try:
            session.canary.close()
        finally:
            canary = session.canary
            self._closed.append(_ClosedSession(
                forwards=canary.step, stats=canary.stats(), violations=canary.violations(), counters=canary.counters(),
            ))
            self._sessions.remove(session)

    # ---- user API ------------------------------------------------------------------------------
    def _results(self) -> list:
        live = [
            _ClosedSession(forwards=s.canary.step, stats=s.canary.stats(), violations=s.canary.violations(),
                           counters=s.canary.counters())
            for s in self._sessions
        ]
        return self._closed + live

    @property
    def sessions(self) -> int:
        """Engine caches seen so far (one canary each)."""
        return len(self._closed) + len(self._sessions)

    @property
    def forwards(self) -> int:
        return sum(r.forwards for r in self._results())

    def violations(self) -> list[Violation]:
        """Every violation so far, over every session, oldest first."""
        return [v for r in self._results() for v in r.violations]

    def counters(self) -> dict:
        """Counts summed over sessions: ``total``, ``by_reason``, ``by_tag`` (and other numeric keys)."""
        return merge_counters([r.counters for r in self._results()])

    def stats(self) -> list:
        """One `CanaryStats` per session."""
        return [r.stats for r in self._results()]

    def sweep(self):
        """Verify every live slot of the current cache now."""
        if self._current is None:
            return None
        return self._current.canary.sweep()

    def raise_if_failed(self) -> None:
        """Raise the first error the canary hit in the engine thread: a `CanaryViolationError` (only
        raised in ``raise`` mode) or a ``kv-canary:`` usage error (any mode — the engine failed the
        requests of that step, so checking did not silently stop)."""
        if self.errors:
            raise self.errors[0]

    def detach(self) -> None:
        """Remove both hooks and close every canary. The model and the engine are left exactly as they
        were (the hooks were the only change). Idempotent."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._current is not None:
            try:
                self._close_session(self._current)
            except CanaryViolationError as exc:
                self.errors.append(exc)
            self._current = None

    def __enter__(self) -> "TransformersCbHandle":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.detach()
        if exc_type is None:
            self.raise_if_failed()


def merge_counters(parts: list[dict]) -> dict:
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, dict):
                inner = out.setdefault(key, {})
                for k, v in value.items():
                    inner[k] = inner.get(k, 0) + v
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key] = out.get(key, 0) + value
    return out


def _refuse_unobservable_paths(processor) -> None:
    """CUDA-graph replays and torch.compile'd forwards skip Python hooks; async batching runs the
    forward from a second IO pair. The canary refuses them rather than silently stop checking."""
    runner = processor.model_runner
    if runner.use_cuda_graph_varlen or runner.use_cuda_graph_decode:
        raise RuntimeError(
            "kv-canary: CUDA graphs are on for continuous batching (use_cuda_graph="
            f"{(runner.use_cuda_graph_varlen, runner.use_cuda_graph_decode)}); graph replays skip the canary's "
            "hooks. Pass ContinuousBatchingConfig(use_cuda_graph=False) to run checked"
        )
    if runner._compiled_varlen is not None or runner._compiled_decode is not None:
        raise RuntimeError(
            "kv-canary: torch.compile is on for continuous batching (varlen/decode_compile_config); compiled "
            "forwards do not run the canary's hooks. Leave the compile configs unset to run checked"
        )
    if getattr(processor, "use_async_batching", False):
        raise RuntimeError(
            "kv-canary: async batching is on; the canary supports synchronous continuous batching. Pass "
            "ContinuousBatchingConfig(use_async_batching=False)"
        )


def attach(
    model: torch.nn.Module,
    *,
    max_requests: int = DEFAULT_MAX_REQUESTS,
    max_context: Optional[int] = None,
    device: Optional[torch.device] = None,
    config: Optional[CanaryConfig] = None,
    **options: object,
) -> TransformersCbHandle:
    """Check every continuous-batching forward of ``model`` (``generate_batch`` / the manager).

    ``options`` are `CanaryConfig` fields (``mode="raise"``, ``sweep_interval=...``); unset ones come
    from ``KVCANARY_*`` environment variables. ``max_requests``: live requests tracked at once;
    ``max_context``: longest request (default: the cache's capacity, at most 32768). In mode
    ``none`` nothing is attached.
    """
    check_transformers_version()
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "generate_batch"):
        raise TypeError(
            f"kv-canary: attach() needs a transformers model with continuous batching (generate_batch), "
            f"got {type(model).__name__}"
        )
    cfg = config if config is not None else CanaryConfig.from_env(**options)
    if config is not None and options:
        cfg = config.with_options(**options)
    handle = TransformersCbHandle(
        model=model, config=cfg, max_requests=max_requests, max_context=max_context,
        device=torch.device(device) if device is not None else None,
    )
    if cfg.enabled:
        handle._install()
    return handle
