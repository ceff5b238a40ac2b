"""`echoic import-model nemo`: tiny random NeMo CTC models made, saved and exported by NeMo
3.0.0 itself (tests/fixtures/nemo/, made once by scripts/make_nemo_fixtures.py; NeMo is
not installed here), imported, and checked against NeMo's own numbers on a real clip:
its preprocessor's features, its model's log-probs, its greedy transcript, and what a
real server answers.

`chars` is an EncDecCTCModel with a QuartzNet-style ConvASR encoder over characters;
`bpe` an EncDecCTCModelBPE with a Conformer encoder over a SentencePiece BPE tokenizer.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("onnx", reason="the import extra is not installed")
yaml = pytest.importorskip("yaml", reason="the import extra is not installed")

from echoic.model.core.decoding import GreedyDecoder  # noqa: E402
from echoic.model.core.features import NemoFeatureConfig, nemo_features  # noqa: E402
from echoic.model.runtime.card import open_session, read_card  # noqa: E402
from echoic.model.runtime.recognizer import Recognizer  # noqa: E402
from tests.streaming import stream_all  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "nemo"
KINDS = ("chars", "bpe")
FEATURE_TOLERANCE = 5e-5  # max |echoic's features - NeMo's| (normalised log-mel units)
TOLERANCE = 1e-4  # max |log-prob difference| between echoic's engine and NeMo
MEL_BINS = {"chars": 64, "bpe": 80}


def clip() -> np.ndarray:
    samples, _ = sf.read(FIXTURES / "clip.flac", dtype="float32")
    return samples


def nemo_numbers(kind: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / f"{kind}.npz") as data:
        return dict(data)


@pytest.fixture(scope="module")
def nemo_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each fixture's ONNX export imported with its .nemo's config and tokenizer."""
    from echoic.model.nn.nemo_import import import_nemo

    root = tmp_path_factory.mktemp("nemo-models")
    return {
        kind: import_nemo(
            FIXTURES / f"{kind}.onnx", root / kind / "1", nemo=FIXTURES / f"{kind}.nemo"
        )
        for kind in KINDS
    }


def to_echoic(kind: str, nemo_rows: np.ndarray) -> np.ndarray:
    """NeMo's log-probs (T, V + 1) in echoic's order: the blank (NeMo's last id, with
    <unk> folded in for the BPE model) first."""
    specials = {"bpe": [0], "chars": []}[kind]  # <unk> is the BPE tokenizer's id 0
    blank = [nemo_rows.shape[1] - 1, *specials]
    kept = [i for i in range(nemo_rows.shape[1]) if i not in blank]
    folded = np.logaddexp.reduce(nemo_rows[:, blank], axis=1, keepdims=True)
    return np.concatenate([folded, nemo_rows[:, kept]], axis=1)


def nemo_onnx_log_probs(kind: str) -> list[np.ndarray]:
    """NeMo's exported graph on NeMo's own features, each utterance alone, trimmed."""
    data = nemo_numbers(kind)
    session = open_session(FIXTURES / f"{kind}.onnx")
    names = {i.name for i in session.get_inputs()}
    out = []
    for features, n, frames in zip(
        data["features"], data["feature_lengths"], data["out_lengths"], strict=True
    ):
        width = -(-(int(n) + 1) // 16) * 16  # NeMo's preprocessor: its frames, pad_to 16
        feed = {"audio_signal": features[None, :, :width]}
        if "length" in names:
            feed["length"] = np.array([n])
        out.append(session.run(["logprobs"], feed)[0][0, : int(frames)])
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_features_equal_nemo_preprocessor(kind: str) -> None:
    """echoic's numpy recipe against AudioToMelSpectrogramPreprocessor's own output on
    the clip and on its first 1.3 s (normalised over each utterance's own frames)."""
    data, samples = nemo_numbers(kind), clip()
    cfg = NemoFeatureConfig(window_samples=400, n_fft=512, mel_bins=MEL_BINS[kind])
    for row, (n, frames) in enumerate(
        zip(data["sample_lengths"], data["feature_lengths"], strict=True)
    ):
        got = nemo_features(samples[:n], cfg)
        assert got.shape == (frames, MEL_BINS[kind])
        want = data["features"][row][:, :frames].T
        np.testing.assert_allclose(got, want, atol=FEATURE_TOLERANCE, rtol=0)


def test_the_cards_describe_nemo_models(nemo_dirs: dict[str, Path]) -> None:
    chars, bpe = (read_card(nemo_dirs[k] / "model.onnx") for k in KINDS)
    for card, kind in ((chars, "chars"), (bpe, "bpe")):
        assert (card.input, card.feature_recipe) == ("features", "nemo")
        assert card.nemo_features == NemoFeatureConfig(
            window_samples=400, n_fft=512, mel_bins=MEL_BINS[kind]
        )
        assert card.sample_rate == 16000 and card.hop_ms == 10.0
    # QuartzNet-style: one stride-2 block; NeMo exports its convolutions unmasked.
    assert (chars.source, chars.token_type, chars.batch_padding) == (
        "nemo:EncDecCTCModel", "chars", "alone",
    )  # fmt: skip
    assert (chars.time_stride, chars.output_frame_ms) == (2, 20.0)
    assert chars.vocabulary == ("<blank>", " ", *"abcdefghijklmnopqrstuvwxyz'")
    # Conformer: 4x subsampling, masked attention and convolutions.
    assert (bpe.source, bpe.token_type, bpe.batch_padding) == (
        "nemo:EncDecCTCModelBPE", "bpe", "masked",
    )  # fmt: skip
    assert (bpe.time_stride, bpe.output_frame_ms) == (4, 40.0)
    with tarfile.open(FIXTURES / "bpe.nemo") as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("tokenizer.vocab"))
        text = tar.extractfile(member).read().decode()
    pieces = [line.split("\t")[0] for line in text.splitlines() if line]
    assert pieces[0] == "<unk>"  # folded into the blank
    assert bpe.vocabulary == ("<blank>", *pieces[1:])
    assert bpe.source_tokens == ("<blank>", *pieces[1:])
    report = json.loads((nemo_dirs["bpe"] / "export.json").read_text())
    assert report["source"]["folded_into_blank"] == ["<unk>"]
    assert report["source"]["nemo_toolkit"] == "3.0.0"


