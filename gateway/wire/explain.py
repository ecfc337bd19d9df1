"""An upstream's own explanation of a request it rejected, made safe to show a client. Pure.

Why relay it at all: a client cannot fix a request from "the upstream rejected it". OpenAI
names the parameter and the rule (`Invalid 'max_output_tokens': integer below minimum value
...`, with `param` and `code`), Anthropic the validation path (`messages.1.role: Input should
be 'user' or 'assistant'`), and some clients act on those words: Claude Code reads a 400's
message to decide which beta feature to drop before it retries, so a hidden message ends its
session where the upstream's own message lets it go on.

Why not relay the body as it is: an upstream's error body is the upstream's text, and can
echo the credential it was sent (`Incorrect API key provided: sk-...`), name internal hosts
and URLs, or be megabytes of HTML. So only four fields are kept (message, type, param,
code), each bounded, and the message is scrubbed word by word:
- each value the caller knows to be secret (the backend's key, its static header and query
  values, its cloud keys, the host of its URL) is replaced wherever it appears;
- a word that looks like a credential whatever its value (`gateway.settings.hidden.
  looks_like_credential`: `sk-...`, an AWS key id, a JWT, a long run of letters and
  digits), the word after `Bearer` or `Basic` or after a `key:`, `token=`, `secret:`,
  `password=`, `signature=` or `credential:` word, a URL of any scheme, an IPv4 address
  and a `host:port` are replaced;
- control characters are dropped, whitespace runs folded, and the result cut to
  `MAX_MESSAGE` characters.
`type`, `param` and `code` are kept only when they are short words of a safe alphabet (an
identifier path such as `messages[0].content`) that hold no secret and look like no
credential or address; anything else is dropped, never scrubbed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from gateway.settings.hidden import MIN_SECRET_CHARS, holds_secret, looks_like_credential

#: the longest message shown, in characters (after scrubbing)
MAX_MESSAGE = 600
#: the longest `type`, `param` or `code` kept
MAX_FIELD = 120
#: the most body bytes parsed: an explanation is a few hundred bytes; past this, none is given
MAX_BODY = 64 * 1024
#: what stands where something was scrubbed
REDACTED = "[redacted]"

_FIELD = re.compile(rf"[A-Za-z0-9_.\[\]$:/-]{{1,{MAX_FIELD}}}")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")
_SPACE = re.compile(r"\s+")
#: a word, without the quotes, backticks and brackets around it
_WORD = re.compile(r"[^\s\"'`<>()\[\]{},;]+")
#: a URL (any scheme), an IPv4 address (and port), a host (dotted or not) and port, a name
#: in a private DNS zone (a cluster's service names, a cloud's internal hosts). The scheme is
#: a run of its alphabet holding a letter and ending in `://`, matched only from where a run
#: starts and without going back: searched from every letter (`[A-Za-z][...]*://`), a long
#: word of an upstream's message was read again from each, quadratic in its length
_ADDRESS = re.compile(r"(?<![A-Za-z0-9+.-])[0-9+.-]*+[A-Za-z][A-Za-z0-9+.-]*+://"
                      r"|^\d{1,3}(?:\.\d{1,3}){3}\b"
                      r"|^[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*:\d{1,5}\b"
                      r"|\.(?:internal|local|localdomain|lan|svc|cluster\.local)\.?$", re.I)
#: a word that names a credential, then its value: `key=...` in one word, or `key:` before it
_NAMED = re.compile(r"(?i)^((?:api[-_]?)?keys?|tokens?|secrets?|passwords?|signatures?|"
                    r"credentials?|authorization)([:=])(.*)$")
_SCHEMES = frozenset({"bearer", "basic"})


@dataclass(frozen=True, slots=True)
class Explanation:
    """What an upstream said of a request it rejected, safe to show (see the module)."""

    message: str
    type: str | None = None
    param: str | None = None
    code: str | None = None


def scrub(text: str, secrets: Collection[str] = ()) -> str:
    """`text` without the known secrets, anything shaped like a credential or an address,
    control characters and runs of whitespace, cut to `MAX_MESSAGE` characters."""
    text = _CONTROL.sub(" ", text)
    for secret in sorted((s for s in secrets if len(s) >= MIN_SECRET_CHARS),
                         key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    before = [""]  # the word before, lower-cased

    def word(match: re.Match[str]) -> str:
        value = match.group()
        previous, before[0] = before[0], value.lower()
        if (previous in _SCHEMES or value in secrets or value.partition(":")[0] in secrets
                or looks_like_credential(value)
                or _ADDRESS.search(value) or _names_credential(previous)):
            return REDACTED
        named = _NAMED.match(value)
        if named is not None and named.group(3):
            return f"{named.group(1)}{named.group(2)}{REDACTED}"
        return value

    text = _SPACE.sub(" ", _WORD.sub(word, text)).strip()
    if len(text) > MAX_MESSAGE:
        text = text[:MAX_MESSAGE - 3].rstrip() + "..."
    return text


def _names_credential(word: str) -> bool:
    """`key:`, `token=`: a word naming a credential whose value is the next word."""
    named = _NAMED.match(word)
    return named is not None and not named.group(3)


def _field(value: object, secrets: Collection[str]) -> str | None:
    """A short identifier of a safe alphabet that holds no secret, else nothing."""
    if not isinstance(value, str) or not _FIELD.fullmatch(value):
        return None
    if holds_secret(value, secrets) or looks_like_credential(value) or _ADDRESS.search(value):
        return None
    return value


def explain(body: bytes, secrets: Collection[str] = ()) -> Explanation | None:
    """The explanation in an upstream's error body, or None when it holds none we can read.

    Read: OpenAI's `{"error": {message, type, param, code}}`, Anthropic's `{"type": "error",
    "error": {type, message}}`, Google's `{"error": {code, message, status}}` (its `status`,
    `INVALID_ARGUMENT`, as the type), AWS's `{"message": ...}` / `{"Message": ...}`, any of
    them as the first item of a list (Vertex wraps some so). A body that is not JSON (an HTML
    page, a proxy's text) gives none: it is no upstream's explanation of the request."""
    if not body or len(body) > MAX_BODY:
        return None
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if isinstance(parsed, list) and parsed:
        parsed = parsed[0]
    if not isinstance(parsed, Mapping):
        return None
    inner = parsed.get("error")
    where: Mapping[str, object] = inner if isinstance(inner, Mapping) else parsed
    message = where.get("message", where.get("Message"))
    if not isinstance(message, str) or not message.strip():
        return None
    shown = scrub(message, secrets)
    if not shown:
        return None
    kind = where.get("type", where.get("status"))
    code = where.get("code")
    return Explanation(shown, _field(kind, secrets), _field(where.get("param"), secrets),
                       _field(code, secrets))
