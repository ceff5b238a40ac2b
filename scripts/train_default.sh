#!/usr/bin/env bash
# Reproduce the bundled default model from nothing (see docs/models-and-import.md, "The default model"):
# synthetic corpus -> training -> LM -> export -> evaluation. Every step resumes or
# skips what is already done, so the script can be rerun after an interruption.
#   bash scripts/train_default.sh            # CPU: about 2 hours on 2 cores
# Extra arguments go to `echoic train` (e.g. device=cuda, or mpirun via ECHOIC_LAUNCH).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
E=.venv/bin/echoic
# The LM counts WordNet's sentences too (package wordnet-base).
[ -f /usr/share/wordnet/data.noun ] || { s=""; [ "$(id -u)" = 0 ] || s=sudo
  DEBIAN_FRONTEND=noninteractive $s apt-get install -y -qq wordnet-base >/dev/null; }
D=data/default
[ -f $D/text/train.txt ] || $E synth --make-text $D/text --seed 1
$E synth --text $D/text/train.txt --out $D/train --voices-per-sentence 2 --noise-prob 0.25 --seed 11
$E synth --text $D/text/heldout.txt --out $D/heldout --noise-prob 0.25 --seed 12
${ECHOIC_LAUNCH:-} $E train --config training/recipes/default.toml "$@"
$E lm $D/text/train.txt --wordnet --exclude $D/text/heldout.txt $D/lm.arpa --min-count 3
rm -rf runs/default-export
$E export runs/default/last.pt runs/default-export/1 --name echoic-en-default --version 1
cp $D/lm.arpa runs/default-export/1/lm.arpa
bash scripts/build_lm_binary.sh runs/default-export/1/lm.arpa  # lm.bin: what loads
rm -rf model/default && cp -r runs/default-export/1 model/default
$E eval --model model/default --manifest $D/heldout/manifest.jsonl
$E eval --model model/default --manifest $D/heldout/manifest.jsonl --decoder beam
