"""Peak memory of one whole long utterance on an imported model: bounded by a window, or not.

    python bench/long_audio_memory.py [MODEL_DIR ...] [--minutes 1 5 10] [--whole] [--cap-gb 8]

With no MODEL_DIR: a tiny random wav2vec2 (tests/tiny_hf.py, imported here; needs the
import extra) and the NeMo test fixtures (tests/fixtures/nemo/: a QuartzNet-style
character model and a Conformer BPE model), imported into a temporary directory.

The audio is the fixtures' real clip (espeak-ng's "the quick brown fox ...") repeated to
each length. One row per model and length, each measured in a fresh child process:
its resident memory after loading the model and the audio, the peak during one
`Recognizer.log_probs` call (Recognize's and `echoic transcribe`'s path), the growth
between the two, and the audio's own size beside it. --whole runs every utterance whole
(what the runtime did before long utterances ran in windows); a child is capped at
--cap-gb of address space, so a run that would take the machine's memory fails instead.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "nemo"


def child(model_dir: str, seconds: float, whole: bool, cap_gb: float) -> dict:
    resource.setrlimit(resource.RLIMIT_AS, (int(cap_gb * 2**30),) * 2)
    import numpy as np
    import soundfile as sf

    from echoic.model.runtime.recognizer import Recognizer

    clip, _ = sf.read(FIXTURES / "clip.flac", dtype="float32")
    recognizer = Recognizer(model_dir, intra_op_threads=1, whole_seconds=1e9 if whole else 30)
    audio = np.resize(clip, int(seconds * recognizer.sample_rate))
    recognizer.log_probs([clip])  # sessions warm, arenas made

    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20

    base = rss_mb()
    start = time.perf_counter()
    try:
        recognizer.log_probs([audio])
        error = ""
    except Exception as e:  # noqa: BLE001 - reported in the table: out of memory, say
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    # VmHWM, not ru_maxrss: the latter keeps the parent's peak across fork and exec.
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    return {"base": base, "peak": peak, "seconds": time.perf_counter() - start,
            "audio": audio.nbytes / 2**20, "error": error}  # fmt: skip


def default_models(tmp: Path) -> list[Path]:
    from echoic.model.nn.nemo_import import import_nemo

    out = []
    try:
        from echoic.model.nn.hf_import import import_huggingface

        src = tmp / "src" / "tiny-wav2vec2"  # made by tests/ from the checkout
        subprocess.run([sys.executable, "-m", "tests.tiny_hf", str(src)], cwd=ROOT, check=True)
        out.append(import_huggingface(src, tmp / "tiny-wav2vec2" / "1"))
    except (ImportError, subprocess.CalledProcessError) as e:
        print(f"(no wav2vec2 row: {e}; pip install 'echoic[import]')", file=sys.stderr)
    for kind in ("chars", "bpe"):
        nemo = FIXTURES / f"{kind}.nemo"
        out.append(import_nemo(FIXTURES / f"{kind}.onnx", tmp / f"nemo-{kind}" / "1", nemo=nemo))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", type=Path)
    parser.add_argument("--minutes", nargs="+", type=float, default=[1.0, 5.0, 10.0])
    parser.add_argument("--whole", action="store_true", help="run every utterance whole")
    parser.add_argument("--cap-gb", type=float, default=8.0, help="address space per child")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], float(args.child[1]), args.whole, args.cap_gb)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        models = args.models or default_models(Path(tmp))
        mode = "whole" if args.whole else "windows"
        print(f"{'model':<16} {'min':>4} {'mode':<8} {'base MB':>8} {'peak MB':>8} "
              f"{'growth MB':>9} {'audio MB':>8} {'time s':>6}  error")  # fmt: skip
        for model in models:
            for minutes in args.minutes:
                whole = ["--whole"] if args.whole else []
                command = [sys.executable, __file__, "--child", str(model), str(minutes * 60),
                           "--cap-gb", str(args.cap_gb), *whole]  # fmt: skip
                done = subprocess.run(command, capture_output=True, text=True, check=True)
                r = json.loads(done.stdout.strip().splitlines()[-1])
                print(
                    f"{model.parent.name:<16} {minutes:>4g} {mode:<8} {r['base']:>8.0f} "
                    f"{r['peak']:>8.0f} {r['peak'] - r['base']:>9.0f} {r['audio']:>8.1f} "
                    f"{r['seconds']:>6.1f}  {r['error']}"
                )


if __name__ == "__main__":
    main()
