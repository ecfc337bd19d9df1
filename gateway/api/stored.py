"""Response ids that carry their backend: stored Responses state with no shared store. Pure.

A Responses request that continues a conversation (`previous_response_id`), and `GET`/`DELETE
/v1/responses/{id}`, `/cancel`, `/input_items`, can only be served by the backend that stored
the response. Instead of remembering which backend made each id (a map that lives in one
process, so another worker or replica would not know it), the gateway hands the client an id
that says it:

    resp_ + base64url(payload + tag)
    payload = version (1 byte) | pool | backend | upstream id | key binding
              (each a length byte, or two for the upstream id, then its bytes)
    tag     = the first 16 bytes of HMAC-SHA256(secret, payload)

The key binding is an HMAC of the client's gateway key (empty without client keys): the id
never contains the key, and a client with another key gets a 404, as for an unknown id. Any
process that has the same secret (`server.response_id_secret`, or the one the supervisor
generates at start for its workers) reads the id back; one that does not verify it is
unknown. The payload is readable, not secret: it names a pool, a backend and the upstream's id.

The gateway rewrites the upstream's id into its own in what it relays: the few stream events
that carry the response object (`IdRewriter`, one byte replace each) and whole bodies.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import secrets
from typing import NamedTuple

PREFIX = "resp_"
_VERSION = 1
_TAG_BYTES = 16
_BINDING_BYTES = 12
#: the longest id the gateway reads (a few hundred bytes is what it mints)
MAX_ID_CHARS = 1024
#: the longest upstream id the gateway wraps (longer ones are relayed as they came)
MAX_UPSTREAM_ID = 512
#: stream events that carry the whole response object, and so its id (a few per stream)
RESPONSE_OBJECT_EVENTS = frozenset({
    b"response.created", b"response.queued", b"response.in_progress", b"response.completed",
    b"response.incomplete", b"response.failed",
})


def generate_secret() -> str:
    """A fresh secret for one server's lifetime (its workers inherit it)."""
    return secrets.token_urlsafe(32)


class StoredRef(NamedTuple):
    """What a verified response id says."""

    pool: str
    backend: str
    upstream_id: str
    binding: bytes


class ResponseIds:
    """Mints and verifies the gateway's response ids with one secret."""

    __slots__ = ("_binding_key", "_tag_key")

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("the response id secret must not be empty")
        root = secret.encode()
        # separate keys for the tag and the key binding, both derived from the one secret
        self._tag_key = hmac.digest(root, b"hedge-gateway response id tag", "sha256")
        self._binding_key = hmac.digest(root, b"hedge-gateway response id key", "sha256")

    def binding(self, client_key: str | None) -> bytes:
        """The binding of a client key: empty without one, never the key itself."""
        if not client_key:
            return b""
        digest = hmac.digest(self._binding_key, client_key.encode("latin-1", "replace"),
                             "sha256")
        return digest[:_BINDING_BYTES]

    def mint(self, pool: str, backend: str, upstream_id: str, binding: bytes) -> str | None:
        """The client's id for `upstream_id` of `backend`; None when the upstream's id cannot
        be wrapped (too long, or a pool or backend name too long to encode)."""
        up = upstream_id.encode()
        names = pool.encode(), backend.encode()
        if not up or len(up) > MAX_UPSTREAM_ID or any(len(n) > 255 for n in names):
            return None
        payload = b"".join((
            bytes((_VERSION, len(names[0]))), names[0], bytes((len(names[1]),)), names[1],
            len(up).to_bytes(2, "big"), up, bytes((len(binding),)), binding,
        ))
        token = payload + self._tag(payload)
        return PREFIX + base64.urlsafe_b64encode(token).decode().rstrip("=")

    def read(self, response_id: str) -> StoredRef | None:
        """What a client's id says, or None when it is not one this secret made."""
        if not response_id.startswith(PREFIX) or len(response_id) > MAX_ID_CHARS:
            return None
        text = response_id[len(PREFIX):]
        try:
            raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        except (binascii.Error, ValueError):
            return None
        # only the canonical (unpadded) spelling of a token is the token
        if base64.urlsafe_b64encode(raw).decode().rstrip("=") != text:
            return None
        payload, tag = raw[:-_TAG_BYTES], raw[-_TAG_BYTES:]
        if len(raw) <= _TAG_BYTES or not hmac.compare_digest(tag, self._tag(payload)):
            return None
        return _parse(payload)

    def _tag(self, payload: bytes) -> bytes:
        return hmac.digest(self._tag_key, payload, "sha256")[:_TAG_BYTES]


def _parse(payload: bytes) -> StoredRef | None:
    """The fields of an authenticated payload (None for a version this gateway does not
    know; a payload that verified but does not parse cannot come from this code)."""
    try:
        if payload[0] != _VERSION:
            return None
        at = 1
        fields: list[bytes] = []
        for width in (1, 1, 2, 1):
            size = int.from_bytes(payload[at:at + width], "big")
            at += width
            fields.append(payload[at:at + size])
            at += size
        if at != len(payload):
            return None
        pool, backend, up = (f.decode() for f in fields[:3])
    except (IndexError, UnicodeDecodeError):
        return None
    return StoredRef(pool, backend, up, fields[3])


class IdRewriter:
    """Rewrites an upstream's response ids into the client's in what the gateway relays.

    Called only on the few events that carry the response object (`RESPONSE_OBJECT_EVENTS`)
    and on whole bodies: one bytes replace per pair. When the upstream's id was not seen
    before commit, the first such event is parsed once to learn it."""

    __slots__ = ("_mint", "_pairs", "_pending")

    def __init__(self, pairs: list[tuple[str, str]], mint: MintFor | None = None) -> None:
        self._pairs = [(_quoted(old), _quoted(new)) for old, new in pairs]
        #: mints the client's id once the upstream's is known (None: it is known)
        self._mint = mint
        self._pending = mint is not None

    def __call__(self, data: bytes) -> bytes:
        if self._pending:
            self._learn(data)
        for old, new in self._pairs:
            if data.find(old) >= 0:  # not `old in data`: see `gateway.wire.sse.encode_event`
                data = data.replace(old, new)
        return data

    def _learn(self, data: bytes) -> None:
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError):
            return
        if not isinstance(obj, dict):
            return
        response = obj.get("response")
        found = (response if isinstance(response, dict) else obj).get("id")
        if not isinstance(found, str) or not found or self._mint is None:
            return
        self._pending = False
        minted = self._mint(found)
        if minted is not None:
            self._pairs.insert(0, (_quoted(found), _quoted(minted)))


class MintFor:
    """Mints the client's id of one backend's response for one client (a bound `mint`)."""

    __slots__ = ("_backend", "_binding", "_ids", "_pool")

    def __init__(self, ids: ResponseIds, pool: str, backend: str, binding: bytes) -> None:
        self._ids, self._pool, self._backend, self._binding = ids, pool, backend, binding

    def __call__(self, upstream_id: str) -> str | None:
        return self._ids.mint(self._pool, self._backend, upstream_id, self._binding)


def _quoted(value: str) -> bytes:
    """A string as it appears in the upstream's JSON (ids are plain ASCII in practice)."""
    return json.dumps(value).encode()

