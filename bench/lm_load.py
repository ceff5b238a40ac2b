"""What a word LM's file format costs: loading it, and a beam search with it.

    python bench/lm_load.py [LM ...] [--repeats 5]

For each LM file (default: the bundled model's lm.arpa and lm.bin) this prints its size;
the median times to read its vocabulary (`lm.lm_words`), to load it in flashlight-text's
KenLM, and to load it whole as the beam search does (`decoding._KenLM`: both, and the
adapter's word and prefix tables, which take the same time whatever the format); the
median time of beam searches (default settings) over the bundled model's log-probs of 12
sentences synthesized with `echoic synth` (espeak-ng/flite), and whether their transcripts
equal the first LM's. Each load is a new one (not the copy decoders of one file share).
Build a binary file of an ARPA file with scripts/build_lm_binary.sh (probing or trie:
pass one of each to compare them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from echoic.model.core.audio import load_audio
from echoic.model.core.decoding import BeamSearchDecoder, _KenLM
from echoic.model.core.lm import LM_FILES, is_kenlm_binary, lm_words
from echoic.model.runtime.recognizer import Recognizer, default_model_dir

SENTENCES = """The quick brown fox jumps over the lazy dog.
She sells sea shells by the sea shore.
A stitch in time saves nine.
The early bird catches the worm.
Actions speak louder than words.
Every cloud has a silver lining.
Where there is smoke there is fire.
The best things in life are free.
Practice makes perfect in the end.
Time and tide wait for no man.
Better late than never, they said.
All that glitters is not gold.
"""


def _speech() -> list:
    """The 12 sentences, synthesized (one voice each), as 16 kHz samples."""
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "sentences.txt"
        text.write_text(SENTENCES)
        out = Path(tmp) / "corpus"
        subprocess.run(
            [sys.executable, "-m", "echoic.cli.main", "synth", "--text", str(text), "--out",
             str(out), "--jobs", str(os.cpu_count() or 1)],
            check=True, capture_output=True, timeout=600,
        )  # fmt: skip
        rows = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
        return [load_audio(out / r["audio_filepath"], 16000) for r in rows]


def _median_seconds(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("lms", nargs="*", type=Path, help="LM files (ARPA or KenLM binary)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    model = default_model_dir()
    lms = args.lms or [model / name for name in reversed(LM_FILES) if (model / name).is_file()]
    from flashlight.lib.text.decoder.kenlm import KenLM
    from flashlight.lib.text.dictionary import Dictionary

    from echoic.model.core.native import KENLM_CHATTER, quiet_stderr

    rec = Recognizer(intra_op_threads=1)
    log_probs = rec.log_probs(_speech())
    print(f"{'LM':<36} {'format':<6} {'MB':>5} {'vocab ms':>8} {'KenLM ms':>8} {'whole ms':>8}"
          f" {'beam ms':>8}  same text")  # fmt: skip
    first = None
    for lm in lms:
        vocab = _median_seconds(lambda lm=lm: lm_words(lm), args.repeats)
        words = Dictionary(lm_words(lm))
        with quiet_stderr(KENLM_CHATTER):
            native = _median_seconds(lambda lm=lm, w=words: KenLM(str(lm), w), args.repeats)
        whole = _median_seconds(lambda lm=lm: _KenLM(lm), args.repeats)
        beam = BeamSearchDecoder(rec.vocab, frame_seconds=rec.frame_seconds, lm_path=lm)
        texts = [beam.decode(lp).text for lp in log_probs]
        first = first or texts
        decode = _median_seconds(lambda b=beam: [b.decode(lp) for lp in log_probs], args.repeats)
        kind = "binary" if is_kenlm_binary(lm) else "ARPA"
        print(f"{str(lm):<36} {kind:<6} {lm.stat().st_size / 1e6:>5.1f} {vocab * 1e3:>8.0f}"
              f" {native * 1e3:>8.0f} {whole * 1e3:>8.0f} {decode * 1e3:>8.0f}"
              f"  {texts == first}")  # fmt: skip


if __name__ == "__main__":
    main()
