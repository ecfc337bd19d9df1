"""Which backend made each stored response this gateway relayed. Pure, bounded.

A Responses request that continues a conversation (`previous_response_id`), and `GET`/`DELETE
/v1/responses/{id}`, `/cancel`, `/input_items`, can only be served by the backend that stored
the response. The gateway learns the id when it relays the response and keeps the most
recently used ids up to a fixed count: the least recently used is forgotten first, so memory
stays bounded whatever the traffic. One instance per app, no module state.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

#: response ids remembered by default (about 100 bytes each)
DEFAULT_CAPACITY = 100_000


class Origin(NamedTuple):
    pool: str
    backend: str


class ResponseDirectory:
    """A bounded LRU map: response id -> (pool, backend)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._origins: OrderedDict[str, Origin] = OrderedDict()

    def remember(self, response_id: str, pool: str, backend: str) -> None:
        self._origins[response_id] = Origin(pool, backend)
        self._origins.move_to_end(response_id)
        while len(self._origins) > self.capacity:
            self._origins.popitem(last=False)

    def find(self, response_id: str) -> Origin | None:
        """The origin of an id (and mark it recently used), or None when unknown."""
        origin = self._origins.get(response_id)
        if origin is not None:
            self._origins.move_to_end(response_id)
        return origin

    def forget(self, response_id: str) -> None:
        self._origins.pop(response_id, None)

    def __len__(self) -> int:
        return len(self._origins)
