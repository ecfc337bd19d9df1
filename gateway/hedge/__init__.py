"""The hedging core: attempts, the race, the relay, a pool's live state and its pure decisions.

Knows no HTTP framework and no wire format beyond "an attempt returned its first token".
"""
