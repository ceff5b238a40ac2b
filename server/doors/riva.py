"""The Riva ASR API (`nvidia.riva.asr.RivaSpeechRecognition`) as a second door to the server.

Clients written for NVIDIA Riva (`nvidia-riva-client`, or stubs generated from Riva's
protos in any language) work unchanged against echoic, on the same port as
`echoic.v1.Transcriber`. The messages are the classes that the `nvidia-riva-client`
package generates (the `riva` extra); this module only translates: a Riva request
becomes an echoic one, goes through `TranscriberService` (the same admission,
limits, sessions, batches and metrics; `method` labels "riva.Recognize" and
"riva.StreamingRecognize"), and each echoic response becomes a Riva one.

How Riva's fields map (docs/riva.md, "Coming from Riva"):

- encoding: LINEAR_PCM is raw PCM16, or a whole WAV file when the bytes start with
  a RIFF header (as Riva's own file helpers send it); FLAC, MULAW, ALAW, OGGOPUS as
  named; ENCODING_UNSPECIFIED detects WAV, FLAC or Ogg from the header, and is raw
  PCM16 when there is none and sample_rate_hertz is set.
- sample_rate_hertz, audio_channel_count, max_alternatives, model, interim_results:
  as echoic's. language_code: English ("en-US", any "en-*", or empty).
- enable_word_time_offsets: words with start and end in milliseconds, Riva's unit.
- endpointing_config: stop_history (ms of silence that ends an utterance; else
  stop_history_eou) is echoic's trailing silence; the start_* and threshold fields
  have no counterpart and are ignored.
- custom_configuration: "decoder" (greedy or beam; absent: the server's default,
  `echoic serve --decoder`; "beam_size" alone means beam), "beam_size" and
  "max_utterance_ms"; any other key is refused, naming these.
- enable_automatic_punctuation: final transcripts get sentence ends, commas, question
  marks and capitals (echoic's `formatting.punctuation`, docs/formatting.md).
- verbatim_transcripts: as in Riva, false (the proto's default) writes final transcripts
  in written form ("$25", "3:30 p.m.": echoic's `formatting.inverse_normalization`);
  true keeps the words as spoken. Interim results are always the spoken words.
- profanity_filter: accepted and ignored (no word list).
- speech_contexts (word boosting): the beam decoder with those words boosted, Riva's
  `boost` divided by 4 into echoic's nats (Riva's suggested 20 is 5 nats).
- Refused with INVALID_ARGUMENT: speaker diarization, separate recognition per channel.
"""

from __future__ import annotations

import re
from typing import Any

import grpc
from riva.client.proto import riva_asr_pb2 as rasr
from riva.client.proto import riva_audio_pb2 as raudio

from echoic.protos import DECODER_KINDS
from echoic.protos.v1 import transcriber_pb2 as pb
from echoic.server.core.types import invalid
from echoic.server.doors.grpc_api import check_phrase_count
from echoic.server.doors.service import Malformed, TranscriberService, lenient

SERVICE_NAME = rasr.DESCRIPTOR.services_by_name["RivaSpeechRecognition"].full_name
API = "Riva's riva_asr.proto (nvidia-riva-client)"
LANGUAGE = "en-US"

_ENCODINGS = {
    raudio.ENCODING_UNSPECIFIED: pb.RecognitionConfig.ENCODING_UNSPECIFIED,
    raudio.LINEAR_PCM: pb.RecognitionConfig.LINEAR16,
    raudio.FLAC: pb.RecognitionConfig.FLAC,
    raudio.MULAW: pb.RecognitionConfig.MULAW,
    raudio.ALAW: pb.RecognitionConfig.ALAW,
    raudio.OGGOPUS: pb.RecognitionConfig.OGG_OPUS,
}
_CUSTOM_KEYS = ("decoder", "beam_size", "max_utterance_ms")
# Riva's boost scale (its clients suggest about 20 for a word to favour) per echoic nat:
# 20 becomes 5 nats, enough to recover a word the model nearly heard.
RIVA_BOOST_PER_NAT = 4.0


# ---------------------------------------------------------------- requests


