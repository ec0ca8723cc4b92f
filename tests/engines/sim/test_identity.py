"""Producer identity on the simulated engine: weights versions, images, adapters and salts. Each cache that ignores a
field the KV depends on is caught against the request that read the stale KV, named; each correct engine is silent."""
import random

import pytest

from kvcanary.engines.sim.identity import IMAGE_TOKEN, SimImage, cache_key
from kvcanary.errors import KvCanaryValueError
from kvcanary.runtime.identity import ProducerIdentity

from tests.runtime.conftest import make_sim

PROMPT = [random.Random(0).randrange(1, 30000) for _ in range(20)]


def _drain(engine, steps=400):
    for _ in range(steps):
        if not engine.running and not engine.waiting:
            return
        engine.step()


def _found(canary):
    return {(v.request_id, v.stored_position, v.reason_label) for v in canary.violations()}


def _weights(reset: bool, fields=("images",)):
    engine, canary = make_sim(seed=1, block_size=4, cache_key_fields=fields)
    engine.add_request(PROMPT, 2, rid="before")
    _drain(engine)
    engine.update_weights(reset_prefix_cache=reset)
    engine.add_request(PROMPT, 2, rid="after")
    _drain(engine)
    return engine, canary


def test_a_prefix_cache_that_survives_a_weight_update_is_caught_and_named():
    engine, canary = _weights(reset=False)
    assert engine.cache_hit_tokens == 16  # the stale blocks were served
    assert _found(canary) == {("after", 0, "verify_chain_hash+identity_weights_version")}
    assert all("weights_version 0 -> 1" in v.identity_detail for v in canary.violations())


@pytest.mark.parametrize("reset,fields", [(True, ("images",)), (False, ("images", "weights_version"))])
def test_a_reset_or_a_versioned_cache_key_is_silent(reset, fields):
    engine, canary = _weights(reset=reset, fields=fields)
    assert engine.cache_hit_tokens == 0 and canary.counters()["total"] == 0


def test_a_weight_update_with_reset_recomputes_running_requests_silently():
    engine, canary = make_sim(seed=2, block_size=4)
    for i in range(4):
        engine.add_request(PROMPT[: 10 + i], 30, rid=f"r{i}")
    for _ in range(6):
        engine.step()
    running = [r.rid for r in engine.running]
    engine.update_weights(reset_prefix_cache=True)
    assert running and engine.retracted == len(running) and not engine.cache.nodes()
    engine.add_request(PROMPT, 2, rid="late")
    _drain(engine)
    assert engine.finished == 5 and canary.counters()["total"] == 0


def _images(second: bytes, fields=("images",)):
    engine, canary = make_sim(seed=1, block_size=4, cache_key_fields=fields)
    prompt = PROMPT[:4] + [IMAGE_TOKEN] * 8 + PROMPT[12:]
    engine.add_request(prompt, 2, rid="cat", images=(SimImage(start=4, length=8, content=b"cat"),))
    _drain(engine)
    engine.add_request(prompt, 2, rid="other", images=(SimImage(start=4, length=8, content=second),))
    _drain(engine)
    return engine, canary


def test_a_cache_key_that_ignores_the_image_is_caught_at_every_placeholder():
    engine, canary = _images(b"dog", fields=())
    assert engine.cache_hit_tokens == 16
    assert {(rid, label) for rid, _, label in _found(canary)} == {("other", "verify_token+identity_multimodal")}
    assert {p for _, p, _ in _found(canary)} == set(range(4, 12))  # the placeholders, not the text


def test_same_image_shares_the_prefix_and_another_image_shares_only_the_text():
    engine, canary = _images(b"cat")
    assert engine.cache_hit_tokens == 16 and canary.counters()["total"] == 0
    engine, canary = _images(b"dog")
    assert engine.cache_hit_tokens == 4 and canary.counters()["total"] == 0  # the block before the image


@pytest.mark.parametrize("field", ["adapter", "salt"])
def test_a_cache_key_that_ignores_adapter_or_salt_is_caught_and_named(field):
    for fields, caught in (((), True), ((field,), False)):
        engine, canary = make_sim(seed=1, block_size=4, cache_key_fields=fields)
        engine.add_request(PROMPT, 2, rid="a", identity=ProducerIdentity(**{field: "one"}, context="shared"))
        _drain(engine)
        engine.add_request(PROMPT, 2, rid="b", identity=ProducerIdentity(**{field: "two"}, context="shared"))
        _drain(engine)
        if caught:
            assert _found(canary) == {("b", 0, f"verify_chain_hash+identity_{field}")}
        else:
            assert engine.cache_hit_tokens == 0 and canary.counters()["total"] == 0


def test_images_and_identities_are_checked_on_input():
    engine, _ = make_sim(seed=1)
    with pytest.raises(KvCanaryValueError, match="^kv-canary: prompt positions"):
        engine.add_request(PROMPT, 2, images=(SimImage(start=0, length=2, content=b"x"),))
    with pytest.raises(KvCanaryValueError, match="context or identity"):
        engine.add_request(PROMPT, 2, context=3, identity=ProducerIdentity(salt="s"))
    with pytest.raises(KvCanaryValueError, match="unknown prefix-cache key field"):
        make_sim(cache_key_fields=("tenant",))
    key = cache_key([1, 2, 3], (), ProducerIdentity(salt="s"), ("salt",))
    assert key[0] == ((("salt", "s"),), 1) and key[1:] == [2, 3]
