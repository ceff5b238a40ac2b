"""Word boosting: a word the bundled model misses comes back when it is boosted, and the
transcripts of the audio that does not hold it stay as they were; in the decoder, through
echoic's API and through Riva's speech_contexts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("flashlight.lib.text", reason="beam search needs flashlight-text")

from echoic.model.core.audio import load_audio  # noqa: E402
from echoic.model.core.decoding import DecoderConfig, _Boost  # noqa: E402
from echoic.model.core.text import normalize_text  # noqa: E402
from echoic.model.runtime.recognizer import Recognizer, default_model_dir  # noqa: E402

BOOSTS = (3.0, 6.0, 10.0)  # nats tried, smallest first


def test_a_boost_is_earned_while_spelling_and_kept_only_by_the_whole_word() -> None:
    boost = _Boost({"hatch": 5.0, "hat": 2.0})
    spelled, total = "", 0.0
    for char in "hatch":
        total += boost.step(spelled, spelled + char)
        spelled += char
    assert total + boost.close("hatch") == pytest.approx(5.0)
    total, spelled = 0.0, ""
    for char in "hath":  # leaves every boosted word at its last letter
        total += boost.step(spelled, spelled + char)
        spelled += char
    assert total + boost.close("hath") == pytest.approx(0.0)
    assert boost.step("", "h") + boost.step("h", "ha") + boost.step("ha", "hat") + boost.close(
        "hat"
    ) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="need the beam decoder"):
        DecoderConfig("greedy", boost=(("x", 1.0),))


def test_a_negative_boost_makes_a_word_less_likely() -> None:
    """A word the LM does not know, boosted below zero, scores lower than unboosted (it
    still pays the unknown-word penalty), and a positive boost waives that penalty."""
    from echoic.model.core.decoding import _KenLM, _words_lm_class
    from echoic.model.core.text import Vocabulary

    vocab = Vocabulary()
    kenlm = _KenLM.shared(default_model_dir() / "lm.arpa")

    def score(boost: dict[str, float]) -> float:
        lm = _words_lm_class()(kenlm, vocab, (0.5, 1.0, 10.0), _Boost(boost) if boost else None)
        state, total = lm.start(False), 0.0
        for char in "zqxv ":
            state, gained = lm.score(state, vocab.index[char])
            total += gained
        return total

    plain, down, up = score({}), score({"zqxv": -5.0}), score({"zqxv": 5.0})
    assert down == pytest.approx(plain - 5.0) and up == pytest.approx(plain + 5.0 + 10.0)


@pytest.fixture(scope="module")
def recovered(speech_corpus: Path) -> dict:
    """A word the bundled model's beam search misses in one corpus utterance, and the
    smallest boost that brings it back with every other utterance unchanged (searched,
    not written in: the corpus is synthesized on this machine)."""
    rows = [json.loads(line) for line in speech_corpus.read_text().splitlines()]
    audios = [load_audio(r["audio_filepath"], 16000) for r in rows]
    beam = Recognizer(default_model_dir(), DecoderConfig("beam"), intra_op_threads=1)
    log_probs = beam.log_probs(audios)
    base = [beam.decode(lp).text for lp in log_probs]
    for i, (row, hyp) in enumerate(zip(rows, base, strict=True)):
        for word in normalize_text(row["text"]).split():
            if word in hyp.split() or len(word) < 4:
                continue
            for nats in BOOSTS:
                boosted = Recognizer(beam.engine, DecoderConfig("beam", boost=((word, nats),)))
                hyps = [boosted.decode(lp).text for lp in log_probs]
                if word in hyps[i].split():
                    others = [j for j in range(len(rows)) if j != i]
                    return dict(index=i, word=word, nats=nats, before=hyp, after=hyps[i],
                                unchanged=all(hyps[j] == base[j] for j in others),
                                audio=audios[i], wav=row["audio_filepath"])  # fmt: skip
    pytest.fail("no missed word of the corpus came back with a boost of up to 10 nats")


def test_a_boosted_word_comes_back_and_the_rest_stays(recovered: dict) -> None:
    assert recovered["word"] not in recovered["before"].split()
    assert recovered["word"] in recovered["after"].split()
    assert recovered["unchanged"], "boosting changed the transcript of other audio"


def test_echoic_and_riva_apis_boost_the_same(recovered: dict) -> None:
    grpc = pytest.importorskip("grpc")
    pytest.importorskip("onnxruntime")
    from echoic.protos.v1 import transcriber_pb2 as pb
    from echoic.protos.v1 import transcriber_pb2_grpc as pb_grpc
    from tests.test_server import channel_to, pcm16, recognize, running, status_of, texts

    audio = pcm16(recovered["audio"])
    boost = pb.WordBoost(words=[recovered["word"].upper()], boost=recovered["nats"])
    beam = pb.DecoderConfig(kind=pb.DecoderConfig.BEAM)
    boosted = pb.DecoderConfig(kind=pb.DecoderConfig.BEAM, boosts=[boost])

    def config(decoder):
        return pb.RecognitionConfig(encoding=pb.RecognitionConfig.LINEAR16,
                                    sample_rate_hertz=16000, decoder=decoder)  # fmt: skip

    with running(default_model_dir()) as server, channel_to(server) as channel:
        stub = pb_grpc.TranscriberStub(channel)
        assert " ".join(texts(recognize(stub, audio, config(beam)))) == recovered["before"]
        assert " ".join(texts(recognize(stub, audio, config(boosted)))) == recovered["after"]
        for bad, says in (
            (pb.DecoderConfig(boosts=[boost]), "need decoder.kind BEAM"),
            (
                pb.DecoderConfig(kind=1, boosts=[pb.WordBoost(words=["x"], boost=500)]),
                "-100 to 100",
            ),
            (pb.DecoderConfig(kind=1, boosts=[pb.WordBoost(words=["w" * 60])]), "over 50"),
            (pb.DecoderConfig(kind=1, boosts=[pb.WordBoost(words=["a"] * 1001)]), "at most 1000"),
        ):
            code, details = status_of(lambda bad=bad: recognize(stub, audio, config(bad)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and says in details, details
        riva = pytest.importorskip("riva.client")
        asr = riva.ASRService(riva.Auth(uri=server.address))
        context = riva.proto.riva_asr_pb2.SpeechContext(
            phrases=[recovered["word"]], boost=4.0 * recovered["nats"]
        )
        rconfig = riva.RecognitionConfig(language_code="en-US", sample_rate_hertz=16000,
                                         encoding=riva.AudioEncoding.LINEAR_PCM,
                                         speech_contexts=[context])  # fmt: skip
        answer = asr.offline_recognize(audio, rconfig)
        assert " ".join(r.alternatives[0].transcript for r in answer.results) == recovered["after"]