@pytest.mark.parametrize("kind", KINDS)
def test_the_engine_gives_nemo_log_probs(nemo_dirs: dict[str, Path], kind: str) -> None:
    """The imported model.onnx on echoic's features, as one batch of the clip and its
    start: NeMo's exported graph on NeMo's features, every frame; and NeMo's torch
    forward, every frame but the last two of the ConvASR model's utterances, which
    NeMo's own export computes from padding (its masked convolutions are turned off)."""
    data, samples = nemo_numbers(kind), clip()
    got = Recognizer(nemo_dirs[kind]).log_probs([samples[:n] for n in data["sample_lengths"]])
    reach = {"chars": 2, "bpe": 0}[kind]
    for g, onnx_rows, torch_rows, frames in zip(
        got, nemo_onnx_log_probs(kind), data["log_probs"], data["out_lengths"], strict=True
    ):
        assert g.shape[0] == frames
        np.testing.assert_allclose(g, to_echoic(kind, onnx_rows), atol=TOLERANCE, rtol=0)
        inner = int(frames) - reach
        want = to_echoic(kind, torch_rows[:inner])
        np.testing.assert_allclose(g[:inner], want, atol=TOLERANCE, rtol=0)


def test_the_server_answers_nemo_greedy_decode(nemo_dirs: dict[str, Path]) -> None:
    """Recognize through a real server: the greedy decode of NeMo's log-probs, with word
    times from the frames; for the BPE model that is NeMo's own greedy transcript."""
    from tests.test_server import channel_to, linear16, pb_grpc, recognize, running

    samples, _ = sf.read(FIXTURES / "clip.flac", dtype="int16")
    wire = samples.astype("<i2").tobytes()  # exactly the float samples NeMo was given
    for kind in KINDS:
        card = read_card(nemo_dirs[kind] / "model.onnx")
        decoder = GreedyDecoder(card.vocab, frame_seconds=card.output_frame_ms / 1000)
        want = decoder.decode(to_echoic(kind, nemo_onnx_log_probs(kind)[0]))
        assert len(want.words) >= 3, "the fixture should spell several words"
        with running(nemo_dirs[kind]) as server, channel_to(server) as channel:
            stub = pb_grpc.TranscriberStub(channel)
            response = recognize(stub, wire, linear16(enable_word_time_offsets=True))
        (result,) = response.results
        best = result.alternatives[0]
        assert best.transcript == want.text
        assert [w.word for w in best.words] == [w.text for w in want.words]
        got = [(w.start_time, w.end_time) for w in best.words]
        np.testing.assert_allclose(got, [(w.start, w.end) for w in want.words], atol=1e-9)
        if kind == "bpe":
            assert best.transcript == " ".join(str(nemo_numbers(kind)["greedy"]).split())


