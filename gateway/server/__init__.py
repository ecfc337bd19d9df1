"""How `serve` runs: the uvicorn server, the HTTP/1.1 connection, workers and their supervisor.
"""
