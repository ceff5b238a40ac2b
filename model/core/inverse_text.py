"""Inverse text normalization: spoken words as a person would write them, English.

"the meeting is at three thirty on march fifth it costs twenty five dollars" ->
"the meeting is at 3:30 on March 5th it costs $25". Each written `Token` keeps the
span of spoken words it came from ("$25" <- words 9..12), so word times and
confidences carry over to the written form.

What is rewritten (the spelling is the one `training/transcripts.py` reads back, so a
transcript that went through both comes back as it was, wherever those rules reach):

- cardinals from 10 up: "twenty five" -> 25, "one hundred and five" -> 105, 12,500,
  "three million" -> "3 million"; zero to nine stay words ("one of them"), as style
  guides have it, unless a unit, sign or larger form needs the digits.
- ordinals from 10th up ("twenty first" -> 21st); "first" to "ninth" stay words
  except in dates.
- decimals ("twelve point five" -> 12.5), percentages (12.5%), fractions
  ("three quarters" -> 3/4, "two and a half" -> 2 1/2).
- money: dollars, pounds and euros ("five dollars fifty cents" -> $5.50, "two million
  dollars" -> "$2 million"); "pounds" is money, as the forward rules write "£5".
- times: "three thirty p m" -> "3:30 p.m.", "at seven oh five" -> "at 7:05",
  "six o'clock" -> "6:00"; a bare "three thirty" only after at/by/until/from/...
- dates: "march fifth" -> "March 5th", "march fifth twenty twenty four" ->
  "March 5th, 2024", "the fifth of march" -> "the 5th of March".
- years: "nineteen ninety nine" -> 1999, "nineteen oh five" -> 1905,
  "twenty twenty four" -> 2024, "nineteen nineties" -> 1990s.
- digit runs: three or more digits read one by one -> "555-1234" (7 digits),
  "555-123-4567" (10), otherwise the digits ("oh oh seven" -> 007).
- measures after a number: "five kilograms" -> "5 kg", "sixty miles per hour" -> "60 mph".
- abbreviations: mister Mr., missus Mrs., doctor Dr. (before a name, not after "the"),
  versus vs., et cetera etc.; "minus five" -> -5.

Pure Python, no grammar library: docs/formatting.md says why (cost, size, spans).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Token:
    """One written token and the spoken words it stands for: words[first:last]."""

    text: str
    first: int  # index of its first spoken word
    last: int  # one past its last spoken word


_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen "
    "fourteen fifteen sixteen seventeen eighteen nineteen"
).split()
ONES = {w: i for i, w in enumerate(_ONES)}
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
TENS = {w: 10 * i for i, w in enumerate(_TENS) if i >= 2}
SCALES = {"thousand": 10**3, "million": 10**6, "billion": 10**9, "trillion": 10**12}
_ORDINAL_ONES = {"first": 1, "second": 2, "third": 3, "fifth": 5, "eighth": 8, "ninth": 9,
                 "twelfth": 12}  # fmt: skip


def _ordinal_value(word: str) -> tuple[str, int] | None:
    """An ordinal word's place and value: "twentieth" -> ("tens", 20), "fourth" -> ("ones", 4)."""
    if word in _ORDINAL_ONES:
        return "ones", _ORDINAL_ONES[word]
    if word.endswith("ieth") and word[:-4] + "y" in TENS:
        return "tens", TENS[word[:-4] + "y"]
    if word.endswith("th"):
        base = word[:-2]
        if base in ONES:
            return "ones", ONES[base]
        if base == "hundred":
            return "hundred", 100
        if base in SCALES:
            return "scale", SCALES[base]
    return None


DIGITS = {**{w: i for w, i in ONES.items() if i < 10}, "oh": 0}
SUFFIX = {1: "st", 2: "nd", 3: "rd"}


def ordinal_suffix(n: int) -> str:
    return "th" if 10 <= n % 100 <= 20 else SUFFIX.get(n % 10, "th")


@dataclass(frozen=True)
class Number:
    value: int
    end: int  # index one past its last word
    ordinal: bool  # its last word is an ordinal ("twenty first")


