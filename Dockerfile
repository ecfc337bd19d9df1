# hedge-gateway as a container image: `hedge-gateway serve` on 0.0.0.0:8080 as an unprivileged
# user, with the configuration read from /etc/hedge-gateway/config.yaml. The image ships the
# demo configuration there (three simulated backends, no keys, no network), so a bare
# `docker run -p 8080:8080 hedge-gateway` answers at once; mounting a file or a Kubernetes
# ConfigMap over that path serves a real one (docs/deploy.md).
#
# Linted by hadolint in the test suite (tests/e2e/test_deploy.py), which also runs the
# ENTRYPOINT and CMD below as a real process: change them here and the test follows.

# One base for both stages: the virtualenv built in the first is copied into the second,
# and its interpreter link points at this image's /usr/local/bin/python3.11. A release build
# pins it by digest: --build-arg PYTHON_IMAGE=python:3.11-slim-trixie@sha256:... with the
# digest `docker buildx imagetools inspect python:3.11-slim-trixie` prints (docs/deploy.md).
ARG PYTHON_IMAGE=python:3.11-slim-trixie

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Only what the wheel is built from (pyproject names README.md as its readme) and the lock
# file: no tests, benchmarks or dev extras reach the image.
COPY pyproject.toml README.md requirements.lock ./
COPY gateway ./gateway
COPY providers ./providers
# Every dependency from the lock file, each file checked against its hash (every provider's
# extra: `hedge-gateway[all]`), then the package itself with nothing resolved again. A plain
# (non-editable) install, so the virtualenv holds the package itself and does not point back
# at /src, which the final stage does not have.
RUN python -m venv /opt/hedge-gateway \
    && /opt/hedge-gateway/bin/pip install --no-cache-dir --require-hashes --no-deps \
       -r /src/requirements.lock \
    && /opt/hedge-gateway/bin/pip install --no-cache-dir --no-deps /src

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="hedge-gateway" \
      org.opencontainers.image.description="OpenAI-compatible streaming gateway that hedges on the first token" \
      org.opencontainers.image.licenses="Apache-2.0"
# Unbuffered so log lines reach `docker logs`/`kubectl logs` as they happen; no bytecode
# writes, since the root filesystem may be read-only (the Kubernetes manifests make it so).
ENV PATH=/opt/hedge-gateway/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# A fixed numeric uid/gid, so Kubernetes' runAsNonRoot can verify the user without a name
# lookup, and a mounted Secret or ConfigMap can be made readable to it (fsGroup).
RUN groupadd --system --gid 10001 hedge \
    && useradd --system --no-log-init --uid 10001 --gid 10001 \
       --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin hedge
COPY --from=build /opt/hedge-gateway /opt/hedge-gateway
COPY config/demo.yaml /etc/hedge-gateway/config.yaml
USER 10001:10001
EXPOSE 8080
# SIGTERM starts the drain (new requests refused, live streams get server.shutdown_grace,
# then a final error event, exit 0); named here so no base-image default can change it.
STOPSIGNAL SIGTERM
# Exec form: hedge-gateway itself is PID 1 and receives the stop signal (a shell form would
# put /bin/sh there, which does not pass SIGTERM on, and the drain would never start).
# 0.0.0.0 because 127.0.0.1 inside a container is unreachable from outside it; --host and
# --port here override the file's `server.host`/`server.port`, so EXPOSE, the Kubernetes
# probes and the Service always agree on 8080 whatever the mounted file says.
ENTRYPOINT ["hedge-gateway", "serve", "--host", "0.0.0.0", "--port", "8080"]
# Arguments to `serve`, replaced by `docker run IMAGE ARGS...` or a Kubernetes `args:`.
CMD ["--config", "/etc/hedge-gateway/config.yaml"]
# No HEALTHCHECK: Kubernetes ignores it (its own probes on /readyz and /healthz are in
# deploy/), and a plain Docker engine only reports it without acting on it; checking would
# also need an HTTP client in the image that the gateway itself does not use.
