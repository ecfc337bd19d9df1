"""`hedge-gateway keys create|list|revoke|usage`: the store's keys and usage from a shell.

Works on the store's file directly (no gateway needs to run): the running gateways' workers see
a key made or revoked here within their next poll (well under a second), and usage as each
process last wrote it (once a second). The store is `--store URL` (a file, or a
shared PostgreSQL server), else the `server.store` of `--config FILE`, else the embedded default
file.
"""

from __future__ import annotations

import argparse
import datetime
import json
from typing import TextIO

from gateway.settings.fields import ConfigError
from gateway.settings.tenants import TenantBudget, TenantLimits, store_url
from gateway.tenants.spend import cost_text
from gateway.tenants.store import StoreError, StoreUnavailable
from gateway.tenants.stores import missing_store_extra, open_store

LIMIT_FLAGS = ("requests_per_minute", "input_tokens_per_minute", "output_tokens_per_minute",
               "in_flight")


def store_path(ns: argparse.Namespace) -> str | None:
    """The store URL the command works on (see the module docstring); None: the default
    file."""
    if ns.store is not None:
        return store_url(ns.store)
    if ns.config is not None:
        from gateway.settings.load import load_settings

        return load_settings(ns.config).server.store
    return None


def run(ns: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """The `keys` command: 0 done, 1 refused (a name taken, an unknown key), 2 unusable
    arguments or configuration."""
    try:
        url = store_path(ns)
    except ConfigError as exc:
        print(f"hedge-gateway keys: {exc}", file=err)
        return 2
    missing = missing_store_extra(url)
    if missing is not None:
        print(f"hedge-gateway keys: {missing}", file=err)
        return 2
    try:
        store = open_store(url)
    except StoreUnavailable as exc:
        print(f"hedge-gateway keys: the PostgreSQL store cannot be reached ({exc})", file=err)
        return 1
    try:
        if ns.action == "create":
            limits = TenantLimits(**{flag: getattr(ns, flag) for flag in LIMIT_FLAGS})
            budget = TenantBudget(usd=ns.budget_usd, period=ns.budget_period)
            secret, key = store.create_key(ns.name, ns.pool or (), limits, budget=budget)
            print(json.dumps({"name": key.name, "key": secret, "pools": list(key.pools)}),
                  file=out)
            print("the key is shown this once; the store keeps only its SHA-256", file=err)
        elif ns.action == "revoke":
            store.revoke(ns.name)
            print(f"revoked {ns.name}", file=out)
        elif ns.action == "list":
            for stored in store.list_keys():
                state = "revoked " + _day(stored.revoked) if stored.revoked else "active"
                if stored.invalid:  # a row that makes no key: never in force
                    state = "invalid" if not stored.revoked else state + " invalid"
                pools = ",".join(stored.pools) or "*"
                shown = " ".join(f"{flag}={value}" for flag, value in
                                 zip(LIMIT_FLAGS, _limits(stored.limits), strict=True)
                                 if value is not None)
                if stored.budget.usd is not None:
                    shown += f" budget={stored.budget.usd:g}/{stored.budget.period}"
                print(f"{stored.name}\t{state}\tpools={pools}\t{shown}".rstrip(), file=out)
        else:
            print("name\tday\trequests\tinput_tokens\toutput_tokens\tspend_usd", file=out)
            for row in store.usage(ns.name):
                print(f"{row.name}\t{row.day}\t{row.requests}\t{row.input_tokens}\t"
                      f"{row.output_tokens}\t{cost_text(row.spend_usd)}", file=out)
    except (StoreError, StoreUnavailable, ConfigError) as exc:
        print(f"hedge-gateway keys {ns.action}: {exc}", file=err)
        return 1
    finally:
        store.close()
    return 0


def _limits(limits: TenantLimits) -> tuple[int | None, ...]:
    return tuple(getattr(limits, flag) for flag in LIMIT_FLAGS)


def _day(when: float) -> str:
    return datetime.datetime.fromtimestamp(when, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
