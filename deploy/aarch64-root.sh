#!/usr/bin/env bash
# An aarch64 (arm64) Debian root that runs the real device agent under qemu-user, so that
# the farm is tested end to end for an ARM device class without a board (`make aarch64-root`).
#
# Idempotent; each step is skipped when already done:
#   1. packages: the aarch64 cross compiler (build workers link aarch64 kernels and
#      models with it), qemu-user-static, mmdebstrap and arch-test (apt-get, as root);
#   2. binfmt_misc mounted and qemu-aarch64 registered with the F flag (the interpreter
#      is opened at registration, so aarch64 programs run in any root or directory);
#   3. the root: mmdebstrap --arch=arm64 of this machine's Debian suite from this machine's
#      apt sources, with python3 and libstdc++6 (stamp: <root>/.tunefarm-root);
#   4. the agent's Python packages: exactly the pins of pyproject.toml's `agent` extra,
#      downloaded on this host as aarch64 wheels (pip download --platform, cached next to
#      the root) and installed into the root's /usr/local (no pip runs under emulation;
#      stamp: <root>/.tunefarm-wheels, redone when the pins change);
#   5. a check: the root's python imports them as an aarch64 process.
#
# The agent's own code is not installed: it runs from the repository checkout
# (PYTHONPATH), so the root never goes stale. Run a program of the root with
#   QEMU_LD_PREFIX=<root> <root>/usr/bin/python3 ...
# (qemu looks files up in the root first: the root's libraries and Python, this
# machine's /proc, /sys and every other path; children it spawns run emulated too).
#
# Settings (environment): TUNEFARM_AARCH64_ROOT (default /var/cache/tunefarm/aarch64-root),
# TUNEFARM_AARCH64_WHEELS (default: wheels-aarch64 beside the root), TUNEFARM_AARCH64_MIRRORS
# (apt sources for mmdebstrap, space separated; default: this machine's files in /etc/apt),
# PYTHON (a Python 3.11 with pip: the repository's .venv), PYPROJECT (default ./pyproject.toml).
set -euo pipefail

ROOT=${TUNEFARM_AARCH64_ROOT:-/var/cache/tunefarm/aarch64-root}
WHEELS=${TUNEFARM_AARCH64_WHEELS:-$(dirname "$ROOT")/wheels-aarch64}
PYTHON=${PYTHON:-.venv/bin/python}
PYPROJECT=${PYPROJECT:-pyproject.toml}
ROOT_PACKAGES=python3,libstdc++6

say() { echo "aarch64-root: $*"; }
die() { echo "aarch64-root: error: $*" >&2; exit 2; }

