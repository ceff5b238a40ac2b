"""What travels to and from a lent GPU machine that has no network: in, a corpus packed
small (Ogg/Opus or FLAC in one tar, with its manifest) and a starting checkpoint; back,
the trained weights in parts under the size limit of what a call returns.
`scripts/gpu_train.sh` drives it (docs/training-gpu.md):

    python -m echoic.training.gpu_pack corpus MANIFEST OUT.tar [--format opus] [--max-mb N]
        [--opus-level L]
    python -m echoic.training.gpu_pack init SOURCE OUT.pt [--recipe R --manifest M]
    python -m echoic.training.gpu_pack parts CHECKPOINT OUT_DIR [--part-mb 15 --max-parts 6]
    python -m echoic.training.gpu_pack join DIR OUT.pt

A checkpoint that travels is slim: the weights and what describes them (configs, hash,
step), without the optimizer, schedule, data position and RNG states (a fresh call
fine-tunes from it with `init_from`; it cannot resume exactly). Weights go as float32
when they fit the parts, else as bfloat16 (`weights_dtype` in the file says which;
loading them into a model makes them float32 again).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import soundfile as sf
import torch

from echoic.model.core.audio import load_audio
from echoic.model.core.configs import to_dict
from echoic.model.nn.checkpoint import Checkpoint, load_checkpoint

RATE = 16000  # Hz, what echoic's models read
FORMATS = {"opus": ("OGG", "OPUS", ".opus"), "flac": ("FLAC", "PCM_16", ".flac")}
MB = 1_000_000


def pack_corpus(
    manifest: str | Path,
    out_tar: str | Path,
    fmt: str = "opus",
    max_mb: float = 50.0,
    opus_level: float | None = None,
) -> dict[str, Any]:
    """Encode the manifest's utterances (16 kHz mono) in manifest order into one tar
    (`manifest.jsonl` with relative paths, `audio/NNNNNN.<ext>`) until its files would pass
    `max_mb`, tar headers counted (about 0.8 kB an utterance); returns counts and sizes.
    Opus at libsndfile's default rate is about 3.4 kB per second of speech (about 4 hours
    in 50 MB); `opus_level` (libsndfile's compression level, 0-1) sets another: 0.95 is
    about 2.5 kB/s, 0.97 about 1.9 kB/s (15 kbit/s, still clear speech). FLAC is about
    25 kB/s. Files are encoded on every core; the tar is the same bytes whatever their
    number."""
    container, subtype, ext = FORMATS[fmt]
    if opus_level is not None and (fmt != "opus" or not 0.0 <= opus_level <= 1.0):
        raise ValueError(f"opus_level {opus_level}: a level from 0 to 1, for --format opus")
    manifest = Path(manifest)
    rows = [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()]
    out_tar = Path(out_tar)
    out_tar.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_tar.with_name(f".{out_tar.name}.tmp")
    level = {} if opus_level is None else {"compression_level": opus_level}

    def encode(row: dict[str, Any]) -> bytes:
        source = Path(row["audio_filepath"])
        source = source if source.is_absolute() else manifest.parent / source
        buffer = io.BytesIO()
        audio = load_audio(source, RATE)
        sf.write(buffer, audio, RATE, format=container, subtype=subtype, **level)
        return buffer.getvalue()

    packed, size, seconds, lines = 0, 0, 0.0, []
    # libsndfile's encoders run outside the interpreter lock: threads use every core.
    with tarfile.open(tmp, "w") as tar, ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for i, data in enumerate(pool.map(encode, rows)):
            # What the file takes in the tar: a 512-byte header, its data padded to 512.
            cost = 512 + -(-len(data) // 512) * 512
            if size + cost > max_mb * MB:
                pool.shutdown(wait=False, cancel_futures=True)
                break
            row = rows[i]
            name = f"audio/{i:06d}{ext}"
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            duration = sf.info(io.BytesIO(data)).duration
            lines.append(
                json.dumps({**row, "audio_filepath": name, "duration": round(duration, 6)})
            )
            packed, size, seconds = packed + 1, size + cost, seconds + duration
        text = ("\n".join(lines) + "\n").encode()
        info = tarfile.TarInfo("manifest.jsonl")
        info.size = len(text)
        tar.addfile(info, io.BytesIO(text))
    tmp.replace(out_tar)
    return {
        "utterances": packed,
        "left_out": len(rows) - packed,
        "audio_seconds": round(seconds, 1),
        "bytes": out_tar.stat().st_size,
        "format": fmt,
        "opus_level": opus_level,
    }


def slim(ckpt: Checkpoint, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The weights and what describes them (no optimizer, schedule or RNG state),
    floating tensors as `dtype`, as the dict a checkpoint file holds."""
    weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in ckpt.model.items()}
    small = Checkpoint(
        model=weights,
        model_config=ckpt.model_config,
        train_config=ckpt.train_config,
        config_hash=ckpt.config_hash,
        step=ckpt.step,
        epoch=ckpt.epoch,
    )
    return {**small.to_dict(), "weights_dtype": str(dtype).removeprefix("torch.")}


def _size(obj: Any) -> int:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.tell()


