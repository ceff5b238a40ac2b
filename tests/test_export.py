"""ONNX export, the model card, and the ONNX Runtime engine that serves the result.

Real parts throughout: a tiny network saved as a real checkpoint, exported by
`export_model`, loaded by `Engine`, fed with features of generated audio.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from echoic.cli.main import main
from echoic.model.core.configs import to_dict
from echoic.model.core.features import FeatureStream, compute_features
from echoic.model.nn.checkpoint import (
    FORMAT,
    Checkpoint,
    CheckpointError,
    load_checkpoint,
    load_model,
)
from echoic.model.nn.export import ExportError, build_card, export_model
from echoic.model.nn.network import DeepSpeech2
from echoic.model.runtime.card import CARD_KEY, ModelCard, ModelError, read_card
from echoic.model.runtime.engine import Engine, WindowFeeder
from echoic.training import checkpoint
from tests.tiny import tiny_model

MODELS = {
    "bigru-chunk4-ctx2": dict(chunk_frames=4, context_frames=2),
    "bilstm-chunk3-ctx2": dict(rnn_type="lstm", chunk_frames=3, context_frames=2),
    "unigru-rowconv3": dict(bidirectional=False, context_frames=3),
    "birnn-relu-chunk4": dict(rnn_type="rnn", chunk_frames=4, context_frames=1),
    "bigru-full-context": dict(),
}
STREAMABLE = [m for m in MODELS if m != "bigru-full-context"]


_model = tiny_model


def _save_checkpoint(path: Path, model: DeepSpeech2) -> Path:
    """A checkpoint with what export reads (the rest at Checkpoint's defaults)."""
    saved = Checkpoint(
        model=model.state_dict(),
        model_config=to_dict(model.cfg),
        config_hash="0123456789abcdef",
        step=42,
    )
    return checkpoint.save_atomic(saved.to_dict(), path)


@pytest.mark.parametrize(
    ("saved", "message"),
    [
        pytest.param({"model": {}}, "format echoic-checkpoint-1 expected", id="no-format"),
        pytest.param([1, 2], "format echoic-checkpoint-1 expected", id="not-a-dict"),
        pytest.param({"format": FORMAT, "model": {}}, "without model_config", id="no-config"),
    ],
)
def test_a_checkpoint_that_is_not_one_is_named(saved, message: str, tmp_path: Path) -> None:
    torch.save(saved, tmp_path / "last.pt")
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path / "last.pt")


def test_a_checkpoint_reads_back_what_was_written(tmp_path: Path) -> None:
    """The file is a plain dict (readable without echoic's class); keys a later version
    adds are left out when this one reads it."""
    model = _model()
    path = _save_checkpoint(tmp_path / "last.pt", model)
    raw = torch.load(path, weights_only=False)
    assert raw["format"] == FORMAT and raw["step"] == 42 and raw["world_size"] == 1
    torch.save({**raw, "from_a_later_version": 1}, path)
    back = load_checkpoint(path)
    assert (back.step, back.config_hash, back.model_config) == (
        42,
        raw["config_hash"],
        raw["model_config"],
    )
    assert back.model.keys() == model.state_dict().keys()


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Path]]:
    """Model id -> (checkpoint, exported model directory), each exported once per module."""
    root = tmp_path_factory.mktemp("export")
    cache: dict[str, tuple[Path, Path]] = {}

    def get(model_id: str) -> tuple[Path, Path]:
        if model_id not in cache:
            ckpt = _save_checkpoint(root / f"{model_id}.pt", _model(**MODELS[model_id]))
            cache[model_id] = ckpt, export_model(ckpt, root / "repo" / model_id / "1")
        return cache[model_id]

    return get


