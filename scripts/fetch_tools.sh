#!/bin/sh
# The binaries the tests need beside Python, placed in the project's tool folder (default
# .tools/bin), never installed: Debian's packages are downloaded with `apt-get download` and
# unpacked with `dpkg -x`, so nothing is registered with dpkg or the init system (no service,
# no user, no unit). redis-server (with the two libraries it needs that a bare Debian lacks)
# runs through a wrapper that points the loader at them; promtool is a static Go binary.
# Best effort: without apt (another distribution) the tests fall back to binaries on PATH, or
# skip saying why. Rerunning is a no-op once the tools are there.
set -u
TOOLS=${1:-.tools}
BIN="$TOOLS/bin"
ROOT="$TOOLS/root"
mkdir -p "$BIN" "$ROOT"
BIN=$(cd "$BIN" && pwd)
ROOT=$(cd "$ROOT" && pwd)

if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg >/dev/null 2>&1; then
    echo "fetch_tools: no apt-get/dpkg: redis-server and promtool are taken from PATH if there"
    exit 0
fi
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"

# apt-get download needs the package lists; refresh them once if a download fails
download() {
    apt-get download "$@" >/dev/null 2>&1 && return 0
    $SUDO apt-get update -qq >/dev/null 2>&1 || true
    apt-get download "$@" >/dev/null 2>&1
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work" || exit 1

if ! "$BIN/redis-server" --version >/dev/null 2>&1; then
    if download redis-server redis-tools liblzf1 libjemalloc2; then
        for deb in ./*.deb; do dpkg -x "$deb" "$ROOT"; done
        rm -f ./*.deb
        libdir=$(ls -d "$ROOT"/usr/lib/*-linux-gnu 2>/dev/null | head -n 1)
        cat > "$BIN/redis-server" <<WRAPPER
#!/bin/sh
# redis-server unpacked from Debian's package (scripts/fetch_tools.sh), not installed
LD_LIBRARY_PATH="$libdir\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$ROOT/usr/bin/redis-server" "\$@"
WRAPPER
        chmod +x "$BIN/redis-server"
        "$BIN/redis-server" --version || echo "fetch_tools: the unpacked redis-server does not run"
    else
        echo "fetch_tools: cannot download redis-server: the Redis tests will skip"
    fi
fi

if ! "$BIN/promtool" --version >/dev/null 2>&1; then
    if download prometheus; then
        dpkg -x ./prometheus_*.deb "$work/prometheus"
        cp "$work/prometheus/usr/bin/promtool" "$BIN/promtool"
        "$BIN/promtool" --version 2>&1 | head -n 1
    else
        echo "fetch_tools: cannot download promtool: monitoring files get the parser checks only"
    fi
fi
exit 0
