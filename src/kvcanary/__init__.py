"""kvcanary — catch KV-cache corruption in LLM inference engines.

Layers (one direction): ``ops`` <- ``runtime`` <- ``faults`` / ``engines`` <- ``cli``.
"""
__version__ = "0.1.0"
