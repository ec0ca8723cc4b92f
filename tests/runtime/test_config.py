import pytest

from kvcanary.ops import RealKvHashMode
from kvcanary.runtime import CanaryConfig


def test_defaults():
    c = CanaryConfig()
    assert (c.mode, c.real_kv_hash, c.real_kv_layers) == ("log", "partial", (0, -1))
    assert c.real_kv_hash_mode is RealKvHashMode.PARTIAL


def test_from_env_reads_every_kind_of_option(tmp_path):
    env = {
        "KVCANARY_MODE": "raise", "KVCANARY_REAL_KV_HASH": "all", "KVCANARY_REAL_KV_LAYERS": "1, -2",
        "KVCANARY_SWEEP_INTERVAL": "8", "KVCANARY_VERIFY_TOKEN": "off", "KVCANARY_JSONL_PATH": str(tmp_path / "v.jsonl"),
        "UNRELATED": "x",
    }
    c = CanaryConfig.from_env(env, ring_capacity=7)
    assert c.mode == "raise" and c.real_kv_hash_mode is RealKvHashMode.ALL
    assert c.real_kv_layers == (1, -2) and c.sweep_interval == 8 and c.verify_token is False
    assert c.ring_capacity == 7 and c.jsonl_path.endswith("v.jsonl")
    assert CanaryConfig.from_env({}) == CanaryConfig()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(mode="loud"), "kv-canary: mode must be one of none, log, raise, got 'loud'"),
        (dict(real_kv_hash="some"), "kv-canary: real_kv_hash must be one of none, partial, all, got 'some'"),
        (dict(real_kv_layers=(0, 1, 2, 3, 4)), "kv-canary: real_kv_layers must be 1 to 4 layer indices"),
        (dict(real_kv_layers=()), "kv-canary: real_kv_layers must be 1 to 4 layer indices"),
        (dict(sweep_interval=-1), "kv-canary: sweep_interval must be an integer >= 0, got -1"),
        (dict(ring_capacity=0), "kv-canary: ring_capacity must be an integer >= 1, got 0"),
        (dict(chain_position_warmup=-2), "kv-canary: chain_position_warmup must be an integer >= -1"),
        (dict(verify_token="yes"), "kv-canary: verify_token must be True or False"),
    ],
)
def test_bad_values_name_the_option_and_allowed_values(kwargs, message):
    with pytest.raises(ValueError) as err:
        CanaryConfig(**kwargs)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"KVCANARY_MODE": "off"}, "kv-canary: mode must be one of none, log, raise"),
        ({"KVCANARY_SWEEP_INTERVAL": "often"}, "kv-canary: KVCANARY_SWEEP_INTERVAL (sweep_interval) must be an integer"),
        ({"KVCANARY_VERIFY_TOKEN": "maybe"}, "kv-canary: KVCANARY_VERIFY_TOKEN (verify_token) must be one of"),
        ({"KVCANARY_REAL_KV_LAYERS": "first"}, "kv-canary: KVCANARY_REAL_KV_LAYERS (real_kv_layers) must be a comma list"),
    ],
)
def test_bad_environment_values(env, message):
    with pytest.raises(ValueError) as err:
        CanaryConfig.from_env(env)
    assert str(err.value).startswith(message)