def test_bpe_words_begin_at_word_start_tokens() -> None:
    """Greedy decoding of subword tokens: a word begins at each "▁" token; its time runs
    from its first token's first frame to its last token's last frame."""
    from echoic.model.core.text import BLANK, Vocabulary

    vocab = Vocabulary((BLANK, "\u2581the", "\u2581ca", "t", "s", "\u2581"), "bpe")
    path = [1, 1, 0, 2, 0, 3, 3, 4, 0, 5, 0, 3]  # the | ca t s | ▁ | t
    log_probs = np.full((len(path), vocab.size), -20.0, dtype=np.float32)
    log_probs[np.arange(len(path)), path] = 0.0
    transcript = GreedyDecoder(vocab, frame_seconds=0.04).decode(log_probs)
    assert transcript.text == "the cats t"
    assert [w.text for w in transcript.words] == ["the", "cats", "t"]
    times = [(w.start, w.end) for w in transcript.words]
    np.testing.assert_allclose(times, [(0.0, 0.08), (0.12, 0.32), (0.44, 0.48)], atol=1e-12)
    assert vocab.decode([1, 2, 3, 4, 5, 3]) == "the cats t"


@pytest.mark.parametrize("kind", KINDS)
def test_the_server_streams_a_nemo_model_by_overlapped_chunks(
    nemo_dirs: dict[str, Path], kind: str
) -> None:
    """Streaming: windows of audio, each with NeMo's features over its own samples, the
    middle of each kept; interim results on the way; Recognize still runs it whole."""
    from tests.test_server import (
        RPC_TIMEOUT,
        channel_to,
        finals,
        linear16,
        pb,
        pb_grpc,
        recognize,
        running,
        stream,
    )

    samples, _ = sf.read(FIXTURES / "clip.flac", dtype="int16")
    wire = samples.astype("<i2").tobytes()
    sent = samples.astype(np.float32) / 32768
    streamed = stream_all(Recognizer(nemo_dirs[kind]), sent).text
    offline = Recognizer(nemo_dirs[kind]).transcribe([sent])[0].text
    assert streamed
    with running(nemo_dirs[kind]) as server, channel_to(server) as channel:
        stub = pb_grpc.TranscriberStub(channel)
        (info,) = stub.ListModels(pb.ListModelsRequest(), timeout=RPC_TIMEOUT).models
        responses = stream(stub, wire, linear16(), interim=True)
        whole = recognize(stub, wire, linear16()).results[0].alternatives[0].transcript
    # 1 s chunks and 0.5 s of lookahead, rounded to frames (the Conformer's are 40 ms)
    lookahead = {"chars": 0.5, "bpe": 0.48}[kind]
    assert (info.streamable, info.chunk_seconds) == (True, 1.0)
    assert info.lookahead_seconds == pytest.approx(lookahead)
    interims = [r for r in responses if r.results and not r.results[0].is_final]
    assert interims  # a chunk a second for 2.6 s, before the end
    assert finals(responses) == [streamed]
    assert whole == offline


