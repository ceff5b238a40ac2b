"""Formatting of final results, for every door: a result's transcript and words rewritten
as people write them (`model/runtime/formatting.py`), word times and confidences kept.

A door asks for it through `Options.formatting` (echoic's `RecognitionConfig.formatting`,
Riva's `enable_automatic_punctuation` / `verbatim_transcripts`, the OpenAI door by
default, the realtime WebSocket's `transcription_session.update`). `Session.advance`
formats its final results after the batch step, never inside it (`format_finals`). Up to
`FORMAT_ON_LOOP_WORDS` words it does so on the event loop: a final result of 20 words
costs 1.5 ms (80 words: 4.2 ms; bench/formatting_cost.py), about what a hop to a worker
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
from dataclasses import replace

from echoic.model.runtime.formatting import (
    Formatter,
    FormattingUnavailable,
    punctuator,
    use_tagger,
    written_words,
)
from echoic.server.core.types import Alternative, Refusal, RefusalKind, Result, Word

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


def _format_alternative(alt: Alternative, formatter: Formatter) -> Alternative:
    spoken = [w.text for w in alt.words] or alt.text.split()
    tokens = formatter.format(spoken)
    text = " ".join(t.text for t in tokens)
    if not alt.words:
        return replace(alt, text=text)
    written = written_words(
        tokens, [w.start for w in alt.words], [w.end for w in alt.words],
        [w.confidence for w in alt.words],
    )  # fmt: skip
    return replace(
        alt, text=text, words=tuple(Word(w.text, w.start, w.end, w.confidence) for w in written)
    )


def format_results(results: Sequence[Result], formatter: Formatter) -> list[Result]:
    """The results with each final one's alternatives formatted; interim ones as they are."""
    return [
        replace(r, alternatives=tuple(_format_alternative(a, formatter) for a in r.alternatives))
        if r.is_final
        else r
        for r in results
    ]


# Words of final results formatted on the event loop (more: a thread), about 4 ms of the
# bundled tagger: the most the loop waits on one formatting.
FORMAT_ON_LOOP_WORDS = 75


async def format_finals(results: Sequence[Result], formatter: Formatter) -> list[Result]:
    """`format_results`, in a worker thread when the finals hold over FORMAT_ON_LOOP_WORDS
    words, so that a long (or hostile) transcript does not stall the event loop."""
    words = sum(
        len(alt.words) or len(alt.text.split())
        for r in results
        if r.is_final
        for alt in r.alternatives
    )
    if words <= FORMAT_ON_LOOP_WORDS:
        return format_results(results, formatter)
    return await asyncio.to_thread(format_results, results, formatter)
