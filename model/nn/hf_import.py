"""A Hugging Face CTC model (Wav2Vec2ForCTC, HubertForCTC) as an echoic model directory.

The source is a local `save_pretrained` directory: `config.json` and the weights,
`vocab.json` (token -> id), and where present `tokenizer_config.json` (the word
delimiter and special tokens) and `preprocessor_config.json` or `processor_config.json`
(the feature extractor's sampling rate, `do_normalize`, `return_attention_mask`). The
model is loaded and traced with the real `transformers` code (the `import` extra), so
the graph is that code's forward:

    model.onnx   waveform (B, S) float32, lengths (B,) samples
                 -> log_probs (B, T', V), out_lengths (B,)

What differs from the source, all written on the card:

- The vocabulary is echoic's: the blank (the model's pad token, which its CTC loss
  uses as blank) first, then the character tokens in the model's order, lower-cased,
  with the word delimiter ("|") as " ". Special tokens (`<s>`, `</s>`, `<unk>`) spell
  nothing: their probability joins the blank's (a CTC-trained model gives them next
  to none). `source_tokens` keeps the model's own token for every id.
- Normalisation ("utterance": zero mean, unit variance over an utterance's own
  samples, as the feature extractor's `do_normalize`) is the runtime's, not the graph's.
- Padding: a model whose feature extractor returns an attention mask (layer-norm
  wav2vec2s, HuBERT large) gets one built from `lengths` inside the graph, so rows
  batch freely ("masked"). One without (group-norm wav2vec2-base: padding changes its
  normalisation statistics) runs each utterance alone ("alone"), as it was trained.
- The output frame rate is the convolutional front end's stride product (320
  samples: 20 ms at 16 kHz); word times come from it.

Nothing is written unless ONNX Runtime reproduces transformers (`check_parity`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from echoic.model.core.features import FeatureConfig, normalize_utterance
from echoic.model.core.files import staged_directory, write_durably
from echoic.model.core.text import BLANK, TextError, Vocabulary
from echoic.model.nn.export import (
    OPSET,
    PARITY_TOLERANCE,
    ExportError,
    Shapes,
    _default_version,
    _finish_graph,
    _trace,
)
from echoic.model.runtime.card import (
    BATCH,
    CARD_FORMAT,
    FULL_CONTEXT,
    OFFLINE_FILE,
    REPORT_FILE,
    ModelCard,
)
from echoic.model.runtime.repository import check_name

SUPPORTED = ("Wav2Vec2ForCTC", "HubertForCTC")  # `architectures` in config.json
# Utterance lengths (samples) of the parity batches: alone, and a mixed batch whose
# shortest row is under one output frame's receptive field plus a little.
PARITY_BATCHES: tuple[tuple[int, ...], ...] = ((8000,), (16000, 5123, 1201))


@dataclass(frozen=True)
class HFSource:
    """What the importer read from a `save_pretrained` directory."""

    vocab_file: Path  # SOURCE/vocab.json, named in errors
    architecture: str  # e.g. "Wav2Vec2ForCTC"
    config: dict[str, Any]  # config.json
    vocab: dict[str, int]  # vocab.json: token -> id
    blank_token: str  # the pad token (CTC blank)
    word_delimiter: str  # the token between words, "|"
    special_tokens: tuple[str, ...]  # tokens that spell nothing (folded into the blank)
    sample_rate: int  # Hz
    normalize: bool  # the feature extractor's do_normalize
    attention_mask: bool  # whether the model is given an attention mask


def _read_json(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ExportError(f"{path}: missing; a `save_pretrained` directory has it")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"{path}: not readable JSON ({e})") from e
    if not isinstance(data, dict):
        raise ExportError(f"{path}: expected a JSON object")
    return data


def read_source(src: Path) -> HFSource:
    """Read and check a `save_pretrained` directory (no weights loaded yet)."""
    if not src.is_dir():
        raise ExportError(f"{src}: no such directory (a Hugging Face `save_pretrained` one)")
    config = _read_json(src / "config.json", required=True)
    vocab = _read_json(src / "vocab.json", required=True)
    tokenizer = _read_json(src / "tokenizer_config.json", required=False)
    # The feature extractor's settings: preprocessor_config.json (released checkpoints,
    # transformers 4) or the "feature_extractor" part of processor_config.json (5).
    extractor = _read_json(src / "preprocessor_config.json", required=False)
    if not extractor:
        processor = _read_json(src / "processor_config.json", required=False)
        extractor = processor.get("feature_extractor") or {}
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED), None)
    if arch is None:
        raise ExportError(
            f"{src / 'config.json'}: architectures {archs} include none that echoic imports "
            f"({', '.join(SUPPORTED)}); a CTC head over characters is needed"
        )
    # Some vocab.json files nest the vocabulary under a language code.
    if vocab and all(isinstance(v, dict) for v in vocab.values()) and len(vocab) == 1:
        vocab = next(iter(vocab.values()))
    ids = sorted(vocab.values()) if all(isinstance(v, int) for v in vocab.values()) else None
    size = config.get("vocab_size")
    if ids != list(range(len(vocab))) or size != len(vocab):
        raise ExportError(
            f"{src / 'vocab.json'}: its ids must be 0..{size - 1 if size else '?'} once each "
            f"(config.json's vocab_size {size}); it has {len(vocab)} tokens"
        )
    by_id = {i: t for t, i in vocab.items()}
    pad_id = config.get("pad_token_id")
    if not isinstance(pad_id, int) or pad_id not in by_id:
        raise ExportError(f"{src / 'config.json'}: pad_token_id {pad_id!r} (the blank) is no id")
    delimiter = tokenizer.get("word_delimiter_token", "|")
    specials = {tokenizer.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    specials |= {t for t in vocab if len(t) > 1 and t.startswith("<") and t.endswith(">")}
    specials = {t for t in specials if isinstance(t, str) and t in vocab and t != by_id[pad_id]}
    attention = extractor.get("return_attention_mask", config.get("feat_extract_norm") == "layer")
    return HFSource(
        vocab_file=src / "vocab.json",
        architecture=arch,
        config=config,
        vocab=vocab,
        blank_token=by_id[pad_id],
        word_delimiter=delimiter,
        special_tokens=tuple(sorted(specials, key=vocab.__getitem__)),
        sample_rate=int(extractor.get("sampling_rate", 16000)),
        normalize=bool(extractor.get("do_normalize", True)),
        attention_mask=bool(attention),
    )


def echoic_vocabulary(source: HFSource) -> tuple[Vocabulary, list[int], list[int]]:
    """echoic's vocabulary, the source id of each of its symbols after the blank, and the
    source ids that make up the blank (the pad token and the special tokens)."""
    folded = [source.vocab[source.blank_token], *(source.vocab[t] for t in source.special_tokens)]
    kept = [i for t, i in sorted(source.vocab.items(), key=lambda kv: kv[1]) if i not in folded]
    symbols = [BLANK]
    for i in kept:
        token = next(t for t, j in source.vocab.items() if j == i)
        if token == source.word_delimiter:
            symbols.append(" ")
        elif len(token) == 1:
            symbols.append(token.lower())
        else:
            raise ExportError(
                f"{source.vocab_file}: token {token!r} (id {i}) is not one character: echoic "
                "imports character CTC models (subword vocabularies are not supported yet)"
            )
    try:
        vocab = Vocabulary(tuple(symbols))
    except TextError as e:
        raise ExportError(
            f"{source.vocab_file}: its tokens do not map onto echoic's characters "
            f"(lower-cased, the word delimiter {source.word_delimiter!r} as ' '): {e}"
        ) from e
    return vocab, kept, folded


def conv_geometry(config: dict[str, Any]) -> tuple[int, int]:
    """(samples per output frame, samples one output frame sees) of the conv front end."""
    stride, field = 1, 1
    for k, s in zip(config["conv_kernel"], config["conv_stride"], strict=True):
        field += (k - 1) * stride
        stride *= s
    return stride, field


class _CTCGraph(nn.Module):
    """The transformers model as echoic's offline graph: waveform and lengths in,
    log-probs over echoic's vocabulary and their lengths out."""

    def __init__(self, model: nn.Module, kept: list[int], folded: list[int], mask: bool) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("kept", torch.tensor(kept, dtype=torch.long))
        self.register_buffer("folded", torch.tensor(folded, dtype=torch.long))
        self.mask = mask

    def forward(self, waveform: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        samples = torch.arange(waveform.shape[1], device=waveform.device)
        attention = (samples[None, :] < lengths[:, None]).long() if self.mask else None  # (B, S)
        logits = self.model(waveform, attention_mask=attention).logits  # (B, T', V_source)
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        blank = torch.logsumexp(log_probs.index_select(-1, self.folded), -1, keepdim=True)
        out = torch.cat([blank, log_probs.index_select(-1, self.kept)], dim=-1)  # (B, T', V)
        out_lengths = self.model._get_feat_extract_output_lengths(lengths)  # (B,)
        return out, out_lengths.clamp(min=0)


def load_model(src: Path, source: HFSource) -> nn.Module:
    """The source model in eval mode, by the real transformers class, with eager attention
    (the one attention every exporter traces the same)."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "importing a Hugging Face model needs transformers: pip install 'echoic[import]'"
        ) from e
    cls = getattr(transformers, source.architecture)
    try:
        model = cls.from_pretrained(src, attn_implementation="eager")
    except (OSError, ValueError) as e:
        raise ExportError(f"{src}: transformers could not load the weights ({e})") from e
    return model.float().eval()


def build_card(
    source: HFSource, model: nn.Module, vocab: Vocabulary, kept: list[int], folded: list[int],
    *, name: str, version: str, config_bytes: bytes,
) -> ModelCard:  # fmt: skip
    hop_ms = 1000.0 / source.sample_rate  # one sample
    stride, field = conv_geometry(source.config)
    digest = hashlib.sha256(config_bytes).hexdigest()[:16]
    ids = {i: t for t, i in source.vocab.items()}
    return ModelCard(
        format=CARD_FORMAT,
        name=name,
        version=version,
        vocabulary=vocab.symbols,
        blank_id=vocab.blank_id,
        features=FeatureConfig(source.sample_rate, window_ms=hop_ms, hop_ms=hop_ms),
        sample_rate=source.sample_rate,
        hop_ms=hop_ms,
        num_features=1,
        time_stride=stride,
        output_frame_ms=hop_ms * stride,
        receptive_field=field,
        feature_mean=(0.0,),
        **FULL_CONTEXT,  # self-attention sees the whole utterance
        parameters=sum(p.numel() for p in model.parameters()),
        config_hash=digest,
        model_config_hash=digest,
        training_step=0,
        opset=OPSET,
        input="waveform",
        normalize="utterance" if source.normalize else "none",
        batch_padding="masked" if source.attention_mask else "alone",
        token_type="chars",
        source=f"huggingface:{source.architecture}",
        source_tokens=(ids[folded[0]], *(ids[i] for i in kept)),
    )


def _export_graph(graph: _CTCGraph, card: ModelCard) -> bytes:
    samples = 2 * card.receptive_field + 5 * card.time_stride
    waveform = torch.randn(2, samples, generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([samples, samples - 2 * card.time_stride - 7])
    shapes: Shapes = {
        "waveform": [BATCH, "samples"],
        "lengths": [BATCH],
        "log_probs": [BATCH, "out_frames", len(card.vocabulary)],
        "out_lengths": [BATCH],
    }
    inputs, outputs = ["waveform", "lengths"], ["log_probs", "out_lengths"]
    onnx_bytes = _trace(graph, (waveform, lengths), inputs, outputs, shapes)
    return _finish_graph(onnx_bytes, card, "offline", shapes)


def check_parity(graph: _CTCGraph, model_dir: Path, normalize: bool) -> list[dict[str, Any]]:
    """torch against model.onnx on batches of different lengths: per batch, the lengths
    and the largest |log-prob difference| over real frames (rows batched as the engine
    batches them)."""
    from echoic.model.runtime.engine import Engine

    engine = Engine(model_dir)
    rng = np.random.default_rng(0)
    report = []
    for lengths in PARITY_BATCHES:
        rows = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in lengths]
        if normalize:
            rows = [normalize_utterance(x) for x in rows]
        got = engine.offline(rows)
        diffs = []
        for row, g in zip(rows, got, strict=True):  # torch one row at a time: no padding
            with torch.no_grad():
                want, n = graph(torch.from_numpy(row)[None], torch.tensor([len(row)]))
            w = want[0, : int(n[0])].numpy()
            if w.shape != g.shape or not np.isfinite(w).all():
                diffs.append(math.inf)
            else:
                diffs.append(float(np.abs(w - g).max()) if len(w) else 0.0)
        report.append({"lengths": list(lengths), "max_abs_diff": max(diffs)})
    return report


def import_huggingface(
    src: str | Path,
    out_dir: str | Path,
    *,
    name: str | None = None,
    version: str | None = None,
    tolerance: float = PARITY_TOLERANCE,
) -> Path:
    """Import the `save_pretrained` directory `src` as the model directory `out_dir`
    (which must not exist, or be empty); name defaults to `src`'s folder name, version
    as for `echoic export`. Raises ExportError, writing nothing, when ONNX Runtime does
    not reproduce transformers within `tolerance`."""
    src, out_dir = Path(src), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"{out_dir} already exists; import each version to a new directory")
    source = read_source(src)
    vocab, kept, folded = echoic_vocabulary(source)
    name = name or src.resolve().name
    version = version or _default_version(out_dir)
    try:
        check_name("name", name)
        check_name("version", version)
    except ValueError as e:
        raise ExportError(str(e)) from e
    model = load_model(src, source)
    card = build_card(
        source, model, vocab, kept, folded,
        name=name, version=version, config_bytes=(src / "config.json").read_bytes(),
    )  # fmt: skip
    graph = _CTCGraph(model, kept, folded, source.attention_mask).eval()

    with staged_directory(out_dir) as tmp:
        write_durably(tmp / OFFLINE_FILE, _export_graph(graph, card))
        parity = check_parity(graph, tmp, source.normalize)
        bad = [p for p in parity if not p["max_abs_diff"] <= tolerance]
        if bad:
            raise ExportError(
                f"ONNX Runtime does not reproduce transformers (tolerance {tolerance:g}): "
                + "; ".join(f"lengths {p['lengths']}: {p['max_abs_diff']:.3g}" for p in bad)
            )
        import transformers

        report = {
            "model_card": json.loads(card.to_json()),
            "parity": {"tolerance": tolerance, "offline": parity},
            "source": {
                "path": str(src.resolve()),
                "transformers": transformers.__version__,
                "folded_into_blank": list(source.special_tokens),
                "attention_mask": source.attention_mask,
            },
        }
        text = json.dumps(report, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        write_durably(tmp / REPORT_FILE, text.encode())
    return out_dir


__all__ = ["SUPPORTED", "HFSource", "import_huggingface", "read_source"]