def test_beam_search_and_lm_fusion_on_subword_tokens(
    nemo_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Beam search over BPE tokens: without an LM its words are spelled from the pieces;
    a word LM (scored at each "▁" boundary) pulls the transcript towards its words."""
    pytest.importorskip("flashlight.lib.text", reason="beam search needs flashlight-text")
    from echoic.model.core.decoding import DecoderConfig
    from echoic.model.core.lm import build_arpa
    from tests.test_server import channel_to, linear16, pb, pb_grpc, recognize, running

    samples, _ = sf.read(FIXTURES / "clip.flac", dtype="int16")
    wire, sent = samples.astype("<i2").tobytes(), samples.astype(np.float32) / 32768
    model = nemo_dirs["bpe"]
    greedy = Recognizer(model).transcribe([sent])[0]
    beam = Recognizer(model, DecoderConfig(kind="beam", beam_size=16, use_lm=False))
    plain = beam.transcribe([sent])[0]
    assert plain.text and len(plain.words) >= 3
    # A word LM of the greedy transcript's words but one, which it has never seen.
    words = [w.text for w in greedy.words]
    unseen = max(words, key=len)
    arpa = tmp_path / "lm.arpa"
    build_arpa([" ".join(w for w in words if w != unseen)] * 5, arpa, order=2)
    fused = Recognizer(
        model, DecoderConfig(kind="beam", beam_size=16, lm_path=str(arpa), lm_weight=2.0)
    ).transcribe([sent])[0]
    spelled = [w.text for w in fused.words]
    assert spelled and unseen not in spelled, (plain.text, fused.text)
    assert set(spelled) <= set(words) - {unseen}, (plain.text, fused.text)
    config = linear16(decoder=pb.DecoderConfig(kind=pb.DecoderConfig.BEAM, beam_size=16))
    with running(model) as server, channel_to(server) as channel:
        stub = pb_grpc.TranscriberStub(channel)
        got = recognize(stub, wire, config).results[0].alternatives[0].transcript
    assert got == plain.text


def test_the_command_imports_and_summarises(tmp_path: Path, capsys) -> None:
    from echoic.cli.main import main

    out = tmp_path / "conformer" / "3"
    args = ["import-model", "nemo", str(FIXTURES / "bpe.onnx"), str(out)]
    assert main([*args, "--nemo", str(FIXTURES / "bpe.nemo"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["name"], summary["version"]) == ("bpe", "3")
    assert summary["source"] == "nemo:EncDecCTCModelBPE"
    assert summary["files"] == ["export.json", "model.onnx"]
    assert max(c["max_abs_diff"] for c in summary["parity"]["onnx"]) <= TOLERANCE
    # The config alone (no tokenizer needed) for a character model.
    config = tmp_path / "model_config.yaml"
    with tarfile.open(FIXTURES / "chars.nemo") as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("model_config.yaml"))
        config.write_bytes(tar.extractfile(member).read())
    out = tmp_path / "quartznet" / "1"
    args = ["import-model", "nemo", str(FIXTURES / "chars.onnx"), str(out), "--config", str(config)]
    assert main(args) == 0
    assert "nemo:EncDecCTCModel: 29 symbols" in capsys.readouterr().out


def _nemo_with(tmp_path: Path, kind: str, change) -> Path:  # noqa: ANN001
    """A copy of the fixture's .nemo with its config changed and/or members dropped."""
    out = tmp_path / f"{kind}-changed.nemo"
    with tarfile.open(FIXTURES / f"{kind}.nemo") as src, tarfile.open(out, "w") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read() if member.isfile() else None
            if data is not None and member.name.endswith("model_config.yaml"):
                config = yaml.safe_load(data)
                change(config)
                data = yaml.safe_dump(config).encode()
                member.size = len(data)
            elif change is no_tokenizer and ("tokenizer" in member.name or "vocab" in member.name):
                continue
            dst.addfile(member, io.BytesIO(data) if data is not None else None)
    return out


def rnnt(config: dict) -> None:
    config["target"] = "nemo.collections.asr.models.EncDecRNNTBPEModel"
    config["joint"] = {"_target_": "nemo.collections.asr.modules.RNNTJoint"}
    config["decoder"] = {"_target_": "nemo.collections.asr.modules.RNNTDecoder"}


def no_tokenizer(config: dict) -> None:
    pass


def squeezeformer(config: dict) -> None:
    config["encoder"]["_target_"] = "nemo.collections.asr.modules.SqueezeformerEncoder"


@pytest.mark.parametrize(
    ("change", "onnx", "message"),
    [
        pytest.param(rnnt, "bpe", "is a transducer (RNNT/TDT", id="rnnt"),
        pytest.param(no_tokenizer, "bpe", "the tokenizer's vocabulary", id="no-tokenizer"),
        pytest.param(squeezeformer, "bpe", "SqueezeformerEncoder is not one", id="encoder"),
        pytest.param(None, "not-nemo", "are not a NeMo CTC export's", id="not-nemo-onnx"),
        pytest.param(None, "chars", "preprocessor gives 80 features per frame", id="other-model"),
        pytest.param(None, "not-a-tar", "not a .nemo file (a tar archive)", id="not-a-tar"),
    ],
)
def test_a_model_echoic_cannot_import_is_one_line_naming_the_file(
    tmp_path: Path,
    capsys,
    nemo_dirs: dict[str, Path],
    change,
    onnx: str,
    message: str,  # noqa: ANN001
) -> None:
    from echoic.cli.main import main

    nemo = _nemo_with(tmp_path, "bpe", change) if change else FIXTURES / "bpe.nemo"
    if onnx == "not-nemo":
        src = nemo_dirs["chars"] / "model.onnx"  # echoic's own signature, not NeMo's
    elif onnx == "not-a-tar":
        src, nemo = FIXTURES / "bpe.onnx", tmp_path / "broken.nemo"
        nemo.write_bytes(b"not a tar archive at all" * 40)
    else:
        src = FIXTURES / f"{onnx}.onnx"
    out = tmp_path / "out"
    assert main(["import-model", "nemo", str(src), str(out), "--nemo", str(nemo)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("echoic import-model: error: ") and message in err, err
    named = str(nemo) if onnx not in ("not-nemo", "chars") else str(src)
    assert named in err, err
    assert not out.exists()


def test_without_nemo_a_nemo_file_alone_says_how_to_import_it(tmp_path: Path, capsys) -> None:
    from echoic.cli.main import main

    if _nemo_installed():
        pytest.skip("nemo_toolkit is installed: the .nemo would be exported by NeMo itself")
    src = FIXTURES / "bpe.nemo"
    assert main(["import-model", "nemo", str(src), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "needs nemo_toolkit" in err and f"--nemo {src}" in err, err


def _nemo_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("nemo") is not None