def parse_number(words: Sequence[str], i: int) -> Number | None:
    """The longest cardinal (or ordinal) starting at words[i]: "one hundred and five",
    "a thousand", "twelve hundred", "three million two hundred thousand", "twenty first"."""
    total = 0  # the completed scales ("three million" of "three million two hundred")
    group = 0  # the group below the next scale ("two hundred", or "twelve hundred")
    last_scale = 10**15
    state = "start"  # what the last word was: start, a, ones, tens, hundred, scale, and
    best: Number | None = None
    j = i
    while j < len(words):
        w = words[j]
        ordinal = _ordinal_value(w)
        kind, value = ordinal if ordinal else ("", 0)
        following = words[j + 1] if j + 1 < len(words) else ""
        if w in ONES or kind == "ones":
            v = ONES.get(w, value)
            ok = state in ("start", "hundred", "scale", "and") or (state == "tens" and 0 < v < 10)
            if not ok or (v == 0 and state != "start"):
                break
            group += v
            state = "ones"
        elif w in TENS or kind == "tens":
            if state not in ("start", "hundred", "scale", "and"):
                break
            group += TENS.get(w, value)
            state = "tens"
        elif ordinal and state == "start" and kind in ("hundred", "scale"):
            group = value  # "the hundredth", "the thousandth"
            state = "ones"
        elif w == "hundred" or kind == "hundred":
            if state not in ("ones", "a", "tens") or group % 100 == 0 and state != "a":
                break
            if group >= 100 or (state == "tens" and group % 10 == 0):
                break  # "one hundred five hundred", "twenty hundred"
            group = (group or 1) * 100
            state = "hundred"
        elif w in SCALES or kind == "scale":
            scale = SCALES.get(w, value)
            if state not in ("ones", "tens", "hundred", "a") or scale >= last_scale:
                break
            if group == 0 and state != "a":
                break  # "zero thousand"
            total += (group or 1) * scale
            group, last_scale, state = 0, scale, "scale"
        elif w == "a" and state == "start" and following in ("hundred", *SCALES):
            state = "a"
        elif (
            w == "and"
            and state in ("hundred", "scale")
            and following != "zero"
            and (following in ONES or following in TENS or _ordinal_value(following))
        ):
            state = "and"
        else:
            break
        j += 1
        if state not in ("a", "and"):
            best = Number(total + group, j, bool(ordinal))
        if ordinal or (state == "ones" and group == 0):
            break  # an ordinal ends a number, and so does "zero"
    return best


def written_number(n: int) -> str:
    """12 -> "12", 1234 -> "1,234", 2005 -> "2005", 3000000 -> "3 million". A thousands
    comma marks a quantity (without it, 1234 reads as the year "twelve thirty four");
    2000-2009 go without one, as they are said alike and mostly are years."""
    for name, scale in sorted(SCALES.items(), key=lambda kv: -kv[1]):
        if scale >= 10**6 and n >= scale and n % scale == 0 and n // scale < 1000:
            return f"{n // scale} {name}"
    return str(n) if n < 1000 or 2000 <= n <= 2009 else f"{n:,}"


# ------------------------------------------------------------------ vocabularies

MONTHS = ("january february march april may june july august september october november "
          "december").split()  # fmt: skip
CURRENCIES = {"dollar": "$", "dollars": "$", "pound": "£", "pounds": "£", "euro": "€",
              "euros": "€"}  # fmt: skip
MINOR = {"cent", "cents", "penny", "pence"}  # a hundredth of any of them
UNITS = {
    ("kilograms",): "kg", ("kilogram",): "kg", ("grams",): "g", ("gram",): "g",
    ("milligrams",): "mg", ("kilometers",): "km", ("kilometres",): "km", ("kilometer",): "km",
    ("meters",): "m", ("metres",): "m", ("meter",): "m", ("centimeters",): "cm",
    ("centimeter",): "cm", ("millimeters",): "mm", ("millimeter",): "mm", ("liters",): "L",
    ("litres",): "L", ("liter",): "L", ("milliliters",): "mL", ("miles", "per", "hour"): "mph",
    ("kilometers", "per", "hour"): "km/h", ("degrees", "celsius"): "°C",
    ("degrees", "fahrenheit"): "°F", ("feet",): "ft", ("foot",): "ft", ("inches",): "in",
    ("gigabytes",): "GB", ("gigabyte",): "GB", ("megabytes",): "MB", ("megabyte",): "MB",
    ("kilobytes",): "KB", ("terabytes",): "TB", ("hertz",): "Hz", ("kilohertz",): "kHz",
    ("megahertz",): "MHz", ("gigahertz",): "GHz", ("milliseconds",): "ms",
    ("volts",): "V", ("watts",): "W", ("kilowatts",): "kW",
}  # fmt: skip
DENOMINATORS = {"half": 2, "halves": 2, "third": 3, "thirds": 3, "quarter": 4, "quarters": 4,
                "fourth": 4, "fourths": 4, "fifth": 5, "fifths": 5, "sixth": 6, "sixths": 6,
                "seventh": 7, "sevenths": 7, "eighth": 8, "eighths": 8, "ninth": 9,
                "ninths": 9, "tenth": 10, "tenths": 10}  # fmt: skip
