"""Formatting of final results, for every door: a result's transcript and words rewritten
as people write them (`model/runtime/formatting.py`), word times and confidences kept.

A door asks for it through `Options.formatting` (echoic's `RecognitionConfig.formatting`,
Riva's `enable_automatic_punctuation` / `verbatim_transcripts`, the OpenAI door by
default, the realtime WebSocket's `transcription_session.update`). `Session.advance`
formats its final results after the batch step, never inside it (`format_finals`). Up to
`FORMAT_ON_LOOP_WORDS` words it does so on the event loop: a final result of 20 words
costs 0.4 ms (80 words: 1.5 ms; bench/formatting_cost.py), about what a hop to a worker
thread and back costs in waiting for the interpreter lock on a busy server, so the hop
would add latency without taking work off the loop. A longer final (Recognize without
endpointing gives one final for up to --max-audio-seconds of audio) goes to a worker
thread: it still holds the lock while it runs Python, but the interpreter hands the lock
back to the loop every few milliseconds, so other requests and /healthz keep answering.

Interim results stay as the model wrote them: they change with every step, a mark or a
"$25" that comes and goes as words firm up would flicker, and they are only meant to
show progress.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from echoic.model.runtime.formatting import (
    Formatter,
    FormattingUnavailable,
    punctuator,
    use_tagger,
    written_words,
)
from echoic.protos.v1 import transcriber_pb2 as pb
from echoic.server.core import Refusal, RefusalKind

__all__ = [
    "FORMAT_ON_LOOP_WORDS", "Formatter", "FormattingUnavailable", "check_available",
    "check_tagger", "default_formatter", "format_finals", "format_results", "formatter_of",
    "punctuator", "use_tagger",
]  # fmt: skip

# Whether the tagger loads, found once (check_tagger, at the server's start) and read by
# every request: a tagger that cannot be loaded is not tried again per request (an ONNX
# session built on the event loop each time).
_tagger_error: FormattingUnavailable | None = None  # why it cannot be loaded; None: it can
_tagger_known = False  # whether check_tagger has run in this process


def default_formatter() -> Formatter:
    """What "formatted" means when a door does not say more: punctuation, capitals and
    written forms."""
    return Formatter(punctuation=True, inverse=True)


def check_tagger() -> FormattingUnavailable | None:
    """Load the tagger (`use_tagger`'s) and record whether it could be; why it could not."""
    global _tagger_error, _tagger_known
    try:
        punctuator()
        _tagger_error = None
    except FormattingUnavailable as e:
        _tagger_error = e
    _tagger_known = True
    return _tagger_error


def check_available(formatter: Formatter | None) -> None:
    """FormattingUnavailable (one line saying why) when `formatter` needs a tagger this
    server could not load at its start; asked once per request, so a stream fails at its
    config."""
    if formatter is not None and formatter.punctuation:
        error = _tagger_error if _tagger_known else check_tagger()
        if error is not None:
            raise FormattingUnavailable(str(error))


def formatter_of(punctuation: bool, inverse: bool) -> Formatter | None:
    """The formatter a request asks for (None: none); a Refusal (UNSUPPORTED) when this
    server cannot punctuate."""
    if not (punctuation or inverse):
        return None
    formatter = Formatter(punctuation=punctuation, inverse=inverse)
    try:
        check_available(formatter)
    except FormattingUnavailable as e:
        raise Refusal(RefusalKind.UNSUPPORTED, str(e)) from None
    return formatter


def _format_alternative(alt: pb.SpeechRecognitionAlternative, formatter: Formatter) -> None:
    spoken = [w.word for w in alt.words] or alt.transcript.split()
    tokens = formatter.format(spoken)
    alt.transcript = " ".join(t.text for t in tokens)
    if alt.words:
        old = list(alt.words)
        written = written_words(
            tokens, [w.start_time for w in old], [w.end_time for w in old],
            [w.confidence for w in old],
        )  # fmt: skip
        del alt.words[:]
        alt.words.extend(
            pb.WordInfo(word=w.text, start_time=w.start, end_time=w.end, confidence=w.confidence)
            for w in written
        )


def format_results(
    results: Sequence[pb.SpeechRecognitionResult], formatter: Formatter
) -> list[pb.SpeechRecognitionResult]:
    """The results with each final one's alternatives formatted (in place); interim ones as
    they are."""
    for r in results:
        if r.is_final:
            for alt in r.alternatives:
                _format_alternative(alt, formatter)
    return list(results)


FORMAT_ON_LOOP_WORDS = 200  # words of final results formatted on the event loop; more: a thread


async def format_finals(
    results: Sequence[pb.SpeechRecognitionResult], formatter: Formatter
) -> list[pb.SpeechRecognitionResult]:
    """`format_results`, in a worker thread when the finals hold over FORMAT_ON_LOOP_WORDS
    words, so that a long (or hostile) transcript does not stall the event loop."""
    words = sum(
        len(alt.words) or len(alt.transcript.split())
        for r in results
        if r.is_final
        for alt in r.alternatives
    )
    if words <= FORMAT_ON_LOOP_WORDS:
        return format_results(results, formatter)
    return await asyncio.to_thread(format_results, results, formatter)
