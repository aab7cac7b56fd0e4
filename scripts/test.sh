#!/usr/bin/env bash
# Runs the checks and the test suite: bootstrap, then ruff + mypy on src/, then pytest.
# Arguments go to pytest, e.g.  scripts/test.sh -m "not slow" tests/unit -x
# Works from any directory. SKIP_LINT=1 skips ruff and mypy. The whole suite also runs the
# Trainer tests under the oldest supported transformers (HF_OLDEST=0 skips that).
# Exit status: pytest's when it fails (5 = no tests collected), else 1 if a lint failed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/bootstrap.sh
# The site's build tools and the release checks (requirements/docs.txt): the tests of the
# site's hooks import them, and the packaging tests run twine.
bash scripts/docs.sh deps

VPY="$ROOT/.venv/bin/python"
lint_failed=()

run_lint() { # run_lint NAME CMD...: run one checker, remember a failure
    local name=$1 t0=$SECONDS
    shift
    if "$@"; then
        printf 'test.sh: %s ok (%ds)\n' "$name" $((SECONDS - t0)) >&2
    else
        printf 'test.sh: %s FAILED (%ds)\n' "$name" $((SECONDS - t0)) >&2
        lint_failed+=("$name")
    fi
}

if [ "${SKIP_LINT:-0}" = 1 ]; then
    echo "test.sh: lint skipped (SKIP_LINT=1)" >&2
elif [ -d src ]; then
    run_lint "ruff check" "$VPY" -m ruff check src
    run_lint "ruff format" "$VPY" -m ruff format --check src
    run_lint "mypy" "$VPY" -m mypy src
else
    echo "test.sh: no src/ yet; lint skipped" >&2
fi

rc=0
"$VPY" -m pytest -p no:cacheprovider "$@" || rc=$?

# The oldest transformers release the Trainer integration supports: its tests run again
# in a second venv (requirements/hf-oldest.txt), when the whole suite runs (no test
# paths among the arguments). HF_OLDEST=0 skips it, HF_OLDEST=1 forces it.
whole_suite=1
for a in "$@"; do
    case "$a" in -*) ;; *) whole_suite=0 ;; esac
done
if [ "${HF_OLDEST:-$whole_suite}" = 1 ]; then
    old="$ROOT/.venv-hf-oldest"
    t0=$SECONDS
    if ! cmp -s requirements/hf-oldest.txt "$old/.stamp" 2>/dev/null; then
        rm -rf "$old"
        "${PYTHON:-python3}" -m venv "$old"
        # torch is pinned in the same install as everything that depends on it.
        "$old/bin/pip" install -q --disable-pip-version-check -r requirements/hf-oldest.txt
        cp requirements/hf-oldest.txt "$old/.stamp"
    fi
    echo "test.sh: oldest supported transformers ($(grep '^transformers==' \
        requirements/hf-oldest.txt)), venv ready in $((SECONDS - t0))s" >&2
    PYTHONPATH="$ROOT/src:$ROOT" "$old/bin/python" -m pytest -p no:cacheprovider -q -rs \
        tests/integrations/test_hf_trainer.py tests/integrations/test_hf_preemption.py \
        tests/integrations/test_hf_adopt.py || { r=$?; [ "$rc" -ne 0 ] || rc=$r; }
fi

if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests (exit 5)" >&2
fi
if [ "$rc" -ne 0 ]; then
    [ "${#lint_failed[@]}" -eq 0 ] || echo "test.sh: also failed: ${lint_failed[*]}" >&2
    exit "$rc"
fi
if [ "${#lint_failed[@]}" -ne 0 ]; then
    echo "test.sh: tests passed, but failed: ${lint_failed[*]}" >&2
    exit 1
fi
