#!/usr/bin/env bash
# Debian 12 packages only docker-compose 1.29. This installs Debian 13's Compose v2 (the `docker compose`
# CLI plugin) beside it, from Debian's archive with apt-get, without adding trixie to the machine's
# sources: both `docker compose` and `docker-compose` then work (the testbed test runs both). Needs root.
set -euo pipefail
plugin=/usr/libexec/docker/cli-plugins/docker-compose
if docker compose version >/dev/null 2>&1; then
    docker compose version
    exit 0
fi
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial"
echo "deb $mirror trixie main" >"$tmp/sources.list"
# A private sources list, package index and cache: the machine's own apt state is left alone.
apt=(apt-get -q -o "Dir::Etc::SourceList=$tmp/sources.list" -o "Dir::Etc::SourceParts=$tmp/none"
     -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache" -o APT::Sandbox::User=root)
"${apt[@]}" update >/dev/null
(cd "$tmp" && "${apt[@]}" download docker-compose >/dev/null)
dpkg-deb -x "$tmp"/docker-compose_2*.deb "$tmp/root"
install -D -m 755 "$tmp/root$plugin" "$plugin"
docker compose version
