"""What each API looks like on the wire: first token, ends, error shapes, usage, encoders.

Pure: no event loop, no HTTP client, no web framework.
"""
