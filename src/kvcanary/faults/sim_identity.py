"""Fault injectors for producer identity on the simulated engine (docs/design.md §5.6, §6.2).

Each re-enacts a prefix cache whose key leaves out something the KV depends on, and sends a request that hits the
stale block on identical token ids (the bug stays on until `repair`, at the end of the detection window):

* ``weights_update_stale_prefix`` — the engine takes new weights in place and keeps its prefix cache;
* ``salt_ignored_by_cache_key`` / ``adapter_ignored_by_cache_key`` — a request of another cache salt / LoRA
  adapter reuses a prefix cached under the first;
* ``multimodal_key_ignores_image`` — same text, another image: the cache serves the first image's KV.

The first three are caught at position 0 (``verify_chain_hash``, named ``identity_*`` at drain time), the last at the
image's placeholder positions (``verify_token``, named ``identity_multimodal``), all against the hitting request.
"""
from __future__ import annotations

from typing import Optional

from kvcanary.engines.sim.identity import IMAGE_TOKEN, SimImage
from kvcanary.faults.ledger import Injection
from kvcanary.faults.sim import SimInjector
from kvcanary.runtime.identity import ProducerIdentity


class _StaleHit(SimInjector):
    """Shared shape: a cached root block written under the engine's identity, then a request with the same tokens
    under another identity (``_identity``), admitted next while the block is still cached."""

    field = ""  # the cache-key field the bug leaves out
    label = ""

    def _before(self) -> None:
        """What the bug does before the hitting request arrives (by default: the key forgets ``field``)."""
        e = self.t.engine
        if self.field in e.key_fields:
            e.key_fields.discard(self.field)
            self._undo.append(lambda: e.key_fields.add(self.field))

    def _identity(self, node) -> ProducerIdentity:
        return ProducerIdentity()

    def fire(self) -> Optional[Injection]:
        e = self.t.engine
        nodes = [n for n in e.cache.nodes() if n.parent is e.cache.root and n.full_slots
                 and all(isinstance(t, int) for t in n.key)]
        if not nodes or not e.table.num_free:
            return None
        node = self.rng.choice(nodes)
        self._before()
        prompt = list(node.key) + [self.rng.randrange(1, 30000) for _ in range(3)]
        rid = f"{self.fault}#{len(self.t.ledger)}"
        e.add_request(prompt, 4, rid=rid, identity=self._identity(node))
        e.waiting.insert(0, e.waiting.pop())  # admitted next, while the node is still cached
        if self.t.register is not None:
            self.t.register(rid, prompt)
        return self.record(group="full", slot=node.full_slots[0], position=0, request_id=rid,
                           expected=("verify_chain_hash", self.label),
                           detail=f"{rid} hits a block cached under another {self.field}")


class WeightsUpdateStalePrefix(_StaleHit):
    """New weights in place, the prefix cache kept (its key has no weights version): later hits read old KV."""

    fault = "weights_update_stale_prefix"
    fresh_engine = True  # the stale blocks stay cached: later windows would see them too
    field = "weights_version"
    label = "identity_weights_version"

    def _before(self) -> None:
        super()._before()
        self.t.engine.update_weights(reset_prefix_cache=False)


class SaltIgnoredByCacheKey(_StaleHit):
    fault = "salt_ignored_by_cache_key"
    field = "salt"
    label = "identity_salt"

    def _identity(self, node) -> ProducerIdentity:
        return ProducerIdentity(salt=f"tenant-{self.rng.randrange(1 << 30)}")


class AdapterIgnoredByCacheKey(_StaleHit):
    fault = "adapter_ignored_by_cache_key"
    field = "adapter"
    label = "identity_adapter"

    def _identity(self, node) -> ProducerIdentity:
        return ProducerIdentity(adapter=f"lora-{self.rng.randrange(1 << 30)}")


class MultimodalKeyIgnoresImage(SimInjector):
    """Same text, another image: the engine's prefix-cache key leaves the image out. First a request with image A
    is served and cached (``fire`` returns None meanwhile), then one with the same text and image B hits its blocks."""

    fault = "multimodal_key_ignores_image"
    fresh_engine = True  # the first image's blocks stay cached
    IMAGE = (2, 6)  # the image's placeholder positions [2, 8)

    def __init__(self, target, seed: int) -> None:
        super().__init__(target, seed)
        self._first = None

    def _prompt(self) -> list[int]:
        lo, hi = self.IMAGE
        text = [self.rng.randrange(1, 30000) for _ in range(4 * self.t.engine.config.block_size + hi)]
        return text[:lo] + [IMAGE_TOKEN] * (hi - lo) + text[hi:]

    def _add(self, rid: str, prompt: list[int], content: bytes):
        e = self.t.engine
        lo, hi = self.IMAGE
        req = e.add_request(prompt, 1, rid=rid, images=(SimImage(start=lo, length=hi - lo, content=content),))
        e.waiting.insert(0, e.waiting.pop())
        if self.t.register is not None:
            self.t.register(rid, list(req.tokens))
        return req

    def fire(self) -> Optional[Injection]:
        e = self.t.engine
        if self._first is None:
            if "images" in e.key_fields:  # the buggy key: the first image's blocks are cached under it too
                e.key_fields.discard("images")
                self._undo.append(lambda: e.key_fields.add("images"))
            self._first = self._add(f"{self.fault}#{len(self.t.ledger)}:cat", self._prompt(), b"cat")
            return None
        if self._first.state != "finished" or not e.table.num_free:
            return None
        first, self._first = self._first, None
        path = e.cache.match(e.cache_key(first), len(first.tokens) - 1)
        if len(path) * e.config.block_size < self.IMAGE[1]:
            return None  # evicted already: plant again
        rid = first.rid.replace(":cat", ":dog")
        prompt = first.tokens[: len(first.tokens) - 1]
        prompt[self.IMAGE[0] : self.IMAGE[1]] = [IMAGE_TOKEN] * (self.IMAGE[1] - self.IMAGE[0])
        self._add(rid, prompt, b"dog")
        b = e.config.block_size
        return self.record(group="full", slot=path[self.IMAGE[0] // b].full_slots[self.IMAGE[0] % b],
                           position=self.IMAGE[0], request_id=rid, expected=("verify_token", "identity_multimodal"),
                           detail=f"{rid}: same text as {first.rid}, another image; the cache key ignores the image")


IDENTITY_INJECTORS = (WeightsUpdateStalePrefix, SaltIgnoredByCacheKey, AdapterIgnoredByCacheKey,
                      MultimodalKeyIgnoresImage)
