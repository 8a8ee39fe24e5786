#!/usr/bin/env bash
# Screenshot a kdcache report page with headless Chromium, to look at what a user sees.
#   bash docs/screenshot-report.sh demo-out/run/report/report.html report.png
# Needs Chromium (Debian: apt-get install chromium). The page is self-contained (plots are inlined), so the file
# opens without a server.
set -euo pipefail
page="$(realpath "${1:?usage: screenshot-report.sh REPORT.html OUT.png}")"
out="${2:?usage: screenshot-report.sh REPORT.html OUT.png}"
browser="$(command -v chromium || command -v chromium-browser || command -v google-chrome)"
"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,2400 \
    --screenshot="$out" "file://$page" >/dev/null 2>&1
echo "$out"
