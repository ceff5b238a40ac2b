"""One request or stream on the server: its config, its audio, its utterances, its results.

A `Session` owns an `AudioInput` (bytes -> samples at the model's rate) and a
runtime `Stream` (samples -> utterances, made with the request's endpointing and
decoder settings: `model/runtime/recognizer.py`, where endpointing lives), and
turns what each step gives (`Stepped`, one await of the dispatcher per step) into
the core's `Result`s (`server/core/types.py`), which each door writes as its own messages:
interim results every `interim_interval_ms` of decoded audio, a final one at each
endpoint and at the end of the audio.

Endpointing (the rule is `model/core/decoding.py:Endpointing`, shared with
files transcribed locally): rule 1 ends an utterance after `trailing_silence_ms`
of trailing silence (CTC blanks and spaces after its last word) once it has a
word; rule 2 ends it once it reaches `max_utterance_ms`, at the first step that
does not end inside a character's run of frames (at most MAX_CUT_DELAY later).
Word times are seconds from the start of the stream's audio.

Errors a client can fix are `server/core/types.py:Refusal`s, in no door's words; each door
says them with its own status table and remedies (server/core/refusals.py). `open_session`
is the one place a request or stream is opened on a model version and closed again.
Each door's settings become `Options` through `server/core/options.py:stream_options` (the
gRPC doors' `RecognitionConfig` in `server/doors/grpc_api.py:parse_config`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np

from echoic.model.runtime.recognizer import Endpointing, Recognizer, Utterance
from echoic.server.config import ServerConfig
from echoic.server.core.audio_input import AudioInput
from echoic.server.core.formatting import format_finals
from echoic.server.core.models import LoadedModel, ModelRegistry
from echoic.server.core.types import Options, Remedy, Result, invalid


@asynccontextmanager
async def open_session(
    registry: ModelRegistry,
    opts: Options,
    config: ServerConfig,
    *,
    name: str,
    live: bool = False,
    whole: bool | None = False,
) -> AsyncIterator[Session]:
    """The one place a request or stream is opened, for every door: the model version
    resolved from `opts` and held for the session's life (a draining version unloads once
    its last session closes), the recognizer for its decoder, a `Session` with the
    server's audio limits; closed and released however it ends. live: a stream whose
    audio comes as it is spoken, refused for a model that cannot stream. whole: all the
    audio comes at once (Recognize); None: whole only for a model that streams by
    overlapped chunks (a paced file: `TranscriberService.recognize_paced`)."""
    model = registry.resolve(opts.model, opts.version)
    if live and not model.streamable:
        raise invalid(
            f"model {model.name!r} version {model.version!r} cannot stream (a full-context "
            "model without stream.onnx, and for an imported one, echoic serve --chunk-ms 0)",
            remedy=Remedy.SEND_WHOLE,
        )
    registry.acquire(model)
    session = None
    try:
        recognizer = await model.recognizer(opts.decoder)
        session = Session(
            model, recognizer, opts, name=name, max_seconds=config.max_audio_seconds,
            time_limit=config.decode_timeout_seconds,
            whole=not model.streams_exactly if whole is None else whole,
        )  # fmt: skip
        yield session
    finally:
        if session is not None:
            session.close()
        registry.release(model)


class Session:
    """The audio and transcripts of one request or stream on one model version."""

    def __init__(
        self,
        model: LoadedModel,
        recognizer: Recognizer,
        options: Options,
        name: str,
        *,
        max_seconds: float = 0.0,
        time_limit: float = 0.0,
        whole: bool = False,
    ) -> None:
        """max_seconds, time_limit: the audio's limits (`AudioInput`'s). whole: all the audio
        comes at once (Recognize); a model that streams only by overlapped chunks then runs
        it whole instead, with the whole utterance as context."""
        self.model = model
        self.options = options
        self.audio = AudioInput(
            options.encoding,
            model.card.sample_rate,
            sample_rate=options.sample_rate,
            channels=options.channels,
            name=name,
            max_seconds=max_seconds,
            time_limit=time_limit,
        )
        self._recognizer = recognizer
        streams = model.streamable and (model.streams_exactly or not whole)
        # A beam search is decoded in the decoder pool, not in the shared batch (the
        # recognizer's default for its decoder).
        self.stream = (
            recognizer.stream(
                endpointing=Endpointing(options.trailing_silence, options.max_utterance),
                n_best=options.alternatives,
            )
            if streams
            else None
        )
        self._offline: list[np.ndarray] = []  # samples, for a model that cannot stream
        self.samples = 0  # samples at the model's rate accepted, count
        self._last_interim = 0.0  # decoded audio at the last interim result, s
        self.finished = False  # the audio has ended
        self.done = False  # the last final result has been produced

    def close(self) -> None:
        """Let go of the audio decoder (a FLAC or Ogg decoder's threads end with the session)
        and of the stream (an engine process's state for it)."""
        self.audio.close()
        if self.stream is not None:
            self.stream.close()

    @property
    def seconds(self) -> float:
        """Audio received, s."""
        return self.samples / self.model.card.sample_rate

    @property
    def decoded_seconds(self) -> float:
        """Audio decoded so far, s (all of it once the audio has ended and been decoded)."""
        if self.stream is None or self.stream.is_final:
            return self.seconds if self.done else 0.0
        return min(self.stream.decoded_seconds, self.seconds)

    def accept(self, samples: np.ndarray) -> None:
        self.samples += len(samples)
        if self.stream is not None:
            self.stream.accept_audio(samples)
        elif len(samples):
            self._offline.append(samples)

    def finish(self, *, features_now: bool = False) -> None:
        """The audio has ended (`Stream.finish`; features_now: see there)."""
        self.finished = True
        if self.stream is not None:
            self.stream.finish(features_now=features_now)

    async def advance(self) -> list[Result]:
        """Run every ready step (through the dispatcher, one await each); the results to
        send now, final ones formatted as the options ask (server/core/formatting.py)."""
        out = await self._advance()
        formatter = self.options.formatting
        if formatter is None or not any(r.is_final for r in out):
            return out
        return await format_finals(out, formatter)

    async def _advance(self) -> list[Result]:
        if self.stream is None:
            return await self._advance_offline()
        out: list[Result] = []
        stream, opts = self.stream, self.options
        while stream.is_ready():
            stepped = await self.model.dispatcher.step(stream)
            out += (self._result(u, True) for u in stepped.finals)
            if stepped.endpoint:
                self._last_interim = stepped.decoded_seconds
            elif (
                stepped.partial is not None
                and opts.interim
                and stepped.decoded_seconds - self._last_interim >= opts.interim_interval
            ):
                self._last_interim = stepped.decoded_seconds
                out.append(self._result(stepped.partial, False))
            if stream.is_final:
                break
        if stream.is_final and not self.done:
            self.done = True
            # Whole audio whose features were computed at finish (`features_now`) may
            # leave no step to run: its last utterance is settled here.
            out += (self._result(u, True) for u in stream.settle().finals)
        return out

    def _result(self, utterance: Utterance, final: bool) -> Result:
        end = min(utterance.end, self.seconds)
        return Result.of(utterance, final=final, words=self.options.words, end=end)

    async def _advance_offline(self) -> list[Result]:
        """A model without stream.onnx: the whole utterance once the audio has ended."""
        if self.done or not self.finished:
            return []
        audio = np.concatenate(self._offline) if self._offline else np.zeros(0, np.float32)
        dispatcher = self.model.dispatcher
        log_probs = await dispatcher.offline(audio)
        transcript = await dispatcher.decode_whole(
            self._recognizer, log_probs, self.options.alternatives
        )
        self.done = True
        return [self._result(Utterance(transcript, 0, 0.0, self.seconds), True)]
