"""Readable transcripts (docs/formatting.md) on every door: echoic's gRPC, Riva's, the OpenAI
HTTP API, the realtime WebSocket (tests/test_http.py) and `echoic transcribe`, against a
real server on the bundled model, with speech synthesized by espeak-ng."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

pytest.importorskip("onnxruntime", reason="formatting runs the tagger on ONNX Runtime")

from echoic.model.core.inverse_text import Token  # noqa: E402
from echoic.model.core.punctuation import (  # noqa: E402
    MAX_ACRONYM,
    apply_tags,
    spoken_case,
    tags_of_prose,
)
from echoic.model.runtime.formatting import (  # noqa: E402
    PUNCT_FILE,
    Formatter,
    Punctuator,
    ends_sentence,
    written_words,
)
from echoic.protos.v1 import transcriber_pb2 as pb  # noqa: E402
from echoic.protos.v1 import transcriber_pb2_grpc as pb_grpc  # noqa: E402
from echoic.server.core.formatting import FORMAT_ON_LOOP_WORDS, format_finals, format_results  # noqa: E402
from echoic.server.core.types import Alternative, Result, Word  # noqa: E402
from tests.test_http import http_server, openai_client  # noqa: E402

TIMEOUT = 60.0
SAID = "the meeting is at three thirty. it costs twenty five dollars. can you come?"
ECHOIC = [sys.executable, "-m", "echoic.cli.main"]


# ---------------------------------------------------------------- without a server


@pytest.mark.parametrize(
    "prose",
    [
        pytest.param("Hello, world. How are you? I am fine.", id="marks-and-capitals"),
        pytest.param("Mr. Smith paid $25 at 3:30 p.m. on Monday.", id="abbreviations-stay"),
        pytest.param("NASA said no.", id="upper"),
    ],
)
def test_tags_read_off_prose_write_it_back(prose: str) -> None:
    tagged = tags_of_prose(prose)
    written = apply_tags([t.token for t in tagged], [t.mark for t in tagged],
                         [t.case for t in tagged])  # fmt: skip
    assert " ".join(written) == prose


@pytest.mark.parametrize(
    ("tokens", "marks", "cases", "written"),
    [
        pytest.param(["the", "fox", "she", "ran"], [0, 2, 0, 3], [0, 0, 0, 0],
                     "The fox. She ran?", id="sentence-starts-take-a-capital"),
        pytest.param(["5th", "of", "may", "ok"], [0, 0, 2, 2], [0, 0, 1, 0],
                     "5th of May. Ok.", id="no-letter-to-raise"),
        pytest.param(["mr.", "smith", "left"], [0, 0, 2], [1, 1, 0],
                     "Mr. Smith left.", id="an-abbreviation-ends-no-sentence"),
    ],
)  # fmt: skip
def test_every_sentence_starts_with_a_capital_whatever_the_tagger_says(
    tokens: list[str], marks: list[int], cases: list[int], written: str
) -> None:
    assert " ".join(apply_tags(tokens, marks, cases)) == written


def test_the_tagger_writes_capitals_only_on_short_words() -> None:
    """A long word's all-capitals becomes a capital (a tagger once wrote "the LABEL og"
    for "the label og"); a short one (an acronym: "USA") keeps them."""
    assert spoken_case(2, "label") == 1 and spoken_case(2, "usa") == 2
    words = "the quick brown for jumps over the label og she sells sea shells in the usa".split()
    tokens = Formatter(inverse=False).format(words)
    assert tokens[0].text == "The"
    assert all(len(t.text.strip(",.?")) <= MAX_ACRONYM or not t.text.isupper() for t in tokens)
    assert any(t.text.strip(",.?") == "USA" for t in tokens)
    for before, after in zip(tokens, tokens[1:], strict=False):
        if before.text.endswith((".", "?")):
            assert after.text[0].isupper(), (before, after)


def test_the_bundled_tagger_is_small_and_carries_its_scores() -> None:
    assert PUNCT_FILE.stat().st_size < 10_000_000  # the budget: under 10 MB
    scores = Punctuator(PUNCT_FILE).scores
    assert {",", ".", "?", "case_accuracy", "mark_offsets", "data"} <= set(scores)


def test_formatting_writes_a_sentence_and_keeps_every_words_span() -> None:
    words = "it costs twenty five dollars at three thirty p m".split()
    tokens = Formatter().format(words)
    text = " ".join(t.text for t in tokens)
    assert text[0].isupper() and text[-1] in ".?"
    written = Formatter(punctuation=False).format(words)
    assert " ".join(t.text for t in written) == "it costs $25 at 3:30 p.m."
    # The tagger only adds a mark and raises letters of the words as spoken.
    for got, plain in zip(tokens, written, strict=True):
        assert (got.first, got.last) == (plain.first, plain.last)
        assert got.text.rstrip(",.?") in (plain.text.rstrip("."), plain.text.capitalize())
    assert tokens[0].first == 0 and tokens[-1].last == len(words)
    assert all(a.last == b.first for a, b in zip(tokens, tokens[1:], strict=False))
    assert Formatter(punctuation=False, inverse=False).format(words) == [
        Token(w, i, i + 1) for i, w in enumerate(words)
    ]


def test_written_words_take_the_times_and_lowest_confidence_of_their_span() -> None:
    tokens = [Token("It", 0, 1), Token("costs", 1, 2), Token("$25.", 2, 5)]
    starts, ends = [0.0, 0.3, 0.7, 1.0, 1.3], [0.2, 0.6, 0.9, 1.2, 1.8]
    got = written_words(tokens, starts, ends, [0.9, 0.8, 0.7, 0.95, 0.6])
    assert [(w.text, w.start, w.end, w.confidence) for w in got] == [
        ("It", 0.0, 0.2, 0.9), ("costs", 0.3, 0.6, 0.8), ("$25.", 0.7, 1.8, 0.6),
    ]  # fmt: skip


def test_format_results_writes_finals_with_their_spoken_words_times() -> None:
    """The core's results are frozen: formatting gives new ones, each written word timed by
    the spoken words it came from, and leaves interim results (and its input) as they are."""
    said = [("it", 0.0, 0.2, 0.9), ("costs", 0.3, 0.6, 0.8), ("twenty", 0.7, 0.9, 0.7),
            ("five", 1.0, 1.2, 0.95), ("dollars", 1.3, 1.8, 0.6)]  # fmt: skip
    spoken = Alternative(" ".join(w[0] for w in said), 0.8, tuple(Word(*w) for w in said))

    def result(final: bool) -> Result:
        return Result((spoken,), final, 1.0, 5, 0, 0.0, 1.8)

    interim, final = result(False), result(True)
    got = format_results([interim, final], Formatter(punctuation=False))
    assert got[0] is interim and final.alternatives == (spoken,)
    (written,) = got[1].alternatives
    assert written.text == "it costs $25" and written.confidence == spoken.confidence
    assert written.words == (
        Word("it", 0.0, 0.2, 0.9), Word("costs", 0.3, 0.6, 0.8), Word("$25", 0.7, 1.8, 0.6),
    )  # fmt: skip
    assert dataclasses.replace(got[1], alternatives=final.alternatives) == final


async def _loop_turns_while_formatting(result: Result) -> tuple[int, Result]:
    """How often the event loop turned while `format_finals` formatted `result`, and the
    result formatted."""
    turns, formatting = 0, True

    async def other_work() -> None:
        nonlocal turns
        while formatting:
            turns += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(other_work())
    await asyncio.sleep(0)
    before = turns
    (formatted,) = await format_finals([result], Formatter())
    during = turns - before
    formatting = False
    await other
    return during, formatted


@pytest.mark.parametrize(
    ("words", "off_the_loop"),
    [
        pytest.param(20, False, id="short-on-the-loop"),
        pytest.param(10_000, True, id="long-in-a-thread"),
    ],
)
def test_a_long_final_is_formatted_while_the_event_loop_turns(words: int, off_the_loop: bool):
    """A final of thousands of words ("oh oh oh ...": Recognize without endpointing gives one
    for up to --max-audio-seconds) is formatted in a worker thread, so the server's other
    streams and /healthz go on meanwhile; a short one costs less than the hop."""
    spoken = " ".join(["oh"] * words)
    result = Result(
        alternatives=(Alternative(spoken, 1.0, ()),), is_final=True, stability=1.0,
        stable_words=words, utterance_index=0, start=0.0, end=0.0,
    )  # fmt: skip
    assert (words > FORMAT_ON_LOOP_WORDS) == off_the_loop
    turns, written = asyncio.run(_loop_turns_while_formatting(result))
    assert (turns > 0) == off_the_loop
    formatted = written.alternatives[0].text
    assert formatted.startswith("Oh") and formatted.endswith((".", "?"))
    assert len(formatted.split()) == words


# ---------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> Path:
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        pytest.skip("espeak-ng is not installed (scripts/bootstrap.sh installs it)")
    wav = tmp_path_factory.mktemp("formatting") / "said.wav"
    subprocess.run([espeak, "-w", str(wav), SAID], check=True, timeout=60)
    return wav


@pytest.fixture(scope="module")
def server():
    with http_server() as s:
        yield s


@pytest.fixture(scope="module")
def stub(server) -> Iterator[pb_grpc.TranscriberStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.TranscriberStub(channel)


def _recognize(stub, wav: Path, **formatting: bool) -> pb.SpeechRecognitionAlternative:
    config = pb.RecognitionConfig(
        enable_word_time_offsets=True, formatting=pb.FormattingConfig(**formatting)
    )
    response = stub.Recognize(
        pb.RecognizeRequest(config=config, audio_content=wav.read_bytes()), timeout=TIMEOUT
    )
    (result,) = response.results
    return result.alternatives[0]


@pytest.fixture(scope="module")
def raw(stub, speech: Path) -> pb.SpeechRecognitionAlternative:
    """What the bundled model hears, as spoken: the words the others are formatted from."""
    heard = _recognize(stub, speech)
    assert "three thirty" in heard.transcript and "twenty five" in heard.transcript, heard
    return heard


def _formatted(raw: pb.SpeechRecognitionAlternative, **kw: bool) -> str:
    return " ".join(t.text for t in Formatter(**kw).format([w.word for w in raw.words]))


def test_grpc_formats_only_when_asked_and_keeps_word_times(stub, speech, raw) -> None:
    assert raw.transcript == raw.transcript.lower() and not re.search(r"[.,?$:]", raw.transcript)
    got = _recognize(stub, speech, punctuation=True, inverse_normalization=True)
    assert got.transcript == _formatted(raw) and "3:30" in got.transcript
    assert got.transcript[0].isupper() and got.transcript[-1] in ".?"
    assert [w.word for w in got.words] == got.transcript.split()
    (time,) = [w for w in got.words if w.word.startswith("3:30")]
    spoken = list(raw.words)
    first = next(i for i, w in enumerate(spoken) if w.word == "three")
    assert time.start_time == spoken[first].start_time  # "three thirty": both words' times
    assert time.end_time == spoken[first + 1].end_time
    assert time.confidence == min(spoken[first].confidence, spoken[first + 1].confidence)
    numbers_only = _recognize(stub, speech, inverse_normalization=True)
    assert numbers_only.transcript == _formatted(raw, punctuation=False)


def test_grpc_interim_results_stay_raw_and_finals_are_formatted(stub, speech, raw) -> None:
    config = pb.RecognitionConfig(
        formatting=pb.FormattingConfig(punctuation=True, inverse_normalization=True)
    )
    data = speech.read_bytes()

    def messages():
        streaming = pb.StreamingRecognitionConfig(config=config, interim_results=True)
        yield pb.StreamingRecognizeRequest(streaming_config=streaming)
        for i in range(0, len(data), 3200):
            yield pb.StreamingRecognizeRequest(audio_content=data[i : i + 3200])

    results = [r for m in stub.StreamingRecognize(messages(), timeout=TIMEOUT) for r in m.results]
    interim = [r.alternatives[0].transcript for r in results if not r.is_final]
    finals = [r.alternatives[0].transcript for r in results if r.is_final]
    assert interim and all(t == t.lower() and "." not in t for t in interim)
    assert finals == [_formatted(raw)]


def test_riva_punctuation_and_verbatim_are_honoured(server, speech, raw) -> None:
    """nvidia-riva-client, unchanged: enable_automatic_punctuation gives punctuated, cased
    finals; Riva's default (verbatim_transcripts false) writes numbers as written."""
    riva_client = pytest.importorskip("riva.client", reason="the riva extra is not installed")
    asr = riva_client.ASRService(riva_client.Auth(uri=server.address))

    def transcript(**fields) -> str:
        config = riva_client.RecognitionConfig(language_code="en-US", max_alternatives=1,
                                               enable_word_time_offsets=True, **fields)  # fmt: skip
        riva_client.add_audio_file_specs_to_config(config, speech)
        response = asr.offline_recognize(speech.read_bytes(), config)
        return " ".join(r.alternatives[0].transcript for r in response.results)

    assert transcript(enable_automatic_punctuation=True) == _formatted(raw)
    assert transcript() == _formatted(raw, punctuation=False)
    assert transcript(verbatim_transcripts=True) == raw.transcript
    config = riva_client.RecognitionConfig(language_code="en-US", max_alternatives=1,
                                           enable_automatic_punctuation=True)  # fmt: skip
    riva_client.add_audio_file_specs_to_config(config, speech)
    streaming = riva_client.StreamingRecognitionConfig(config=config, interim_results=True)
    with riva_client.AudioChunkFileIterator(str(speech), 1600) as chunks:
        results = [r for response in asr.streaming_response_generator(chunks, streaming)
                   for r in response.results]  # fmt: skip
    interim = [r.alternatives[0].transcript for r in results if not r.is_final]
    assert interim and all(t == t.lower() and "." not in t for t in interim)
    assert [r.alternatives[0].transcript for r in results if r.is_final] == [_formatted(raw)]


