"""The bundled default model: present, self-describing, streamable, and it hears speech."""

from __future__ import annotations

import jiwer
import numpy as np
import pytest

from echoic.model.core.decoding import DecoderConfig
from echoic.model.runtime.recognizer import Recognizer, default_model_dir
from tests.streaming import stream_all

pytestmark = pytest.mark.skipif(
    not (default_model_dir() / "model.onnx").is_file(),
    reason="no bundled model in model/default (scripts/train_default.sh makes it)",
)


@pytest.fixture(scope="module")
def recognizer() -> Recognizer:
    return Recognizer(intra_op_threads=1)


def test_card_describes_a_streamable_bidirectional_model(recognizer: Recognizer) -> None:
    card = recognizer.card
    assert card.name == "echoic-en-default" and card.streamable and card.bidirectional
    assert card.sample_rate == 16000 and card.chunk_frames > 0
    assert {"lm.bin", "lm.arpa"} <= {f.name for f in default_model_dir().iterdir()}
    size = sum(f.stat().st_size for f in default_model_dir().iterdir())
    assert size < 40e6


def test_it_transcribes_synthesized_speech(recognizer: Recognizer, corpus_audio) -> None:
    """A loose floor on accuracy, far below what README reports, to catch a broken model."""
    refs = [text for text, _ in corpus_audio[:10]]
    hyps = [t.text for t in recognizer.transcribe([a for _, a in corpus_audio[:10]])]
    assert jiwer.cer(refs, hyps) < 0.35, list(zip(refs, hyps, strict=True))


def test_streaming_equals_offline(recognizer: Recognizer, corpus_audio) -> None:
    audio = corpus_audio[0][1]
    assert stream_all(recognizer, audio, 3000).text == recognizer.transcribe([audio])[0].text


def test_beam_search_with_the_bundled_lm(corpus_audio) -> None:
    rec = Recognizer(decoder=DecoderConfig(kind="beam"), intra_op_threads=1)
    assert rec.lm_path is not None and rec.lm_path.endswith("lm.bin")  # the binary first
    text = rec.transcribe([corpus_audio[1][1]])[0].text
    assert jiwer.cer(corpus_audio[1][0], text) < 0.5
    assert rec.transcribe([np.zeros(1600, np.float32)])[0].text == ""


def test_the_bundled_lm_binary_decodes_as_its_arpa_file(corpus_audio) -> None:
    """lm.bin is lm.arpa in KenLM's binary format (scripts/build_lm_binary.sh): the same
    vocabulary, and the beam search's transcripts are the same with either file."""
    from echoic.model.core.lm import arpa_words, binary_words

    model = default_model_dir()
    words = binary_words(model / "lm.bin")
    assert words[0] == "<unk>" and sorted(words) == sorted(arpa_words(model / "lm.arpa"))
    audio = [a for _, a in corpus_audio[:6]]
    texts = {
        name: [
            t.text for t in Recognizer(
                decoder=DecoderConfig(kind="beam", lm_path=str(model / name)), intra_op_threads=1
            ).transcribe(audio)
        ]
        for name in ("lm.arpa", "lm.bin")
    }  # fmt: skip
    assert texts["lm.bin"] == texts["lm.arpa"] and any(texts["lm.bin"])


def test_the_bundled_lm_loads_without_kenlms_advice_to_build_a_binary(capfd) -> None:
    """KenLM itself, unfiltered (echoic drops its loading chatter, `native.quiet_stderr`),
    says nothing of building a binary file when it loads the LM the model directory
    ships: the binary one (an ARPA-only directory gets the advice)."""
    from flashlight.lib.text.decoder.kenlm import KenLM
    from flashlight.lib.text.dictionary import Dictionary

    from echoic.model.core.lm import lm_words, model_lm

    lm = model_lm(default_model_dir())
    assert lm is not None
    capfd.readouterr()
    KenLM(str(lm), Dictionary(lm_words(lm)))
    err = capfd.readouterr().err
    assert "build a binary file" not in err and "Reading" not in err, err


@pytest.mark.parametrize("kind", ["greedy", "beam"])
def test_a_file_is_cut_at_its_pauses_the_same_whole_or_a_block_at_a_time(corpus_audio, kind):
    """Three utterances joined by 1 s of silence, with the files' endpointing: the whole
    file at once and the same file a block at a time (the path of files over two minutes)
    give the same words and times, one utterance a sentence, none glued over a pause."""
    from echoic.model.core.decoding import FILE_ENDPOINTING

    recognizer = Recognizer(decoder=DecoderConfig(kind), intra_op_threads=1)
    parts = [a for _, a in corpus_audio[:3]]
    pause = np.zeros(16000, np.float32)
    audio = np.concatenate([parts[0], pause, parts[1], pause, parts[2]])
    (whole,) = recognizer.transcribe([audio], endpointing=FILE_ENDPOINTING)
    blocks = recognizer.transcribe_blocks(
        (audio[i : i + 8000] for i in range(0, len(audio), 8000)), endpointing=FILE_ENDPOINTING
    )
    assert whole.text == blocks.text
    assert [t for w in whole.words for t in (w.start, w.end)] == pytest.approx(
        [t for w in blocks.words for t in (w.start, w.end)], abs=1e-6
    )
    pauses = [(len(parts[0]) / 16000, len(parts[0]) / 16000 + 1.0)]
    pauses.append((pauses[0][1] + len(parts[1]) / 16000, pauses[0][1] + len(parts[1]) / 16000 + 1))
    for w in whole.words:
        assert not any(a + 0.1 < w.end and w.start < b - 0.1 for a, b in pauses), w
