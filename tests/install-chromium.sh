#!/usr/bin/env bash
# Chromium for the browser tests (tests/integration/browser.py drives it with Playwright): Debian's
# package, so no browser is downloaded from anywhere but the package registry. Part of the README's
# test command. Without root or apt-get it installs nothing and says so; the browser tests then skip
# (and fail under CI, which must run them).
set -uo pipefail
for name in chromium chromium-browser google-chrome; do
  command -v "$name" >/dev/null 2>&1 && exit 0
done
[ -n "${RLHF_CHROMIUM:-}" ] && exit 0
# Under CI (CI set) a browser that cannot be had is an error: the browser tests must run there.
give_up() {
  if [ -n "${CI:-}" ]; then echo "tests/install-chromium.sh: $1 (CI: the browser tests must run)" >&2; exit 1; fi
  echo "tests/install-chromium.sh: $1; the browser tests will skip (install Chromium, or set RLHF_CHROMIUM)" >&2
  exit 0
}
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  give_up "no Chromium here and no root apt-get to install Debian's chromium"
fi
echo "tests/install-chromium.sh: installing Debian's chromium for the browser tests" >&2
if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
    >/tmp/rlhf-install-chromium.log 2>&1; then
  tail -n 20 /tmp/rlhf-install-chromium.log >&2
  give_up "installing chromium failed (log above)"
fi
exit 0