def test_openai_door_formats_by_default_and_gives_raw_words_when_asked(server, speech, raw):
    with openai_client(server) as client:  # closed: its sockets with it
        audio = ("said.wav", speech.read_bytes())
        assert client.audio.transcriptions.create(model="whisper-1", file=audio).text == (
            _formatted(raw)
        )
        plain = client.audio.transcriptions.create(
            model="whisper-1", file=audio, extra_body={"formatting": "false"}
        )
        assert plain.text == raw.transcript
        srt = client.audio.transcriptions.create(
            model="whisper-1", file=audio, response_format="srt"
        )
        cues = [block.split("\n")[2] for block in srt.strip().split("\n\n")]
        assert " ".join(cues) == _formatted(raw)
        assert all(ends_sentence(c.split()[-1]) for c in cues)
        assert len(cues) == sum(ends_sentence(w) for w in _formatted(raw).split())
        events = list(
            client.audio.transcriptions.create(model="whisper-1", file=audio, stream=True)
        )
        deltas = "".join(e.delta for e in events if e.type == "transcript.text.delta")
        assert deltas == events[-1].text == _formatted(raw)


def test_without_a_tagger_the_server_serves_and_refuses_punctuation_in_one_line(
    speech, tmp_path
) -> None:
    """Whether the tagger loads is found once, at the start: requests are refused in one
    line without trying it again (a tagger file that appears later is not loaded), and
    the OpenAI door's default is written forms alone, without marks and capitals."""
    missing = tmp_path / "no-such-tagger.onnx"
    with http_server(punctuation_model=missing) as s:
        shutil.copyfile(PUNCT_FILE, missing)  # after the start: this server does without
        with grpc.insecure_channel(s.address) as channel:
            stub = pb_grpc.TranscriberStub(channel)
            with pytest.raises(grpc.RpcError) as e:
                _recognize(stub, speech, punctuation=True)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert str(missing) in e.value.details() and "\n" not in e.value.details()
            numbers = _recognize(stub, speech, inverse_normalization=True)
            assert "3:30" in numbers.transcript
            raw = _recognize(stub, speech).transcript
        with openai_client(s) as client:
            audio = ("said.wav", speech.read_bytes())
            # The OpenAI door's default falls back to written forms alone, as Riva's does.
            got = client.audio.transcriptions.create(model="whisper-1", file=audio).text
            assert got == numbers.transcript != raw
            plain = client.audio.transcriptions.create(
                model="whisper-1", file=audio, extra_body={"formatting": "false"}
            )
            assert plain.text == raw
            import openai

            with pytest.raises(openai.BadRequestError) as bad:
                client.audio.transcriptions.create(
                    model="whisper-1", file=audio, extra_body={"formatting": "true"}
                )
            assert bad.value.body["param"] == "formatting"


