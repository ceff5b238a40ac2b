"""The recognition core's own types (server/core/types.py): every kind of refusal has its
answer at every door, every remedy its words at every door, and a gRPC-worded refusal
carries the kind its status means; every door's settings checked in one place
(server/core/options.py)."""

from __future__ import annotations

import grpc
import pytest

from echoic.model.core.decoding import Transcript, Word
from echoic.model.runtime.recognizer import Utterance
from echoic.server.core.options import stream_options
from echoic.server.core.types import Refusal, RefusalKind, Remedy, Result
from echoic.server.doors.grpc_api import parse_config
from echoic.server.doors.openai_api import (
    api_error,
    options_of,
    recognition_config,
    transcription_request,
)
from echoic.server.doors.service import RequestError, status_of


@pytest.mark.parametrize("kind", list(RefusalKind), ids=lambda k: k.value)
def test_every_refusal_kind_has_a_status_at_each_door(kind: RefusalKind) -> None:
    """A refusal from the core reaches a gRPC client with its kind's status and an HTTP
    client with the HTTP status of that, its sentence unchanged; only INTERNAL is a 500."""
    refusal = Refusal(kind, "what to change")
    code, message = status_of(refusal)
    assert message == "what to change"
    assert (code == grpc.StatusCode.INTERNAL) == (kind is RefusalKind.INTERNAL)
    error = api_error(refusal)
    assert error.message == "what to change"
    assert (error.status == 500) == (kind is RefusalKind.INTERNAL)
    # The same kind said in gRPC's words is the same refusal.
    assert RequestError(code, "what to change").kind is kind


@pytest.mark.parametrize("remedy", list(Remedy), ids=lambda r: r.value)
def test_every_remedy_is_said_in_each_doors_own_words(remedy: Remedy) -> None:
    """A refusal whose remedy depends on the door gets a sentence at each: the gRPC doors
    name their rpcs, the HTTP door its endpoints, and neither the other's."""
    refusal = Refusal(RefusalKind.INVALID, "what is wrong", remedy=remedy)
    _, grpc_message = status_of(refusal)
    http_message = api_error(refusal).message
    assert grpc_message.startswith("what is wrong: ") and "/v1/" not in grpc_message
    assert http_message.startswith("what is wrong: ") and "Recognize" not in http_message
    assert "Recognize" in grpc_message and "/v1/audio/transcriptions" in http_message


def test_a_result_counts_word_times_from_the_audios_start() -> None:
    """Word times in a result count from the stream's start; interim results give only
    the stable words as stable, and alternatives only once final."""
    words = (Word("a", 0.1, 0.2, 0.9), Word("b", 0.3, 0.4, 0.8))
    other = Transcript("a c", words, 0.5)
    transcript = Transcript("a b", words, 0.85, stable_words=1, alternatives=(other,))
    utterance = Utterance(transcript, index=2, start=10.0, end=10.5)
    interim = Result.of(utterance, final=False, words=True, end=10.5)
    got = [(w.text, w.start, w.end) for w in interim.alternatives[0].words]
    assert got == [("a", pytest.approx(10.1), pytest.approx(10.2)),
                   ("b", pytest.approx(10.3), pytest.approx(10.4))]  # fmt: skip
    assert (interim.stable_words, interim.stability, len(interim.alternatives)) == (1, 0.5, 1)
    final = Result.of(utterance, final=True, words=False, end=10.5)
    assert (final.stable_words, final.stability, len(final.alternatives)) == (2, 1.0, 2)
    assert final.alternatives[0].words == ()
    assert (final.utterance_index, final.start, final.end) == (2, 10.0, 10.5)


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({}, id="defaults"),
        pytest.param({"decoder": ["beam"], "model": ["whisper-1"]}, id="beam"),
        pytest.param({"decoder": ["greedy"], "formatting": ["false"]}, id="greedy-raw"),
        pytest.param({"model": ["tiny"], "stream": ["true"]}, id="named-stream"),
    ],
)
def test_the_http_doors_options_are_its_grpc_configs(fields: dict[str, list[str]]) -> None:
    """The HTTP door checks its fields into Options itself (`options_of`), and what it asks
    is what its RecognitionConfig asks a gRPC server (`recognition_config`, which
    bench/http_vs_grpc.py sends): the two doors cannot drift apart."""
    asked = transcription_request(fields)
    direct = options_of(asked, max_beam=16, interim=asked.stream)
    assert direct == parse_config(recognition_config(asked), max_beam=16, interim=asked.stream)
    assert direct.words and direct.trailing_silence == 0.8 and direct.max_utterance == 30.0


@pytest.mark.parametrize(
    ("values", "said"),
    [
        pytest.param({"model": "m" * 257}, "at most 256", id="long-name"),
        pytest.param({"encoding": "linear16"}, "sample_rate_hertz", id="raw-without-rate"),
        pytest.param({"decoder": "viterbi"}, "use greedy or beam", id="unknown-decoder"),
        pytest.param({"decoder": "beam", "beam_size": 17}, "--max-beam-size", id="wide-beam"),
        pytest.param({"boost": (("echoic", 5.0),)}, "need decoder.kind BEAM", id="greedy-boost"),
        pytest.param({"trailing_silence_ms": -1}, "trailing_silence_ms must be >= 0", id="neg"),
    ],
)
def test_stream_options_refuse_what_no_door_may_ask(values: dict, said: str) -> None:
    """One place checks every door's settings (server/core/options.py): each mistake is an
    INVALID refusal that says what to change."""
    with pytest.raises(Refusal) as refused:
        stream_options(max_beam=16, **values)
    assert refused.value.kind is RefusalKind.INVALID and said in str(refused.value)