def _audio(seconds: float, seed: int) -> np.ndarray:
    """A chirp in noise at 16 kHz: speech-like enough to give every feature bin energy."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    chirp = 0.3 * np.sin(2 * np.pi * (200 + 900 * t) * t)
    return (chirp + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def _torch_offline(ckpt: Path, feats: list[np.ndarray]) -> list[np.ndarray]:
    model, _ = load_model(ckpt)
    with torch.no_grad():
        batch = torch.nn.utils.rnn.pad_sequence(
            [torch.from_numpy(f) for f in feats], batch_first=True
        )
        log_probs, lengths = model(batch, torch.tensor([len(f) for f in feats]))
    return [lp[: int(n)].numpy() for lp, n in zip(log_probs, lengths, strict=True)]


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True) if x.size)


# ---------------------------------------------------------------- the card


def test_model_card_round_trips(exported) -> None:
    ckpt, model_dir = exported("bigru-chunk4-ctx2")
    model, saved = load_model(ckpt)
    want = build_card(model, saved, name="echoic-ds2", version="1", chunk=4)
    offline, stream = read_card(model_dir / "model.onnx"), read_card(model_dir / "stream.onnx")
    assert offline == stream == want == ModelCard.from_json(want.to_json())
    cfg = model.cfg
    assert offline.vocabulary == cfg.vocabulary and offline.blank_id == 0
    assert offline.features == cfg.features and offline.sample_rate == 16000
    assert (offline.chunk_frames, offline.context_frames) == (4, 2)
    assert offline.window_input_frames == cfg.window_input_frames(4)
    assert (offline.time_stride, offline.pad_left) == (cfg.time_stride, cfg.pad_left)
    assert [(s.input, s.output, s.shape) for s in offline.states] == [
        ("state_h.0", "next_state_h.0", (1, "batch", 12)),
        ("state_h.1", "next_state_h.1", (1, "batch", 12)),
    ]
    # Exactly the buffer's float32 values: a client pads with them to get normalised 0.
    assert np.array_equal(np.float32(offline.feature_mean), model.feature_mean.numpy())
    assert (offline.config_hash, offline.training_step) == ("0123456789abcdef", 42)
    metadata = {p.key: p.value for p in onnx.load(model_dir / "model.onnx").metadata_props}
    assert metadata["echoic.name"] == "echoic-ds2" and metadata["echoic.version"] == "1"
    assert json.loads(metadata[CARD_KEY])["format"] == "echoic-model-card-1"


def test_name_and_version_options(exported, tmp_path: Path) -> None:
    ckpt, _ = exported("unigru-rowconv3")
    numbered = export_model(ckpt, tmp_path / "uni" / "7", stream_chunk=5)
    assert (read_card(numbered / "model.onnx").version, Engine(numbered).card.chunk_frames) == (
        "7",
        5,
    )
    named = export_model(ckpt, tmp_path / "elsewhere", name="uni-small", version="2024.1")
    card = read_card(named / "stream.onnx")
    assert (card.name, card.version) == ("uni-small", "2024.1")


# ---------------------------------------------------------------- offline


@pytest.mark.parametrize("model_id", list(MODELS))
def test_offline_onnx_equals_torch(exported, model_id: str) -> None:
    ckpt, model_dir = exported(model_id)
    engine = Engine(model_dir, intra_op_threads=1)
    rng = np.random.default_rng(1)
    for lengths in ([1], [40, 13], [77, 2, 50, 31]):
        feats = [rng.standard_normal((n, 20)).astype(np.float32) for n in lengths]
        assert _max_diff(engine.offline(feats), _torch_offline(ckpt, feats)) <= 1e-4


def test_offline_handles_empty_utterances(exported) -> None:
    _, model_dir = exported("bigru-chunk4-ctx2")
    engine = Engine(model_dir)
    empty, some = np.zeros((0, 20), np.float32), np.ones((9, 20), np.float32)
    assert [x.shape for x in engine.offline([empty, some])] == [(0, 29), (5, 29)]
    assert [x.shape for x in engine.offline([empty])] == [(0, 29)]
    assert engine.offline([]) == []


# ---------------------------------------------------------------- streaming


def _stream_audio(engine: Engine, audios: list[np.ndarray], piece_ms: list[int]) -> list:
    """Stream several recordings at once, as the server does: audio arrives in pieces,
    features come from FeatureStream, and each step batches the ready streams."""
    streams = [FeatureStream(engine.card.features) for _ in audios]
    feeders = [WindowFeeder(engine.card) for _ in audios]
    states = [engine.initial_state(1) for _ in audios]
    outputs: list[list[np.ndarray]] = [[] for _ in audios]
    sent = [0] * len(audios)
    tick = 0
    while not all(f.done for f in feeders):
        for i, (stream, feeder, audio) in enumerate(zip(streams, feeders, audios, strict=True)):
            if feeder.finished:
                continue
            n = piece_ms[(i + tick) % len(piece_ms)] * 16
            feeder.accept(stream.accept(audio[sent[i] : sent[i] + n]))
            sent[i] += n
            if sent[i] >= len(audio):
                feeder.finish()
        tick += 1
        ready = [i for i, f in enumerate(feeders) if f.ready()]
        if not ready:
            continue
        windows, out_frames = zip(*(feeders[i].next_window() for i in ready), strict=True)
        batch = engine.gather_states([states[i] for i in ready])
        log_probs, new = engine.stream_step(np.stack(windows), np.array(out_frames), batch)
        for row, (i, state) in enumerate(zip(ready, engine.scatter_states(new), strict=True)):
            states[i] = state
            outputs[i].append(log_probs[row, : min(feeders[i].chunk, out_frames[row])])
    for feeder in feeders:
        assert feeder.done  # every window of the stream was taken
    return [np.concatenate(o) for o in outputs]


@pytest.mark.parametrize("model_id", STREAMABLE)
def test_streaming_onnx_equals_offline_onnx(exported, model_id: str) -> None:
    ckpt, model_dir = exported(model_id)
    engine = Engine(model_dir, intra_op_threads=1)
    audios = [_audio(s, seed) for seed, s in enumerate([1.03, 0.31, 0.6, 0.05])]
    streamed = _stream_audio(engine, audios, piece_ms=[30, 70, 10, 250])
    feats = [compute_features(a, engine.card.features) for a in audios]
    offline = engine.offline(feats)
    assert _max_diff(streamed, offline) <= 1e-4
    assert _max_diff(streamed, _torch_offline(ckpt, feats)) <= 1e-4


def test_window_feeder_waits_for_whole_windows(exported) -> None:
    _, model_dir = exported("bigru-chunk4-ctx2")
    card = Engine(model_dir).card
    feeder = WindowFeeder(card)
    real_frames_needed = card.window_input_frames - card.pad_left
    feeder.accept(np.zeros((real_frames_needed - 1, 20), np.float32))
    assert not feeder.ready()
    feeder.accept(np.zeros((1, 20), np.float32))
    window, out_frames = feeder.next_window()
    assert window.shape == (card.window_input_frames, 20) and out_frames == 6
    assert np.array_equal(window[0], np.float32(card.feature_mean))  # left padding
    assert not feeder.ready()
    feeder.accept(np.zeros((18, 20), np.float32))  # 33 frames: 17 output frames
    before_end = []
    while feeder.ready():
        before_end.append(feeder.next_window()[1])
    feeder.finish()  # the rest, padded with the mean, with fewer valid output frames
    at_end = [feeder.next_window()[1] for _ in range(2)]
    assert (before_end, at_end) == ([6, 6], [5, 1])
    assert feeder.done and feeder.total_output_frames == 17


# ---------------------------------------------------------------- refusing to export


def _nan_weights(model: DeepSpeech2) -> None:
    with torch.no_grad():
        model.head.weight[0, 0] = math.nan


@pytest.mark.parametrize(
    ("corrupt", "tolerance", "message"),
    [
        pytest.param(_nan_weights, 1e-4, "not finite", id="nan-weights"),
        pytest.param(None, 1e-12, "tolerance 1e-12", id="tolerance-too-tight"),
    ],
)
def test_export_refuses_a_model_onnx_does_not_reproduce(
    tmp_path: Path, corrupt, tolerance: float, message: str
) -> None:
    model = _model(**MODELS["bigru-chunk4-ctx2"])
    if corrupt:
        corrupt(model)
    ckpt = _save_checkpoint(tmp_path / "bad.pt", model)
    repo = tmp_path / "repo"
    with pytest.raises(ExportError, match=re.escape(message)):
        export_model(ckpt, repo / "bad" / "1", tolerance=tolerance)
    assert list((repo / "bad").iterdir()) == []  # not even the temporary directory


def test_export_refuses_an_existing_directory(exported, tmp_path: Path) -> None:
    ckpt, _ = exported("bigru-chunk4-ctx2")
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="already exists"):
        export_model(ckpt, tmp_path / "1")
    assert [p.name for p in (tmp_path / "1").iterdir()] == ["keep.txt"]


@pytest.mark.parametrize(
    ("model_id", "chunk", "message"),
    [
        pytest.param("bigru-chunk4-ctx2", 8, "trained with", id="bidi-other-chunk"),
        pytest.param("bigru-full-context", 4, "cannot stream", id="full-context-chunk"),
        pytest.param("unigru-rowconv3", 0, "at least 1", id="zero-chunk"),
    ],
)
def test_bad_stream_chunk(exported, tmp_path: Path, model_id: str, chunk: int, message: str):
    ckpt, _ = exported(model_id)
    with pytest.raises(ExportError, match=message):
        export_model(ckpt, tmp_path / "1", stream_chunk=chunk)
    assert not (tmp_path / "1").exists()


def test_export_is_deterministic(exported, tmp_path: Path) -> None:
    ckpt, first = exported("bilstm-chunk3-ctx2")
    again = export_model(ckpt, tmp_path / "1")
    for name in ("model.onnx", "stream.onnx", "export.json"):
        assert (first / name).read_bytes() == (again / name).read_bytes(), name


# ---------------------------------------------------------------- bad model directories


def _edit_card(path: Path, edit: Callable[[dict], dict | None]) -> None:
    proto = onnx.load(path)
    props = {p.key: p.value for p in proto.metadata_props}
    card = edit(json.loads(props.pop(CARD_KEY)))
    if card is not None:
        props[CARD_KEY] = json.dumps(card)
    del proto.metadata_props[:]
    for key, value in props.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(proto, path)


def _drop_last_symbol(card: dict) -> dict:
    return card | {"vocabulary": card["vocabulary"][:-1]}


BROKEN = [
    pytest.param(lambda d: shutil.rmtree(d), "", id="missing-dir"),
    pytest.param(lambda d: (d / "model.onnx").unlink(), "model.onnx", id="missing-model-onnx"),
    pytest.param(
        lambda d: (d / "model.onnx").write_bytes(b"\x08garbage" * 64), "model.onnx", id="garbage"
    ),
    pytest.param(
        lambda d: _edit_card(d / "model.onnx", lambda c: None), "model.onnx", id="no-card"
    ),
    pytest.param(
        lambda d: _edit_card(d / "model.onnx", _drop_last_symbol),
        "model.onnx",
        id="card-vocabulary-not-V",
    ),
    pytest.param(
        lambda d: _edit_card(d / "model.onnx", lambda c: c | {"format": "other-9"}),
        "model.onnx",
        id="card-format-unknown",
    ),
    pytest.param(
        lambda d: _edit_card(d / "model.onnx", lambda c: c | {"chunk_frames": "four"}),
        "model.onnx",
        id="card-invalid",
    ),
    pytest.param(
        lambda d: _edit_card(d / "stream.onnx", lambda c: c | {"version": "2"}),
        "stream.onnx",
        id="stream-card-differs",
    ),
    pytest.param(
        lambda d: (d / "stream.onnx").write_bytes(b"not onnx"), "stream.onnx", id="stream-garbage"
    ),
]


@pytest.mark.parametrize(("breakage", "culprit"), BROKEN)
def test_bad_model_directory(exported, tmp_path: Path, breakage, culprit: str) -> None:
    _, good = exported("bigru-chunk4-ctx2")
    model_dir = shutil.copytree(good, tmp_path / "model")
    breakage(model_dir)
    with pytest.raises(ModelError, match=re.escape(str(model_dir / culprit))):
        Engine(model_dir)


def test_read_card_names_the_mismatched_file(exported, tmp_path: Path) -> None:
    _, good = exported("bigru-chunk4-ctx2")
    path = shutil.copy(good / "model.onnx", tmp_path / "model.onnx")
    _edit_card(Path(path), _drop_last_symbol)
    with pytest.raises(ModelError, match=re.escape(f"{path}: log_probs has shape")):
        read_card(path)


@pytest.mark.parametrize(
    ("model_id", "why"),
    [
        pytest.param("bigru-full-context", "full-context", id="not-streamable"),
        pytest.param("bigru-chunk4-ctx2", "missing", id="stream-onnx-deleted"),
    ],
)
def test_streaming_without_stream_onnx(exported, tmp_path: Path, model_id: str, why: str):
    _, good = exported(model_id)
    model_dir = shutil.copytree(good, tmp_path / "model")
    (model_dir / "stream.onnx").unlink(missing_ok=True)
    engine = Engine(model_dir)
    assert not engine.streamable and engine.offline([np.zeros((5, 20), np.float32)])
    with pytest.raises(ModelError, match=re.escape(str(model_dir / "stream.onnx")) + ".*" + why):
        engine.initial_state(1)


def test_unavailable_provider_is_a_clear_error(exported) -> None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("CUDAExecutionProvider is available here")
    _, model_dir = exported("bigru-chunk4-ctx2")
    with pytest.raises(ModelError, match=r"CUDAExecutionProvider is not available.*echoic\[gpu\]"):
        Engine(model_dir, providers=("CUDAExecutionProvider", "CPUExecutionProvider"))


# ---------------------------------------------------------------- boundaries and CLI


def test_engine_and_card_are_torch_free() -> None:
    code = (
        "import sys, echoic.model.runtime.engine, echoic.model.runtime.card\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'grpc'})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_cli_export(exported, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt, _ = exported("unigru-rowconv3")
    assert (
        main(["export", str(ckpt), str(tmp_path / "uni" / "3"), "--stream-chunk", "5", "--json"])
        == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert (summary["version"], summary["chunk_frames"]) == ("3", 5)
    assert summary["files"] == ["export.json", "model.onnx", "stream.onnx"]
    assert max(c["max_abs_diff"] for c in summary["parity"]["offline"]) <= 1e-4
    assert summary["parity"]["stream"]["max_abs_diff"] <= 1e-4
    assert main(["export", str(ckpt), str(tmp_path / "uni" / "3")]) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith("echoic export: error:") and "already exists" in err and err.count("\n") == 1
    )


def test_the_server_serves_a_model_that_cannot_stream(exported) -> None:
    """A full-context BiRNN (no stream.onnx): Recognize requests, two at a time so the
    dispatcher batches them through model.onnx, give exactly the in-process transcripts
    (words, times and confidences); StreamingRecognize says why it cannot."""
    import concurrent.futures

    import grpc

    from echoic.model.core.audio import decode_audio
    from echoic.model.runtime.recognizer import Recognizer
    from echoic.protos.v1 import transcriber_pb2_grpc as pb_grpc
    from tests.test_server import channel_to, linear16, recognize, running, status_of, stream

    _, model_dir = exported("bigru-full-context")
    assert not (model_dir / "stream.onnx").exists()
    sent = [_audio(1.3, seed=21), _audio(2.1, seed=22), _audio(0.7, seed=23)]
    pcm = [(np.clip(a, -1, 1) * 32767).astype("<i2").tobytes() for a in sent]
    audios = [decode_audio(p, 16000, encoding="linear16", sample_rate=16000) for p in pcm]
    local = Recognizer(model_dir, intra_op_threads=1)
    want = [local.transcribe([a])[0] for a in audios]
    assert any(t.words for t in want), "random weights should still spell something"
    config = linear16(enable_word_time_offsets=True)
    with running(model_dir, max_wait_ms=50) as server, channel_to(server) as channel:
        stub = pb_grpc.TranscriberStub(channel)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda data: recognize(stub, data, config), pcm))
        code, message = status_of(lambda: stream(stub, pcm[0], config))
    for response, audio, transcript in zip(got, audios, want, strict=True):
        (result,) = response.results
        best = result.alternatives[0]
        assert result.is_final and best.transcript == transcript.text
        assert [w.word for w in best.words] == [w.text for w in transcript.words]
        times = [t for w in best.words for t in (w.start_time, w.end_time, w.confidence)]
        want_times = [t for w in transcript.words for t in (w.start, w.end, w.confidence)]
        assert times == pytest.approx(want_times, abs=1e-6)
        assert response.audio_processed_seconds == pytest.approx(len(audio) / 16000, abs=1e-3)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "cannot stream" in message


# ---------------------------------------------------------------- back from an export


def _with_trained_norms(model: DeepSpeech2, seed: int) -> DeepSpeech2:
    """Every norm with statistics and affine parameters away from their initial values,
    as training leaves them (an export folds them away; a rebuild must cope)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "running_var"):
                n = m.running_var.numel()
                m.running_mean.copy_(torch.randn(n, generator=g) * 0.5)
                m.running_var.copy_(torch.rand(n, generator=g) * 2 + 0.2)
                m.weight.copy_(torch.rand(n, generator=g) + 0.5)
                m.bias.copy_(torch.randn(n, generator=g) * 0.3)
    return model


