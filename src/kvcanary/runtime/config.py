"""The canary's configuration: keyword arguments, or ``KVCANARY_*`` environment variables.

`CanaryConfig.from_env` is the only place in kvcanary that reads the environment; everything
below the config receives a `CanaryConfig`.
"""
from __future__ import annotations

import difflib
import math
import os
import warnings
from dataclasses import dataclass, fields, replace
from typing import Mapping, Optional

from kvcanary.errors import KvCanaryTypeError, KvCanaryValueError
from kvcanary.ops.constants import MAX_REAL_KV_SOURCES, RealKvHashMode
from kvcanary.ops.jitter import JITTER_MAX_CYCLES_LIMIT

MODES = ("none", "log", "raise")
REAL_KV_HASH_MODES = {"none": RealKvHashMode.NONE, "partial": RealKvHashMode.PARTIAL, "all": RealKvHashMode.ALL}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
ENV_PREFIX = "KVCANARY_"
# KVCANARY_* variables that are not options and never warn: the test suite's own knobs
ENV_IGNORED_PREFIXES = ("KVCANARY_TEST_",)


@dataclass(frozen=True, kw_only=True)
class CanaryConfig:
    """What the canary checks and how it reports.

    mode: ``none`` (attach nothing), ``log`` (report, keep serving), ``raise`` (report, then raise
        `CanaryViolationError` at the end of a step that had violations).
    real_kv_hash: ``none | partial | all`` — fingerprint no bytes, the first 16 bytes, or every
        byte of each slot's K/V strip (docs/design.md §3.2).
    real_kv_layers: which of a group's layers feed its TAIL fingerprints, as indices into the
        group's ``layer_ids`` (negative counts from the end). Each layer gives one K source (for
        the TAIL_K buffer) and one V source (TAIL_V); at most 4 layers. Default: first and last.
    sweep_interval: sweep every live cached slot every N forwards (0 = never).
    sweep_max_bytes: the most K/V bytes one sweep launched without a host read (`Canary.launch_sweep`, vLLM's
        periodic sweep on CUDA) reads: it verifies the live slots of the next window of the slot space (slot
        order, wrapping) holding at most that many bytes (`CanaryGroup.kv_bytes_per_slot` per slot), so a pass
        over a larger slot space takes several sweeps (docs/design.md §4.4); 0 = no limit (every live slot at
        each sweep). Explicit `Canary.sweep` calls always verify every live slot.
    ring_capacity: violation rows kept per launch tag per step (counts are exact beyond it).
    verify_token: compare stored tokens with the request's token history when the adapter
        supplies one (`BatchDescription.token_table`).
    write_input_assert: compare each written token/position with the token oracle (the batch's
        ``expected_input_ids`` or its token history) and with ``prefix_len + i``.
    chain_position_warmup: forwards before the chain-position assert (a written position must be
        its predecessor's + 1) is switched on; -1 = never.
    stats_interval: log a stats line every N forwards (0 = never).
    health_interval: check that the canary's kernels are running every N forwards (0 = never).
    jsonl_path: append one JSON object per violation to this file (None = no file).
    readable_per_step: violations per step also reported as a multi-line readable block.
    deep_fingerprints: also fingerprint every byte of every layer of each written slot (one 32-byte record
        per 4 layers and side, written at TAIL) and verify them in the rotating sweep, so a flipped bit
        anywhere in cached KV is caught within one sweep pass (ignored with ``real_kv_hash="none"``). On by
        default; cost measured on an H200 in docs/lab/NOTES.md (runs 16, 18 and 20).
    allow_eager_fallback: on a CUDA device whose Triton cannot run (not installed, no C compiler for its
        launcher, no graph capture), run the torch twins eagerly with the canary's CUDA graphs off instead of
        refusing to attach (slow; an engine that captures its own CUDA graphs is still refused). See
        docs/troubleshooting.md.
    log_lines_per_slot: log lines per (reason, group, slot) before that slot's further rows are only
        counted (and summarised per drain); every row still goes to the counters and the JSON lines.
    drain_interval: ``log`` mode on CUDA: look at the device's violation counters every N forwards (one
        non-blocking copy, read a look later), so violations reach the log about 2N forwards after they were
        found, plus the device's lag; 1 = every forward. Counts stay exact whatever N; ``raise`` mode and the CPU look every forward.
    jitter_fire_prob: timing jitter (docs/design.md §3.11, §4.9), off at 0.0 (default): the probability, in [0, 1] and
        quantised to 1/65536, that a HEAD / TAIL verify or write entry stalls its GPU program before it reads the
        records and KV, so the engine's own kernels interleave differently and a rare KV race can show up more
        often (the intent; the gain is a matter of measurement on a GPU, per race).
        Draws are seeded and counter-based (same on every device); stalls and cycles drawn are counted in
        ``stats().jitter_stalls`` / ``jitter_cycles``. Only the Triton kernels on a GPU spin; the torch twins (the
        CPU, the eager fallback) count the same stalls without waiting.
        Refused with ``mode="none"`` (nothing runs to stall).
    jitter_max_cycles: longest stall, in SM clock cycles (a draw is uniform in [1, jitter_max_cycles]).
    jitter_seed: seed of the draws (any integer); with the step number and the launch tag it decides every stall.
    padding_read_check: report, at HEAD, every position a live request reads (its prefix, or its sliding window)
        whose slot resolves to the padding slot 0 (``verify_padding_slot_read``, docs/design.md §3.12): the verify
        op skips those entries, so such a read would otherwise go unchecked. On by default.
    """

    mode: str = "log"
    real_kv_hash: str = "partial"
    real_kv_layers: tuple[int, ...] = (0, -1)
    sweep_interval: int = 64
    sweep_max_bytes: int = 256 << 20
    ring_capacity: int = 1024
    verify_token: bool = True
    write_input_assert: bool = True
    chain_position_warmup: int = 2
    stats_interval: int = 0
    health_interval: int = 32
    jsonl_path: Optional[str] = None
    readable_per_step: int = 4
    log_lines_per_slot: int = 3
    deep_fingerprints: bool = True
    drain_interval: int = 4
    allow_eager_fallback: bool = False
    jitter_fire_prob: float = 0.0
    jitter_max_cycles: int = 2000
    jitter_seed: int = 0
    padding_read_check: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise KvCanaryValueError(f"kv-canary: mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.real_kv_hash not in REAL_KV_HASH_MODES:
            raise KvCanaryValueError(
                f"kv-canary: real_kv_hash must be one of {', '.join(REAL_KV_HASH_MODES)}, got {self.real_kv_hash!r}"
            )
        layers = self.real_kv_layers
        if isinstance(layers, list):
            layers = tuple(layers)
            object.__setattr__(self, "real_kv_layers", layers)
        if (
            not isinstance(layers, tuple)
            or not 1 <= len(layers) <= MAX_REAL_KV_SOURCES
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
        ):
            raise KvCanaryValueError(
                f"kv-canary: real_kv_layers must be 1 to {MAX_REAL_KV_SOURCES} layer indices "
                f"(negative counts from the last layer), got {layers!r}"
            )
        for name, low in (
            ("sweep_interval", 0), ("sweep_max_bytes", 0), ("ring_capacity", 1), ("chain_position_warmup", -1),
            ("stats_interval", 0), ("health_interval", 0), ("readable_per_step", 0), ("log_lines_per_slot", 0),
            ("drain_interval", 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise KvCanaryValueError(f"kv-canary: {name} must be an integer >= {low}, got {value!r}")
        for name in ("verify_token", "write_input_assert", "deep_fingerprints", "allow_eager_fallback",
                     "padding_read_check"):
            if not isinstance(getattr(self, name), bool):
                raise KvCanaryValueError(f"kv-canary: {name} must be True or False, got {getattr(self, name)!r}")
        if self.jsonl_path is not None:
            object.__setattr__(self, "jsonl_path", _check_sink_path("jsonl_path", self.jsonl_path))
        self._check_jitter()

    def _check_jitter(self) -> None:
        prob = self.jitter_fire_prob
        if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not math.isfinite(prob) or not 0 <= prob <= 1:
            raise KvCanaryValueError(f"kv-canary: jitter_fire_prob must be a number in [0, 1], got {prob!r}")
        object.__setattr__(self, "jitter_fire_prob", float(prob))
        cycles = self.jitter_max_cycles
        if isinstance(cycles, bool) or not isinstance(cycles, int) or not 1 <= cycles <= JITTER_MAX_CYCLES_LIMIT:
            raise KvCanaryValueError(
                f"kv-canary: jitter_max_cycles must be an integer in [1, {JITTER_MAX_CYCLES_LIMIT}], got {cycles!r}")
        if isinstance(self.jitter_seed, bool) or not isinstance(self.jitter_seed, int):
            raise KvCanaryValueError(f"kv-canary: jitter_seed must be an integer, got {self.jitter_seed!r}")
        if self.jitter and self.mode == "none":
            raise KvCanaryValueError("kv-canary: jitter_fire_prob > 0 needs the canary on (mode 'log' or 'raise'); "
                                     "mode 'none' runs no kernel to stall")

    @property
    def real_kv_hash_mode(self) -> RealKvHashMode:
        return REAL_KV_HASH_MODES[self.real_kv_hash]

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def jitter(self) -> bool:
        """True when timing jitter is on (``jitter_fire_prob > 0``)."""
        return self.jitter_fire_prob > 0

    def with_options(self, **overrides: object) -> "CanaryConfig":
        """A copy with some options replaced (validated again); an unknown option is a
        ``kv-canary:`` `TypeError` naming the valid ones."""
        check_option_names(overrides)
        return replace(self, **overrides)

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, **overrides: object) -> "CanaryConfig":
        """Read ``KVCANARY_<OPTION>`` (upper-case option name) from ``environ`` (default
        ``os.environ``); keyword ``overrides`` win over the environment.

        Booleans accept 1/0, true/false, yes/no, on/off; ``KVCANARY_REAL_KV_LAYERS`` is a comma
        list (``0,-1``); ``KVCANARY_JSONL_PATH`` empty means none. An error in a value read from the
        environment names the variable (``kv-canary: KVCANARY_MODE (mode) must be ...``); an unknown
        ``KVCANARY_*`` variable warns (`UserWarning`) naming the closest valid one; an unknown keyword
        override is a ``kv-canary:`` `TypeError` naming the valid options.
        """
        check_option_names(overrides)
        env = os.environ if environ is None else environ
        warn_unknown_env(env)
        values: dict[str, object] = {}
        from_env: set[str] = set()
        for f in fields(cls):
            raw = env.get(_env_var(f.name))
            if raw is None:
                continue
            values[f.name] = _parse(f.name, raw.strip(), f.default)
            from_env.add(f.name)
        values.update(overrides)
        from_env -= set(overrides)
        try:
            return cls(**values)
        except KvCanaryValueError as exc:
            msg = str(exc)
            for name in from_env:  # say which variable held the bad value
                head = f"kv-canary: {name} "
                if msg.startswith(head):
                    raise KvCanaryValueError(f"kv-canary: {_env_var(name)} ({name}) {msg[len(head):]}") from None
            raise


def check_option_names(options: Mapping[str, object]) -> None:
    """Raise a ``kv-canary:`` `TypeError` for a keyword that is not a `CanaryConfig` option."""
    valid = CanaryConfig.option_names()
    unknown = [k for k in options if k not in valid]
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise KvCanaryTypeError(f"kv-canary: unknown option {name!r}{hint}; valid options: {', '.join(valid)}")


def warn_unknown_env(environ: Mapping[str, str]) -> list[str]:
    """Warn (`UserWarning`) once per ``KVCANARY_*`` variable that names no option; returns them."""
    valid = [_env_var(n) for n in CanaryConfig.option_names()]
    unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in valid
                     and not k.startswith(ENV_IGNORED_PREFIXES))
    for var in unknown:
        close = difflib.get_close_matches(var, valid, n=1)
        hint = f" (did you mean {close[0]}?)" if close else f" (valid: {', '.join(valid)})"
        warnings.warn(f"kv-canary: unknown environment variable {var}{hint}; it is ignored", UserWarning,
                      stacklevel=3)
    return unknown


def _env_var(name: str) -> str:
    return f"{ENV_PREFIX}{name.upper()}"


def _check_sink_path(name: str, path: object) -> str:
    """A JSON-lines sink path that can be opened for appending now: its directory exists and is
    writable, and the path is not a directory (or an existing read-only file). Nothing is created."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise KvCanaryValueError(f"kv-canary: {name} must be a file path (str), got {path!r}")
    if os.path.isdir(path):
        raise KvCanaryValueError(f"kv-canary: {name} {path!r} is a directory, not a file")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise KvCanaryValueError(f"kv-canary: {name} {path!r}: directory {directory!r} does not exist")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise KvCanaryValueError(f"kv-canary: {name} {path!r} exists and is not writable")
    elif not os.access(directory, os.W_OK | os.X_OK):
        raise KvCanaryValueError(f"kv-canary: {name} {path!r}: directory {directory!r} is not writable")
    return path


def _parse(name: str, raw: str, default: object) -> object:
    var = _env_var(name)
    if isinstance(default, bool):
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise KvCanaryValueError(f"kv-canary: {var} ({name}) must be one of 1/0, true/false, yes/no, on/off, got {raw!r}")
    if isinstance(default, int):
        try:
            return int(raw)
        except ValueError:
            raise KvCanaryValueError(f"kv-canary: {var} ({name}) must be an integer, got {raw!r}") from None
    if isinstance(default, float):
        try:
            return float(raw)
        except ValueError:
            raise KvCanaryValueError(f"kv-canary: {var} ({name}) must be a number, got {raw!r}") from None
    if isinstance(default, tuple):
        try:
            return tuple(int(x) for x in raw.split(",") if x.strip())
        except ValueError:
            raise KvCanaryValueError(
                f"kv-canary: {var} ({name}) must be a comma list of layer indices such as '0,-1', got {raw!r}"
            ) from None
    if name == "jsonl_path":
        return raw or None
    return raw.lower()