def test_transcribe_formatting_writes_sentences_and_srt_cues_end_at_them(speech, tmp_path):
    out = tmp_path / "subs"
    run = subprocess.run(
        [*ECHOIC, "transcribe", str(speech), "--formatting", "--format", "srt",
         "--output-dir", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    cues = [block.split("\n")[2] for block in (out / "said.srt").read_text().strip().split("\n\n")]
    text = " ".join(cues)
    assert "3:30" in text and text[0].isupper()
    assert all(ends_sentence(c.split()[-1]) or len(c.split()) == 7 for c in cues)
    plain = subprocess.run(
        [*ECHOIC, "transcribe", str(speech), "--format", "jsonl", "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    record = json.loads(plain.stdout)
    assert record["text"] == record["text"].lower() and "3:30" not in record["text"]


def test_an_exported_tagger_is_what_the_runtime_loads(tmp_path) -> None:
    """model/nn/punctuation.py's export (checked against torch) read back by the runtime:
    its word list and scores from the metadata, one mark and one case per token."""
    pytest.importorskip("torch", reason="exporting needs the train extra")
    from echoic.model.core.punctuation import WordList
    from echoic.model.nn.punctuation import Tagger, TaggerConfig, export_tagger

    cfg = TaggerConfig(words=3, word_dim=4, char_dim=4, char_filters=4, hidden=4)
    path = tmp_path / "tagger.onnx"
    export_tagger(Tagger(cfg), WordList(("the", "a", "of")), {"made": "here"}, path)
    tagger = Punctuator(path)
    assert tagger.words.words == ("the", "a", "of") and tagger.scores == {"made": "here"}
    marks, cases = tagger.tag(["the", "3:30", "unheard"])
    assert len(marks) == len(cases) == 3 and marks[-1] in (2, 3)
