"""`attach(model, **options)` (exported as `kvcanary.attach`): pick the engine adapter for ``model``.

Today: Hugging Face transformers continuous batching (`kvcanary.engines.transformers_cb`, pinned to
transformers==5.24.0). The adapter is imported only when needed.
"""
from __future__ import annotations

from kvcanary.errors import KvCanaryTypeError


def attach(model, **options):
    """Attach a canary to ``model``; returns a handle (a context manager with ``detach()``).

    ``options``: the adapter's (``max_requests``, ``max_context``, ``device``, ``config``) and any
    `kvcanary.runtime.CanaryConfig` field (``mode="raise"``, ``sweep_interval=16``, ...).
    """
    if hasattr(model, "generate_batch") and type(model).__module__.startswith("transformers."):
        from kvcanary.engines.transformers_cb import attach as attach_transformers

        return attach_transformers(model, **options)
    raise KvCanaryTypeError(
        f"kv-canary: no adapter for {type(model).__module__}.{type(model).__name__}; supported: transformers "
        "models with continuous batching (generate_batch)"
    )