# -- 1. packages ----------------------------------------------------------------------------
missing=()
command -v aarch64-linux-gnu-g++ >/dev/null || missing+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64-static >/dev/null || missing+=(qemu-user-static)
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
command -v arch-test >/dev/null || missing+=(arch-test)
if ((${#missing[@]})); then
    [ "$(id -u)" = 0 ] || die "missing packages ${missing[*]}; run as root or apt-get install them"
    say "installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; }
fi

# -- 2. binfmt_misc -------------------------------------------------------------------------
BINFMT=/proc/sys/fs/binfmt_misc
if [ ! -e "$BINFMT/register" ]; then
    [ "$(id -u)" = 0 ] || die "binfmt_misc is not mounted; run as root"
    mount -t binfmt_misc binfmt_misc "$BINFMT"
fi
if [ ! -e "$BINFMT/qemu-aarch64" ]; then
    [ "$(id -u)" = 0 ] || die "qemu-aarch64 is not registered with binfmt_misc; run as root"
    conf=/usr/lib/binfmt.d/qemu-aarch64.conf
    [ -f "$conf" ] || die "$conf is missing (qemu-user-static installs it)"
    flags=$(awk -F: '{print $NF}' "$conf")
    case "$flags" in *F*) ;; *) die "$conf lacks the F flag (aarch64 programs would not run in a root)" ;; esac
    say "registering qemu-aarch64 with binfmt_misc"
    tr -d '\n' <"$conf" >"$BINFMT/register"
fi
grep -qx enabled "$BINFMT/qemu-aarch64" || die "binfmt_misc's qemu-aarch64 entry is disabled"

# -- 3. the root ----------------------------------------------------------------------------
. /etc/os-release
SUITE=${VERSION_CODENAME:?this machine is not Debian (no VERSION_CODENAME)}
ROOT_STAMP="$SUITE $ROOT_PACKAGES"
if [ "$(cat "$ROOT/.tunefarm-root" 2>/dev/null)" != "$ROOT_STAMP" ]; then
    [ "$(id -u)" = 0 ] || die "making the root needs root (mmdebstrap)"
    if [ -n "${TUNEFARM_AARCH64_MIRRORS:-}" ]; then
        read -r -a mirrors <<<"$TUNEFARM_AARCH64_MIRRORS"
    else
        mirrors=()
        for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
            [ -s "$f" ] && grep -qE '^[[:space:]]*(deb |Types:)' "$f" && mirrors+=("$f")
        done
        ((${#mirrors[@]})) || die "no apt sources in /etc/apt; set TUNEFARM_AARCH64_MIRRORS"
    fi
    say "building the $SUITE arm64 root in $ROOT (a few minutes)"
    mkdir -p "$(dirname "$ROOT")"
    rm -rf "$ROOT.tmp"
    mmdebstrap --quiet --arch=arm64 --variant=essential --include="$ROOT_PACKAGES" \
        "$SUITE" "$ROOT.tmp" "${mirrors[@]}"
    rm -rf "$ROOT"
    mv "$ROOT.tmp" "$ROOT"
    echo "$ROOT_STAMP" >"$ROOT/.tunefarm-root"
fi

# -- 4. the agent's Python packages -----------------------------------------------------------
[ -x "$PYTHON" ] || die "$PYTHON is not a Python (run make setup first, or set PYTHON)"
mapfile -t pins < <("$PYTHON" -c '
import sys, tomllib
for pin in tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["agent"]:
    print(pin)' "$PYPROJECT")
((${#pins[@]})) || die "no agent extra in $PYPROJECT"
pyver=$(basename "$(ls -d "$ROOT"/usr/lib/python3.[0-9]* | head -n 1)")  # python3.11
pyver=${pyver#python}
site="$ROOT/usr/local/lib/python$pyver/dist-packages"
WHEELS_STAMP="python$pyver ${pins[*]}"
if [ "$(cat "$ROOT/.tunefarm-wheels" 2>/dev/null)" != "$WHEELS_STAMP" ]; then
    platforms=()
    for p in manylinux2014_aarch64 manylinux_2_17_aarch64 manylinux_2_24_aarch64 manylinux_2_27_aarch64 manylinux_2_28_aarch64; do
        platforms+=(--platform "$p")
    done
    abi="cp${pyver/./}"
    wheel_args=(--only-binary=:all: --python-version "$pyver" --implementation cp --abi "$abi" --abi abi3 --abi none "${platforms[@]}")
    say "downloading aarch64 wheels for ${pins[*]}"
    mkdir -p "$WHEELS"
    "$PYTHON" -m pip download --quiet --disable-pip-version-check --dest "$WHEELS" "${wheel_args[@]}" "${pins[@]}"
    say "installing them into $site"
    rm -rf "$site"
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-index --find-links "$WHEELS" \
        --target "$site" "${wheel_args[@]}" "${pins[@]}"
    rm -f "$ROOT/.tunefarm-checked"
    echo "$WHEELS_STAMP" >"$ROOT/.tunefarm-wheels"
fi

# -- 5. check -------------------------------------------------------------------------------
if [ ! -e "$ROOT/.tunefarm-checked" ]; then
    say "checking the root (imports TVM under emulation)"
    QEMU_LD_PREFIX="$ROOT" "$ROOT/usr/bin/python3" -c '
import platform, grpc, numpy, google.protobuf, tvm
assert platform.machine() == "aarch64", platform.machine()
print("aarch64-root: python", platform.python_version(), "tvm", tvm.__version__, "numpy", numpy.__version__, "grpcio", grpc.__version__)'
    touch "$ROOT/.tunefarm-checked"
fi
QEMU_LD_PREFIX="$ROOT" "$ROOT/usr/bin/python3" -c 'import platform; assert platform.machine() == "aarch64"' \
    || die "the root's python does not run (binfmt_misc?)"
say "ready: $ROOT"
