"""kvcanary — catch KV-cache corruption in LLM inference engines.

Layers (one direction): ``ops`` <- ``runtime`` <- ``faults`` / ``engines`` <- ``cli``.

``kvcanary.attach(model, mode="log")`` attaches a canary to an engine (see `kvcanary.engines`).
"""
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "attach":  # lazy: importing kvcanary must not import torch-heavy adapters
        from kvcanary.engines.dispatch import attach

        return attach
    raise AttributeError(f"module 'kvcanary' has no attribute {name!r}")


__all__ = ["attach", "__version__"]
