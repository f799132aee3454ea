# Sourced by scripts/vllm_venv.sh and scripts/sglang_venv.sh: where a side venv is built, so that a fresh
# clone on the same machine reuses it instead of building it again (the builds take 1.5-2 min of unpacking
# and byte-compiling on 2 cores; pip's own cache saves nothing here, it is the install that costs).
#
#   venv_build_dir VENV NAME SCRIPT SETTINGS...   prints the directory to build in or reuse
#
# With the cache on (the default), that is ${ARL_VENV_CACHE:-~/.cache/arl/venvs}/NAME-KEY, KEY a hash of the
# building SCRIPT and SETTINGS (python, package pins): editing the script or a pin builds a new venv, never
# reuses a stale one. The caller builds there, then `venv_link` points VENV (e.g. .vllm-venv) at it.
# ARL_VENV_CACHE=0, or a VENV that is already a real directory, builds in VENV itself as before.
# Builds of one key are serialised with flock, so two checkouts testing at once share one build.

venv_build_dir() {
    local venv=$1 name=$2 script=$3; shift 3
    if [ "${ARL_VENV_CACHE:-}" = 0 ] || { [ -d "$venv" ] && [ ! -L "$venv" ]; }; then
        echo "$venv"
        return
    fi
    local root="${ARL_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/arl/venvs}" key
    key="$({ cat "$script"; printf '%s\n' "$@"; } | sha256sum | cut -c1-16)"
    mkdir -p "$root"
    echo "$root/$name-$key"
}

venv_link() {  # venv_link VENV DIR: VENV becomes a link to DIR (nothing to do when they are the same)
    local venv=$1 dir=$2
    [ "$venv" = "$dir" ] && return
    rm -f "$venv"
    ln -s "$dir" "$venv"
}
