"""Translations between two wire APIs: pure code, one module per pair (requests, whole answers,
streams event by event).

Each API's own rules stay in its file under `gateway.wire`; a translation only maps one API's
fields onto another's. Nothing here does I/O or reads a clock: a value that needs the time (a
Chat answer's `created`) is handed in. What a request asks for that the other API cannot carry
and that would change the answer is refused (`gateway.errors.Untranslatable`, a 400 naming the
field); what only tunes is dropped, and `docs/translation.md` lists both.
"""