def _features_batch(
    model: DeepSpeech2, seconds: tuple[float, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    feats = [torch.from_numpy(compute_features(_audio(s, i), model.cfg.features))
             for i, s in enumerate(seconds)]  # fmt: skip
    return (torch.nn.utils.rnn.pad_sequence(feats, batch_first=True),
            torch.tensor([len(f) for f in feats]))  # fmt: skip


def test_rebuild_gives_back_the_exported_network(tmp_path: Path) -> None:
    """The recurrent and output weights come back bit for bit, the folded norms as the
    same function: the rebuilt network computes what the checkpoint did."""
    from echoic.model.nn.rebuild import rebuild

    original = _with_trained_norms(_model(**MODELS["bigru-chunk4-ctx2"]), seed=3).eval()
    ckpt = _save_checkpoint(tmp_path / "trained.pt", original)
    out = export_model(ckpt, tmp_path / "repo" / "m" / "1")
    rebuilt, info = rebuild(out)
    assert info["model_config"] == original.cfg and info["model_config_matches"]
    assert info["step"] == 42 and info["parity_max_abs_diff"] <= 1e-4
    theirs, ours = original.state_dict(), rebuilt.state_dict()
    exact = [
        k for k in theirs if ".fwd." in k or ".bwd." in k or k.startswith(("head.", "feature_"))
    ]
    assert len(exact) == 4 * 2 * original.cfg.rnn_layers + 4
    for key in exact:
        assert torch.equal(theirs[key], ours[key]), key
    features, lengths = _features_batch(original, (0.7, 1.3, 0.2))
    with torch.no_grad():
        want, got = original(features, lengths)[0], rebuilt(features, lengths)[0]
    assert float((want - got).abs().max()) < 1e-5
    assert rebuild(out / "model.onnx")[1]["source"] == str(out)  # the graph's path works too


@pytest.mark.parametrize("model_id", ["bilstm-chunk3-ctx2", "unigru-rowconv3"])
def test_rebuild_says_which_models_it_cannot_rebuild(exported, model_id: str) -> None:
    from echoic.model.nn.rebuild import RebuildError, rebuild

    with pytest.raises(
        RebuildError, match="supports bidirectional GRU models.*training checkpoint"
    ):
        rebuild(exported(model_id)[1])


def test_recalibrated_norms_keep_the_function_and_fit_training_mode(tmp_path: Path) -> None:
    """After `recalibrate_norms` on some audio, eval mode computes what it did, and
    training mode (batch statistics) on that audio computes nearly the same: without it,
    the first fine-tuning steps would start from another function."""
    import copy

    from echoic.model.nn.rebuild import rebuild, recalibrate_norms

    original = _with_trained_norms(_model(**MODELS["bigru-chunk4-ctx2"]), seed=4).eval()
    out = export_model(_save_checkpoint(tmp_path / "t.pt", original), tmp_path / "r" / "m" / "1")
    rebuilt, _ = rebuild(out)
    calibration = _features_batch(original, (0.9, 1.1, 0.6, 1.4))
    features, lengths = _features_batch(original, (1.0, 1.2, 0.8, 1.3))

    def run(model: DeepSpeech2, train: bool) -> torch.Tensor:
        model.train(train)
        with torch.no_grad():
            return model(copy.deepcopy(features), lengths)[0]

    before_eval, before_train = run(rebuilt, False), run(copy.deepcopy(rebuilt), True)
    frames = recalibrate_norms(rebuilt, [calibration])
    assert frames == sum(original.cfg.output_frames(int(n)) for n in calibration[1])
    after_eval, after_train = run(rebuilt, False), run(rebuilt, True)
    assert float((after_eval - before_eval).abs().max()) < 1e-4
    gap_before = float((before_train - before_eval).abs().mean())
    gap_after = float((after_train - after_eval).abs().mean())
    assert gap_after < gap_before / 3, (gap_before, gap_after)


@pytest.mark.parametrize("model_id", ["bigru-chunk4-ctx2", "unigru-rowconv3", "bilstm-chunk3-ctx2"])
def test_export_quantize_int8(
    exported, speech_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], model_id
) -> None:
    """int8 straight from a checkpoint: the card says so, streamed log-probs equal the
    offline graph's (both graphs quantize with the same scales), and the int8 graphs
    stay near the fp32 export on speech."""
    from echoic.model.core.audio import load_audio
    from echoic.model.nn.export import _stream_all

    ckpt, fp32_dir = exported(model_id)
    out = tmp_path / model_id / "2"
    args = ["export", str(ckpt), str(out), "--quantize", "int8", "--calibration"]
    assert main([*args, str(speech_corpus), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"] == "int8"
    engine, fp32 = Engine(out), Engine(fp32_dir)
    assert engine.card.precision == "int8" and engine.card == read_card(out / "stream.onnx")
    rows = [json.loads(line) for line in speech_corpus.read_text().splitlines()[:4]]
    audio = [load_audio(speech_corpus.parent / r["audio_filepath"], 16000) for r in rows]
    feats = [compute_features(a, engine.card.features) for a in audio]
    offline = engine.offline(feats)
    streamed, _ = _stream_all(engine, feats, np.random.default_rng(0))
    for s, o, f in zip(streamed, offline, fp32.offline(feats), strict=True):
        assert np.abs(s - o).max() <= 1e-4
        assert np.abs(np.exp(o) - np.exp(f)).max() <= 0.35


def test_export_quantize_needs_calibration(exported, tmp_path: Path, capsys) -> None:
    ckpt, _ = exported("bigru-chunk4-ctx2")
    assert main(["export", str(ckpt), str(tmp_path / "q"), "--quantize", "int8"]) == 1
    assert "--calibration MANIFEST" in capsys.readouterr().err
    with pytest.raises(ExportError, match="calibration audio"):
        export_model(ckpt, tmp_path / "q", quantize="int8")
    assert not (tmp_path / "q").exists()


def test_a_blend_of_two_exports_is_the_weighted_mean_of_their_weights(tmp_path: Path) -> None:
    """training/blend.py: a fine-tune and the model it started from, blended in the form
    both exports share (norms folded), as a checkpoint that exports; weight 0 is the base,
    1 the fine-tune; two different networks are refused."""
    from echoic.model.nn.rebuild import rebuild
    from echoic.training.blend import BlendError, blend
    from echoic.training.blend import main as blend_main

    dirs = []
    for seed in (3, 4):
        torch.manual_seed(seed)
        net = _with_trained_norms(_model(**MODELS["bigru-chunk4-ctx2"]), seed=seed).eval()
        ckpt = _save_checkpoint(tmp_path / f"m{seed}.pt", net)
        dirs.append(export_model(ckpt, tmp_path / "repo" / f"m{seed}" / "1"))
    base, tuned = (rebuild(d)[0].state_dict() for d in dirs)
    for weight, want in ((0.0, base), (1.0, tuned)):
        net, _ = blend(*dirs, weight)
        assert all(torch.equal(net.state_dict()[k], want[k]) for k in want), weight
    net, ckpt = blend(*dirs, 0.25)
    for key, value in net.state_dict().items():
        if value.is_floating_point():
            assert torch.allclose(value, 0.75 * base[key] + 0.25 * tuned[key], atol=1e-6), key
    saved = tmp_path / "blend.pt"
    blend_main([str(d) for d in dirs] + ["--weight", "0.25", "--out", str(saved)])
    written = load_checkpoint(saved)
    assert written.model_config == ckpt.model_config and written.config_hash == ckpt.config_hash
    # its own config hash, made of the two it blends and the weight: its card tells it apart
    assert written.train_config["blend"]["weight"] == 0.25
    assert written.config_hash not in {rebuild(d)[1]["config_hash"] for d in dirs}
    out = export_model(saved, tmp_path / "repo" / "blend" / "1")  # its parity check passes
    again = rebuild(out)[0].state_dict()
    assert all(torch.allclose(again[k], v, atol=1e-6) for k, v in net.state_dict().items())
    other = _save_checkpoint(tmp_path / "other.pt", _model(**MODELS["bigru-full-context"]))
    with pytest.raises(BlendError, match="different networks"):
        blend(dirs[0], export_model(other, tmp_path / "repo" / "other" / "1"), 0.5)
    with pytest.raises(BlendError, match="between 0 and 1"):
        blend(*dirs, 1.5)


# ---------------------------------------------------------------- weights stored as float16


def test_float16_weights_halve_the_files_and_keep_parity(tmp_path: Path) -> None:
    """export --weights float16: the graphs reproduce the rounded network within the usual
    tolerance (streaming equal to offline), the large weights are stored as float16, the
    files are about half, and the report says how far the rounding moved the output."""
    from echoic.model.nn.half import MIN_ELEMENTS, half_weights

    model = _with_trained_norms(_model(**MODELS["bigru-chunk4-ctx2"], rnn_hidden=48), seed=5)
    ckpt = _save_checkpoint(tmp_path / "m.pt", model)
    full = export_model(ckpt, tmp_path / "full" / "1")
    half = export_model(ckpt, tmp_path / "half" / "1", weights="float16")
    for name in ("model.onnx", "stream.onnx"):
        proto = onnx.load(str(half / name))
        stored = [t for t in proto.graph.initializer if t.data_type == onnx.TensorProto.FLOAT16]
        assert stored and half_weights(proto) == len(stored)
        assert all(math.prod(t.dims) >= MIN_ELEMENTS for t in stored)
        # this small network's float32 share (norms, biases, the mel filterbank) is larger
        # than a real one's: the 5 x 320 default model's graphs are 0.51 of their float32 size
        assert (half / name).stat().st_size < 0.7 * (full / name).stat().st_size
    report = json.loads((half / "export.json").read_text())
    assert report["parity"]["stream"]["max_abs_diff"] <= 1e-4
    assert max(c["max_abs_diff"] for c in report["parity"]["offline"]) <= 1e-4
    weights = report["weights"]
    assert weights["dtype"] == "float16" and weights["values_rounded"] > 0
    # every value rounded is stored as float16 (the convolutions are neither)
    assert weights["stored"]["model.onnx"]["values"] == weights["values_rounded"]
    assert weights["stored"]["model.onnx"]["tensors"] == half_weights(
        onnx.load(str(half / "model.onnx"))
    )
    assert 0 < weights["max_abs_log_prob_change"] < 0.05
    # the same audio through both: float16 storage moves the log-probs by the rounding alone
    feats = [compute_features(_audio(s, i), model.cfg.features) for i, s in enumerate((0.9, 0.4))]
    moved = _max_diff(Engine(full).offline(feats), Engine(half).offline(feats))
    assert 0 < moved < 0.05
    assert read_card(half / "model.onnx") == read_card(full / "model.onnx")


def test_float16_weights_rebuild_and_quantize(tmp_path: Path) -> None:
    """A float16-stored export rebuilds into the rounded network (for fine-tuning) and
    quantizes to int8 from its float32 values (`echoic quantize` of the bundled model);
    export refuses both at once, saying what to do."""
    from echoic.model.nn.half import half_weights, round_weights
    from echoic.model.nn.quantize import quantize_model
    from echoic.model.nn.rebuild import rebuild

    model = _with_trained_norms(_model(**MODELS["bigru-chunk4-ctx2"], rnn_hidden=48), seed=6)
    ckpt = _save_checkpoint(tmp_path / "m.pt", model)
    half = export_model(ckpt, tmp_path / "half" / "1", weights="float16")
    rebuilt, info = rebuild(half)
    assert info["parity_max_abs_diff"] <= 1e-4
    round_weights(model)
    theirs, ours = model.state_dict(), rebuilt.state_dict()
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs if ".fwd." in k or ".bwd." in k)
    with pytest.raises(ExportError, match="drop --weights float16"):
        export_model(ckpt, tmp_path / "q" / "1", weights="float16", quantize="int8",
                     calibration=[_audio(1.0, 0)])  # fmt: skip
    int8 = quantize_model(half, tmp_path / "int8", [_audio(1.0, 0), _audio(0.6, 1)])
    assert read_card(int8 / "model.onnx").precision == "int8"
    for name in ("model.onnx", "stream.onnx"):
        proto = onnx.load(str(int8 / name))
        assert not half_weights(proto)
        assert any(n.op_type == "DequantizeLinear" for n in proto.graph.node)
    assert not [p for p in int8.iterdir() if p.name.startswith(".")]  # no scratch left
    with pytest.raises(ExportError, match="unknown weights 'bfloat16'"):
        export_model(ckpt, tmp_path / "b" / "1", weights="bfloat16")
