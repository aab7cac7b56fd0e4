#!/usr/bin/env bash
# Sets up everything the project and its tests need on a Debian 12 machine:
#   apt   system packages (sshd + sshfs, FUSE, libfiu + gcc to build the campaigns' extra fiu
#         preload, s3fs-fuse, mkfs tools) - as root only
#   venv  .venv at the repository root, made with `python3 -m venv` (or $PYTHON)
#   pip   pinned dev/test dependencies + editable install of the project
#   fiu   Debian's libfiu Python modules linked into the venv
#   sys   /run/sshd for sshd, /dev/fuse for FUSE mounts
#
# This is the one place that knows how to set up; other scripts call it.
# Idempotent: when everything is in place it only checks (well under a second).
#
# Environment:
#   PYTHON=python3       interpreter that creates the venv
#   BOOTSTRAP_VERBOSE=1  stream apt/pip output instead of showing it only on failure
#   BOOTSTRAP_FORCE=1    reinstall the Python packages even if the stamp is up to date
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-python3}"
VENV="$ROOT/.venv"
VPY="$VENV/bin/python"
STAMP="$VENV/.bootstrap-stamp"
CONSTRAINTS="requirements/constraints.txt"
DEV_REQS="requirements/dev.txt"

APT_PACKAGES=(
    openssh-server openssh-client sshfs fuse3
    fiu-utils libfiu0 python3-fiu
    gcc libc6-dev
    s3fs iproute2 e2fsprogs xfsprogs psmisc procps
    strace
)

# ---------------------------------------------------------------- helpers

is_root() { [ "$(id -u)" -eq 0 ]; }

now_us() { local t="$EPOCHREALTIME"; echo "${t//[.,]/}"; }

fmt_secs() { # microseconds -> "12.3s"
    local us=$1
    printf '%d.%01ds' $((us / 1000000)) $(((us % 1000000) / 100000))
}

CURRENT_STEP=""
NOTE=""
T_START="$(now_us)"

on_exit() {
    local rc=$?
    if [ "$rc" -ne 0 ]; then
        printf 'bootstrap: FAILED in step "%s" (exit %d)\n' "${CURRENT_STEP:-?}" "$rc" >&2
    fi
}
trap on_exit EXIT

step() { # step NAME FUNCTION: run it, then print one line with its duration
    CURRENT_STEP=$1
    NOTE=""
    local t0
    t0="$(now_us)"
    "$2"
    printf 'bootstrap: %-5s %7s  %s\n' "$1" "$(fmt_secs $(($(now_us) - t0)))" "$NOTE" >&2
    CURRENT_STEP=""
}

warn() { printf 'bootstrap: warning: %s\n' "$*" >&2; }

quiet() { # run a command; show its output only when it fails (or BOOTSTRAP_VERBOSE=1)
    if [ "${BOOTSTRAP_VERBOSE:-0}" = 1 ]; then
        "$@"
        return
    fi
    local log rc=0
    log="$(mktemp)"
    "$@" >"$log" 2>&1 </dev/null || rc=$?
    if [ "$rc" -ne 0 ]; then
        printf 'bootstrap: command failed (exit %d): %s\n' "$rc" "$*" >&2
        tail -n 60 "$log" >&2
    fi
    rm -f "$log"
    return "$rc"
}

