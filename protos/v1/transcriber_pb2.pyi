from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RecognitionConfig(_message.Message):
    __slots__ = ("encoding", "sample_rate_hertz", "audio_channel_count", "model", "model_version", "enable_word_time_offsets", "max_alternatives", "decoder", "endpointing", "formatting")
    class AudioEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ENCODING_UNSPECIFIED: _ClassVar[RecognitionConfig.AudioEncoding]
        LINEAR16: _ClassVar[RecognitionConfig.AudioEncoding]
        WAV: _ClassVar[RecognitionConfig.AudioEncoding]
        FLAC: _ClassVar[RecognitionConfig.AudioEncoding]
        MULAW: _ClassVar[RecognitionConfig.AudioEncoding]
        ALAW: _ClassVar[RecognitionConfig.AudioEncoding]
        OGG_OPUS: _ClassVar[RecognitionConfig.AudioEncoding]
    ENCODING_UNSPECIFIED: RecognitionConfig.AudioEncoding
    LINEAR16: RecognitionConfig.AudioEncoding
    WAV: RecognitionConfig.AudioEncoding
    FLAC: RecognitionConfig.AudioEncoding
    MULAW: RecognitionConfig.AudioEncoding
    ALAW: RecognitionConfig.AudioEncoding
    OGG_OPUS: RecognitionConfig.AudioEncoding
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HERTZ_FIELD_NUMBER: _ClassVar[int]
    AUDIO_CHANNEL_COUNT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENABLE_WORD_TIME_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    MAX_ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    DECODER_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTING_FIELD_NUMBER: _ClassVar[int]
    FORMATTING_FIELD_NUMBER: _ClassVar[int]
    encoding: RecognitionConfig.AudioEncoding
    sample_rate_hertz: int
    audio_channel_count: int
    model: str
    model_version: str
    enable_word_time_offsets: bool
    max_alternatives: int
    decoder: DecoderConfig
    endpointing: EndpointingConfig
    formatting: FormattingConfig
    def __init__(self, encoding: _Optional[_Union[RecognitionConfig.AudioEncoding, str]] = ..., sample_rate_hertz: _Optional[int] = ..., audio_channel_count: _Optional[int] = ..., model: _Optional[str] = ..., model_version: _Optional[str] = ..., enable_word_time_offsets: _Optional[bool] = ..., max_alternatives: _Optional[int] = ..., decoder: _Optional[_Union[DecoderConfig, _Mapping]] = ..., endpointing: _Optional[_Union[EndpointingConfig, _Mapping]] = ..., formatting: _Optional[_Union[FormattingConfig, _Mapping]] = ...) -> None: ...

class FormattingConfig(_message.Message):
    __slots__ = ("punctuation", "inverse_normalization")
    PUNCTUATION_FIELD_NUMBER: _ClassVar[int]
    INVERSE_NORMALIZATION_FIELD_NUMBER: _ClassVar[int]
    punctuation: bool
    inverse_normalization: bool
    def __init__(self, punctuation: _Optional[bool] = ..., inverse_normalization: _Optional[bool] = ...) -> None: ...

class DecoderConfig(_message.Message):
    __slots__ = ("kind", "beam_size", "disable_lm", "boosts")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        GREEDY: _ClassVar[DecoderConfig.Kind]
        BEAM: _ClassVar[DecoderConfig.Kind]
    GREEDY: DecoderConfig.Kind
    BEAM: DecoderConfig.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    BEAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    DISABLE_LM_FIELD_NUMBER: _ClassVar[int]
    BOOSTS_FIELD_NUMBER: _ClassVar[int]
    kind: DecoderConfig.Kind
    beam_size: int
    disable_lm: bool
    boosts: _containers.RepeatedCompositeFieldContainer[WordBoost]
    def __init__(self, kind: _Optional[_Union[DecoderConfig.Kind, str]] = ..., beam_size: _Optional[int] = ..., disable_lm: _Optional[bool] = ..., boosts: _Optional[_Iterable[_Union[WordBoost, _Mapping]]] = ...) -> None: ...

class WordBoost(_message.Message):
    __slots__ = ("words", "boost")
    WORDS_FIELD_NUMBER: _ClassVar[int]
    BOOST_FIELD_NUMBER: _ClassVar[int]
    words: _containers.RepeatedScalarFieldContainer[str]
    boost: float
    def __init__(self, words: _Optional[_Iterable[str]] = ..., boost: _Optional[float] = ...) -> None: ...

class EndpointingConfig(_message.Message):
    __slots__ = ("trailing_silence_ms", "max_utterance_ms")
    TRAILING_SILENCE_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_UTTERANCE_MS_FIELD_NUMBER: _ClassVar[int]
    trailing_silence_ms: int
    max_utterance_ms: int
    def __init__(self, trailing_silence_ms: _Optional[int] = ..., max_utterance_ms: _Optional[int] = ...) -> None: ...

class StreamingRecognitionConfig(_message.Message):
    __slots__ = ("config", "interim_results", "interim_interval_ms")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    INTERIM_RESULTS_FIELD_NUMBER: _ClassVar[int]
    INTERIM_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    config: RecognitionConfig
    interim_results: bool
    interim_interval_ms: int
    def __init__(self, config: _Optional[_Union[RecognitionConfig, _Mapping]] = ..., interim_results: _Optional[bool] = ..., interim_interval_ms: _Optional[int] = ...) -> None: ...

class RecognizeRequest(_message.Message):
    __slots__ = ("config", "audio_content")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    AUDIO_CONTENT_FIELD_NUMBER: _ClassVar[int]
    config: RecognitionConfig
    audio_content: bytes
    def __init__(self, config: _Optional[_Union[RecognitionConfig, _Mapping]] = ..., audio_content: _Optional[bytes] = ...) -> None: ...

