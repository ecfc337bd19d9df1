"""The simulator's `/v1/embeddings` answer, as OpenAI sends it.

Vectors are deterministic (a hash of the input, not a meaning) and of unit length, `dimensions`
long when the request asks (8 by default, small on purpose: tests compare them). The OpenAI SDK
asks for `encoding_format: "base64"` unless told otherwise and decodes the vectors itself:
each is then its float32 values, little-endian, base64-encoded, as OpenAI packs them. Usage
counts the inputs' tokens (`providers.sim.prompt`).
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
from typing import Any

from providers.sim.wire import EMBEDDING_DIMENSIONS, SimPlan


def embedding_vector(text: str, dimensions: int = EMBEDDING_DIMENSIONS) -> list[float]:
    """A deterministic unit vector for one input, rounded to 6 decimals."""
    digest = hashlib.shake_256(text.encode("utf-8", "surrogatepass")).digest(dimensions)
    raw = [b / 127.5 - 1.0 for b in digest]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [round(x / norm, 6) for x in raw]


def packed(vector: list[float]) -> str:
    """The vector as OpenAI's base64 encoding: little-endian float32."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def embeddings_body(plan: SimPlan, model: str) -> dict[str, Any]:
    data: list[dict[str, Any]] = []
    for i, text in enumerate(plan.inputs):
        vector = embedding_vector(text, plan.dimensions)
        data.append({"object": "embedding", "index": i,
                     "embedding": packed(vector) if plan.base64 else vector})
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": plan.prompt_tokens, "total_tokens": plan.prompt_tokens},
    }