apt_installed() {
    [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" = "install ok installed" ]
}

# ------------------------------------------------------------------ steps

step_apt() {
    if ! command -v dpkg-query >/dev/null 2>&1; then
        NOTE="no dpkg here; skipped (needs: ${APT_PACKAGES[*]})"
        return
    fi
    local wanted=("${APT_PACKAGES[@]}") missing=() p
    # Debian's own python3 can only make venvs with python3-venv (ensurepip).
    if [ ! -x "$VPY" ] && ! "$PYTHON" -c 'import ensurepip' >/dev/null 2>&1; then
        wanted+=(python3-venv)
    fi
    for p in "${wanted[@]}"; do
        apt_installed "$p" || missing+=("$p")
    done
    if [ "${#missing[@]}" -eq 0 ]; then
        NOTE="all ${#wanted[@]} packages present"
        return
    fi
    if ! is_root; then
        NOTE="not root: NOT installing missing packages: ${missing[*]}"
        warn "missing apt packages (install as root): ${missing[*]}"
        return
    fi
    export DEBIAN_FRONTEND=noninteractive
    quiet apt-get update
    quiet apt-get install -y --no-install-recommends "${missing[@]}"
    NOTE="installed: ${missing[*]}"
}

step_venv() {
    if [ -x "$VPY" ] && "$VPY" -c '' >/dev/null 2>&1; then
        NOTE="$VENV present ($("$VPY" -c 'import platform; print(platform.python_version())'))"
        return
    fi
    if [ -e "$VENV" ]; then
        warn "$VENV is broken (its python does not run); recreating it"
        rm -rf "$VENV"
    fi
    quiet "$PYTHON" -m venv "$VENV"
    NOTE="created $VENV with $("$VPY" -c 'import platform; print(platform.python_version())')"
}

stamp_value() {
    {
        "$VPY" -c 'import sys; print(sys.version)'
        echo "constraints:"
        cat "$CONSTRAINTS"
        echo "dev:"
        cat "$DEV_REQS"
        echo "pyproject:"
        pyproject_install_part
    } | sha256sum | cut -d' ' -f1
}

# The parts of pyproject.toml that change what gets installed (not tool settings such
# as ruff's or pytest's, so editing those does not trigger a reinstall).
pyproject_install_part() {
    if [ ! -f pyproject.toml ]; then
        echo "(none)"
        return
    fi
    "$VPY" - <<'EOF' 2>/dev/null || cat pyproject.toml
import json
import tomllib

with open("pyproject.toml", "rb") as f:
    d = tomllib.load(f)
part = {k: d.get(k) for k in ("build-system", "project")}
part["tool.setuptools"] = d.get("tool", {}).get("setuptools")
print(json.dumps(part, sort_keys=True))
EOF
}

# Exit 0 when the project (if it has a pyproject.toml) is installed in the venv.
project_installed() {
    [ -f pyproject.toml ] || return 0
    "$VPY" - <<'EOF' >/dev/null 2>&1
import importlib.metadata, sys
try:
    import tomllib
except ImportError:  # Python < 3.11: trust the stamp
    sys.exit(0)
with open("pyproject.toml", "rb") as f:
    name = tomllib.load(f)["project"]["name"]
importlib.metadata.distribution(name)
EOF
}

step_pip() {
    local want
    want="$(stamp_value)"
    if [ "${BOOTSTRAP_FORCE:-0}" != 1 ] && [ -f "$STAMP" ] \
        && [ "$(cat "$STAMP")" = "$want" ] && project_installed; then
        NOTE="up to date"
        return
    fi
    rm -f "$STAMP"
    local args=(-c "$CONSTRAINTS" -r "$DEV_REQS")
    if [ -f pyproject.toml ]; then
        args+=(-e .)
        NOTE="installed $DEV_REQS + project (editable)"
    else
        NOTE="installed $DEV_REQS (no pyproject.toml yet: project not installed)"
    fi
    quiet "$VPY" -m pip install --disable-pip-version-check --no-input --progress-bar off \
        "${args[@]}"
    quiet "$VPY" -m pip check
    echo "$want" >"$STAMP"
}

step_fiu() {
    if ! command -v dpkg-query >/dev/null 2>&1 || ! apt_installed python3-fiu; then
        NOTE="python3-fiu not installed; skipped (fault-injection tests need it)"
        return
    fi
    local site ext files=() f linked=0 have_ll=0
    site="$("$VPY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
    ext="$("$VPY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
    while IFS= read -r f; do
        case "$(basename "$f")" in
            fiu.py | fiu_ctrl.py) files+=("$f") ;;
            fiu_ll*.so)
                if [ "$(basename "$f")" = "fiu_ll$ext" ]; then
                    files+=("$f")
                    have_ll=1
                fi
                ;;
        esac
    done < <(dpkg-query -L python3-fiu)
    if [ "$have_ll" -ne 1 ]; then
        NOTE="python3-fiu has no fiu_ll$ext for the venv's Python; not linked"
        warn "$NOTE"
        return
    fi
    for f in "${files[@]}"; do
        if [ "$(readlink "$site/$(basename "$f")" 2>/dev/null)" != "$f" ]; then
            ln -sfn "$f" "$site/$(basename "$f")"
            linked=$((linked + 1))
        fi
    done
    "$VPY" -c 'import fiu, fiu_ctrl' || {
        warn "linked Debian's fiu modules, but the venv cannot import them"
        return 1
    }
    if [ "$linked" -gt 0 ]; then
        NOTE="linked ${#files[@]} fiu modules into the venv; import fiu_ctrl ok"
    else
        NOTE="fiu modules already linked; import fiu_ctrl ok"
    fi
}

step_sys() {
    local notes=()
    if [ -d /run/sshd ]; then
        notes+=("/run/sshd ok")
    elif is_root && mkdir -p /run/sshd; then
        notes+=("/run/sshd created")
    else
        notes+=("/run/sshd missing (needs root)")
    fi
    if [ ! -e /dev/fuse ]; then
        modprobe fuse >/dev/null 2>&1 || true
    fi
    if [ ! -e /dev/fuse ] && is_root; then
        mknod -m 666 /dev/fuse c 10 229 >/dev/null 2>&1 || true
    fi
    if [ -e /dev/fuse ]; then
        notes+=("/dev/fuse ok")
    else
        notes+=("/dev/fuse missing: FUSE (sshfs, s3fs) tests cannot run")
        warn "/dev/fuse missing: FUSE (sshfs, s3fs) tests cannot run"
    fi
    NOTE="${notes[*]}"
}

# ------------------------------------------------------------------- main

# Concurrent runs (two shells running the tests) wait for each other.
if command -v flock >/dev/null 2>&1; then
    exec 9<"${BASH_SOURCE[0]}"
    flock 9
fi

step apt step_apt
step venv step_venv
step pip step_pip
step fiu step_fiu
step sys step_sys
printf 'bootstrap: done  %7s\n' "$(fmt_secs $(($(now_us) - T_START)))" >&2
