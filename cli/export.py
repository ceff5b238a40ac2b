"""`echoic export`: turn a checkpoint into a model directory for the server."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import NoReturn

EXAMPLES = """\
examples:
  # into a model repository: MODEL_REPO/<name>/<version>/ (the version is taken from OUT_DIR)
  echoic export runs/ds2/last.pt models/echoic-ds2/3

  # a unidirectional model streamed in steps of 8 output frames, report as JSON
  echoic export runs/uni/last.pt models/uni/1 --stream-chunk 8 --json

  # int8 convolutions and output layer, scales calibrated on a manifest's audio (an
  # existing model directory: echoic quantize); docs/benchmarks.md, "Benchmarks" says what it gains
  echoic export runs/ds2/last.pt models/echoic-ds2/4 --quantize int8 --calibration dev.jsonl

  # half the file: the large weights stored as float16, computed in float32 (the bundled model)
  echoic export runs/gpu-default/last.pt models/echoic-en-default/4 --weights float16

OUT_DIR must not exist (or be empty). It gets model.onnx (offline), stream.onnx
(streaming step; streamable models only), both carrying the model card, and
export.json. Nothing is written unless ONNX Runtime reproduces the checkpoint on
several batch sizes and lengths, offline and streamed step by step.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="export a checkpoint to ONNX (model.onnx, stream.onnx, model card)",
        description="Export a training checkpoint to a model directory the server loads:\n"
        "ONNX graphs for offline and streaming recognition with the model card in their\n"
        "metadata, checked against torch before anything is written.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint file (e.g. last.pt)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="model directory to create")
    p.add_argument("--name", metavar="N", help="model name (default: the model config's name)")
    p.add_argument(
        "--version",
        metavar="V",
        help="model version (default: OUT_DIR's name when it is a number, else 1)",
    )
    p.add_argument(
        "--stream-chunk",
        type=int,
        metavar="C",
        help="output frames per streaming step of a unidirectional model (default 16); "
        "a chunked BiRNN always uses its trained chunk",
    )
    p.add_argument(
        "--quantize",
        choices=("int8",),
        help="quantize the graphs once their parity is proved: int8 = ONNX Runtime's static "
        "quantization of convolutions and matrix products (the recurrent layers stay fp32)",
    )
    add_calibration(p, required=False)
    p.add_argument(
        "--weights",
        choices=("float32", "float16"),
        default="float32",
        help="how the graphs store their weights: float16 = the large weights rounded to "
        "float16, half the file, still computed in float32 (default float32)",
    )
    p.add_argument("--json", action="store_true", help="print a one-line JSON summary")
    p.set_defaults(func=run)


def _explain_missing(e: ModuleNotFoundError) -> NoReturn:
    """Export needs torch and onnx (the train extra) and onnxruntime (serve) for parity."""
    from echoic.cli.errors import missing_extra

    if e.name in ("torch", "onnx", "onnxruntime"):
        raise missing_extra("serve" if e.name == "onnxruntime" else "train", e.name) from e
    raise e


def add_calibration(p: argparse.ArgumentParser, *, required: bool) -> None:
    p.add_argument(
        "--calibration",
        metavar="MANIFEST",
        required=required,
        help="JSON-lines manifest (audio_filepath) of speech like what the model will hear: "
        "the first 32 utterances fix the int8 activation scales"
        + ("" if required else " (needed with --quantize)"),
    )


def calibration_audio(manifest: str, sample_rate: int) -> list:
    """The first utterances of a manifest, as float32 samples at `sample_rate`."""
    from echoic.cli.errors import UserError
    from echoic.model.core.audio import AudioError, load_audio
    from echoic.model.nn.quantize import CALIBRATION_UTTERANCES

    path = Path(manifest)
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except OSError as e:
        raise UserError(f"{path}: cannot read the calibration manifest ({e.strerror})") from e
    audio = []
    for number, line in enumerate(lines[:CALIBRATION_UTTERANCES], start=1):
        try:
            audio_path = path.parent / json.loads(line)["audio_filepath"]
            audio.append(load_audio(audio_path, sample_rate))
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(
                f"{path}:{number}: not a manifest line with an audio_filepath ({e})"
            ) from e
        except (AudioError, OSError) as e:
            raise UserError(f"{path}:{number}: {e}") from e
    if not audio:
        raise UserError(f"{path}: no utterances to calibrate on")
    return audio


