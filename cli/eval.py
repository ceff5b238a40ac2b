"""`echoic eval`: WER, CER and speed of an exported model on a manifest."""

from __future__ import annotations

import argparse
import json
import sys
import time

from echoic.cli.transcribe_local import add_decoder_options, load_recognizer, resolve_decoder

EXAMPLES = """\
examples:
  echoic eval --manifest data/heldout/manifest.jsonl                 # bundled model, greedy
  echoic eval --model runs/export/1 --manifest test.jsonl --decoder beam --lm lm.arpa
  echoic eval --manifest test.jsonl --decoder beam --json

  # one table over several sets, both decoders, with a row per synthesizer engine
  echoic eval --manifest data/heldout/manifest.jsonl data/heldout-degraded/*/manifest.jsonl \\
      --decoders greedy,beam --by engine

With one manifest and one decoder it also shows the worst utterances. A set is named
by its manifest's folder (or file name); --by FIELD adds a row for each value of that
manifest field within each set (engine, voice, degradation, ...).
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="word and character error rates of a model on one or more manifests",
        description="Evaluate an exported model: WER and CER (jiwer), real-time factor, and the"
        " utterances it gets most wrong; over several sets and decoders, one table.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", metavar="DIR", help="exported model directory (default: bundled)")
    p.add_argument("--manifest", required=True, action="append", nargs="+", metavar="MANIFEST",
                   help="JSON-lines manifest(s) with reference text; repeatable")  # fmt: skip
    add_decoder_options(p, default="greedy")  # a measurement names what it measures
    p.add_argument("--decoders", metavar="LIST",
                   help="comma-separated decoders to compare, e.g. greedy,beam (overrides"
                        " --decoder)")  # fmt: skip
    p.add_argument("--by", metavar="FIELD", help="a row per value of this manifest field too")
    p.add_argument("--limit", type=int, default=0, help="first N utterances of each set only")
    p.add_argument("--worst", type=int, default=5, help="show the N worst utterances")
    p.add_argument("--batch-size", type=int, default=16, help="utterances per model call")
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads (0 = all)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _read_set(path: str, limit: int) -> list[dict]:
    """The manifest's lines that have a reference, with absolute audio paths."""
    from pathlib import Path

    from echoic.cli.batch_io import manifest_items
    from echoic.cli.errors import UserError

    manifest = Path(path)
    if not manifest.is_file():
        raise UserError(f"{manifest}: no such manifest")
    rows = [
        {**item.row, "audio_filepath": item.path}
        for item in manifest_items(manifest)
        if item.row.get("text") is not None
    ]
    rows = rows[:limit] if limit else rows
    if not rows:
        raise UserError(f"{manifest}: no utterances with a 'text' reference")
    return rows


def _set_name(path: str, taken: set[str]) -> str:
    from pathlib import Path

    p = Path(path)
    name = p.parent.name if p.stem == "manifest" and p.parent.name else p.stem
    while name in taken:
        name = f"{p.parent.parent.name}/{name}" if "/" not in name else f"{name}'"
    taken.add(name)
    return name


def _score(recognizer, audios: list, batch_size: int) -> tuple[list[str], float]:
    hyps, compute = [], 0.0
    for start in range(0, len(audios), batch_size):
        t0 = time.perf_counter()
        hyps += [t.text for t in recognizer.transcribe(audios[start : start + batch_size])]
        compute += time.perf_counter() - t0
    return hyps, compute


def _resolved(args: argparse.Namespace, kind: str) -> str:
    """greedy or beam: auto resolved for --model and --lm / --no-lm."""
    args.decoder = kind
    resolve_decoder(args)
    return args.decoder


