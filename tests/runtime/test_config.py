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
        (dict(real_kv_hash="lanes"), "kv-canary: real_kv_hash must be one of none, partial, all, got 'lanes'"),  # deep only
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
        ({"KVCANARY_MODE": "off"}, "kv-canary: KVCANARY_MODE (mode) must be one of none, log, raise"),
        ({"KVCANARY_SWEEP_INTERVAL": "often"}, "kv-canary: KVCANARY_SWEEP_INTERVAL (sweep_interval) must be an integer"),
        ({"KVCANARY_VERIFY_TOKEN": "maybe"}, "kv-canary: KVCANARY_VERIFY_TOKEN (verify_token) must be one of"),
        ({"KVCANARY_REAL_KV_LAYERS": "first"}, "kv-canary: KVCANARY_REAL_KV_LAYERS (real_kv_layers) must be a comma list"),
    ],
)
def test_bad_environment_values(env, message):
    with pytest.raises(ValueError) as err:
        CanaryConfig.from_env(env)
    assert str(err.value).startswith(message)


# ---- attach-time checks (issue 10 item 2) ----------------------------------------------------------
def test_unknown_keyword_is_a_type_error_naming_the_valid_options():
    with pytest.raises(TypeError) as err:
        CanaryConfig.from_env({}, sweep_intervall=3)
    msg = str(err.value)
    assert msg.startswith("kv-canary: unknown option 'sweep_intervall' (did you mean 'sweep_interval'?)")
    for name in ("mode", "real_kv_hash", "sweep_interval", "jsonl_path"):
        assert name in msg
    with pytest.raises(TypeError, match=r"^kv-canary: unknown option 'colour'"):
        CanaryConfig().with_options(colour="red")


def test_unknown_environment_variable_warns_with_the_closest_valid_one():
    with pytest.warns(UserWarning, match=r"^kv-canary: unknown environment variable KVCANARY_SWEEP_INTERVALL "
                                         r"\(did you mean KVCANARY_SWEEP_INTERVAL\?\)"):
        c = CanaryConfig.from_env({"KVCANARY_SWEEP_INTERVALL": "3", "KVCANARY_MODE": "raise"})
    assert c.mode == "raise" and c.sweep_interval == CanaryConfig().sweep_interval


def test_test_only_environment_variables_do_not_warn(recwarn):
    CanaryConfig.from_env({"KVCANARY_TEST_EXAMPLES_SCALE": "3"})
    assert not [w for w in recwarn if "kv-canary" in str(w.message)]


def test_environment_errors_name_the_variable():
    with pytest.raises(ValueError, match=r"^kv-canary: KVCANARY_MODE \(mode\) must be one of none, log, raise"):
        CanaryConfig.from_env({"KVCANARY_MODE": "off"})
    with pytest.raises(ValueError, match=r"^kv-canary: KVCANARY_RING_CAPACITY \(ring_capacity\) must be an integer >= 1"):
        CanaryConfig.from_env({"KVCANARY_RING_CAPACITY": "0"})


def test_jsonl_path_must_be_writable_at_config_time(tmp_path):
    ok = CanaryConfig(jsonl_path=str(tmp_path / "v.jsonl"))
    assert ok.jsonl_path.endswith("v.jsonl")
    with pytest.raises(ValueError, match=r"^kv-canary: jsonl_path .*: directory .* does not exist"):
        CanaryConfig(jsonl_path=str(tmp_path / "missing" / "v.jsonl"))
    with pytest.raises(ValueError, match=r"^kv-canary: KVCANARY_JSONL_PATH \(jsonl_path\) .*does not exist"):
        CanaryConfig.from_env({"KVCANARY_JSONL_PATH": str(tmp_path / "missing" / "v.jsonl")})
    with pytest.raises(ValueError, match=r"^kv-canary: jsonl_path .* is a directory"):
        CanaryConfig(jsonl_path=str(tmp_path))
