"""Every error kvcanary raises on purpose is a `KvCanaryError`.

Callers (and the ``kvcanary`` CLI) catch kvcanary's own errors by type::

    try:
        handle = kvcanary.attach(model, max_context=0)
    except kvcanary.errors.KvCanaryError as exc:   # str(exc) starts with "kv-canary:"
        ...

Each concrete class also subclasses the builtin type the error had before this module existed
(``ValueError`` for a bad value, ``TypeError`` for a wrong type or an unknown keyword,
``RuntimeError`` for a state or environment problem, ``IndexError`` for an index outside a buffer),
so ``except ValueError`` keeps working. Messages start with ``kv-canary:`` (docs/design.md §3: the text of a
message is part of the contract; tests assert it).

This module imports nothing from kvcanary: every layer (ops, runtime, engines, cli) may use it.
"""
from __future__ import annotations

PREFIX = "kv-canary:"


class KvCanaryError(Exception):
    """Base of every error kvcanary raises on purpose; the message starts with ``kv-canary:``."""


class KvCanaryValueError(KvCanaryError, ValueError):
    """A bad value: an option, a shape, a length, a capacity."""


class KvCanaryTypeError(KvCanaryError, TypeError):
    """A wrong type, or an unknown keyword argument."""


class KvCanaryRuntimeError(KvCanaryError, RuntimeError):
    """A problem of state or environment: unsupported engine version, detached handle, capacity
    exceeded while serving, device not usable."""


class KvCanaryCapacityError(KvCanaryRuntimeError):
    """A limit given at attach (``max_requests``, ``max_context``, a batch size) was exceeded while
    serving. In ``log`` mode the adapter runs that work unchecked and counts it; ``raise`` mode raises."""


class KvCanaryIndexError(KvCanaryError, IndexError):
    """An index outside a buffer (a request row, a slot) caught before any state changed."""


def is_kvcanary_message(exc: BaseException) -> bool:
    """True for an error kvcanary raised on purpose: a `KvCanaryError`, or (older call sites, other
    layers not converted yet) any exception whose message starts with ``kv-canary:``."""
    return isinstance(exc, KvCanaryError) or str(exc).startswith(PREFIX)


__all__ = [
    "PREFIX", "KvCanaryError", "KvCanaryValueError", "KvCanaryTypeError", "KvCanaryRuntimeError",
    "KvCanaryCapacityError", "KvCanaryIndexError", "is_kvcanary_message",
]
