#!/usr/bin/env bash
# The browser the page tests (tests/test_view.py) drive: Debian's chromium, which Playwright
# starts by its path (no browser is downloaded). Installed with apt-get where this runs as root
# (or with password-less sudo); elsewhere it says so in one line and the page tests are skipped.
set -uo pipefail
for name in chromium chromium-browser; do
    if command -v "$name" >/dev/null 2>&1; then
        echo "browser: $(command -v "$name") already installed"
        exit 0
    fi
done
if [ "$(id -u)" = 0 ]; then
    run=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    run=(sudo -n)
else
    echo "browser: chromium is not installed and apt-get needs root: the page tests will be skipped"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "browser: no apt-get here to install chromium: the page tests will be skipped"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if "${run[@]}" apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 \
    || { "${run[@]}" apt-get update -q >/dev/null 2>&1 && "${run[@]}" apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1; }; then
    echo "browser: installed $(command -v chromium)"
else
    echo "browser: apt-get could not install chromium: the page tests will be skipped"
fi
exit 0
