"""`echoic eval`: WER, CER and speed of an exported model on a manifest."""

from __future__ import annotations

import argparse
import json
import sys
import time

from echoic.cli.transcribe import add_decoder_options, load_recognizer

EXAMPLES = """\
examples:
  echoic eval --manifest data/heldout/manifest.jsonl                 # bundled model, greedy
  echoic eval --model runs/export/1 --manifest test.jsonl --decoder beam --lm lm.arpa
  echoic eval --manifest test.jsonl --decoder beam --json
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="word and character error rates of a model on a manifest",
        description="Evaluate an exported model: WER and CER (jiwer), real-time factor, and the"
        " utterances it gets most wrong.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", metavar="DIR", help="exported model directory (default: bundled)")
    p.add_argument("--manifest", required=True, help="JSON-lines manifest with reference text")
    add_decoder_options(p)
    p.add_argument("--limit", type=int, default=0, help="first N utterances only")
    p.add_argument("--worst", type=int, default=5, help="show the N worst utterances")
    p.add_argument("--batch-size", type=int, default=16, help="utterances per model call")
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads (0 = all)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import jiwer

    from echoic.cli.batch_io import collect_inputs
    from echoic.cli.errors import UserError
    from echoic.model.core.audio import load_audio
    from echoic.model.core.text import normalize_text

    items = [i for i in collect_inputs([args.manifest]).items if i.reference is not None]
    if args.limit:
        items = items[: args.limit]
    if not items:
        raise UserError(f"{args.manifest}: no utterances with a 'text' reference")
    recognizer = load_recognizer(args)
    audios = [load_audio(i.path, recognizer.sample_rate) for i in items]
    refs = [normalize_text(i.reference) for i in items]
    hyps, compute = [], 0.0
    for start in range(0, len(items), args.batch_size):
        t0 = time.perf_counter()
        hyps += [t.text for t in recognizer.transcribe(audios[start : start + args.batch_size])]
        compute += time.perf_counter() - t0
    audio_seconds = sum(len(a) for a in audios) / recognizer.sample_rate
    per_utt = [
        (jiwer.wer(r or "<empty>", h), i.path, r, h)
        for i, r, h in zip(items, refs, hyps, strict=True)
    ]
    worst = sorted(per_utt, key=lambda x: -x[0])[: args.worst]
    result = {
        "model": f"{recognizer.card.name}/{recognizer.card.version}",
        "decoder": args.decoder,
        "lm": recognizer.lm_path,
        "utterances": len(items),
        "audio_hours": round(audio_seconds / 3600, 4),
        "wer": round(float(jiwer.wer([r or "<empty>" for r in refs], hyps)), 4),
        "cer": round(float(jiwer.cer([r or "<empty>" for r in refs], hyps)), 4),
        "real_time_factor": round(compute / audio_seconds, 5),
        "worst": [{"wer": round(w, 3), "audio": p, "ref": r, "hyp": h} for w, p, r, h in worst],
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{result['model']} on {args.manifest}: {len(items)} utterances,"
        f" {audio_seconds / 60:.1f} min of audio; decoder {args.decoder}"
        + (f" with LM {result['lm']}" if result["lm"] else "")
    )
    print(f"WER {100 * result['wer']:.2f}%  CER {100 * result['cer']:.2f}%  "
          f"real-time factor {result['real_time_factor']:.4f}")  # fmt: skip
    for w in result["worst"]:
        print(
            f"  WER {100 * w['wer']:5.1f}%  {w['audio']}\n    ref: {w['ref']}\n    hyp: {w['hyp']}"
        )
    sys.stdout.flush()
    return 0