def echoic_config(config: rasr.RecognitionConfig, first_audio: bytes = b"") -> pb.RecognitionConfig:
    """A Riva RecognitionConfig as echoic's; a Refusal (INVALID) for what
    echoic cannot do. `first_audio`: the first audio bytes, to tell a WAV file sent
    as LINEAR_PCM from raw PCM."""
    if config.encoding not in _ENCODINGS:
        raise invalid(
            f"unsupported encoding {config.encoding}: use LINEAR_PCM, FLAC, MULAW, ALAW or OGGOPUS"
        )
    language = config.language_code
    if language and not (language == "en" or language.lower().startswith("en-")):
        raise invalid(
            f"language_code {language[:40]!r} is not served: this server transcribes English"
            f" (set language_code to {LANGUAGE!r} or leave it empty)"
        )
    if config.diarization_config.enable_speaker_diarization:
        raise invalid("speaker diarization is not supported by this server: turn it off")
    if config.enable_separate_recognition_per_channel:
        raise invalid(
            "separate recognition per channel is not supported: channels are mixed to mono;"
            " send each channel as its own request"
        )
    encoding = _ENCODINGS[config.encoding]
    rate = config.sample_rate_hertz
    container = first_audio[:4] in (b"RIFF", b"fLaC", b"OggS")
    if encoding == pb.RecognitionConfig.LINEAR16 and first_audio[:4] == b"RIFF":
        encoding = pb.RecognitionConfig.WAV  # a whole WAV file: its header gives the format
    elif encoding == pb.RecognitionConfig.ENCODING_UNSPECIFIED and rate and not container:
        encoding = pb.RecognitionConfig.LINEAR16  # a rate and no header: raw PCM, as Riva takes it
    out = pb.RecognitionConfig(
        encoding=encoding,
        sample_rate_hertz=rate,
        audio_channel_count=config.audio_channel_count,
        model=config.model,
        enable_word_time_offsets=config.enable_word_time_offsets,
        max_alternatives=config.max_alternatives,
        formatting=pb.FormattingConfig(
            punctuation=config.enable_automatic_punctuation,
            inverse_normalization=not config.verbatim_transcripts,
        ),
    )
    e = config.endpointing_config
    silence = e.stop_history or e.stop_history_eou
    if silence > 0:
        out.endpointing.trailing_silence_ms = silence
    _apply_custom(dict(config.custom_configuration), out)
    check_phrase_count(sum(len(c.phrases) for c in config.speech_contexts), "speech_contexts")
    contexts = [c for c in config.speech_contexts if c.phrases]
    if contexts:  # word boosting: the beam decoder, Riva's boost in echoic's nats
        out.decoder.kind = pb.DecoderConfig.BEAM
        for context in contexts:
            out.decoder.boosts.add(
                words=list(context.phrases), boost=context.boost / RIVA_BOOST_PER_NAT
            )
    return out


def _apply_custom(custom: dict[str, str], out: pb.RecognitionConfig) -> None:
    unknown = sorted(set(custom) - set(_CUSTOM_KEYS))
    if unknown:
        raise invalid(
            f"custom_configuration key {unknown[0][:40]!r} is not known here; this server"
            f" takes {', '.join(_CUSTOM_KEYS)}"
        )
    decoder = custom.get("decoder")  # absent: the server's default (echoic serve --decoder)
    if decoder is not None and decoder not in DECODER_KINDS:
        raise invalid(
            f"custom_configuration decoder={decoder[:40]!r}: use {' or '.join(DECODER_KINDS)}"
        )
    if decoder is not None:
        out.decoder.kind = DECODER_KINDS[decoder]
    for key in ("beam_size", "max_utterance_ms"):
        if key in custom:
            value = custom[key]
            if not re.fullmatch(r"[0-9]{1,9}", value):
                raise invalid(f"custom_configuration {key}={value[:40]!r}: give a whole number")
            if key == "beam_size":
                if decoder is None:  # a beam size asks for the beam search
                    out.decoder.kind = pb.DecoderConfig.BEAM
                out.decoder.beam_size = int(value)
            else:
                out.endpointing.max_utterance_ms = int(value)


# ---------------------------------------------------------------- responses


def _alternative(alt: pb.SpeechRecognitionAlternative) -> rasr.SpeechRecognitionAlternative:
    return rasr.SpeechRecognitionAlternative(
        transcript=alt.transcript,
        confidence=alt.confidence,
        words=[
            rasr.WordInfo(
                word=w.word,
                start_time=round(w.start_time * 1000),  # Riva's unit: milliseconds
                end_time=round(w.end_time * 1000),
                confidence=w.confidence,
                language_code=LANGUAGE,
            )
            for w in alt.words
        ],
        language_code=[LANGUAGE],
    )


def riva_streaming_response(
    response: pb.StreamingRecognizeResponse,
) -> rasr.StreamingRecognizeResponse:
    return rasr.StreamingRecognizeResponse(
        results=[
            rasr.StreamingRecognitionResult(
                alternatives=[_alternative(a) for a in r.alternatives],
                is_final=r.is_final,
                stability=r.stability,
                channel_tag=1,
                audio_processed=response.audio_processed_seconds,
            )
            for r in response.results
        ]
    )


def riva_response(response: pb.RecognizeResponse) -> rasr.RecognizeResponse:
    return rasr.RecognizeResponse(
        results=[
            rasr.SpeechRecognitionResult(
                alternatives=[_alternative(a) for a in r.alternatives],
                channel_tag=1,
                audio_processed=response.audio_processed_seconds,
            )
            for r in response.results
        ]
    )


