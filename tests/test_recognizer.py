"""Recognizer: offline batches and batched streams of a real exported model agree."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from echoic.model.core.decoding import DecoderConfig
from echoic.model.runtime.recognizer import Recognizer, Stream
from tests.streaming import stream_all


@pytest.fixture(scope="module")
def recognizer(tiny_model_dir: Path) -> Recognizer:
    return Recognizer(tiny_model_dir, intra_op_threads=1)


class _RecordingStream(Stream):
    """A stream that keeps the log-prob rows of every step it is given."""

    def __init__(self, recognizer: Recognizer) -> None:
        super().__init__(recognizer)
        self.rows: list[np.ndarray] = []

    def accept_step(self, log_probs: np.ndarray, state) -> None:
        self.rows.append(log_probs)
        super().accept_step(log_probs, state)


def test_stream_equals_offline(recognizer: Recognizer, corpus_audio) -> None:
    audios = [a for _, a in corpus_audio[:4]]
    offline = recognizer.log_probs(audios)
    for audio, expected in zip(audios, offline, strict=True):
        s = _RecordingStream(recognizer)
        rows = s.rows
        for i in range(0, len(audio), 1234):
            s.accept_audio(audio[i : i + 1234])
            while recognizer.step([s]):
                pass
        s.finish()
        while recognizer.step([s]):
            pass
        streamed = np.concatenate(rows)
        assert streamed.shape == expected.shape
        assert np.abs(streamed - expected).max() <= 1e-4


def test_batched_streams_have_no_cross_talk(recognizer: Recognizer, corpus_audio) -> None:
    audios = [a for _, a in corpus_audio[:6]]
    alone = [stream_all(recognizer, a).text for a in audios]
    streams = [recognizer.stream() for _ in audios]
    pieces = [np.array_split(a, 7 + i) for i, a in enumerate(audios)]
    batch_sizes = []
    for k in range(max(len(p) for p in pieces)):
        for s, p in zip(streams, pieces, strict=True):
            if k < len(p):
                s.accept_audio(p[k])
            elif not s.finished:
                s.finish()
        batch_sizes.append(recognizer.step(streams))
    for s in streams:
        s.finish()
    while recognizer.step(streams):
        pass
    assert [s.result().text for s in streams] == alone
    assert all(s.is_final for s in streams)
    assert max(batch_sizes) > 1
    assert alone == [t.text for t in recognizer.transcribe(audios)]


def test_audio_arriving_while_a_step_runs_is_not_lost(recognizer: Recognizer, corpus_audio) -> None:
    """As in the server: one thread accepts audio and finishes streams while another
    steps them (features and model batched); every transcript equals the stream's alone."""
    audios = [a for _, a in corpus_audio[6:10]]
    alone = [stream_all(recognizer, a).text for a in audios]
    streams = [recognizer.stream() for _ in audios]
    done = threading.Event()

    def feed() -> None:
        for k in range(0, max(len(a) for a in audios), 640):
            for s, a in zip(streams, audios, strict=True):
                if k < len(a):
                    s.accept_audio(a[k : k + 640])
        for s in streams:
            s.finish()
        done.set()

    feeder = threading.Thread(target=feed)
    feeder.start()
    deadline = time.monotonic() + 120
    while not (done.is_set() and all(s.is_final for s in streams)):
        assert time.monotonic() < deadline, "the streams never became final"
        recognizer.step(streams)
    feeder.join()
    assert [s.result().text for s in streams] == alone


def test_audio_after_finish_is_refused(recognizer: Recognizer) -> None:
    s = recognizer.stream()
    s.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        s.accept_audio(np.zeros(160, np.float32))


