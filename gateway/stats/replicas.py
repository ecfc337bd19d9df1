"""`hedge-gateway stats URL URL ...`: several replicas' stats merged into one view.

Each replica serves its stats in mergeable form at `/hedge/stats?mergeable=1` (under
`--workers`, already merged over its workers); the exports merge exactly
(`gateway.stats.merge`) and print as the one-gateway tables (`gateway.stats.table`), with a line
naming what was merged. Every replica must answer: a view that silently missed one would
under-count, so an unreachable or foreign one is an error (exit status 1) that names it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TextIO

import httpx

from gateway.stats.merge import document, merge
from gateway.stats.table import TIMEOUT, render


class ReplicaError(Exception):
    """One replica could not be read; the message names it."""


def shown(url: str) -> str:
    """`url` as it may be printed: without the user and password an ops key can ride in
    (`http://ops:KEY@host:8080`), which would otherwise be echoed in every line naming it."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        return "(an invalid URL)"
    return str(parsed.copy_with(userinfo=b"")) if parsed.userinfo else url


def fetch_export(client: httpx.Client, url: str) -> dict[str, Any]:
    """One replica's mergeable export, its processes marked with `replica` = its URL (as
    `shown`)."""
    request = url.rstrip("/") + "/hedge/stats?mergeable=1"
    target = shown(request)
    try:
        response = client.get(request)
    except httpx.HTTPError as exc:
        raise ReplicaError(f"cannot reach {target}: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise ReplicaError(f"{target} answered {response.status_code}")
    try:
        item = response.json()
        for worker in item["workers"]:
            worker["replica"] = shown(url)
    except (ValueError, KeyError, TypeError) as exc:
        raise ReplicaError(f"{target} did not return mergeable stats (a gateway too old to "
                           "serve them?)") from exc
    if not isinstance(item, dict):
        raise ReplicaError(f"{target} did not return mergeable stats")
    return item


def merged_document(urls: Sequence[str]) -> dict[str, Any]:
    """The `/hedge/stats` document of the replicas together (ReplicaError naming a replica
    that cannot be read or merged)."""
    with httpx.Client(timeout=TIMEOUT, follow_redirects=False, trust_env=False) as client:
        exports = [fetch_export(client, url) for url in urls]
    try:
        return document(merge(exports))
    except (ValueError, KeyError, TypeError) as exc:  # a replica's document, not our bug
        raise ReplicaError(f"the replicas' stats do not merge: {type(exc).__name__}: {exc}"
                           ) from exc


def print_merged(urls: Sequence[str], out: TextIO, err: TextIO) -> int:
    """Print the replicas' merged stats; 0 on success, 1 with a message on `err`."""
    try:
        doc = merged_document(urls)
    except ReplicaError as exc:
        print(f"hedge-gateway stats: {exc}", file=err)
        return 1
    processes = doc.get("workers", [])
    print(f"merged {len(urls)} replicas, {len(processes)} processes: "
          + ", ".join(f"{w.get('replica')} worker {w.get('worker')} (pid {w.get('pid')})"
                      for w in processes), file=out)
    render(doc, out)
    return 0