def quantization_line(quantization: dict) -> str:
    """What quantization did, as `echoic export --quantize` and `echoic quantize` say it."""
    parts = []
    for graph, info in sorted(quantization["graphs"].items()):
        done = ", ".join(f"{n} {op}" for op, n in sorted(info["quantized"].items()))
        kept = ", ".join(f"{n} {op}" for op, n in sorted(info["left_fp32"].items()))
        parts.append(f"{graph}: {done or 'nothing'} to int8 ({kept or 'nothing'} left fp32)")
    return f"{quantization['scheme']}: " + "; ".join(parts)


def run(args: argparse.Namespace) -> int:
    from echoic.cli.errors import UserError
    from echoic.model.runtime.card import ModelError

    try:
        from echoic.model.nn.export import ExportError, export_model, read_report
    except ModuleNotFoundError as e:
        _explain_missing(e)
    if bool(args.quantize) != bool(args.calibration):
        raise UserError("--quantize int8 and --calibration MANIFEST go together")
    try:
        audio = None
        if args.quantize:
            from echoic.model.nn.checkpoint import load_model

            audio = calibration_audio(
                args.calibration, load_model(args.checkpoint)[0].cfg.features.sample_rate
            )
        path = export_model(
            args.checkpoint,
            args.out_dir,
            name=args.name,
            version=args.version,
            stream_chunk=args.stream_chunk,
            quantize=args.quantize,
            calibration=audio,
            weights=args.weights,
        )
    except ModuleNotFoundError as e:  # onnx and onnxruntime are imported when needed
        _explain_missing(e)
    except (ExportError, ModelError) as e:
        raise UserError(str(e)) from e
    report = read_report(path)
    card, parity = report["model_card"], report["parity"]
    offline = max(case["max_abs_diff"] for case in parity["offline"])
    stream = parity["stream"]["max_abs_diff"] if parity["stream"] else None
    files = sorted(p.name for p in path.iterdir())
    if args.json:
        summary = {
            "model_dir": str(path),
            "name": card["name"],
            "version": card["version"],
            "files": files,
            "streamable": card["streamable"],
            "chunk_frames": card["chunk_frames"],
            "precision": card.get("precision", "fp32"),
            "parity": parity,
            "weights": report.get("weights", {"dtype": "float32"}),
        }
        print(json.dumps(summary))
        return 0
    shapes = ", ".join(
        "x".join(map(str, (len(c["lengths"]), max(c["lengths"])))) for c in parity["offline"]
    )
    print(
        f"offline: torch vs model.onnx max |diff| {offline:.2e} "
        f"on batch x frames {shapes} (tolerance {parity['tolerance']:g})"
    )
    if stream is not None:
        print(
            f"streaming: stream.onnx step by step ({parity['stream']['steps']} batched steps, "
            f"chunk {card['chunk_frames']}) vs model.onnx max |diff| {stream:.2e}"
        )
    if "quantization" in report:
        print(quantization_line(report["quantization"]))
    if "weights" in report:
        half = report["weights"]
        stored = half["stored"]["model.onnx"]
        print(
            f"weights: {half['values_rounded']:,} values rounded to float16, stored so in"
            f" {stored['tensors']} tensors (log-probabilities moved at most"
            f" {half['max_abs_log_prob_change']:.2e})"
        )
    print(f"wrote {card['name']} version {card['version']} to {path} ({', '.join(files)})")
    return 0