class StreamingRecognizeRequest(_message.Message):
    __slots__ = ("streaming_config", "audio_content")
    STREAMING_CONFIG_FIELD_NUMBER: _ClassVar[int]
    AUDIO_CONTENT_FIELD_NUMBER: _ClassVar[int]
    streaming_config: StreamingRecognitionConfig
    audio_content: bytes
    def __init__(self, streaming_config: _Optional[_Union[StreamingRecognitionConfig, _Mapping]] = ..., audio_content: _Optional[bytes] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WordInfo(_message.Message):
    __slots__ = ("word", "start_time", "end_time", "confidence")
    WORD_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    word: str
    start_time: float
    end_time: float
    confidence: float
    def __init__(self, word: _Optional[str] = ..., start_time: _Optional[float] = ..., end_time: _Optional[float] = ..., confidence: _Optional[float] = ...) -> None: ...

class SpeechRecognitionAlternative(_message.Message):
    __slots__ = ("transcript", "confidence", "words")
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    WORDS_FIELD_NUMBER: _ClassVar[int]
    transcript: str
    confidence: float
    words: _containers.RepeatedCompositeFieldContainer[WordInfo]
    def __init__(self, transcript: _Optional[str] = ..., confidence: _Optional[float] = ..., words: _Optional[_Iterable[_Union[WordInfo, _Mapping]]] = ...) -> None: ...

class SpeechRecognitionResult(_message.Message):
    __slots__ = ("alternatives", "is_final", "stability", "stable_words", "utterance_index", "utterance_start_time", "utterance_end_time")
    ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    IS_FINAL_FIELD_NUMBER: _ClassVar[int]
    STABILITY_FIELD_NUMBER: _ClassVar[int]
    STABLE_WORDS_FIELD_NUMBER: _ClassVar[int]
    UTTERANCE_INDEX_FIELD_NUMBER: _ClassVar[int]
    UTTERANCE_START_TIME_FIELD_NUMBER: _ClassVar[int]
    UTTERANCE_END_TIME_FIELD_NUMBER: _ClassVar[int]
    alternatives: _containers.RepeatedCompositeFieldContainer[SpeechRecognitionAlternative]
    is_final: bool
    stability: float
    stable_words: int
    utterance_index: int
    utterance_start_time: float
    utterance_end_time: float
    def __init__(self, alternatives: _Optional[_Iterable[_Union[SpeechRecognitionAlternative, _Mapping]]] = ..., is_final: _Optional[bool] = ..., stability: _Optional[float] = ..., stable_words: _Optional[int] = ..., utterance_index: _Optional[int] = ..., utterance_start_time: _Optional[float] = ..., utterance_end_time: _Optional[float] = ...) -> None: ...

class ModelRef(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class RecognizeResponse(_message.Message):
    __slots__ = ("results", "audio_processed_seconds", "model")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_PROCESSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SpeechRecognitionResult]
    audio_processed_seconds: float
    model: ModelRef
    def __init__(self, results: _Optional[_Iterable[_Union[SpeechRecognitionResult, _Mapping]]] = ..., audio_processed_seconds: _Optional[float] = ..., model: _Optional[_Union[ModelRef, _Mapping]] = ...) -> None: ...

class StreamingRecognizeResponse(_message.Message):
    __slots__ = ("results", "audio_processed_seconds", "model")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_PROCESSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SpeechRecognitionResult]
    audio_processed_seconds: float
    model: ModelRef
    def __init__(self, results: _Optional[_Iterable[_Union[SpeechRecognitionResult, _Mapping]]] = ..., audio_processed_seconds: _Optional[float] = ..., model: _Optional[_Union[ModelRef, _Mapping]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "version", "state", "sample_rate_hertz", "streamable", "vocabulary_size", "frame_seconds", "chunk_seconds", "lookahead_seconds", "has_language_model", "active_streams", "path", "rnn_type", "bidirectional", "parameters")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[ModelInfo.State]
        LOADED: _ClassVar[ModelInfo.State]
        DRAINING: _ClassVar[ModelInfo.State]
    STATE_UNSPECIFIED: ModelInfo.State
    LOADED: ModelInfo.State
    DRAINING: ModelInfo.State
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HERTZ_FIELD_NUMBER: _ClassVar[int]
    STREAMABLE_FIELD_NUMBER: _ClassVar[int]
    VOCABULARY_SIZE_FIELD_NUMBER: _ClassVar[int]
    FRAME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HAS_LANGUAGE_MODEL_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_STREAMS_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RNN_TYPE_FIELD_NUMBER: _ClassVar[int]
    BIDIRECTIONAL_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    state: ModelInfo.State
    sample_rate_hertz: int
    streamable: bool
    vocabulary_size: int
    frame_seconds: float
    chunk_seconds: float
    lookahead_seconds: float
    has_language_model: bool
    active_streams: int
    path: str
    rnn_type: str
    bidirectional: bool
    parameters: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., state: _Optional[_Union[ModelInfo.State, str]] = ..., sample_rate_hertz: _Optional[int] = ..., streamable: _Optional[bool] = ..., vocabulary_size: _Optional[int] = ..., frame_seconds: _Optional[float] = ..., chunk_seconds: _Optional[float] = ..., lookahead_seconds: _Optional[float] = ..., has_language_model: _Optional[bool] = ..., active_streams: _Optional[int] = ..., path: _Optional[str] = ..., rnn_type: _Optional[str] = ..., bidirectional: _Optional[bool] = ..., parameters: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "server_version")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    server_version: str
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., server_version: _Optional[str] = ...) -> None: ...
