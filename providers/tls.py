"""One `SSLContext` per CA bundle, shared by every backend and every reload that names it.

Why: a backend with `tls.ca_file` gets a client of its own, and its context loads the bundle
(`load_verify_locations`: tens of milliseconds for a system-sized bundle, about 0.8 MiB held
per context). A reload rebuilds every changed backend, and one that rotates a key hourly
would load the same bundle again each time, on the event loop, and keep a copy per retired
provider. A context is keyed by the file's identity as well as its path (inode, size,
modification time), so a bundle rewritten in place is loaded anew; `load` lets a reload do
the loading in a worker thread before it builds anything on the loop.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Iterable

#: bundles kept (a configuration names a handful; the oldest go first past it)
MAX_CONTEXTS = 32


class CaContexts:
    """The contexts built so far, by bundle. `get` may load (blocking); `load` is for a
    worker thread."""

    def __init__(self, limit: int = MAX_CONTEXTS) -> None:
        self._limit = limit
        self._contexts: dict[tuple[str, int, int, int], ssl.SSLContext] = {}
        #: bundles loaded so far (tests read it)
        self.loads = 0

    def get(self, ca_file: str) -> ssl.SSLContext:
        """The context that trusts `ca_file`: the one built for it before, unless the file
        changed since. Raises what `ssl.create_default_context` raises for a bad bundle."""
        stat = os.stat(ca_file)
        key = (os.path.abspath(ca_file), stat.st_ino, stat.st_size, stat.st_mtime_ns)
        context = self._contexts.get(key)
        if context is None:
            context = ssl.create_default_context(cafile=ca_file)
            self.loads += 1
            while len(self._contexts) >= self._limit:
                del self._contexts[next(iter(self._contexts))]
            self._contexts[key] = context
        return context

    def load(self, ca_files: Iterable[str]) -> None:
        """Build the contexts of `ca_files` now (blocking: from a worker thread), so that the
        `get`s on the loop that follow find them."""
        for ca_file in ca_files:
            self.get(ca_file)