# ---------------------------------------------------------------- the service


class _TranslatedStream:
    """A Riva StreamingRecognize call as `TranscriberService` reads and writes a stream:
    `read()` gives echoic requests, `write()` takes echoic responses."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        self._held: Any = None  # a message read ahead (the first audio, to sniff a WAV header)
        self._started = False

    async def read(self) -> Any:
        if self._held is not None:
            message, self._held = self._held, None
            return self._echoic(message)
        message = await self._context.read()
        if message is grpc.aio.EOF or isinstance(message, Malformed):
            return message
        if not self._started and message.HasField("streaming_config"):
            self._started = True
            audio = await self._context.read()
            first = b""
            if audio is not grpc.aio.EOF and not isinstance(audio, Malformed):
                first = audio.audio_content
            self._held = audio if audio is not grpc.aio.EOF else None
            sc = message.streaming_config
            config = echoic_config(sc.config, first)
            return pb.StreamingRecognizeRequest(
                streaming_config=pb.StreamingRecognitionConfig(
                    config=config, interim_results=sc.interim_results
                )
            )
        self._started = True
        return self._echoic(message)

    @staticmethod
    def _echoic(message: Any) -> Any:
        if isinstance(message, Malformed):
            return message
        if message.HasField("streaming_config"):  # echoic says what is wrong with that
            return pb.StreamingRecognizeRequest(streaming_config=pb.StreamingRecognitionConfig())
        return pb.StreamingRecognizeRequest(audio_content=message.audio_content)

    async def write(self, response: pb.StreamingRecognizeResponse) -> None:
        await self._context.write(riva_streaming_response(response))

    def cancelled(self) -> bool:
        return self._context.cancelled()

    def peer(self) -> str:
        return self._context.peer()

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        await self._context.abort(code, details)


class RivaService:
    """`nvidia.riva.asr.RivaSpeechRecognition`, translated onto `TranscriberService`."""

    def __init__(self, service: TranscriberService, registry: Any) -> None:
        self._service = service
        self._registry = registry

    async def Recognize(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> rasr.RecognizeResponse | None:
        def translate() -> Any:
            if isinstance(request, Malformed):
                return request  # answered INVALID_ARGUMENT, as echoic's own
            config = echoic_config(request.config, request.audio)
            return pb.RecognizeRequest(config=config, audio_content=request.audio)

        response = await self._service.recognize_for("riva.Recognize", translate, context)
        return None if response is None else riva_response(response)

    async def StreamingRecognize(self, request_iterator: Any, context: grpc.aio.ServicerContext):
        await self._service.stream_for("riva.StreamingRecognize", _TranslatedStream(context))

    async def GetRivaSpeechRecognitionConfig(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> rasr.RivaSpeechRecognitionConfigResponse:
        if isinstance(request, Malformed):
            problem = request.problem()
            await context.abort(problem.code, str(problem))
        configs = []
        for model in sorted(self._registry.serving.values(), key=lambda m: m.name):
            if request.model_name and request.model_name != model.name:
                continue
            card = model.card
            configs.append(
                rasr.RivaSpeechRecognitionConfigResponse.Config(
                    model_name=model.name,
                    parameters={
                        "version": model.version,
                        "language_code": LANGUAGE,
                        "sample_rate": str(card.sample_rate),
                        "streaming": str(model.streamable).lower(),
                        "type": "online" if model.streamable else "offline",
                        "word_lm": str(model.has_lm).lower(),
                    },
                )
            )
        return rasr.RivaSpeechRecognitionConfigResponse(model_config=configs)


def add_to_server(service: RivaService, server: grpc.aio.Server) -> None:
    """Register `service` as nvidia.riva.asr.RivaSpeechRecognition, with messages that do
    not parse answered INVALID_ARGUMENT as echoic's are."""
    handlers = {
        "Recognize": grpc.unary_unary_rpc_method_handler(
            service.Recognize,
            request_deserializer=lenient(rasr.RecognizeRequest, API),
            response_serializer=rasr.RecognizeResponse.SerializeToString,
        ),
        "StreamingRecognize": grpc.stream_stream_rpc_method_handler(
            service.StreamingRecognize,
            request_deserializer=lenient(rasr.StreamingRecognizeRequest, API),
            response_serializer=rasr.StreamingRecognizeResponse.SerializeToString,
        ),
        "GetRivaSpeechRecognitionConfig": grpc.unary_unary_rpc_method_handler(
            service.GetRivaSpeechRecognitionConfig,
            request_deserializer=lenient(rasr.RivaSpeechRecognitionConfigRequest, API),
            response_serializer=rasr.RivaSpeechRecognitionConfigResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
