"""Held-out sets that measure robustness: the same utterances, degraded the ways real
audio is (`echoic degrade`).

Each degradation writes its own set, `OUT_DIR/<kind>/manifest.jsonl` with its WAVs
beside it; every manifest line keeps the source line's fields, with the new audio
path, its duration and `"degradation": kind`:

- `mulaw8k`: a phone call: band-limited to 300-3400 Hz, stored as an 8 kHz G.711
  mu-law WAV (the model's input path decodes and resamples it, as it would a call).
- `reverb`: a room with an RT60 drawn from 0.4-0.8 s (the simulated rooms of
  `training/augment.py`).
- `noisy10db`: pink noise at 10 dB SNR.
- `quiet`: the speech at -35 dBFS RMS.

What each utterance gets is drawn from (seed, kind, manifest line), so a rerun writes
the same files (and skips those already there).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import soundfile as sf

from echoic.model.core.audio import load_audio
from echoic.training.augment import (
    add_noise,
    narrowband,
    reverberate,
    room_impulse_response,
    set_level,
)
from echoic.training.synth import make_noise

KINDS = ("mulaw8k", "reverb", "noisy10db", "quiet")
RATE = 16000  # Hz of the sets other than mulaw8k


def degrade(x: np.ndarray, kind: str, rng: np.random.Generator) -> tuple[np.ndarray, int, str]:
    """(samples, rate, soundfile subtype) of 16 kHz `x` degraded as `kind`."""
    if kind == "mulaw8k":
        return narrowband(x, RATE), 8000, "ULAW"
    if kind == "reverb":
        rir = room_impulse_response(float(rng.uniform(0.4, 0.8)), RATE, rng)
        return np.clip(reverberate(x, rir), -1, 1), RATE, "PCM_16"
    if kind == "noisy10db":
        noisy = add_noise(x, make_noise("pink", len(x), rng), 10.0)
        peak = float(np.max(np.abs(noisy))) if noisy.size else 0.0
        return (noisy / peak * 0.99 if peak > 0.99 else noisy), RATE, "PCM_16"
    if kind == "quiet":
        return set_level(x, -35.0), RATE, "PCM_16"
    raise ValueError(f"unknown degradation {kind!r} (known: {', '.join(KINDS)})")


def degrade_manifest(
    manifest: str | Path, out_dir: str | Path, kinds: tuple[str, ...] = KINDS, seed: int = 0
) -> dict[str, Path]:
    """Write one degraded copy of `manifest`'s set per kind; returns kind -> manifest."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown degradation {unknown[0]!r} (known: {', '.join(KINDS)})")
    manifest = Path(manifest)
    rows = [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()]
    out: dict[str, Path] = {}
    for kind in kinds:
        kind_index = KINDS.index(kind)  # draws follow the kind, not its place in `kinds`
        folder = Path(out_dir) / kind
        (folder / "wavs").mkdir(parents=True, exist_ok=True)
        lines = []
        for line, row in enumerate(rows, 1):
            source = Path(row["audio_filepath"])
            source = source if source.is_absolute() else manifest.parent / source
            key = hashlib.sha256(f"{seed}:{kind}:{line}:{source}".encode()).hexdigest()[:16]
            target = folder / "wavs" / f"{key}.wav"
            if not target.is_file():
                rng = np.random.default_rng([seed, kind_index, line])
                samples, rate, subtype = degrade(load_audio(source, RATE), kind, rng)
                tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
                sf.write(tmp, samples, rate, subtype=subtype, format="WAV")
                os.replace(tmp, target)
            info = sf.info(str(target))
            lines.append(json.dumps({
                **row,
                "audio_filepath": str(target.resolve()),
                "duration": round(info.frames / info.samplerate, 6),
                "degradation": kind,
            }) + "\n")  # fmt: skip
        path = folder / "manifest.jsonl"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text("".join(lines), encoding="utf-8")
        os.replace(tmp, path)
        out[kind] = path
    return out
