#!/usr/bin/env bash
# English prose that Debian ships (main, DFSG-free), for the punctuation tagger's data
# recipe (training/punctuation.py --prose DIR; docs/formatting.md, "The tagger").
# Downloads each pinned package's .deb with apt-get download (no install, no root) and
# unpacks it with dpkg -x into DIR/PACKAGE; a package already unpacked is kept.
#   bash scripts/fetch_prose.sh [DIR]      (default data/prose)
set -euo pipefail
dir=${1:-data/prose}
# Everyday prose first (quotes, WordNet's example sentences, an FAQ written as argument);
# the recipe caps the Debian handbooks so that technical prose cannot drown the rest.
# (fortunes-mario is Portuguese; fortunes-debian-hints and jargon are commands and markup;
# wesnoth-1.16-data holds only the tutorial, 146 MB of it images.)
packages=(
  wordnet-base            # /usr/share/wordnet/data.*: example sentences
  fortune-anarchism       # /usr/share/games/fortunes/anarchism: quotes
  anarchism               # /usr/share/doc/anarchism/html: the Anarchist FAQ (HTML)
  debian-faq              # /usr/share/doc/debian/FAQ: HTML
  debian-handbook         # /usr/share/doc/debian-handbook/html/en-US: HTML
  debian-reference-en     # /usr/share/debian-reference: HTML
  # /usr/share/games/wesnoth/1.16/data/campaigns: what the characters of Wesnoth's
  # campaigns say (GPL-2+), 6,400 paragraphs of dialogue, questions and all; 5-20 MB each
  wesnoth-1.16-did wesnoth-1.16-dm wesnoth-1.16-dw wesnoth-1.16-ei wesnoth-1.16-httt
  wesnoth-1.16-l wesnoth-1.16-low wesnoth-1.16-nr wesnoth-1.16-sof wesnoth-1.16-sota
  wesnoth-1.16-sotbe wesnoth-1.16-thot wesnoth-1.16-trow wesnoth-1.16-tsg wesnoth-1.16-ttb
  wesnoth-1.16-utbs
  # What characters say in three more games, read after the above (so that their held-out
  # paragraphs stay the same): Endless Sky's mission conversations (GPL-3+, 70 MB, 160,000
  # words), Dungeon Crawl's descriptions and literary quotes (GPL-2+, 2 MB), Cataclysm: Dark
  # Days Ahead's dialogue, notes and descriptions (CC-BY-SA 3.0, 30 MB)
  endless-sky-data crawl-common cataclysm-dda-data
)
mkdir -p "$dir/.debs"
dir=$(cd "$dir" && pwd)
for p in "${packages[@]}"; do
  if [ -f "$dir/$p/.unpacked" ]; then
    echo "$p: already in $dir/$p"
    continue
  fi
  (cd "$dir/.debs" && ls "${p}"_*.deb >/dev/null 2>&1 || apt-get download -q "$p" 2>&1 >/dev/null |
    grep -v "unsandboxed as root" >&2 || true)
  deb=$(ls "$dir/.debs/${p}"_*.deb 2>/dev/null | head -1 || true)
  if [ -z "$deb" ]; then
    echo "$p: not in this machine's package lists: skipped" >&2
    continue
  fi
  rm -rf "${dir:?}/$p"
  dpkg -x "$deb" "$dir/$p"
  touch "$dir/$p/.unpacked"
  echo "$p: $(basename "$deb") -> $dir/$p ($(du -sh "$dir/$p" | cut -f1))"
done
