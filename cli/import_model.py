"""`echoic import-model`: a CTC model trained elsewhere into an echoic model directory.

Families: `huggingface` (a `save_pretrained` directory, exported with transformers) and
`nemo` (a NeMo CTC model: a .nemo, exported with NeMo's own `export()` when nemo_toolkit
is installed, or NeMo's ONNX export with its config and tokenizer).

Beside `echoic import` (a corpus into a training manifest) rather than inside it: this
one writes what `echoic export` writes, a model directory the server, `echoic deploy`
and `echoic transcribe` take, and it needs torch and transformers where `import` needs
neither.
"""

from __future__ import annotations

import argparse
import json
from typing import NoReturn

EXAMPLES = """\
examples:
  # a Wav2Vec2ForCTC or HubertForCTC saved with save_pretrained (or a hub snapshot)
  echoic import-model huggingface ~/models/wav2vec2-base-960h models/w2v-base/1

  # named, with the summary as JSON
  echoic import-model huggingface ./hubert-large-ft models/hubert/1 --name hubert --json

  # a NeMo CTC model (Conformer-CTC, Citrinet, QuartzNet) where nemo_toolkit is installed
  echoic import-model nemo stt_en_conformer_ctc_small.nemo models/conformer/1

  # NeMo's ONNX export (model.export("model.onnx")), config and tokenizer from the .nemo
  echoic import-model nemo model.onnx models/conformer/1 --nemo stt_en_conformer_ctc_small.nemo

  # then serve it, or publish it into a repository a running server watches
  echoic serve --model models/w2v-base/1
  echoic deploy models/w2v-base/1 --repo /srv/models

For huggingface, SOURCE is a local directory with config.json, the weights, vocab.json
and (for the sampling rate and normalisation) preprocessor_config.json or
processor_config.json. OUT_DIR must not exist (or be empty). It gets model.onnx
(waveform in, log-probs over the model's characters out, the model card in its metadata)
and export.json. Nothing is written unless ONNX Runtime reproduces transformers on
batches of several lengths.

For nemo, SOURCE is a .nemo file, or NeMo's ONNX export with --config
model_config.yaml or --nemo (the .nemo holding the config and a BPE model's tokenizer);
model.onnx then takes NeMo's features, which echoic computes (the card's feature recipe),
and is checked against NeMo's ONNX (and NeMo itself, where installed).
docs/models-and-import.md, "Serving other models", says what works and what is not
supported yet.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "import-model",
        help="turn a Hugging Face wav2vec2/HuBERT or NeMo CTC model into a model directory",
        description="Export a CTC acoustic model trained elsewhere to a model directory\n"
        "the server loads: its real code traced to ONNX, the model card describing its\n"
        "input, normalisation and vocabulary, checked against the source framework.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("family", choices=("huggingface", "nemo"), help="where the model comes from")
    p.add_argument(
        "source",
        metavar="SOURCE",
        help="huggingface: the save_pretrained directory; nemo: a .nemo or NeMo's ONNX export",
    )
    p.add_argument("out_dir", metavar="OUT_DIR", help="model directory to create")
    p.add_argument("--name", metavar="N", help="model name (default: SOURCE's folder name)")
    p.add_argument(
        "--version",
        metavar="V",
        help="model version (default: OUT_DIR's name when it is a number, else 1)",
    )
    p.add_argument(
        "--config", metavar="YAML", help="nemo: the model's model_config.yaml (for an ONNX SOURCE)"
    )
    p.add_argument(
        "--nemo",
        metavar="FILE",
        help="nemo: the .nemo whose config and tokenizer go with an ONNX SOURCE",
    )
    p.add_argument("--json", action="store_true", help="print a one-line JSON summary")
    p.set_defaults(func=run)


def _explain_missing(e: ModuleNotFoundError) -> NoReturn:
    from echoic.cli.errors import missing_extra

    if e.name in ("torch", "onnx", "transformers", "yaml"):
        raise missing_extra("import", e.name) from e
    if e.name == "onnxruntime":
        raise missing_extra("serve", e.name) from e
    raise e


def run(args: argparse.Namespace) -> int:
    from echoic.cli.errors import UserError
    from echoic.model.runtime.card import REPORT_FILE, ModelError

    if args.family != "nemo" and (args.config or args.nemo):
        raise UserError("--config and --nemo are for `import-model nemo`")
    try:
        from echoic.model.nn.export import ExportError
        from echoic.model.nn.hf_import import import_huggingface
        from echoic.model.nn.nemo_import import import_nemo
    except ModuleNotFoundError as e:
        _explain_missing(e)
    try:
        if args.family == "nemo":
            path = import_nemo(
                args.source, args.out_dir, config=args.config, nemo=args.nemo,
                name=args.name, version=args.version,
            )  # fmt: skip
        else:
            path = import_huggingface(
                args.source, args.out_dir, name=args.name, version=args.version
            )
    except ModuleNotFoundError as e:  # transformers, onnx, onnxruntime: imported when needed
        _explain_missing(e)
    except (ExportError, ModelError) as e:
        raise UserError(str(e)) from e
    report = json.loads((path / REPORT_FILE).read_text())
    card, parity = report["model_card"], report["parity"]
    files = sorted(p.name for p in path.iterdir())
    if args.json:
        summary = {
            "model_dir": str(path),
            "name": card["name"],
            "version": card["version"],
            "files": files,
            "source": card["source"],
            "vocabulary_size": len(card["vocabulary"]),
            "output_frame_ms": card["output_frame_ms"],
            "parity": parity,
        }
        print(json.dumps(summary))
        return 0
    checks = {k: v for k, v in parity.items() if k != "tolerance"}
    against = {"offline": "transformers", "onnx": "NeMo's ONNX", "nemo": "NeMo"}
    worst = "; ".join(
        f"{against[k]} vs model.onnx max |diff| {max(c['max_abs_diff'] for c in cases):.2e}"
        for k, cases in checks.items()
    )
    print(
        f"{card['source']}: {len(card['vocabulary'])} symbols, one output frame per "
        f"{card['output_frame_ms']:g} ms; {worst} (tolerance {parity['tolerance']:g})"
    )
    print(f"wrote {card['name']} version {card['version']} to {path} ({', '.join(files)})")
    return 0
