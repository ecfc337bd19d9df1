"""The first-contact smoke client: what a newcomer does against a gateway they just started.

Standard library only, so it runs with any `python3` and proves nothing through a package the
gateway's own install might lack. Exit status 0 when every check held; otherwise 1 and what
failed.

    python3 .ci/smoke.py wait URL SECONDS [PID [PATH]]  until URL/healthz (or URL+PATH)
                                               answers 200 (or time is up, or process PID
                                               has ended)
    python3 .ci/smoke.py chat URL MODEL        a streamed chat completion: text, then [DONE]
    python3 .ci/smoke.py messages URL MODEL    a streamed Messages answer: text, message_stop
    python3 .ci/smoke.py dashboard URL         the dashboard page and every file it loads
"""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.error
import urllib.request

#: bound on one request, so a broken gateway fails the step instead of hanging it
REQUEST_TIMEOUT = 30.0


def _post(url: str, body: dict[str, object], headers: dict[str, str]) -> list[str]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json", **headers})
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as response:
        if response.status != 200:
            raise SystemExit(f"{url}: status {response.status}")
        return response.read().decode().splitlines()


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (an ended child not yet reaped is a zombie: not running)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait(root: str, seconds: float, pid: int | None, path: str = "/healthz") -> None:
    """Until `root` answers `path`; fails at once when process `pid` has ended."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if pid is not None and not _alive(pid):
            raise SystemExit(f"the process starting the gateway ({pid}) has ended")
        try:
            with urllib.request.urlopen(f"{root}{path}", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)  # polling for start-up
    raise SystemExit(f"{root}{path} did not answer within {seconds} s")


def chat(root: str, model: str) -> None:
    lines = _post(f"{root}/v1/chat/completions",
                  {"model": model, "stream": True,
                   "messages": [{"role": "user", "content": "hi"}]}, {})
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    if not data or data[-1] != "[DONE]":
        raise SystemExit(f"chat: the stream did not end with [DONE]: {data[-1:]}")
    text = "".join(choice["delta"].get("content") or ""
                   for chunk in map(json.loads, data[:-1]) for choice in chunk["choices"])
    if not text:
        raise SystemExit("chat: no text in the stream")
    print(f"chat: {len(data) - 1} chunks, {text[:40]!r}...")


def messages(root: str, model: str) -> None:
    lines = _post(f"{root}/v1/messages",
                  {"model": model, "max_tokens": 64, "stream": True,
                   "messages": [{"role": "user", "content": "hi"}]},
                  {"anthropic-version": "2023-06-01"})
    events = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    kinds = [event["type"] for event in events]
    if not kinds or kinds[0] != "message_start" or kinds[-1] != "message_stop":
        raise SystemExit(f"messages: not a complete Messages stream: {kinds}")
    text = "".join(event["delta"].get("text", "") for event in events
                   if event["type"] == "content_block_delta")
    if not text:
        raise SystemExit("messages: no text in the stream")
    print(f"messages: {len(events)} events, {text[:40]!r}...")


def dashboard(root: str) -> None:
    with urllib.request.urlopen(f"{root}/dashboard", timeout=REQUEST_TIMEOUT) as response:
        page = response.read().decode()
    assets = re.findall(r'(?:src|href)="(/dashboard/[^"]+)"', page)
    if not assets:
        raise SystemExit("dashboard: the page loads no script or style")
    for asset in assets:
        with urllib.request.urlopen(f"{root}{asset}", timeout=REQUEST_TIMEOUT) as response:
            if response.status != 200 or not response.read():
                raise SystemExit(f"dashboard: {asset} is missing or empty")
    print(f"dashboard: page and {len(assets)} files")


def main(argv: list[str]) -> int:
    command, root = argv[0], argv[1].rstrip("/")
    try:
        if command == "wait":
            wait(root, float(argv[2]), int(argv[3]) if len(argv) > 3 else None,
                 *argv[4:5])
        elif command == "chat":
            chat(root, argv[2])
        elif command == "messages":
            messages(root, argv[2])
        elif command == "dashboard":
            dashboard(root)
        else:
            raise SystemExit(f"unknown check {command!r}")
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")[:500]
        raise SystemExit(f"{command}: status {exc.code}: {body}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
