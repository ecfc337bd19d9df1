"""Where a configuration came from: its file's checksum and load time, and the environment
variable that names the file an ASGI server's factory serves.

Here, with the configuration, rather than with the generation that carries it: the
supervisor hands each worker the origin of the file it loaded, and the bench names the file
its front servers serve; neither needs the race or the composition root for it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime

from gateway.settings.model import Settings

#: the configuration file `gateway.app.app_from_env` serves (set by whoever starts the ASGI
#: server: the bench's front-server comparison)
CONFIG_ENV = "HEDGE_GATEWAY_CONFIG"


@dataclass(frozen=True, slots=True)
class ConfigOrigin:
    """Where a generation's configuration came from, for `/hedge/stats` and the log."""

    #: "file" (`serve --config`) or "embedded" (the built-in default or an in-process object)
    source: str
    #: sha256 of the file's bytes; for an embedded configuration, of its `repr` (which never
    #: holds a key: `BackendSettings` hides it)
    sha256: str
    #: monotonic time of the load (for "seconds ago")
    loaded_at: float
    #: the same instant on the wall clock, ISO 8601 in UTC
    loaded_wall: str

    @classmethod
    def of_file(cls, data: bytes, *, now: float, wall: datetime | None = None) -> ConfigOrigin:
        return cls("file", hashlib.sha256(data).hexdigest(), now, _iso(wall))

    @classmethod
    def embedded(cls, settings: Settings, *, now: float,
                 wall: datetime | None = None) -> ConfigOrigin:
        digest = hashlib.sha256(repr(settings).encode()).hexdigest()
        return cls("embedded", digest, now, _iso(wall))


def _iso(wall: datetime | None) -> str:
    moment = wall if wall is not None else datetime.now(UTC)
    return moment.isoformat(timespec="seconds")
