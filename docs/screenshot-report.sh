#!/usr/bin/env bash
# Screenshot a kdcache report page with headless Chromium, to look at what a user sees.
#   bash docs/screenshot-report.sh demo-out/run/report/report.html report.png
# Needs Chromium (Debian: apt-get install chromium). The page is self-contained (plots are inlined), so the file
# opens without a server.
set -euo pipefail
usage="usage: screenshot-report.sh REPORT.html OUT.png"
[ -f "${1:?$usage}" ] || { echo "screenshot-report.sh: no report page at $1 (run \`kdcache report RUN\` first)" >&2; exit 2; }
page="$(realpath "$1")"
out="${2:?$usage}"
browser="$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)"
if [ -z "$browser" ]; then
    echo "screenshot-report.sh: no Chromium found (looked for chromium, chromium-browser, google-chrome);" \
         "install one (Debian: apt-get install chromium), or open $page in any browser" >&2
    exit 2
fi
if ! "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,2400 \
        --screenshot="$out" "file://$page" >/dev/null 2>&1 || [ ! -s "$out" ]; then
    echo "screenshot-report.sh: $browser did not write $out; run it by hand to see why:" >&2
    echo "  $browser --headless --no-sandbox --screenshot=$out file://$page" >&2
    exit 1
fi
echo "$out"
