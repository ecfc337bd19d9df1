"""What a log line may hold of text a client chose: its model name, an unmatched path.

The request log is written for every request, refused ones included, so it carries text that
anyone who can reach the port controls. Three rules keep that text from harming the log or
leaking through it:

- bounded: at most `MODEL_CHARS` / `PATH_CHARS` characters, the cut marked with `…`, so a
  4 MiB model name costs one short line;
- escaped: control and format characters (newlines, ESC, DEL, C1 controls, bidi overrides,
  zero-width characters, line and paragraph separators, lone surrogates) become `\\xNN` /
  `\\uNNNN`, so no value can start a forged line, move a terminal's cursor or reorder what an
  operator reads, whatever handler prints it (the JSON encoder escapes only some of them);
- never a key: a value that contains one of the gateway's own secrets (client and ops keys,
  provider keys and headers: `Generation.hidden`) or looks like a credential (`Bearer ...`,
  `sk-...`, an AWS key id, a JWT, a long run of letters and digits:
  `gateway.settings.hidden.looks_like_credential`) is logged as `[redacted]`. A client
  that pastes its key into `model` by mistake does not leave it in the log.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Collection

from gateway.settings.hidden import holds_secret, looks_like_credential

__all__ = ["MODEL_CHARS", "PATH_CHARS", "REDACTED", "escaped", "holds_secret", "loggable_model",
           "loggable_path", "looks_like_credential"]

#: the longest model name a line carries (model names are short; a longer one is cut)
MODEL_CHARS = 128
#: the longest path a line carries (only for a path that no route matched)
PATH_CHARS = 200
#: how far past its cut a model name or path is looked at for a credential's shape: one that
#: starts before the cut shows in the line, and its shape is told within this many characters
SHAPE_TAIL = 256
#: what stands in for a value that holds or looks like a credential
REDACTED = "[redacted]"
#: the Unicode categories that are escaped: controls, format characters (bidi, zero width),
#: line and paragraph separators, surrogates, unassigned code points
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Cn"})

def escaped(text: str, limit: int) -> str:
    """`text` cut to `limit` characters (marked `…`), control and format characters escaped."""
    cut = text[:limit]
    if not cut.isprintable():  # cheap test first: most values need no escaping
        cut = "".join(_escape(ch) for ch in cut)
    return cut + "…" if len(text) > limit else cut


def _escape(ch: str) -> str:
    if unicodedata.category(ch) not in _ESCAPED_CATEGORIES:
        return ch
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 \
        else f"\\U{code:08x}"


def loggable_model(value: object, hidden: Collection[str] = ()) -> str | None:
    """The model name a client sent, as a log line may hold it: None when it sent none (or
    not a string), `[redacted]` when it holds a secret, else bounded and escaped."""
    if not isinstance(value, str):
        return None
    # the shapes are looked for where a credential could show in the line, not in the rest
    # of a name as long as the body (the known secrets are looked for in all of it)
    if holds_secret(value, hidden) or looks_like_credential(value[:MODEL_CHARS + SHAPE_TAIL]):
        return REDACTED
    return escaped(value, MODEL_CHARS)


def loggable_path(path: str) -> str:
    """A request path no route matched, as a log line may hold it: each segment that looks
    like a credential (or a token, such as a response id) becomes `[redacted]`."""
    # looked at a little past the cut: a credential that the cut splits is still found
    seen = path[:PATH_CHARS + SHAPE_TAIL]
    if looks_like_credential(seen):
        seen = "/".join(REDACTED if looks_like_credential(part) else part
                        for part in seen.split("/"))
    dropped = len(path) > PATH_CHARS + SHAPE_TAIL or len(seen) > PATH_CHARS
    return escaped(seen[:PATH_CHARS], PATH_CHARS) + ("…" if dropped else "")
