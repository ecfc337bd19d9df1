"""Tenants: client keys with names and rules, and what they may use (limits).

Pure: no HTTP framework, no I/O, the clock as a number. The API layer asks it who a key is
(`registry.Tenants`), whether a request is within the key's limits (`limits.KeyLimits`) and
which headers say so (`headers`); nothing here knows a request or a response.
"""
