"""Formatting of final results, for every door: a result's transcript and words rewritten
as people write them (`model/runtime/formatting.py`), word times and confidences kept.

A door asks for it through `Options.formatting` (echoic's `RecognitionConfig.formatting`,
Riva's `enable_automatic_punctuation` / `verbatim_transcripts`, the OpenAI door by
default, the realtime WebSocket's `transcription_session.update`). `Session.advance`
formats its final results after the batch step, never inside it, on the event loop: a
final result of 20 words costs 0.4 ms (80 words: 1.5 ms; bench/formatting_cost.py),
about what a hop to a worker thread and back costs in waiting for the interpreter lock
on a busy server, so the hop would add latency to the final result without taking work
off the loop (the normalization is Python and holds the lock anyway).

Interim results stay as the model wrote them: they change with every step, a mark or a
"$25" that comes and goes as words firm up would flicker, and they are only meant to
show progress.
"""

from __future__ import annotations

from collections.abc import Sequence

from echoic.model.runtime.formatting import (
    Formatter,
    FormattingUnavailable,
    punctuator,
    use_tagger,
)
from echoic.protos.v1 import transcriber_pb2 as pb

__all__ = [
    "Formatter", "FormattingUnavailable", "check_available", "check_tagger", "default_formatter",
    "format_results", "punctuator", "use_tagger",
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


def _format_alternative(alt: pb.SpeechRecognitionAlternative, formatter: Formatter) -> None:
    spoken = [w.word for w in alt.words] or alt.transcript.split()
    tokens = formatter.format(spoken)
    alt.transcript = " ".join(t.text for t in tokens)
    if alt.words:
        old = list(alt.words)
        del alt.words[:]
        alt.words.extend(
            pb.WordInfo(
                word=t.text, start_time=old[t.first].start_time, end_time=old[t.last - 1].end_time,
                confidence=min(w.confidence for w in old[t.first : t.last]),
            )
            for t in tokens
        )  # fmt: skip


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