@pytest.mark.parametrize("kind", ["greedy", "beam"])
def test_word_times_lie_inside_the_audio(tiny_model_dir: Path, corpus_audio, kind: str) -> None:
    rec = Recognizer(tiny_model_dir, DecoderConfig(kind=kind), intra_op_threads=1)
    _, audio = corpus_audio[0]
    t = rec.transcribe([audio])[0]
    assert t.words and [w.text for w in t.words] == t.text.split()
    for w in t.words:
        assert 0 <= w.start < w.end <= len(audio) / 16000 + 0.1
        assert 0 <= w.confidence <= 1
    assert all(a.end <= b.start for a, b in zip(t.words, t.words[1:], strict=False))


def test_empty_audio_gives_an_empty_transcript(recognizer: Recognizer) -> None:
    assert recognizer.transcribe([np.zeros(0, np.float32)])[0].text == ""
    s = recognizer.stream()
    s.finish()
    while recognizer.step([s]):
        pass
    assert s.is_final and s.result().text == ""


def test_io_binding_keeps_states_on_the_device(tiny_model_dir: Path, corpus_audio) -> None:
    """The path `echoic serve --device cuda` takes, on the CPU provider: transcripts and
    states equal the plain engine's; a batch of the same streams as the last step reuses
    the device states (no host copy), any other batch regathers them with one copy."""
    from echoic.model.runtime.engine import DeviceRows, Engine

    plain = Recognizer(tiny_model_dir, intra_op_threads=1)
    engine = Engine(tiny_model_dir, intra_op_threads=1, io_binding=True)
    bound = Recognizer(engine)
    audios = [a for _, a in corpus_audio[:3]]
    assert [stream_all(bound, a).text for a in audios] == [
        stream_all(plain, a).text for a in audios
    ]
    copies = engine.host_state_copies
    streams = {r: [r.stream() for _ in audios] for r in (plain, bound)}
    for r, ss in streams.items():
        for s, a in zip(ss, audios, strict=True):
            s.accept_audio(a[:32000])  # 2 s each: several steps of the three together
        steps = 0
        while r.step(ss):
            steps += 1
        assert steps > 1
    assert all(isinstance(s.state, DeviceRows) for s in streams[bound])
    assert engine.host_state_copies == copies  # every step was the same three streams
    order = [2, 0, 1]
    got = engine.gather_states([streams[bound][i].state for i in order])
    want = plain.engine.gather_states([streams[plain][i].state for i in order])
    assert engine.host_state_copies == copies + 1
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value)


@pytest.mark.parametrize("kind", ["greedy", "beam"])
def test_a_live_stream_cuts_utterances_where_a_file_is_cut(
    tiny_model_dir: Path, corpus_audio, kind: str
) -> None:
    """A stream made with endpointing and settled after every step (its rows decoded in
    the step, or deferred and decoded by `settle`, as a beam search is on the server)
    ends the utterances a file of the same audio is cut into: the same words at the same
    times, numbered in order, and no utterance of silence alone."""
    from echoic.model.core.decoding import Endpointing, joined

    rec = Recognizer(tiny_model_dir, DecoderConfig(kind=kind, use_lm=False), intra_op_threads=1)
    gap = np.zeros(16000, np.float32)
    audio = np.concatenate([x for _, a in corpus_audio[:3] for x in (a, gap)])
    rule = Endpointing(trailing_silence=0.5, max_utterance=30.0)
    want = rec.transcribe([audio], endpointing=rule)[0]
    for deferred in (False, True):
        s = rec.stream(endpointing=rule, deferred=deferred)
        finals = []
        for i in range(0, len(audio) + 1600, 1600):
            if i < len(audio):
                s.accept_audio(audio[i : i + 1600])
            else:
                s.finish()
            while rec.step([s]):
                finals += s.settle().finals
        assert s.is_final and s.settle().finals == ()  # the last utterance is given once
        assert len(finals) > 1
        assert [u.index for u in finals] == list(range(len(finals)))
        assert all(u.transcript.words for u in finals)
        got = joined([(u.start, u.transcript) for u in finals])
        assert got.text == want.text
        times = [t for w in got.words for t in (w.start, w.end)]
        assert times == pytest.approx([t for w in want.words for t in (w.start, w.end)])
