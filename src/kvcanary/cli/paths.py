"""Checks on the paths a command writes."""
from __future__ import annotations

import os
from typing import Optional

from kvcanary.errors import KvCanaryValueError


def check_output_path(flag: str, path: Optional[str]) -> None:
    """``path`` can be written now: not a directory, its directory exists and is writable."""
    if path is None:
        return
    if os.path.isdir(path):
        raise KvCanaryValueError(f"kv-canary: {flag} {path!r} is a directory, not a file")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise KvCanaryValueError(f"kv-canary: {flag} {path!r}: directory {directory!r} does not exist")
    if not os.access(path if os.path.exists(path) else directory, os.W_OK):
        raise KvCanaryValueError(f"kv-canary: {flag} {path!r} is not writable")
