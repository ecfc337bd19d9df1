"""The request id sent upstream: always a canonical version-4 UUID (`providers.requestid`)."""

from __future__ import annotations

import uuid

from providers.requestid import upstream_request_headers, upstream_request_id


def test_the_derived_id_is_a_canonical_version_4_uuid() -> None:
    """Strict validators (a version-4 check, a lowercase canonical form) accept it too, and
    one client id always maps to the same upstream id (every attempt of a request)."""
    for rid in ("client-req-42", "req_0123", "x" * 128, str(uuid.uuid1()),
                str(uuid.uuid4()).upper()):
        sent = upstream_request_id(rid)
        parsed = uuid.UUID(sent)
        assert (parsed.version, parsed.variant, str(parsed)) == (4, uuid.RFC_4122, sent)
        assert upstream_request_id(rid) == sent
    mine = str(uuid.uuid4())
    assert upstream_request_id(mine) == mine


def test_the_client_id_goes_beside_only_when_it_was_replaced() -> None:
    mine = str(uuid.uuid4())
    assert upstream_request_headers(mine) == {"x-request-id": mine}
    assert upstream_request_headers("client-7") == {
        "x-request-id": upstream_request_id("client-7"), "x-client-request-id": "client-7"}


def test_the_fast_paths_give_the_ids_the_uuid_module_gives() -> None:
    """The canonical match, the length test and the id formatted from its bytes give what
    parsing with `uuid.UUID` gave: the same ids go upstream as before."""
    salt = b"hedge-gateway upstream request id\x00"

    def by_uuid_module(rid: str) -> str:
        try:
            parsed: uuid.UUID | None = uuid.UUID(rid)
        except ValueError:
            parsed = None
        if parsed is not None and parsed.version == 4 and parsed.variant == uuid.RFC_4122:
            return str(parsed)
        import hashlib
        digest = hashlib.sha256(salt + rid.encode()).digest()
        return str(uuid.UUID(bytes=digest[:16], version=4))

    v4 = str(uuid.uuid4())
    for rid in (v4, v4.upper(), "{" + v4 + "}", "urn:uuid:" + v4, v4.replace("-", ""),
                str(uuid.uuid1()), str(uuid.uuid5(uuid.NAMESPACE_DNS, "x")), "bench-1",
                "warmup-3", "client-req-42", "x" * 128, "a" * 32, "g" * 32, "-" * 36,
                "0" * 32, "{" + "f" * 32 + "}", ""):
        assert upstream_request_id(rid) == by_uuid_module(rid), rid
