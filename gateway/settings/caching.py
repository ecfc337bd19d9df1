"""What a backend's prompt cache keeps, by provider: the shortest input worth a key. Pure.

Why: conversation affinity (`gateway.hedge.affinity`) derives a key from a request's stable
prefix only when its input reaches `affinity.min_input_tokens`; below that, balance is worth
more than a cache that would not hold the prompt, or would save next to nothing. What "long
enough" means is the backend's, not the gateway's:

- the hosted APIs cache no prompt shorter than 1,024 tokens (OpenAI and Azure OpenAI,
  Anthropic, Claude on Bedrock and on Vertex, Gemini), so a shorter one gains nothing from
  being kept on one deployment;
- a self-hosted engine (vLLM, SGLang, llama.cpp, TGI) keeps the KV state of any prefix it has
  prefilled, so every turn of a short conversation is prefilled again from its start on
  another engine, and only from its new message on the one that holds its history. Only a
  request too small to be a conversation (`ENGINE_MIN_PREFIX_TOKENS`) goes by load alone.

A backend's provider says which it is: `anthropic`, `bedrock` and `vertex` are hosted;
`openai` is hosted when its `base_url` is at one of `HOSTED_API_DOMAINS` and an engine
otherwise (that provider is how the gateway speaks to vLLM, SGLang, llama.cpp and TGI); `sim`
is an engine when its profile models a prefix cache (prefill time and cache entries), and
caches nothing otherwise, so it keeps the hosted threshold. A hosted API that is not listed is
taken for an engine: its short requests get keys, which costs a little balance (bounded load
still spreads them) and never a cache. An engine behind a hosted API's name, or a proxy in
front of a hosted API, is what `affinity.min_input_tokens` set by hand is for.
"""

from __future__ import annotations

from urllib.parse import urlsplit

#: the hosted APIs' smallest cacheable prompt (tokens)
HOSTED_MIN_PREFIX_TOKENS = 1024
#: a self-hosted engine caches any prefix it has prefilled, but below this many tokens (about
#: 256 bytes of body, of which the JSON around the messages is a good part) the prefill a
#: cache saves is a few milliseconds, less than balance is worth: a bare "hi" is no
#: conversation to keep anywhere
ENGINE_MIN_PREFIX_TOKENS = 64
#: the providers that only reach hosted APIs
HOSTED_PROVIDERS = ("anthropic", "bedrock", "vertex")
#: domains (and their subdomains) of the hosted APIs an `openai` backend may point at whose
#: prompt caches start at `HOSTED_MIN_PREFIX_TOKENS`: OpenAI, Azure OpenAI and Azure AI
#: Foundry, Anthropic's OpenAI-compatible endpoint, Gemini's and Vertex's, Bedrock's
HOSTED_API_DOMAINS = (
    "openai.com",
    "azure.com",
    "anthropic.com",
    "googleapis.com",
    "amazonaws.com",
)


def is_hosted_url(base_url: str | None) -> bool:
    """`base_url`'s host is a hosted API's (one of `HOSTED_API_DOMAINS` or a subdomain)."""
    host = (urlsplit(base_url).hostname or "") if base_url else ""
    return any(host == domain or host.endswith("." + domain) for domain in HOSTED_API_DOMAINS)


def min_keyed_tokens(provider: str, base_url: str | None, sim_caches: bool) -> int:
    """The shortest input (tokens) worth a conversation key on a backend of `provider` at
    `base_url`; for `sim`, `sim_caches` says whether its profile models a prefix cache."""
    if provider in HOSTED_PROVIDERS:
        return HOSTED_MIN_PREFIX_TOKENS
    if provider == "sim":
        return ENGINE_MIN_PREFIX_TOKENS if sim_caches else HOSTED_MIN_PREFIX_TOKENS
    return HOSTED_MIN_PREFIX_TOKENS if is_hosted_url(base_url) else ENGINE_MIN_PREFIX_TOKENS
