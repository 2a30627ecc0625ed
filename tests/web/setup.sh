#!/usr/bin/env bash
# Installs what tests/web/test_browser.py needs: Debian's Chromium, the ComfyUI frontend package
# (into the project venv) and playwright-core (no browser download). Idempotent; run from anywhere.
# Exits non-zero when any of them cannot be installed.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
FRONTEND="comfyui-frontend-package==1.32.9"

# Debian packages still missing: Chromium, and node/npm for playwright-core.
APT=()
command -v chromium >/dev/null 2>&1 || APT+=(chromium)
command -v node >/dev/null 2>&1 || APT+=(nodejs)
command -v npm >/dev/null 2>&1 || APT+=(npm)
if [ "${#APT[@]}" -gt 0 ]; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
        --no-install-recommends "${APT[@]}" >/dev/null
fi
"$VENV/bin/python" -c "import comfyui_frontend_package" 2>/dev/null \
    || "$VENV/bin/pip" install -q "$FRONTEND"
if [ ! -d "$HERE/node_modules/playwright-core" ]; then
    (cd "$HERE" && npm install --silent --no-audit --no-fund)
fi
echo "web test prerequisites ready: $(command -v chromium), $("$VENV/bin/python" -c \
    'import comfyui_frontend_package, importlib.metadata as m; print("frontend", m.version("comfyui-frontend-package"))'), \
playwright-core $(node -p "require('$HERE/node_modules/playwright-core/package.json').version")"