TIME_CUES = {"at", "by", "until", "till", "from", "around", "before", "after", "since", "to"}
MERIDIEM = {("a", "m"): "a.m.", ("p", "m"): "p.m.", ("am",): "a.m.", ("pm",): "p.m."}
TITLES = {"mister": "Mr.", "missus": "Mrs.", "doctor": "Dr."}
DETERMINERS = {"the", "a", "an", "my", "your", "his", "her", "our", "their", "this", "that",
               "every", "no", "good", "family", "see", "to", "any"}  # fmt: skip


# ------------------------------------------------------------------ the rules

Rule = Callable[[Sequence[str], int], "tuple[list[str], int] | None"]


def _meridiem(words: Sequence[str], j: int) -> tuple[str, int] | None:
    for spoken, written in MERIDIEM.items():
        if tuple(words[j : j + len(spoken)]) == spoken:
            return written, j + len(spoken)
    return None


def _small(words: Sequence[str], i: int, low: int, high: int) -> Number | None:
    n = parse_number(words, i)
    if n and not n.ordinal and low <= n.value <= high and n.end - i <= 2:
        return n
    return None


def time_rule(words: Sequence[str], i: int) -> tuple[list[str], int] | None:
    hour = _small(words, i, 1, 12)
    if hour is None or hour.end - i != 1:
        return None
    j = hour.end
    minutes = None
    if words[j : j + 1] == ["o'clock"]:
        minutes, j = "00", j + 1
    elif words[j : j + 1] == ["oh"] and j + 1 < len(words) and words[j + 1] in DIGITS:
        if DIGITS[words[j + 1]] == 0:
            return None
        minutes, j = f"0{DIGITS[words[j + 1]]}", j + 2
    else:
        m = _small(words, j, 10, 59)
        if m and (m.end - j == 2 or words[j] in TENS or m.value < 20):
            minutes, j = f"{m.value:02d}", m.end
    mer = _meridiem(words, j)
    cue = i > 0 and words[i - 1] in TIME_CUES
    if minutes is None and mer is None:
        return None
    if mer is None and not cue and words[j - 1] != "o'clock":
        return None
    text = f"{hour.value}" + (f":{minutes}" if minutes else "")
    if mer:
        return [text, mer[0]], mer[1]
    return [text], j


def year_rule(words: Sequence[str], i: int) -> tuple[list[str], int] | None:
    """ "nineteen ninety nine", "nineteen oh five", "twenty twenty four", "nineteen nineties"."""
    if i >= len(words):
        return None
    century = ONES.get(words[i], TENS.get(words[i]))
    if century is None or not 11 <= century <= 20:
        return None
    j = i + 1
    if j >= len(words):
        return None
    w = words[j]
    if w == "oh" and j + 1 < len(words) and words[j + 1] in DIGITS and DIGITS[words[j + 1]]:
        return [str(century * 100 + DIGITS[words[j + 1]])], j + 2
    if w.endswith("ies") and w[:-3] + "y" in TENS:  # "nineteen nineties" -> 1990s
        return [f"{century * 100 + TENS[w[:-3] + 'y']}s"], j + 1
    if w == "hundreds":
        return [f"{century * 100}s"], j + 1
    if w == "hundred" and century < 20:  # "nineteen hundred"; "twenty hundred" is no year
        return [str(century * 100)], j + 1
    if w in TENS or (w in ONES and ONES[w] >= 10):
        rest = parse_number(words, j)
        if rest and not rest.ordinal and 10 <= rest.value <= 99 and rest.end - j <= 2:
            if century == 20 and rest.value < 10:
                return None
            return [str(century * 100 + rest.value)], rest.end
    return None


