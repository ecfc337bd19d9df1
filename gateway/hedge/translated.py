"""A request's translations: per backend it reaches only by translation, the translation and
the body it is sent, that body made when an attempt first goes there.

A value of its own, apart from `gateway.hedge.routing` (which decides it before admission):
the proxy, the race's placement and the runner each read it, as they read the pool's state,
without stepping back into the routing.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Any

from gateway.errors import Unreadable, Untranslatable
from gateway.wire.base import Translation


class Translated(Mapping[str, tuple[Translation, Mapping[str, Any]]]):
    """Per backend a request reaches only by translation: its translation and the body it is
    sent, that body made when an attempt first goes to such a backend (`admits`), once per
    translation and request. A request a native backend answers translates nothing.

    Reading a backend's entry makes its body; one its translation refuses raises the
    refusal (`Untranslatable`)."""

    __slots__ = ("_body", "_made", "_via")

    def __init__(self, via: Mapping[str, Translation], body: Mapping[str, Any]) -> None:
        self._via = via
        self._body = body
        #: translation name -> the body it made, or its refusal
        self._made: dict[str, Mapping[str, Any] | Untranslatable] = {}

    def without(self, backends: Collection[str]) -> Translated:
        """The same request's translations less `backends`, the bodies made kept."""
        kept = Translated({b: t for b, t in self._via.items() if b not in backends}, self._body)
        kept._made = self._made
        return kept

    def made(self, translation: Translation) -> Mapping[str, Any] | Untranslatable:
        """The body `translation` makes of the request's, or its refusal (made once)."""
        made = self._made.get(translation.name)
        if made is None:
            try:
                made = translation.request(self._body)
            except Untranslatable as exc:
                made = exc
            except (TypeError, AttributeError, ValueError, LookupError) as exc:
                # a shape the body check let through that the translation did not name (it
                # names the item of `messages`, `input` or `tools` it cannot read): refused,
                # never raised into the race that asked
                made = Unreadable("body", exc)
            self._made[translation.name] = made
        return made

    def admits(self, backend: str) -> bool:
        """Whether an attempt may go to `backend`: it speaks the request's API, or its
        translation carries the request (translated now, on the first attempt there)."""
        translation = self._via.get(backend)
        return translation is None or not isinstance(self.made(translation), Untranslatable)

    def __getitem__(self, backend: str) -> tuple[Translation, Mapping[str, Any]]:
        translation = self._via[backend]
        made = self.made(translation)
        if isinstance(made, Untranslatable):
            raise made
        return translation, made

    def __contains__(self, backend: object) -> bool:
        """Whether `backend` is reached by translation (nothing is translated to say so)."""
        return backend in self._via

    def __iter__(self) -> Iterator[str]:
        return iter(self._via)

    def __len__(self) -> int:
        return len(self._via)


#: a request that reaches no backend by translation (the usual case)
NOT_TRANSLATED = Translated({}, {})
