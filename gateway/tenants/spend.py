"""What a request cost: the tokens each of its attempts was charged, priced per backend. Pure.

A hedged request pays more than its answer: every attempt that reached a backend was sent the
whole input, and one cut off after its first token had generated output too. The spend of a
request is therefore the sum over its attempts (`Charge`), each priced at its own backend's
`price` (US dollars per million tokens: input not read from a cache, input read from it,
output). Who was charged what is decided where the attempts are known
(`gateway.stats.spend`); here it is only arithmetic, so it can be checked by hand.

A backend without a price costs nothing: a request none of whose charged attempts ran on a
priced backend has no cost (None), which is not the same as a cost of zero.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

from gateway.settings.model import PriceSettings

#: prices are per this many tokens
PER_TOKENS = 1_000_000
#: spend is counted in millionths of a dollar (whole numbers add up exactly across requests,
#: batches and processes), the precision `x-hedge-cost` states
MICRO = 1_000_000
#: `x-hedge-cost` and the log line state a cost to this many decimals (a millionth of a
#: dollar: a single token of the cheapest models is below it, a request rarely is)
DECIMALS = 6


class Charge(NamedTuple):
    """The tokens one attempt was charged on `backend`."""

    backend: str
    #: every input token sent, cached or not
    input: int
    #: of `input`, read from the backend's prompt cache (priced at `cached_input`)
    cached: int
    output: int


def charge_cost(charge: Charge, price: PriceSettings) -> float:
    """One attempt's cost in US dollars at `price`."""
    cached = min(max(0, charge.cached), charge.input)
    cached_price = price.input if price.cached_input is None else price.cached_input
    return ((charge.input - cached) * price.input + cached * cached_price
            + charge.output * price.output) / PER_TOKENS


def request_cost(charges: Iterable[Charge],
                 prices: Mapping[str, PriceSettings]) -> float | None:
    """The sum of `charges` at their backends' prices; None when none of them ran on a
    priced backend (the request has no known cost)."""
    total: float | None = None
    for charge in charges:
        price = prices.get(charge.backend)
        if price is not None:
            total = (total or 0.0) + charge_cost(charge, price)
    return total


def cost_text(usd: float) -> str:
    """A cost as `x-hedge-cost` writes it: US dollars, `DECIMALS` decimals (`0.000125`)."""
    return f"{usd:.{DECIMALS}f}"


#: a key's spend as the store last said it, in micro-dollars: (today's, this month's)
PeriodSpend = tuple[int, int]


def period_spend(rows: Iterable[tuple[str, str, int]], today: str) -> dict[str, PeriodSpend]:
    """Per key, its spend of `today` and of today's month (UTC, ISO days), from the store's
    rows (name, day, micro-dollars) of this month."""
    month = today[:7]
    spent: dict[str, PeriodSpend] = {}
    for name, day, micro in rows:
        if day[:7] != month:
            continue
        of_day, of_month = spent.get(name, (0, 0))
        spent[name] = (of_day + (micro if day == today else 0), of_month + micro)
    return spent


def over_budget(usd: float, period: str, stored: PeriodSpend, unsent: int) -> bool:
    """Whether a key whose budget is `usd` a `period` ("day" or "month") has spent it: the
    store's figure for the period plus what this process counted and has not written yet."""
    return (stored[0] if period == "day" else stored[1]) + unsent >= usd * MICRO