def digit_run_end(words: Sequence[str], i: int) -> int:
    """One past the run of digit words that starts at i (i itself when words[i] is none)."""
    j = i
    while j < len(words) and words[j] in DIGITS:
        j += 1
    return j


def digit_run_rule(words: Sequence[str], i: int) -> tuple[list[str], int] | None:
    """A run refused here is refused at every later start inside it too (shorter still, or
    "oh" alone still): `inverse_normalize` skips past it, so a long run costs linear time."""
    j = digit_run_end(words, i)
    if j - i < 3 or all(w == "oh" for w in words[i:j]):
        return None
    digits = "".join(str(DIGITS[w]) for w in words[i:j])
    if len(digits) == 7:
        digits = f"{digits[:3]}-{digits[3:]}"
    elif len(digits) == 10:
        digits = f"{digits[:3]}-{digits[3:6]}-{digits[6:]}"
    return [digits], j


def _decimal(words: Sequence[str], i: int) -> tuple[str, int, int | None] | None:
    """A number with an optional "point d d d": (written, end, integer value if whole);
    "minus" before it is a sign."""
    if words[i] == "minus" and i + 1 < len(words):
        amount = _decimal(words, i + 1)
        return ("-" + amount[0], amount[1], None) if amount else None
    n = parse_number(words, i)
    if n is None or n.ordinal:
        return None
    j = n.end
    if words[j : j + 1] == ["point"] and j + 1 < len(words) and words[j + 1] in DIGITS:
        k = j + 1
        while k < len(words) and words[k] in DIGITS:
            k += 1
        fraction = "".join(str(DIGITS[w]) for w in words[j + 1 : k])
        if words[k : k + 1] and words[k] in SCALES and SCALES[words[k]] >= 10**6:
            return f"{n.value}.{fraction} {words[k]}", k + 1, None
        return f"{n.value}.{fraction}", k, None
    return written_number(n.value), j, n.value


def money_rule(words: Sequence[str], i: int) -> tuple[list[str], int] | None:
    amount = _decimal(words, i)
    if amount is None:
        return None
    text, j, whole = amount
    if j >= len(words) or words[j] not in CURRENCIES:
        return None
    sign = CURRENCIES[words[j]]
    j += 1
    k = j + 1 if words[j : j + 1] == ["and"] else j
    cents = parse_number(words, k) if k < len(words) else None
    if (whole is not None and cents and not cents.ordinal and 1 <= cents.value <= 99
            and cents.end < len(words) and words[cents.end] in MINOR):  # fmt: skip
        return [f"{sign}{whole}.{cents.value:02d}"], cents.end + 1
    return [sign + text], j


def measure_rule(words: Sequence[str], i: int) -> tuple[list[str], int] | None:
    amount = _decimal(words, i)
    if amount is None:
        return None
    text, j, _ = amount
    if words[j : j + 1] == ["percent"]:
        return [text + "%"], j + 1
    for spoken in sorted(UNITS, key=len, reverse=True):
        if tuple(words[j : j + len(spoken)]) == spoken:
            return [text, UNITS[spoken]], j + len(spoken)
    return None


def fraction_rule(words: Sequence[str], i: int) -> tuple[list[str], int] | None:
    """ "three quarters" -> 3/4, "two and a half" -> 2 1/2, "one and three quarters" -> 1 3/4."""
    n = _small(words, i, 1, 19)
    if n is None:
        return None
    j = n.end
    denominator = words[j] if j < len(words) else ""
    if denominator in DENOMINATORS:
        if denominator.endswith("s") != (n.value > 1):  # "one thirds", "two third"
            return None
        return [f"{n.value}/{DENOMINATORS[denominator]}"], j + 1
    if words[j : j + 2] == ["and", "a"] and words[j + 2 : j + 3] in (["half"], ["quarter"]):
        return [f"{n.value} 1/{DENOMINATORS[words[j + 2]]}"], j + 3
    if words[j : j + 1] == ["and"]:
        part = fraction_rule(words, j + 1)
        if part and " " not in part[0][0]:
            return [f"{n.value} {part[0][0]}"], part[1]
    return None


