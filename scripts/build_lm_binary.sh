#!/usr/bin/env bash
# Convert a word LM in ARPA format to KenLM's binary format, which the beam search loads
# in a fraction of the ARPA's time; a model directory's lm.bin is used before its lm.arpa
# (numbers: docs/models-and-import.md, "The language model").
#
#   scripts/build_lm_binary.sh ARPA [OUT] [probing|trie]
#   scripts/build_lm_binary.sh model/default/lm.arpa          # writes model/default/lm.bin
#
# OUT defaults to lm.bin beside ARPA; the structure to probing (hash tables: the quickest
# to load and query; trie is about a third smaller and a little slower to load, measured
# with bench/lm_load.py). KenLM's build_binary is built once, without Boost, from the
# sources of the `kenlm` package (its sdist, fetched with pip), with g++, into
# $ECHOIC_CACHE (default ~/.cache/echoic)/kenlm-build/bin/build_binary.
set -euo pipefail

[ $# -ge 1 ] && [ $# -le 3 ] || { sed -n '6,7p' "$0" | sed 's/^# *//' >&2; exit 2; }
arpa=$1
out=${2:-$(dirname "$arpa")/lm.bin}
structure=${3:-probing}
[ -f "$arpa" ] || { echo "$arpa: no such ARPA file" >&2; exit 1; }
case $structure in probing|trie) ;; *) echo "structure: probing or trie, not $structure" >&2; exit 2;; esac
command -v g++ >/dev/null || { echo "g++ is needed to build KenLM's build_binary (apt-get install g++)" >&2; exit 1; }

KENLM_VERSION=0.3.0  # the sdist whose build_binary wrote model/default/lm.bin
cache=${ECHOIC_CACHE:-$HOME/.cache/echoic}/kenlm-build
tool=$cache/bin/build_binary
if [ ! -x "$tool" ]; then
  python=${PYTHON:-python3}
  [ -x .venv/bin/python ] && python=${PYTHON:-.venv/bin/python}
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  # --no-build-isolation: pip only reads the sdist's metadata; nothing of it is installed.
  "$python" -m pip download -q --no-deps --no-binary :all: --no-build-isolation \
    "kenlm==$KENLM_VERSION" -d "$tmp"
  tar xzf "$tmp"/kenlm-$KENLM_VERSION.tar.gz -C "$tmp"
  src=$tmp/kenlm-$KENLM_VERSION
  # As the sdist's compile_query_only.sh does: every .cc of util/double-conversion, util
  # and lm but the tests and other programs' mains; no Boost, no compressed input.
  flags="-I$src -O2 -DNDEBUG -DKENLM_MAX_ORDER=6 -w"
  objects=()
  for cc in "$src"/util/double-conversion/*.cc "$src"/util/*.cc "$src"/lm/*.cc; do
    case $cc in *test.cc|*main.cc) continue;; esac
    objects+=("${cc%.cc}.o")
  done
  printf '%s\n' "${objects[@]}" | xargs -P "$(nproc)" -I{} sh -c \
    'o={}; g++ '"$flags"' -c "${o%.o}.cc" -o "$o"'
  mkdir -p "$cache/bin"
  g++ $flags "$src"/lm/build_binary_main.cc "${objects[@]}" -o "$tool.tmp" -lrt
  mv "$tool.tmp" "$tool"
fi
"$tool" "$structure" "$arpa" "$out.tmp" >&2
mv "$out.tmp" "$out"
echo "$out: $structure, $(du -k "$out" | cut -f1) KB (from $arpa, $(du -k "$arpa" | cut -f1) KB)"