def init_checkpoint(
    source: str | Path,
    out: str | Path,
    recipe: str | None = None,
    manifest: str | None = None,
    overrides: tuple[str, ...] = (),
) -> None:
    """A slim checkpoint to start from: a checkpoint's weights, or an exported model's
    (rebuilt from its ONNX graphs and its norms measured on `manifest`, as `init_from`
    does, here, where onnxruntime is; the GPU image has none) in `recipe`'s network."""
    from echoic.model.nn.rebuild import is_export

    if not is_export(source):
        torch.save(slim(load_checkpoint(source)), out)
        return
    if not (recipe and manifest):
        raise ValueError("an exported model as the start needs --recipe and --manifest")
    from echoic.model.core.text import Vocabulary
    from echoic.model.nn.network import DeepSpeech2
    from echoic.training.data import read_manifest
    from echoic.training.train import _init_from, load_recipe, saved_config, weights_hash

    cfg = load_recipe(
        recipe, [*overrides, f"init_from={source}", f"data.train_manifest={manifest}"]
    )
    model = DeepSpeech2(cfg.model)
    utts, _ = read_manifest(manifest, Vocabulary(cfg.model.vocabulary), cfg.data)
    _init_from(model, cfg, utts)
    ckpt = Checkpoint(
        model=model.state_dict(),
        model_config=to_dict(cfg.model),
        train_config=saved_config(cfg),
        config_hash=weights_hash(cfg),
    )
    torch.save(slim(ckpt), out)


def write_parts(
    checkpoint: str | Path, out_dir: str | Path, part_mb: float = 15.0, max_parts: int = 6
) -> list[Path]:
    """The slim checkpoint as `weights.pt`, or as `weights.pt.part-NN` when it is larger
    than a part: float32 when that fits `max_parts`, else bfloat16."""
    ckpt = load_checkpoint(checkpoint)
    limit = int(part_mb * MB)
    small = slim(ckpt)
    if _size(small) > limit * max_parts:
        small = slim(ckpt, torch.bfloat16)
    buffer = io.BytesIO()
    torch.save(small, buffer)
    data = buffer.getvalue()
    if len(data) > limit * max_parts:
        raise ValueError(
            f"{checkpoint}: {len(data) / MB:.0f} MB even as bfloat16, more than {max_parts} parts"
            f" of {part_mb} MB: a smaller network, or fewer files left for the logs"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # join_parts reads every part there is, and parts before a lone weights.pt: an earlier
    # write's files would join with (or stand in for) this one's.
    for old in (*out_dir.glob("weights.pt.part-*"), out_dir / "weights.pt"):
        old.unlink(missing_ok=True)
    if len(data) <= limit:
        (out_dir / "weights.pt").write_bytes(data)
        return [out_dir / "weights.pt"]
    parts = []
    for n, start in enumerate(range(0, len(data), limit)):
        part = out_dir / f"weights.pt.part-{n:02d}"
        part.write_bytes(data[start : start + limit])
        parts.append(part)
    return parts


def join_parts(folder: str | Path, out: str | Path) -> Path:
    """`weights.pt` of `write_parts` back in one file (a copy when it was one part)."""
    folder = Path(folder)
    parts = sorted(folder.glob("weights.pt.part-*")) or [folder / "weights.pt"]
    if not parts[0].is_file():
        raise FileNotFoundError(f"no weights.pt or weights.pt.part-* in {folder}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(b"".join(p.read_bytes() for p in parts))
    load_checkpoint(out)  # a part missing or cut short shows here, not in a later export
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m echoic.training.gpu_pack")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("corpus", help="pack a manifest's audio into one tar")
    p.add_argument("manifest")
    p.add_argument("out_tar")
    p.add_argument("--format", choices=sorted(FORMATS), default="opus")
    p.add_argument("--max-mb", type=float, default=50.0)
    p.add_argument("--opus-level", type=float, help="libsndfile's Opus level, 0-1")
    p = sub.add_parser("init", help="a slim checkpoint to start from")
    p.add_argument("source", help="a checkpoint, or an exported model directory")
    p.add_argument("out")
    p.add_argument("--recipe")
    p.add_argument("--manifest")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p = sub.add_parser("parts", help="a checkpoint's weights in parts")
    p.add_argument("checkpoint")
    p.add_argument("out_dir")
    p.add_argument("--part-mb", type=float, default=15.0)
    p.add_argument("--max-parts", type=int, default=6)
    p = sub.add_parser("join", help="the parts back in one checkpoint")
    p.add_argument("folder")
    p.add_argument("out")
    args = parser.parse_args(argv)
    if args.command == "corpus":
        try:
            packed = pack_corpus(
                args.manifest, args.out_tar, args.format, args.max_mb, args.opus_level
            )
        except ValueError as e:
            print(f"gpu_pack: {e}", file=sys.stderr)
            return 2
        print(json.dumps(packed))
    elif args.command == "init":
        init_checkpoint(args.source, args.out, args.recipe, args.manifest, tuple(args.overrides))
    elif args.command == "parts":
        for part in write_parts(args.checkpoint, args.out_dir, args.part_mb, args.max_parts):
            print(part, part.stat().st_size)
    else:
        print(join_parts(args.folder, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
