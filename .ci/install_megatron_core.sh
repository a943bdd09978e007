#!/usr/bin/env bash
# Usage: bash .ci/install_megatron_core.sh VERSION
#
# Replaces the megatron-core installed in the active Python environment by release VERSION, and installs triton
# (megatron-core 0.18+ imports it unguarded in moe/paged_stash.py; CPU torch builds do not bring it).
#
# On Python >= 3.12 this is a plain `pip install megatron-core==VERSION`, what users do.
# On older Pythons (this project's CI: 3.11) pip refuses megatron-core 0.17+ (Requires-Python >= 3.12, cp312 wheels
# only, for a compiled dataset helper; the Python sources run on 3.11, and recipes/pretrain_gpt.py compiles the
# helper from the shipped helpers.cpp where the cp312 build does not load). There the
# script downloads the cp312 wheel and overlays its Python tree: the installed megatron/ package and
# megatron_core-*.dist-info are deleted first (so no file of the old release survives), then the wheel's
# megatron/ and dist-info are copied in. See docs/compat.md.
set -euo pipefail

if [[ $# -ne 1 || -z "$1" ]]; then
    echo "usage: $0 VERSION   (e.g. $0 0.19.2)" >&2
    exit 2
fi
VERSION=$1
PY=python
die() { echo "$0: $*" >&2; exit 1; }

"$PY" -m pip --version >/dev/null || die "no pip in the active Python ($(command -v "$PY"))"

if "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)'; then
    "$PY" -m pip install "megatron-core==$VERSION" "triton>=3.0"
else
    TMPD=$(mktemp -d)
    trap 'rm -rf "$TMPD"' EXIT
    "$PY" -m pip download --no-deps --python-version 3.12 --only-binary=:all: "megatron-core==$VERSION" -d "$TMPD/dl"
    shopt -s nullglob
    wheels=("$TMPD"/dl/megatron_core-"$VERSION"-*.whl)
    [[ ${#wheels[@]} -eq 1 ]] || die "expected one megatron_core-$VERSION wheel in $TMPD/dl, found: ${wheels[*]:-none}"
    "$PY" -m zipfile -e "${wheels[0]}" "$TMPD/whl"
    [[ -d "$TMPD/whl/megatron/core" ]] || die "the wheel has no megatron/core tree"
    dist_infos=("$TMPD"/whl/megatron_core-*.dist-info)
    [[ ${#dist_infos[@]} -eq 1 ]] || die "expected one megatron_core-*.dist-info in the wheel, found: ${dist_infos[*]:-none}"

    SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    [[ -d "$SITE" ]] || die "site-packages $SITE does not exist"
    # The installed megatron must be the one in this environment's site-packages (not a user site or a checkout).
    INSTALLED=$("$PY" - <<'EOF'
import importlib.util, os
spec = importlib.util.find_spec("megatron")
locs = list(spec.submodule_search_locations or []) if spec else []
print(" ".join(os.path.realpath(p) for p in locs))
EOF
    )
    for loc in $INSTALLED; do
        [[ "$loc" == "$(realpath "$SITE")/megatron" ]] || die "megatron is also found at $loc, outside $SITE: refusing to overlay"
    done

    rm -rf "$SITE/megatron"
    for d in "$SITE"/megatron_core-*.dist-info; do rm -rf "$d"; done
    cp -a "$TMPD/whl/megatron" "$SITE/megatron"
    cp -a "${dist_infos[0]}" "$SITE/"
    echo pip >"$SITE/$(basename "${dist_infos[0]}")/INSTALLER"
    find "$SITE/megatron" -name __pycache__ -prune -exec rm -rf {} +
    "$PY" -m pip install "triton>=3.0"
fi

# Check from a neutral directory, so a megatron/ in the current directory cannot shadow the installed one.
(cd / && "$PY" -W ignore - "$VERSION" <<'EOF'
import importlib.metadata, sys
import megatron.core
want = sys.argv[1]
got = (megatron.core.__version__, importlib.metadata.version("megatron-core"))
if got != (want, want):
    sys.exit(f"install_megatron_core.sh: wanted megatron-core {want}, got megatron.core.__version__={got[0]}, "
             f"metadata {got[1]}")
print(f"megatron-core {want} installed ({megatron.core.__file__})")
EOF
)
