#!/usr/bin/env bash
# Builds the documentation site (mkdocs.yml, pages in docs/) into build/site/, in strict
# mode: a warning (a broken link or anchor, a README section a page includes that is
# gone, a page missing from the nav, an API reference that no longer resolves, a
# docstring whose parameters do not match the signature) fails the build.
#
#   scripts/docs.sh            build (exit status: mkdocs's)
#   scripts/docs.sh serve      build and serve on http://127.0.0.1:8000 while editing
#   scripts/docs.sh deps       only install what the site needs (scripts/test.sh does: the
#                              tests of the site's build hooks and of the release import it)
#
# Sets up the project venv with scripts/bootstrap.sh, then installs requirements/docs.txt
# into it (pinned, resolved with requirements/constraints.txt) when that file changed.
# Works from any directory.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/bootstrap.sh

VPY="$ROOT/.venv/bin/python"
STAMP="$ROOT/.venv/.docs-stamp"
want="$(cat requirements/constraints.txt requirements/docs.txt | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
    t0=$SECONDS
    log="$(mktemp)"
    if ! "$VPY" -m pip install --disable-pip-version-check --no-input --progress-bar off \
        -c requirements/constraints.txt -r requirements/docs.txt >"$log" 2>&1; then
        tail -n 40 "$log" >&2
        rm -f "$log"
        echo "docs.sh: installing requirements/docs.txt failed" >&2
        exit 1
    fi
    rm -f "$log"
    "$VPY" -m pip check >&2
    echo "$want" >"$STAMP"
    printf 'docs.sh: installed requirements/docs.txt (%ds)\n' $((SECONDS - t0)) >&2
fi

if [ "${1:-}" = deps ]; then
    exit 0
fi

export NO_MKDOCS_2_WARNING=1 # the theme's notice about its successor, printed on every build
if [ "${1:-}" = serve ]; then
    exec "$VPY" -m mkdocs serve --strict --dev-addr 127.0.0.1:8000
fi
t0=$SECONDS
"$VPY" -m mkdocs build --strict
printf 'docs.sh: site built in build/site/ (%ds)\n' $((SECONDS - t0)) >&2
