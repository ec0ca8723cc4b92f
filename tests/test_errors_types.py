"""Errors are a type (`kvcanary.errors.KvCanaryError`), keep their builtin base and their ``kv-canary:`` text."""
from __future__ import annotations

import pytest

from kvcanary.errors import (
    KvCanaryError,
    KvCanaryIndexError,
    KvCanaryRuntimeError,
    KvCanaryTypeError,
    KvCanaryValueError,
    is_kvcanary_message,
)
from kvcanary.runtime import CanaryConfig, CanaryHealthError, CanaryViolationError


@pytest.mark.parametrize("cls, base", [
    (KvCanaryValueError, ValueError), (KvCanaryTypeError, TypeError),
    (KvCanaryRuntimeError, RuntimeError), (KvCanaryIndexError, IndexError),
])
def test_each_type_is_a_kvcanary_error_and_keeps_its_builtin_base(cls, base):
    assert issubclass(cls, KvCanaryError) and issubclass(cls, base)
    with pytest.raises(KvCanaryError):
        raise cls("kv-canary: x")


def test_violation_and_health_errors_are_kvcanary_runtime_errors():
    assert issubclass(CanaryViolationError, KvCanaryRuntimeError)
    assert issubclass(CanaryHealthError, KvCanaryRuntimeError)


def test_config_errors_are_caught_by_type_with_unchanged_text():
    with pytest.raises(KvCanaryValueError) as err:
        CanaryConfig(mode="loud")
    assert str(err.value) == "kv-canary: mode must be one of none, log, raise, got 'loud'"
    with pytest.raises(KvCanaryValueError, match=r"^kv-canary: KVCANARY_SWEEP_INTERVAL \(sweep_interval\)"):
        CanaryConfig.from_env({"KVCANARY_SWEEP_INTERVAL": "often"})


def test_unknown_option_is_a_kvcanary_type_error():
    with pytest.raises(KvCanaryTypeError, match=r"^kv-canary: unknown option 'sweep_intervall'"):
        CanaryConfig.from_env({}, sweep_intervall=3)


def test_is_kvcanary_message():
    assert is_kvcanary_message(KvCanaryValueError("kv-canary: a"))
    assert is_kvcanary_message(ValueError("kv-canary: legacy"))
    assert not is_kvcanary_message(ValueError("other"))


def test_runtime_errors_are_kvcanary_errors():
    from kvcanary.runtime import Canary

    with pytest.raises(KvCanaryValueError, match=r"^kv-canary: Canary needs at least one GroupSpec"):
        Canary(CanaryConfig(), groups=[], max_requests=4, max_context=8)


def test_no_kvcanary_message_is_raised_with_a_bare_builtin_type():
    """Every ``raise <builtin>("kv-canary: ...")`` in the package (ops, runtime, engines, faults, cli)
    uses a KvCanary* type instead; so does an error built to be raised later (``return`` / ``or``)."""
    import pathlib
    import re

    import kvcanary

    root = pathlib.Path(kvcanary.__file__).parent
    pattern = re.compile(r'(?:raise|return|or) (ValueError|TypeError|RuntimeError|IndexError)\(\s*f?["\']kv-canary:')
    files = sorted(root.rglob("*.py"))
    assert {"ops", "runtime", "engines", "faults", "cli"} <= {p.relative_to(root).parts[0] for p in files}
    bare = [f"{p.relative_to(root)}:{text[: m.start()].count(chr(10)) + 1}"
            for p in files
            for text in [p.read_text()] for m in pattern.finditer(text)]
    assert bare == []


def test_converted_sites_raise_kvcanary_types():
    from kvcanary.engines.dispatch import attach
    from kvcanary.engines.sim.engine import SimConfig
    from kvcanary.faults.oracle import oracle_token

    with pytest.raises(KvCanaryValueError, match=r"^kv-canary: oracle vocab must be >= 2"):
        oracle_token("r", 0, 1)
    with pytest.raises(KvCanaryTypeError, match=r"^kv-canary: no adapter for builtins.object"):
        attach(object())
    with pytest.raises(KvCanaryValueError, match=r"^kv-canary: SimConfig.kv_bytes"):
        SimConfig(kv_bytes=8)