def date_rule(words: Sequence[str], i: int) -> tuple[list[str], int] | None:
    """ "march fifth [twenty twenty four]", "the fifth of march" (from the ordinal)."""
    w = words[i]
    if w in MONTHS:
        day = parse_number(words, i + 1) if i + 1 < len(words) else None
        if day is None or not 1 <= day.value <= 31 or (not day.ordinal and w == "may"):
            return None
        if year_rule(words, i + 1):
            return None  # "march nineteen ninety nine"
        text = str(day.value) + (ordinal_suffix(day.value) if day.ordinal else "")
        year = year_rule(words, day.end) if day.end < len(words) else None
        if year is None and day.end < len(words):
            number = parse_number(words, day.end)
            if number and not number.ordinal and 1000 <= number.value <= 2099:
                year = [str(number.value)], number.end
        if year:
            return [w.capitalize(), text + ",", year[0][0]], year[1]
        return [w.capitalize(), text], day.end
    day = parse_number(words, i)
    if day and day.ordinal and 1 <= day.value <= 31 and words[day.end : day.end + 1] == ["of"]:
        if day.end + 1 < len(words) and words[day.end + 1] in MONTHS:
            text = f"{day.value}{ordinal_suffix(day.value)}"
            return [text, "of", words[day.end + 1].capitalize()], day.end + 2
    return None


def number_rule(words: Sequence[str], i: int) -> tuple[list[str], int] | None:
    """Cardinals and ordinals from 10 up, decimals, "minus five"."""
    if words[i] == "minus":
        amount = _decimal(words, i)
        return ([amount[0]], amount[1]) if amount else None
    n = parse_number(words, i)
    if n is None:
        return None
    if n.ordinal:
        if n.value < 10:
            return None
        return [f"{written_number(n.value)}{ordinal_suffix(n.value)}"], n.end
    amount = _decimal(words, i)
    assert amount is not None
    text, j, whole = amount
    if whole is not None and whole < 10:
        return None
    return [text], j


def title_rule(words: Sequence[str], i: int) -> tuple[list[str], int] | None:
    w = words[i]
    if w == "versus":
        return ["vs."], i + 1
    if words[i : i + 2] == ["et", "cetera"]:
        return ["etc."], i + 2
    if w in TITLES and i + 1 < len(words):
        if w == "doctor" and i > 0 and words[i - 1] in DETERMINERS:
            return None
        return [TITLES[w]], i + 1
    return None


# Order matters: the most specific reading of a span wins.
RULES: tuple[Rule, ...] = (
    date_rule, time_rule, year_rule, money_rule, measure_rule, fraction_rule, digit_run_rule,
    number_rule, title_rule,
)  # fmt: skip


def inverse_normalize(words: Sequence[str]) -> list[Token]:
    """Spoken words -> written tokens, each with the span of words it came from. A rule
    that writes several tokens from one span ("3:30 p.m.", "March 5th, 2024") gives
    each of them the whole span: they are read and timed together."""
    words = [w.lower() for w in words]
    out: list[Token] = []
    i = 0
    refused_run_end = 0  # digit_run_rule refused a run ending here: no start before it can match
    while i < len(words):
        for rule in RULES:
            if rule is digit_run_rule and i < refused_run_end:
                continue
            hit = rule(words, i)
            if rule is digit_run_rule and not hit:
                refused_run_end = digit_run_end(words, i)
            if hit:
                texts, end = hit
                spans = _spans(words, i, end, texts)
                out.extend(Token(t, a, b) for t, (a, b) in zip(texts, spans, strict=True))
                i = end
                break
        else:
            out.append(Token(words[i], i, i + 1))
            i += 1
    return out


def _spans(words: Sequence[str], first: int, last: int, texts: list[str]) -> list[tuple[int, int]]:
    """Each written token's spoken span: words written unchanged ("of" in "5th of March")
    map to themselves, the rest share what is left of the span."""
    if len(texts) == 1:
        return [(first, last)]
    if texts[-1] in ("a.m.", "p.m."):
        end = last - (2 if words[last - 1] == "m" else 1)
        return [*_spans(words, first, end, texts[:-1]), (end, last)]
    if len(texts) == 3 and texts[1] == "of":
        of = words.index("of", first)
        return [(first, of), (of, of + 1), (of + 1, last)]
    return [(first, last)] * len(texts)


def written_text(tokens: Sequence[Token]) -> str:
    return " ".join(t.text for t in tokens)
