#!/usr/bin/env bash
# The bundled LM's size/WER trade (docs/models-and-import.md, "The default model"): LMs from the fortunes'
# training sentences alone and with WordNet's examples and definitions, pruned or not,
# scored with the bundled model's beam search on two held-out sets:
#   clean     the held-out fortune sentences (scripts/heldout_sets.sh), three engines
#   wordnet   100 WordNet sentences that no LM counts (off the fortunes' domain)
#   bash scripts/lm_sizes.sh [MODEL_DIR]      (needs apt-get install wordnet-base)
set -euo pipefail
cd "$(dirname "$0")/.."
E=.venv/bin/echoic
# The LM counts WordNet's sentences too (package wordnet-base).
[ -f /usr/share/wordnet/data.noun ] || { s=""; [ "$(id -u)" = 0 ] || s=sudo
  DEBIAN_FRONTEND=noninteractive $s apt-get install -y -qq wordnet-base >/dev/null; }
model=${1:-model/default}
T=data/default/text
L=data/lm-sizes
mkdir -p $L
[ -f data/heldout-sets/clean/manifest.jsonl ] || bash scripts/heldout_sets.sh "$model" 100 >/dev/null
# The off-domain sentences: every 250th WordNet sentence of 6-14 words, never counted.
.venv/bin/python - <<'PY' > $L/wordnet-heldout.txt
from echoic.training.corpus import wordnet_sentences
picked = [s for s in wordnet_sentences() if 6 <= len(s.split()) <= 14 and " " in s]
print("\n".join(picked[::250][:100]))
PY
$E synth --text $L/wordnet-heldout.txt --out $L/wordnet --engines espeak,flite,festival \
  --seed 31 >/dev/null
cat $T/heldout.txt $L/wordnet-heldout.txt > $L/never.txt
build() { $E lm "$@" --exclude $L/never.txt --json; }
build $T/train.txt $L/fortunes.arpa --min-count 2  # the bundled model's stage-1 LM
build $T/train.txt --wordnet $L/wordnet-min2.arpa --min-count 2
build $T/train.txt --wordnet $L/wordnet-min3.arpa --min-count 3
build $T/train.txt --wordnet $L/wordnet.arpa
for lm in fortunes wordnet-min3 wordnet-min2 wordnet; do
  echo "== $lm: $(du -k $L/$lm.arpa | cut -f1) KB"
  $E eval --model "$model" --decoder beam --lm $L/$lm.arpa \
    --manifest data/heldout-sets/clean/manifest.jsonl $L/wordnet/manifest.jsonl
done