def run(args: argparse.Namespace) -> int:
    import jiwer

    from echoic.cli.errors import UserError
    from echoic.model.core.audio import load_audio
    from echoic.model.core.text import normalize_text

    manifests = [m for group in args.manifest for m in group]
    asked = [d.strip() for d in (args.decoders or args.decoder).split(",") if d.strip()]
    bad = [d for d in asked if d not in ("greedy", "beam", "auto")]
    if bad or not asked:
        raise UserError(
            f"--decoders: unknown decoder {bad[0] if bad else ''!r} (greedy, beam, auto)"
        )
    # auto is measured as what it runs for this model (`echoic transcribe`'s rule), and the
    # report names that decoder: a measurement says what it measured.
    decoders = list(dict.fromkeys(_resolved(args, d) for d in asked))
    recognizers = {}
    for kind in decoders:
        args.decoder = kind
        recognizers[kind] = load_recognizer(args)
    first = recognizers[decoders[0]]
    taken: set[str] = set()
    sets = []
    for path in manifests:
        rows = _read_set(path, args.limit)
        audios = [load_audio(r["audio_filepath"], first.sample_rate) for r in rows]
        refs = [normalize_text(r["text"]) for r in rows]
        sets.append((_set_name(path, taken), path, rows, audios, refs))
    if len(manifests) == 1 and len(decoders) == 1:
        return _single(args, first, *sets[0][1:], decoders[0])

    table = []
    for name, _, rows, audios, refs in sets:
        results = {kind: _score(rec, audios, args.batch_size) for kind, rec in recognizers.items()}
        groups = [(name, list(range(len(rows))))]
        if args.by:
            values = sorted({str(r.get(args.by)) for r in rows})
            groups += [(f"{name} {args.by}={v}", [i for i, r in enumerate(rows)
                        if str(r.get(args.by)) == v]) for v in values]  # fmt: skip
        for label, idx in groups:
            seconds = sum(len(audios[i]) for i in idx) / first.sample_rate
            row = {"set": label, "utterances": len(idx), "minutes": round(seconds / 60, 2)}
            for kind, (hyps, compute) in results.items():
                r = [refs[i] or "<empty>" for i in idx]
                h = [hyps[i] for i in idx]
                row[f"wer_{kind}"] = round(float(jiwer.wer(r, h)), 4)
                row[f"cer_{kind}"] = round(float(jiwer.cer(r, h)), 4)
                if label == name:  # speed is measured per set, not per group
                    row[f"rtf_{kind}"] = round(compute / max(seconds, 1e-9), 5)
            table.append(row)
    model = f"{first.card.name}/{first.card.version}"
    if args.json:
        print(json.dumps({"model": model, "decoders": decoders, "lm": recognizers.get(
            "beam", first).lm_path, "rows": table}))  # fmt: skip
        return 0
    width = max(len(r["set"]) for r in table)
    head = f"{'set':<{width}}  {'utts':>5}  {'min':>6}"
    for kind in decoders:
        head += f"  {'WER ' + kind:>11}  {'CER ' + kind:>11}  {'RTF ' + kind:>11}"
    print(f"{model}" + (f", beam with LM {recognizers['beam'].lm_path}" if "beam" in
                        recognizers and recognizers["beam"].lm_path else ""))  # fmt: skip
    print(head)
    for r in table:
        line = f"{r['set']:<{width}}  {r['utterances']:>5}  {r['minutes']:>6.1f}"
        for kind in decoders:
            rtf = r.get(f"rtf_{kind}")
            line += f"  {100 * r[f'wer_{kind}']:>10.1f}%  {100 * r[f'cer_{kind}']:>10.1f}%"
            line += f"  {rtf:>11.4f}" if rtf is not None else f"  {'':>11}"
        print(line)
    sys.stdout.flush()
    return 0


def _single(args, recognizer, manifest: str, rows: list, audios: list, refs: list,
            kind: str) -> int:  # fmt: skip
    """One set, one decoder: the summary and the worst utterances."""
    import jiwer

    hyps, compute = _score(recognizer, audios, args.batch_size)
    audio_seconds = sum(len(a) for a in audios) / recognizer.sample_rate
    per_utt = [
        (jiwer.wer(r or "<empty>", h), row["audio_filepath"], r, h)
        for row, r, h in zip(rows, refs, hyps, strict=True)
    ]
    worst = sorted(per_utt, key=lambda x: -x[0])[: args.worst]
    result = {
        "model": f"{recognizer.card.name}/{recognizer.card.version}",
        "decoder": kind,
        "lm": recognizer.lm_path,
        "utterances": len(rows),
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
        f"{result['model']} on {manifest}: {len(rows)} utterances,"
        f" {audio_seconds / 60:.1f} min of audio; decoder {kind}"
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
