"""Inverse text normalization (model/core/inverse_text.py) against a hand-written list of
spoken phrases, and against training/transcripts.py, the forward rules, as an oracle."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import pytest

from echoic.model.core import inverse_text
from echoic.model.core.inverse_text import Token, inverse_normalize, written_text
from echoic.training.transcripts import normalize_transcript

FIXTURE = Path(__file__).parent / "fixtures" / "inverse_text.tsv"


def _cases() -> list[tuple[str, str, str, bool]]:
    rows = []
    for line in FIXTURE.read_text().splitlines():
        if line and not line.startswith("#"):
            kind, spoken, written, forward = line.split("\t")
            rows.append((kind, spoken, written, forward == "y"))
    return rows


CASES = _cases()


def test_the_list_covers_every_class_with_enough_phrases() -> None:
    kinds = {kind for kind, *_ in CASES}
    assert len(CASES) >= 200
    assert {"cardinal", "ordinal", "decimal", "fraction", "money", "percent", "time", "date",
            "year", "digits", "measure", "abbreviation"} <= kinds  # fmt: skip


def test_written_form_is_exact_for_at_least_95_percent() -> None:
    wrong = [
        (spoken, written, got)
        for _, spoken, written, _ in CASES
        if (got := written_text(inverse_normalize(spoken.split()))) != written
    ]
    assert len(wrong) <= 0.05 * len(CASES), wrong


@pytest.mark.parametrize(
    ("spoken", "written"),
    [pytest.param(s, w, id=s[:40]) for _, s, w, forward in CASES if forward],
)
def test_round_trip_through_the_forward_rules(spoken: str, written: str) -> None:
    """Where the forward rules spell the written form, they give back the spoken words,
    and the inverse gives back the written form."""
    assert normalize_transcript(written) == spoken
    assert normalize_transcript(written_text(inverse_normalize(spoken.split()))) == spoken


def test_the_forward_column_says_exactly_which_cases_the_forward_rules_cover() -> None:
    wrong = [s for _, s, w, forward in CASES if (normalize_transcript(w) == s) != forward]
    assert not wrong


def _written_forms(seed: int, n: int) -> list[str]:
    """Written forms in the inverse's own spelling, of every kind the forward rules spell."""
    rng = random.Random(seed)

    def cardinal() -> str:
        k = rng.choice([rng.randint(10, 999), rng.randint(1000, 999_999), rng.randint(10, 99)])
        return f"{k:,}" if k >= 1000 and not 2000 <= k <= 2009 else str(k)

    def ordinal() -> str:
        k = rng.randint(10, 999)
        suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
        return f"{k}{suffix}"

    def year() -> str:
        return str(rng.choice([rng.randint(1100, 1999), rng.randint(2010, 2099)]))

    def decimal() -> str:
        return f"{rng.randint(0, 999)}.{rng.randint(0, 99)}"

    def money() -> str:
        sign = rng.choice("$£€")
        whole = rng.randint(1, 999)
        if rng.random() < 0.5:
            return f"{sign}{whole}"
        return f"{sign}{whole}.{rng.randint(1, 99):02d}"

    def percent() -> str:
        whole = f"{rng.randint(10, 100)}%"
        return rng.choice([whole, f"{rng.randint(1, 99)}.{rng.randint(1, 9)}%"])

    def scaled() -> str:
        return f"{rng.choice(['', '$'])}{rng.randint(1, 999)} {rng.choice(['million', 'billion'])}"

    kinds = [cardinal, ordinal, year, decimal, money, percent, scaled]
    return [f"it was {rng.choice(kinds)()} then" for _ in range(n)]


@pytest.mark.parametrize("written", _written_forms(seed=31, n=400))
def test_written_forms_come_back_from_their_spoken_form(written: str) -> None:
    spoken = normalize_transcript(written)
    assert written_text(inverse_normalize(spoken.split())) == written


def test_each_token_knows_the_spoken_words_it_came_from() -> None:
    words = "the meeting is at three thirty p m it costs twenty five dollars".split()
    tokens = inverse_normalize(words)
    assert tokens == [
        Token("the", 0, 1), Token("meeting", 1, 2), Token("is", 2, 3), Token("at", 3, 4),
        Token("3:30", 4, 6), Token("p.m.", 6, 8), Token("it", 8, 9), Token("costs", 9, 10),
        Token("$25", 10, 13),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("spoken", "spans"),
    [
        pytest.param("the fifth of march", [(0, 1), (1, 2), (2, 3), (3, 4)], id="of-stays-itself"),
        pytest.param("march fifth twenty twenty four", [(0, 5)] * 3, id="date-shares-its-span"),
        pytest.param("", [], id="nothing"),
    ],
)
def test_spans_cover_the_spoken_words_in_order(spoken: str, spans: list[tuple[int, int]]) -> None:
    assert [(t.first, t.last) for t in inverse_normalize(spoken.split())] == spans


def _lines_run(words: list[str]) -> int:
    """Lines of model/core/inverse_text.py executed to normalize `words`: the work done,
    counted, so the test does not depend on the machine's speed."""
    source = inverse_text.__file__
    count = 0

    def trace(frame: FrameType, event: str, arg: object) -> Callable | None:
        nonlocal count
        if frame.f_code.co_filename != source:
            return None
        if event == "line":
            count += 1
        return trace

    previous = sys.gettrace()  # a debugger's or coverage's tracer, put back afterwards
    sys.settrace(trace)
    try:
        inverse_normalize(words)
    finally:
        sys.settrace(previous)
    return count


@pytest.mark.parametrize(
    "word",
    [
        pytest.param("oh", id="oh-alone-is-no-digit-run"),
        pytest.param("five", id="a-digit-run"),
        pytest.param("hello", id="no-rule"),
    ],
)
def test_a_long_run_of_one_word_costs_linear_work(word: str) -> None:
    """A hostile final of thousands of "oh" once cost quadratic time on the server's event
    loop: four times the words must cost about four times the work, not sixteen."""
    small, large = _lines_run([word] * 500), _lines_run([word] * 2000)
    assert large < 5 * small, (small, large)


def test_a_run_of_oh_stays_words() -> None:
    assert written_text(inverse_normalize(["oh"] * 1000)) == " ".join(["oh"] * 1000)
