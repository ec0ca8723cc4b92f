"""Producer identity: deterministic keys, the issued-key registry, and naming what differed on a real canary."""
import dataclasses

import pytest
import torch

from kvcanary.errors import KvCanaryTypeError, KvCanaryValueError
from kvcanary.ops.hashing import CHAIN_HEAD_HASH, splitmix64_mix3
from kvcanary.runtime.identity import (IdentityRegistry, ProducerIdentity, anchor_hash, as_identity, identity_key)
from kvcanary.runtime import GroupSpec
from kvcanary.runtime.reads import reason_label

from tests.runtime.conftest import ManualEngine, make_canary


def test_null_identity_is_key_zero_and_keys_are_pinned():
    assert identity_key(ProducerIdentity()) == 0
    assert identity_key(ProducerIdentity(weights_version=0)) == 0
    # pinned: the key is part of what two processes must agree on (prefill -> decode transfers)
    assert identity_key(ProducerIdentity(adapter="a")) == 1107902261647029339
    assert identity_key(ProducerIdentity(adapter="a", weights_version=1)) == 4651992078348622247


def test_every_field_changes_the_key_and_keys_are_63_bit_non_zero():
    base = dict(adapter="lora-1", salt="tenant-a", weights_version=3, context=("x", 1))
    keys = {identity_key(ProducerIdentity(**base))}
    for name, other in (("adapter", "lora-2"), ("salt", "tenant-b"), ("weights_version", 4), ("context", ("x", 2))):
        keys.add(identity_key(ProducerIdentity(**{**base, name: other})))
    assert len(keys) == 5 and all(0 < k < 2**63 for k in keys)
    assert identity_key(ProducerIdentity(adapter="a")) != identity_key(ProducerIdentity(salt="a"))  # field-tagged
    assert identity_key(ProducerIdentity(adapter=1)) != identity_key(ProducerIdentity(adapter="1"))  # type-tagged


def test_bad_identities_are_refused():
    with pytest.raises(KvCanaryValueError, match="^kv-canary: ProducerIdentity.weights_version"):
        ProducerIdentity(weights_version=-1)
    with pytest.raises(KvCanaryValueError):
        ProducerIdentity(weights_version=True)
    with pytest.raises(KvCanaryTypeError, match="^kv-canary: ProducerIdentity.salt must be hashable"):
        ProducerIdentity(salt=["a"])
    with pytest.raises(KvCanaryTypeError, match="^kv-canary: identity_key"):
        identity_key("lora")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ProducerIdentity().adapter = "x"
    assert as_identity(None) == ProducerIdentity() and as_identity("t") == ProducerIdentity(context="t")


def test_registry_inverts_anchor_hashes_and_forgets_the_oldest():
    reg = IdentityRegistry(capacity=2)
    a, b, c = (ProducerIdentity(adapter=n) for n in "abc")
    ka, kb = reg.issue(a), reg.issue(b)
    assert anchor_hash(ka) == splitmix64_mix3(CHAIN_HEAD_HASH, ka, -1)
    assert reg.key_of_anchor(CHAIN_HEAD_HASH) == 0 and reg.identity_of(0) == ProducerIdentity()
    signed = anchor_hash(ka) - (1 << 64) if anchor_hash(ka) >= 1 << 63 else anchor_hash(ka)
    assert reg.key_of_anchor(signed) == ka and reg.identity_of(ka) == a
    reg.issue(c)  # capacity 2: a goes
    assert reg.key_of_anchor(anchor_hash(ka)) is None and reg.identity_of(kb) == b and len(reg) == 2
    assert reg.issue(ProducerIdentity()) == 0 and len(reg) == 2
    with pytest.raises(KvCanaryValueError):
        IdentityRegistry(capacity=0)


def _two_requests(stored: ProducerIdentity, expected: ProducerIdentity, *, issue=True):
    """Request A writes 4 tokens under ``stored``; request B, keyed ``expected``, reads A's slots as its prefix."""
    eng = ManualEngine(make_canary([GroupSpec(name="full", num_slots=64, layer_ids=(0, 1))], max_requests=4, max_context=64))
    reg = eng.canary.identities
    keys = [reg.issue(i) if issue else identity_key(i) for i in (stored, expected)]
    a = eng.batch(1, 0, [5, 6, 7, 8], [1, 2, 3, 4], rid="A")
    eng.forward(dataclasses.replace(a, context_keys=torch.tensor([keys[0]])))
    eng.table[2, :4] = eng.table[1, :4]
    eng.tokens[2, :4] = eng.tokens[1, :4]
    b = eng.batch(2, 4, [9], [5], rid="B")
    eng.forward(dataclasses.replace(b, context_keys=torch.tensor([keys[1]])))
    return [v for v in eng.canary.violations() if v.stored_position == 0]


@pytest.mark.parametrize("field,a,b", [("adapter", "lora-A", "lora-B"), ("salt", "s1", "s2"),
                                       ("weights_version", 1, 2), ("context", "t1", "t2")])
def test_a_position_0_chain_row_names_the_field_that_differed(field, a, b):
    found = _two_requests(ProducerIdentity(**{field: a}), ProducerIdentity(**{field: b}))
    assert found and {v.request_id for v in found} == {"B"}
    label = {"weights_version": "identity_weights_version"}.get(field, f"identity_{field}")
    assert all(v.reason_label == f"verify_chain_hash+{label}" for v in found)
    assert all(f"{field} {a!r} -> {b!r}" in v.identity_detail for v in found)
    assert "identity:" in found[0].readable() and found[0].to_json()["identity_detail"] == found[0].identity_detail


def test_two_fields_are_both_named_and_an_unissued_key_is_a_mismatch():
    found = _two_requests(ProducerIdentity(adapter="x", weights_version=1), ProducerIdentity(adapter="y", weights_version=2))
    assert found and all(v.reason_label == "verify_chain_hash+identity_adapter+identity_weights_version" for v in found)
    found = _two_requests(ProducerIdentity(adapter="x"), ProducerIdentity(adapter="y"), issue=False)
    assert found and all(v.reason_label == "verify_chain_hash" for v in found)  # nothing issued: nothing named
    assert reason_label(1 << 22) == "identity_mismatch"


def test_equal_identities_are_silent():
    assert _two_requests(ProducerIdentity(salt="s"), ProducerIdentity(salt="s")) == []
