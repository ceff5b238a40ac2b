"""The punctuation tagger's data recipe (training/punctuation.py): the readers of the prose
packages scripts/fetch_prose.sh unpacks, on small pages written here, and the scoring of
an exported tagger beside the torch one it came from."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="the training recipe needs the train extra")
pytest.importorskip("onnxruntime", reason="an exported tagger runs on ONNX Runtime")

import torch  # noqa: E402

from echoic.model.core.punctuation import (  # noqa: E402
    PieceList,
    WordList,
    encode,
    end_sentence,
    tags_of_prose,
)
from echoic.model.nn.punctuation import (  # noqa: E402
    PUNCT_KEY,
    Tagger,
    TaggerConfig,
    export_ensemble,
    export_tagger,
    exported_tagger,
)
from echoic.training import punctuation  # noqa: E402
from echoic.training.punctuation import (  # noqa: E402
    FIRST_SOURCES,
    PROSE_SOURCES,
    SECOND_SOURCES,
    Corpus,
    _selection,
    calibrate,
    cataclysm_paragraphs,
    crawl_paragraphs,
    endless_sky_paragraphs,
    held_out_windows,
    html_paragraphs,
    prose_sources,
    running_text,
    score,
    sentence_windows,
    torch_tagger,
    wesnoth_paragraphs,
    wordnet_paragraphs,
)
from tests.conftest import ROOT  # noqa: E402

PAGE = """<html><head><title>Not a paragraph.</title></head><body>
<div class="navheader"><a href="x.html">Prev</a> Next chapter, on the way out.</div>
<p>Anarchism is a political theory, <i>"the absence of a master."</i> [P-J Proudhon,
<b>What is Property</b>, p. 264] In other words, it aims at a free society.
<p>Is this the second paragraph? It is, though the first was never closed.</p>
<div class="para">DocBook writes its paragraphs as divisions; this one reads well enough.</div>
<div class="para">Run <code class="command">apt-get update</code> before you install it.</div>
<pre>This preformatted block is code, not prose, and it is skipped.</pre>
<table><tr><td><p>A paragraph inside a table cell is never running text.</p></td></tr></table>
<p>Too short to count.</p>
<p>"[i]n common with all socialists," they said, and went home early that day.</p>
<p>An ellipsis . . . cuts a quote, so the sentence is not whole any more.</p>
</body></html>"""


def test_html_pages_give_their_running_text_paragraphs(tmp_path: Path) -> None:
    (tmp_path / "page.html").write_text(PAGE, encoding="utf-8")
    (tmp_path / "notes.txt").write_text("Not an HTML page, so it is never read at all.")
    assert list(html_paragraphs(tmp_path)) == [
        'Anarchism is a political theory, "the absence of a master." In other words, '
        "it aims at a free society.",
        "Is this the second paragraph? It is, though the first was never closed.",
        "DocBook writes its paragraphs as divisions; this one reads well enough.",
        '"in common with all socialists," they said, and went home early that day.',
    ]


@pytest.mark.parametrize(
    ("paragraph", "text"),
    [
        pytest.param("It works \u2014 mostly \u2014 as   you\nwould hope.",
                     "It works, mostly, as you would hope.", id="dashes-as-commas"),
        pytest.param("It costs \u20ac5, which is a lot for one cup.", None, id="odd-characters"),
        pytest.param("A heading with no sentence end at all here", None, id="no-sentence-end"),
        pytest.param("It ends (as it should) in a closing bracket here.)",
                     "It ends (as it should) in a closing bracket here.)", id="closing-bracket"),
    ],
)  # fmt: skip
def test_running_text_keeps_only_sentence_like_paragraphs(paragraph: str, text: str | None):
    assert running_text(paragraph) == text


def test_prose_packages_are_read_where_unpacked_and_skipped_when_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert prose_sources(tmp_path / "never-fetched") == {}
    faq = next(s for s in PROSE_SOURCES if s.name == "debian-faq")
    where = tmp_path / faq.package / faq.where
    where.mkdir(parents=True)
    sentence = "<p>This answer has exactly seven words here.</p>"
    (where / "basic.en.html").write_text(sentence * 3)
    (where / "basic.fr.html").write_text("<p>Cette page est en français, pas en anglais.</p>")
    wordnet = next(s for s in PROSE_SOURCES if s.name == "wordnet")
    (tmp_path / wordnet.package / wordnet.where).mkdir(parents=True)
    (tmp_path / wordnet.package / wordnet.where / "data.verb").write_text(
        '00001 29 v 01 go 0 | move; "Did he go home?"; "she went"\n'
    )
    read = {name: list(paragraphs) for name, paragraphs in prose_sources(tmp_path).items()}
    assert read == {"wordnet": ["Did he go home?"],
                    "debian-faq": ["This answer has exactly seven words here."] * 3}  # fmt: skip
    # The cap: whole paragraphs, in file order, until it is reached.
    monkeypatch.setattr(punctuation, "PROSE_SOURCES", (dataclasses.replace(faq, max_words=10),))
    assert len(list(prose_sources(tmp_path)["debian-faq"])) == 2


def test_wordnet_examples_in_lower_case_are_kept_with_a_capital(tmp_path: Path) -> None:
    """Half of WordNet's examples that end a sentence start in lower case, most of them
    questions; they were once dropped. Phrases without a sentence end still are."""
    (tmp_path / "data.adv").write_text(
        '00002 02 r 01 how 0 | in what way; "how did your interview go?"; "how nice"; '
        '"He came home." \n'
        '  1 This line is the licence header, "not an example."\n'
    )
    assert list(wordnet_paragraphs(tmp_path)) == ["How did your interview go?", "He came home."]


def test_an_exported_tagger_scores_as_the_torch_one_it_came_from(tmp_path: Path) -> None:
    """--score-only scores a tagger file with ONNX Runtime as the server runs it; its scores
    on a held-out set are the ones training printed for the same weights in torch."""
    words = WordList(("the", "a", "is", "it", "of"))
    model = Tagger(TaggerConfig(words=5, word_dim=4, char_dim=4, char_filters=4, hidden=4)).eval()
    path = tmp_path / "tagger.onnx"
    export_tagger(model, words, {}, path)
    prose = "Is it the end? It is, of course. The cat sat on a mat, and it slept."
    pieces = held_out_windows([tags_of_prose(prose)] * 3, 7)
    scores = score(exported_tagger(path), pieces)
    assert scores == score(torch_tagger(model, words), pieces)
    assert scores["words"] == 3 * len(prose.split()) and scores["."]["support"] == 6


def test_the_tagger_size_set_on_the_command_line_is_the_exported_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--words, --hidden, ... size the tagger, and the file says its size: the server's
    runtime loads a tagger of any size as it is (`Punctuator`)."""
    from echoic.model.runtime.formatting import Punctuator

    prose = [tags_of_prose(p) for p in ("Is it the end? It is, of course.",
                                        "The cat sat on a mat, and it slept. Did it?")]  # fmt: skip
    data = Corpus(train=prose * 4, dev=prose[1:], held={"fortunes": prose, "info": prose[:1]})
    monkeypatch.setattr(punctuation, "corpus", lambda prose_dir: data)
    out = tmp_path / "tagger.onnx"
    size = ["--words", "9", "--word-dim", "6", "--char-dim", "5", "--char-filters", "7",
            "--hidden", "3", "--layers", "1", "--dropout", "0"]  # fmt: skip
    punctuation.main(["--out", str(out), "--minutes", "0.001", *size])
    assert f"wrote {out}" in capsys.readouterr().out
    tagger = Punctuator(out)
    meta = tagger.session.get_modelmeta().custom_metadata_map[PUNCT_KEY]
    config = json.loads(meta)["config"]
    assert config == {"words": 9, "word_dim": 6, "char_dim": 5, "char_filters": 7, "hidden": 3,
                      "layers": 1, "dropout": 0.0}  # fmt: skip
    assert len(tagger.words.words) == 9
    marks, cases = tagger.tag(["is", "it", "the", "end"])
    assert len(marks) == len(cases) == 4


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _averaged(paths: list[Path], tokens: list[str]) -> list[np.ndarray]:
    """The taggers' mark and case log-probabilities for `tokens`, averaged: each run alone."""
    from echoic.model.runtime.formatting import Punctuator

    out = [np.zeros(1), np.zeros(1)]
    for path in paths:
        alone = Punctuator(path)
        w, c = encode(tokens, alone.words)
        for k, x in enumerate(alone.session.run(None, {"word_ids": w[None], "char_ids": c[None]})):
            out[k] = out[k] + _log_softmax(x[0]) / len(paths)
    return out


def _ensemble_of_two(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Path], Path]:
    """Two small exported taggers of different word lists, and `--ensemble` of them (on a
    corpus of two paragraphs): their files and the ensemble's."""
    members = []
    for i, (known, seed) in enumerate(((("the", "a", "is", "it"), 1), (("cat", "it", "mat"), 2))):
        torch.manual_seed(seed)
        cfg = TaggerConfig(words=len(known), word_dim=4, char_dim=4, char_filters=4, hidden=3 + i)
        members.append(tmp_path / f"member{i}.onnx")
        export_tagger(Tagger(cfg).eval(), WordList(known), {}, members[-1])
    prose = [tags_of_prose(p) for p in ("Is it the end? It is, of course.",
                                        "The cat sat on a mat, and it slept. Did it?")]  # fmt: skip
    data = Corpus(train=prose, dev=prose, held={"fortunes": prose, "info": prose[:1]})
    monkeypatch.setattr(punctuation, "corpus", lambda prose_dir: data)
    out = tmp_path / "ensemble.onnx"
    punctuation.main(["--out", str(out), "--ensemble", *map(str, members)])
    return members, out


ENSEMBLE_TOKENS = ["the", "cat", "sat", "on", "a", "mat", "it", "is"]


def test_an_ensemble_averages_its_members_each_reading_its_own_word_ids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--ensemble writes one tagger file that the runtime loads as any other: its word list
    is the members' together, each member reads its own ids of a word (a word only one of
    them knows is "other" to the rest), and its marks and cases are the members' averaged
    log-probabilities, the marks shifted by the offsets calibrated on the development set."""
    from echoic.model.runtime.formatting import Punctuator

    members, out = _ensemble_of_two(tmp_path, monkeypatch)
    assert f"wrote {out}" in capsys.readouterr().out
    ensemble = Punctuator(out)
    assert ensemble.words.words == ("the", "a", "is", "it", "cat", "mat")
    assert [m["file"] for m in ensemble.scores["members"]] == ["member0.onnx", "member1.onnx"]
    offsets = np.array(ensemble.scores["mark_offsets"], np.float32)
    want = _averaged(members, ENSEMBLE_TOKENS)
    w, c = encode(ENSEMBLE_TOKENS, ensemble.words)
    got = ensemble.session.run(None, {"word_ids": w[None], "char_ids": c[None]})
    np.testing.assert_allclose(got[0][0], want[0] + offsets, atol=1e-5)
    np.testing.assert_allclose(got[1][0], want[1], atol=1e-5)
    assert ensemble.tag(ENSEMBLE_TOKENS) == (
        end_sentence(want[0] + offsets),
        want[1].argmax(-1).tolist(),
    )


def test_an_ensemble_is_a_member_like_any_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bundled tagger is an ensemble of a pair and a third: the pair counts for half,
    and the record of its members names the pair's own."""
    from echoic.model.runtime.formatting import Punctuator

    _, pair = _ensemble_of_two(tmp_path, monkeypatch)
    torch.manual_seed(3)
    third = tmp_path / "member2.onnx"
    cfg = TaggerConfig(words=2, word_dim=4, char_dim=4, char_filters=4, hidden=5)
    export_tagger(Tagger(cfg).eval(), WordList(("it", "sat")), {}, third)
    outer = tmp_path / "outer.onnx"
    punctuation.main(["--out", str(outer), "--ensemble", str(pair), str(third)])
    nested = Punctuator(outer)
    assert nested.scores["members"] == [
        {"file": "ensemble.onnx", "members": Punctuator(pair).scores["members"]},
        {"file": "member2.onnx", "utterances": None},  # no budget recorded: none said
    ]
    want = _averaged([pair, third], ENSEMBLE_TOKENS)
    w, c = encode(ENSEMBLE_TOKENS, nested.words)
    got = nested.session.run(None, {"word_ids": w[None], "char_ids": c[None]})
    offsets = np.array(nested.scores["mark_offsets"], np.float32)
    np.testing.assert_allclose(got[0][0], want[0] + offsets, atol=1e-5)
    np.testing.assert_allclose(got[1][0], want[1], atol=1e-5)


def test_wesnoth_dialogue_is_read_from_the_campaigns_message_and_story_strings(
    tmp_path: Path,
) -> None:
    scenario = tmp_path / "Heir_To_The_Throne" / "scenarios" / "01_Start.cfg"
    scenario.parent.mkdir(parents=True)
    scenario.write_text(
        '[message]\n    speaker=Delfador\n    message= _ "Ho, Galdrad! Has he conjured'
        ' something else to <i>beat</i> me with?"\n'
        '    female_message= _ "female^Ho, Galdrad! Has she conjured something else?"\n'
        "[/message]\n"
        'message= _ "Welcome back, $unit.name, to the end of the world."\n'
        'story= _ "The king was dead. He said ""wait"" and then the\ncity fell to the orcs."\n'
        'message= _ "Too short."\n'
    )
    assert list(wesnoth_paragraphs(tmp_path)) == [
        "Ho, Galdrad! Has he conjured something else to beat me with?",
        'The king was dead. He said "wait" and then the city fell to the orcs.',
    ]


def test_endless_sky_missions_give_their_back_quoted_conversation_lines(
    tmp_path: Path,
) -> None:
    (tmp_path / "intro missions.txt").write_text(
        "# Copyright (c) 2014 (this comment is not read, it is not back-quoted at all).\n"
        'mission "Intro [0]"\n\tname "Passenger to <planet>"\n\ton offer\n'
        "\t\tconversation\n"
        '\t\t\t`\t"Nothing quite like buying your very first starship," he says.`\n'
        "\t\t\tchoice\n"
        '\t\t\t\t`\t"Do you plan to get too attached to this one?"`\n'
        "\t\t\t`You drop off the peacekeepers on <planet> and collect your pay.`\n"
        "\t\t\t`\tToo short.`\n"
    )
    assert list(endless_sky_paragraphs(tmp_path)) == [
        '"Nothing quite like buying your very first starship," he says.',
        '"Do you plan to get too attached to this one?"',
    ]


def test_cataclysm_reads_dialogue_replies_notes_and_descriptions_of_its_json(
    tmp_path: Path,
) -> None:
    talk = [
        {"type": "talk_topic", "id": "TALK_X",
         "dynamic_line": {"u_has_item": "radio", "yes": "Can you get me out of this hole?",
                          "no": "I have nothing more to say to you right now."},
         "responses": [{"text": "What do you need me to bring you, then?", "topic": "T"},
                       {"text": "Let me think about it, <name>, and I will be back."}]},
        {"type": "GENERIC", "id": "box", "name": "metal box of old tools",
         "description": "A sturdy metal box.  It rattles when shaken.\n\nIt is locked."},
    ]  # fmt: skip
    (tmp_path / "npcs").mkdir()
    (tmp_path / "npcs" / "talk.json").write_text(json.dumps(talk))
    (tmp_path / "broken.json").write_text('{"description": "Not JSON at all, so it')
    assert list(cataclysm_paragraphs(tmp_path)) == [
        "Can you get me out of this hole?",
        "I have nothing more to say to you right now.",
        "What do you need me to bring you, then?",
        "A sturdy metal box. It rattles when shaken.",  # "It is locked." is too short
    ]


def test_crawl_reads_records_without_keys_attributions_verse_or_markup(tmp_path: Path) -> None:
    (tmp_path / "quotes.txt").write_text(
        "%%%%\nAgnes\n\nThis spriggan is aged and weathered from years of travel,\n"
        "far from the forests and swamps that are her home.\n%%%%\n"
        "__c_suffix\n\n\u201cHe held up his hand, and they all stopped, and I\n"
        " thought he was saying something.\u201d\n    -Bram Stoker, _Dracula_. 1897.\n"
        "%%%%\nverse\n\nThe woods are lovely, dark and deep,\nBut I have promises to keep,\n"
        "And miles to go before I sleep.\n%%%%\nmarkup\n\n"
        "@The_monster@ says something very loud and clear to you.\n%%%%\n"
    )
    (tmp_path / "de").mkdir()
    (tmp_path / "de" / "quotes.txt").write_text("%%%%\nx\n\nEin Satz, der nicht gelesen wird.\n")
    assert list(crawl_paragraphs(tmp_path)) == [
        "This spriggan is aged and weathered from years of travel, far from the forests and"
        " swamps that are her home.",
        '"He held up his hand, and they all stopped, and I thought he was saying something."',
    ]


def test_earlier_taggers_sources_are_read_first_so_their_held_out_sets_stay_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A paragraph seen before is not read again, so a source's held-out set stays the same
    only while every source read before it does: `corpus` reads the sources of the first
    and second taggers first, in the order they were read then, and the newer ones after."""
    sources = []
    for source in PROSE_SOURCES:  # every package unpacked, each giving one paragraph
        where = tmp_path / source.package.replace("*", "x") / source.where.replace("*", "x")
        where.mkdir(parents=True)
        line = f"The {source.name} source says this, and says it once."
        sources.append(dataclasses.replace(source, read=lambda _, line=line: iter([line])))
    monkeypatch.setattr(punctuation, "PROSE_SOURCES", tuple(sources))
    for reader in ("fortune_paragraphs", "info_paragraphs"):  # the system's own: any words
        monkeypatch.setattr(punctuation, reader, lambda r=reader: iter([f"From {r}, a line."]))
    monkeypatch.setattr(punctuation, "WORDNET_DIR", tmp_path / "no-wordnet")  # from its package
    order = list(punctuation.corpus(tmp_path).held)
    assert order[: len(SECOND_SOURCES)] == list(SECOND_SOURCES)
    assert order[: len(FIRST_SOURCES)] == list(FIRST_SOURCES)
    assert sorted(order[len(SECOND_SOURCES) :]) == ["cataclysm", "crawl", "endless-sky"]


def test_held_out_pieces_are_whole_sentences_up_to_the_window() -> None:
    """An utterance ends where its speaker stopped: the held-out pieces end at sentence ends,
    as many sentences as fit; only a sentence longer than the window is cut inside (and its
    tail stands alone: it ends a sentence, and a piece never starts inside one that does
    not start there)."""
    paragraph = tags_of_prose(
        "One two three. Four five six? Seven eight nine ten eleven twelve. End."
    )
    pieces = sentence_windows([paragraph], 5)
    assert [[t.token for t in p] for p in pieces] == [
        ["one", "two", "three"], ["four", "five", "six"],
        ["seven", "eight", "nine", "ten", "eleven"], ["twelve"], ["end"],
    ]  # fmt: skip
    assert [t for p in pieces for t in p] == paragraph
    cut = held_out_windows([paragraph], 5)  # the old scoring: a cut every 5 words
    assert [p[-1].token for p in cut] == ["five", "ten", "end"]


def test_a_padded_training_batch_tags_each_row_as_the_row_alone() -> None:
    """The server tags one unpadded sequence; a training batch pads its rows to the longest.
    With the rows' lengths the backward GRU starts at each row's last token, so a row's
    logits in the batch are the row's alone (without them a short row's were not: its
    backward pass first ran over the padding)."""
    torch.manual_seed(0)
    model = Tagger(TaggerConfig(words=50, word_dim=8, char_filters=8, hidden=8)).eval()
    paragraph = tags_of_prose("One two three. Four five six seven? Eight nine, ten. Eleven.")
    words = WordList(tuple(t.token for t in paragraph))
    rng = np.random.default_rng(1)
    w, c, _, _, lengths = next(punctuation.batches([paragraph] * 3, words, 8, 16, rng))
    assert len(set(lengths.tolist())) > 1, "rows of one length: nothing padded"
    with torch.no_grad():
        packed, _ = model(w, c, lengths)
        padded, _ = model(w, c)
        for k, n in enumerate(lengths.tolist()):
            alone, _ = model(w[k : k + 1, :n], c[k : k + 1, :n])
            torch.testing.assert_close(packed[k, :n], alone[0], rtol=0, atol=1e-6)
            if n < w.shape[1]:
                assert not torch.allclose(padded[k, :n], alone[0], atol=1e-3)


class _Draws:
    """A random generator whose every draw is given: `random()` gives `share`, `integers()`
    gives `length` (how `windows` picks the shape and length of each window)."""

    def __init__(self, share: float, length: int) -> None:
        self.share, self.length = share, length

    def random(self) -> float:
        return self.share

    def integers(self, low: int, high: int) -> int:
        assert low <= self.length < high
        return self.length


def test_utterance_windows_are_the_whole_sentences_that_fit() -> None:
    """`--utterances`: a window shaped as a scored final result is the whole sentences from a
    sentence start that fit in the length drawn, ending at a sentence end; a first sentence
    longer than that is cut there. Other windows end wherever the length falls."""
    paragraph = tags_of_prose("One two. Three four? Five six seven. Eight nine ten eleven twelve.")

    def shaped(length: int) -> list[tuple[int, int]]:
        out = []
        for piece in punctuation.windows(paragraph, 8, _Draws(0.0, length), utterances=0.5):
            start = next(i for i, t in enumerate(paragraph) if t is piece[0])
            out.append((start, start + len(piece)))
        return out

    # Sentences end after words 2, 4, 7 and 12.
    assert shaped(8) == [(0, 7), (2, 7), (4, 12), (7, 12)]  # as many as fit
    assert shaped(4) == [(0, 4), (2, 4), (4, 7), (7, 11)]  # the last: 5 words, cut at 4
    plain = list(punctuation.windows(paragraph, 8, _Draws(0.9, 4), utterances=0.5))
    assert [p[-1].token for p in plain] == ["four", "six", "eight", "eleven"]  # from each start


def test_calibration_is_folded_into_the_exported_tagger_and_never_scores_worse(
    tmp_path: Path,
) -> None:
    """The marks' offsets chosen on the development pieces go into the mark head's bias:
    the exported file tags with them, and they score at least as well as none there."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(3)
    words = WordList(("the", "a", "is", "it", "of", "cat"))
    model = Tagger(TaggerConfig(words=6, word_dim=4, char_dim=4, char_filters=4, hidden=4))
    prose = "Is it the end? It is, of course. The cat sat on a mat, and it slept. Is it?"
    pieces = sentence_windows([tags_of_prose(prose)] * 4, 12)
    before = score(torch_tagger(model.eval(), words), pieces)
    bias = model.marks.bias.detach().clone()
    offsets = calibrate(model, pieces, words)
    assert torch.allclose(model.marks.bias.detach(), bias + torch.tensor(offsets))
    after = score(torch_tagger(model.eval(), words), pieces)
    assert _selection(after) >= _selection(before)
    path = tmp_path / "tagger.onnx"
    export_tagger(model, words, {}, path)
    assert score(exported_tagger(path), pieces) == after


def test_a_glob_source_reads_every_package_in_name_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Wesnoth's campaigns are a package each: one source reads them all, by package name,
    whatever the release's version folder is called."""
    source = next(s for s in PROSE_SOURCES if s.name == "wesnoth")
    for package, line in (("wesnoth-1.18-b", "Second of all, the bee said so."),
                          ("wesnoth-1.16-a", "First of all, the ant said so.")):  # fmt: skip
        version = package.split("-")[1]
        where = tmp_path / package / "usr/share/games/wesnoth" / version / "data/campaigns/X"
        where.mkdir(parents=True)
        (where / "s.cfg").write_text(f'    message= _ "{line}"\n# message= _ "Not read at all."\n')
    monkeypatch.setattr(punctuation, "PROSE_SOURCES", (source,))
    assert list(prose_sources(tmp_path)["wesnoth"]) == [
        "First of all, the ant said so.", "Second of all, the bee said so."
    ]  # fmt: skip


def test_the_split_keeps_the_held_out_buckets_and_takes_the_next_ones_for_development(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    paragraphs = [f"Paragraph number {i} is here, and it ends." for i in range(400)]
    monkeypatch.setattr(punctuation, "fortune_paragraphs", lambda: iter(paragraphs))
    monkeypatch.setattr(punctuation, "info_paragraphs", lambda: iter(()))
    monkeypatch.setattr(punctuation, "WORDNET_DIR", Path("/nonexistent"))
    data = punctuation.corpus(None)
    bucket = {p: zlib.crc32(p.lower().encode()) % 100 for p in paragraphs}
    text = {tuple(tags_of_prose(p)): p for p in paragraphs}
    assert {bucket[text[tuple(p)]] for p in data.held["fortunes"]} <= set(range(5))
    assert {bucket[text[tuple(p)]] for p in data.dev} <= set(range(5, 10))
    assert min(bucket[text[tuple(p)]] for p in data.train) >= 10
    assert len(data.held["fortunes"]) + len(data.dev) + len(data.train) == 400
    assert data.dev and data.held["fortunes"]


def test_scores_are_of_the_text_as_the_server_writes_it() -> None:
    """Capitals as written (a sentence start has one whatever the tag; a long word is never
    all capitals), and the marks inside a piece scored apart from its given last one."""
    piece = tags_of_prose("NASA said hello. Did it?")
    tokens = [t.token for t in piece]
    assert tokens == ["nasa", "said", "hello", "did", "it"]

    def tag(tokens):  # marks right; "nasa" tagged all capitals, the rest lower case
        return [0, 0, 2, 0, 3], [2, 0, 0, 0, 0]

    scores = score(tag, [piece])
    # written "Nasa said hello. Did it?": "Nasa" is wrong (too long to be written in
    # capitals), "Did" right (a sentence start), the rest right
    assert scores["case_accuracy"] == pytest.approx(4 / 5)
    assert scores["."]["f1"] == 1.0 and scores["?"]["f1"] == 1.0
    assert scores["inside"]["."]["support"] == 1 and scores["inside"]["?"]["support"] == 0


def test_training_refuses_an_empty_development_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prose = [tags_of_prose("Is it the end? It is, of course.")]
    data = Corpus(train=prose * 4, held={"fortunes": prose, "info": prose})
    monkeypatch.setattr(punctuation, "corpus", lambda prose_dir: data)
    with pytest.raises(SystemExit, match="development set is empty"):
        punctuation.main(["--out", str(tmp_path / "t.onnx"), "--minutes", "0.001"])


def test_a_float16_ensemble_stores_half_the_weights_and_tags_as_the_rounded_members(
    tmp_path: Path,
) -> None:
    """--weights float16: the members' large weights (word embeddings, GRU matrices) are
    stored as float16 behind casts, the file shrinks, and the ensemble's outputs are the
    float32 ensemble's to float16 rounding (the export checks them against the rounded
    members to 1e-4)."""
    import onnx

    from echoic.model.nn.half import half_weights
    from echoic.model.runtime.formatting import Punctuator

    vocabulary = tuple(f"w{i}" for i in range(300))
    members = []
    for i in range(2):
        torch.manual_seed(i)
        cfg = TaggerConfig(words=300, word_dim=8, char_dim=4, char_filters=8, hidden=24)
        members.append(tmp_path / f"member{i}.onnx")
        export_tagger(Tagger(cfg).eval(), WordList(vocabulary), {}, members[-1])
    full, half = tmp_path / "full.onnx", tmp_path / "half.onnx"
    export_ensemble(members, [0.0, 0.1, -0.1, 0.0], {}, full)
    export_ensemble(members, [0.0, 0.1, -0.1, 0.0], {}, half, weights="float16")
    assert half_weights(onnx.load(str(half))) >= 4  # two embeddings, two GRUs' matrices at least
    assert half_weights(onnx.load(str(full))) == 0
    assert half.stat().st_size < 0.7 * full.stat().st_size
    tokens = ["w1", "w7", "w299", "other", "w42"]
    outputs = []
    for path in (full, half):
        tagger = Punctuator(path)
        w, c = encode(tokens, tagger.words)
        outputs.append(tagger.session.run(None, {"word_ids": w[None], "char_ids": c[None]}))
    for a, b in zip(*outputs, strict=True):
        difference = float(np.abs(a - b).max())
        assert 0 < difference < 1e-2
    with pytest.raises(ValueError, match="weights must be one of"):
        export_ensemble(members, [0.0] * 4, {}, tmp_path / "x.onnx", weights="int8")


def _tiny_encoder(directory: Path, layers: int = 2) -> Path:
    """A BERT-style encoder directory as Hugging Face writes one (config.json, vocab.txt,
    model.safetensors), small and random: what `--pretrained` reads."""
    from safetensors.torch import save_file

    letters = "abcdefghijklmnopqrstuvwxyz0123456789"
    vocab = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", *letters, *"'$.,?", *(f"##{c}" for c in letters),
              "the", "cat", "sat", "it", "is", "mat", "end", "of", "course", "did", "and",
              "slept", "on", "##at"])  # fmt: skip
    h, ff, positions = 8, 16, 40
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (directory / "config.json").write_text(json.dumps({
        "model_type": "bert", "hidden_act": "gelu", "hidden_size": h, "num_attention_heads": 2,
        "intermediate_size": ff, "num_hidden_layers": layers, "max_position_embeddings": positions,
        "vocab_size": len(vocab), "type_vocab_size": 2, "layer_norm_eps": 1e-12,
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.3  # noqa: E731
    state = {"embeddings.word_embeddings.weight": rand(len(vocab), h),
             "embeddings.position_embeddings.weight": rand(positions, h),
             "embeddings.token_type_embeddings.weight": rand(2, h),
             "embeddings.LayerNorm.weight": 1 + rand(h),
             "embeddings.LayerNorm.bias": rand(h)}  # fmt: skip
    for i in range(layers):
        at = f"encoder.layer.{i}."
        shapes = {"attention.self.query": (h, h), "attention.self.key": (h, h),
                  "attention.self.value": (h, h), "attention.output.dense": (h, h),
                  "intermediate.dense": (ff, h), "output.dense": (h, ff)}  # fmt: skip
        for name, (o, n) in shapes.items():
            state[f"{at}{name}.weight"], state[f"{at}{name}.bias"] = rand(o, n), rand(o)
        for name in ("attention.output.LayerNorm", "output.LayerNorm"):
            state[f"{at}{name}.weight"], state[f"{at}{name}.bias"] = 1 + rand(h), rand(h)
    save_file(state, str(directory / "model.safetensors"))
    return directory


def test_word_pieces_split_words_as_wordpiece_does() -> None:
    """Greedy longest match, "##" continuing a word, a split at every character that is not
    a letter or digit, accents dropped, an unknown character [UNK], a long token's ends."""
    from echoic.model.core.punctuation import PIECES_PER_WORD, PieceList

    pieces = PieceList(("[PAD]", "[UNK]", "[CLS]", "[SEP]", "do", "don", "##n", "'", "t", "$",
                        "2", "##5", "25", "cafe", "x", "##x", "s", "##at", "c"))  # fmt: skip
    name = lambda token: [pieces.pieces[i] for i in pieces.ids(token)]  # noqa: E731
    assert name("don't") == ["don", "'", "t"]
    assert name("$25") == ["$", "25"]
    assert name("café") == ["cafe"]
    assert name("cat") == ["c", "##at"]
    assert name("q") == ["[UNK]"]
    assert name("x" * 20) == ["x"] + ["##x"] * (PIECES_PER_WORD - 1)
    ids, first, last = pieces.encode(["cat", "don't", "s"])
    assert [pieces.pieces[i] for i in ids] == ["[CLS]", "c", "##at", "don", "'", "t", "s", "[SEP]"]
    assert first.tolist() == [1, 3, 6] and last.tolist() == [2, 5, 6]


def test_a_pretrained_encoder_is_read_as_the_transformers_library_reads_it(
    tmp_path: Path,
) -> None:
    """`pretrained_tagger` holds the encoder's own arithmetic: its hidden states are those
    of transformers' BertModel on the same directory (the heads are new)."""
    transformers = pytest.importorskip("transformers")
    from echoic.model.nn.punctuation import pretrained_tagger

    directory = _tiny_encoder(tmp_path / "encoder")
    ours = pretrained_tagger(directory, dropout=0.0).eval()
    theirs = transformers.BertModel.from_pretrained(str(directory)).eval()
    ids = torch.tensor([[2, 45, 46, 30, 3, 0, 0], [2, 47, 48, 49, 50, 51, 3]])
    lengths = torch.tensor([5, 7])
    seen = {}
    ours.layers[-1].register_forward_hook(lambda m, i, out: seen.setdefault("h", out))
    at = torch.arange(7)[None].expand(2, -1)
    with torch.no_grad():
        ours(ids, at, at, lengths)
        want = theirs(input_ids=ids, attention_mask=(at < lengths[:, None]).long())
    for k, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(seen["h"][k, :n], want.last_hidden_state[k, :n],
                                   rtol=0, atol=1e-5)  # fmt: skip


def test_a_padded_piece_batch_tags_each_row_as_the_row_alone(tmp_path: Path) -> None:
    from echoic.model.nn.punctuation import pretrained_pieces, pretrained_tagger

    directory = _tiny_encoder(tmp_path / "encoder")
    model = pretrained_tagger(directory, dropout=0.0).eval()
    pieces = pretrained_pieces(directory)
    paragraph = tags_of_prose("The cat sat on it. Did it? It is the end, of course. It slept.")
    rng = np.random.default_rng(1)
    ids, first, last, _, _, lengths = next(
        punctuation.piece_batches([paragraph] * 3, pieces, 8, 16, rng)
    )
    assert len(set(lengths.tolist())) > 1, "rows of one length: nothing padded"
    with torch.no_grad():
        marks, cases = model(ids, first, last, lengths)
        for k, n in enumerate(lengths.tolist()):
            words = int((last[k] > 0).sum())
            alone = model(ids[k : k + 1, :n], first[k : k + 1, :words], last[k : k + 1, :words])
            torch.testing.assert_close(marks[k, :words], alone[0][0], rtol=0, atol=1e-5)
            torch.testing.assert_close(cases[k, :words], alone[1][0], rtol=0, atol=1e-5)


def test_a_pretrained_encoder_is_fine_tuned_into_an_int8_tagger_the_server_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--pretrained: the encoder's first --keep-layers layers and --pieces most useful
    pieces, fine-tuned, calibrated, written as int8 with its pieces and the scores of the
    file as written; the server's runtime loads it as any tagger and tags through it, a
    result longer than the encoder's positions in runs."""
    from echoic.model.runtime import formatting
    from echoic.model.runtime.formatting import Formatter, Punctuator, punctuator, use_tagger

    monkeypatch.setattr(formatting, "_tagger_file", formatting._tagger_file)  # put back after

    directory = _tiny_encoder(tmp_path / "encoder", layers=2)
    prose = [tags_of_prose(p) for p in ("Is it the end? It is, of course.",
                                        "The cat sat on a mat, and it slept. Did it?")]  # fmt: skip
    data = Corpus(train=prose * 4, dev=prose[1:], held={"fortunes": prose, "info": prose[:1]})
    monkeypatch.setattr(punctuation, "corpus", lambda prose_dir: data)
    out = tmp_path / "tagger.onnx"
    punctuation.main(["--out", str(out), "--minutes", "0.01", "--pretrained", str(directory),
                      "--keep-layers", "1", "--pieces", "90", "--batch", "4",
                      "--window", "4"])  # fmt: skip
    assert f"wrote {out}" in capsys.readouterr().out
    tagger = Punctuator(out)
    meta = json.loads(tagger.session.get_modelmeta().custom_metadata_map[PUNCT_KEY])
    assert meta["config"]["kind"] == "pieces" and meta["config"]["layers"] == 1
    kept = meta["words"]
    assert len(kept) == 90 and kept[:4] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    assert {"the", "cat", "##s"} <= set(kept)  # words of the training text
    assert meta["scores"]["data"]["weights"] == "int8"
    onnx = pytest.importorskip("onnx")
    assert "MatMulInteger" in {n.op_type for n in onnx.load(str(out)).graph.node}
    # The scores it carries are of this file, as the server runs it.
    sets = punctuation.held_out_sets(data)
    assert meta["scores"]["second_sources"] == score(tagger.tag, sets["second"])
    # Words that are one piece each, 96 of them, more than 40 positions hold
    whole = [w for w in "the cat sat on it and slept".split() if len(tagger.pieces.ids(w)) == 1]
    assert len(whole) >= 3
    long = (whole * 96)[:96]
    marks, cases = tagger.tag(long)
    assert len(marks) == len(cases) == len(long)
    # Runs of 38 words fill the 40 positions with [CLS] and [SEP], and the whole result is
    # tagged as those runs each alone.
    n = tagger.positions - 2
    runs = [tagger.logits(long[i : i + n]) for i in range(0, len(long), n)]
    for got, want in zip(tagger.logits(long), zip(*runs, strict=True), strict=True):
        np.testing.assert_allclose(got, np.concatenate(want), rtol=0, atol=1e-6)
    # A token of several pieces is never cut between two runs: 37 one-piece words and a
    # two-piece one do not fit in 38 pieces, so the second run starts with it.
    two = next(w for w in ("cats", "mats", "sats") if len(tagger.pieces.ids(w)) == 2)
    assert tagger.pieces.runs([whole[0]] * 37 + [two], tagger.positions) == [[whole[0]] * 37, [two]]
    use_tagger(out)
    assert punctuator().pieces is not None
    assert Formatter().format(long)


def test_an_ensemble_refuses_a_tagger_that_reads_word_pieces(tmp_path: Path) -> None:
    from echoic.model.core.punctuation import PieceList
    from echoic.model.nn.punctuation import export_piece_tagger, pretrained_tagger

    directory = _tiny_encoder(tmp_path / "encoder", layers=1)
    pieces = PieceList(tuple((directory / "vocab.txt").read_text().split()))
    export_piece_tagger(pretrained_tagger(directory), pieces, {}, tmp_path / "pieces.onnx")
    cfg = TaggerConfig(words=3, word_dim=4, char_dim=4, char_filters=4, hidden=4, layers=1)
    export_tagger(Tagger(cfg).eval(), WordList(("the", "a", "of")), {}, tmp_path / "words.onnx")
    with pytest.raises(ValueError, match="reads word pieces"):
        export_ensemble([tmp_path / "words.onnx", tmp_path / "pieces.onnx"], [0.0] * 4, {},
                        tmp_path / "both.onnx")  # fmt: skip


def test_a_word_too_long_to_match_is_one_unknown_piece() -> None:
    """Matching is quadratic in a word's characters: past PIECE_CHARS (BERT's 100) a word
    is [UNK] at once, as BERT's tokenizer has it, so a hostile transcript of one endless
    digit run costs no more than a word."""
    from echoic.model.core.punctuation import PIECE_CHARS, PieceList

    pieces = PieceList(("[PAD]", "[UNK]", "[CLS]", "[SEP]", "1", "##1"))
    assert [pieces.pieces[i] for i in pieces.ids("1" * PIECE_CHARS)] == ["1"] + ["##1"] * 7
    assert [pieces.pieces[i] for i in pieces.ids("1" * (PIECE_CHARS + 1))] == ["[UNK]"]


@pytest.mark.parametrize(
    "spoil, why",
    [
        (lambda d: (d / "model.safetensors").unlink(), "lacks model.safetensors"),
        (lambda d: (d / "vocab.txt").write_text("[PAD]\n[UNK]\nThe\n"), "lacks \\[CLS\\]"),
        (lambda d: (d / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nThe\n"), "cased"),
        (
            lambda d: (d / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nthe\n"),
            "has 5 pieces and config.json 95",
        ),
        (None, "has 2 layers: keep 1 to 2, not 3"),
    ],
)
def test_a_pretrained_encoder_that_cannot_serve_is_refused_before_the_corpus_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    spoil, why: str,
) -> None:  # fmt: skip
    directory = _tiny_encoder(tmp_path / "encoder", layers=2)
    if spoil is not None:
        spoil(directory)

    def no_corpus(prose_dir: Path) -> None:
        raise AssertionError("the corpus loaded before the options were checked")

    monkeypatch.setattr(punctuation, "corpus", no_corpus)
    with pytest.raises(SystemExit):
        punctuation.main(["--out", str(tmp_path / "t.onnx"), "--pretrained", str(directory),
                          "--keep-layers", "3" if spoil is None else "1"])  # fmt: skip
    assert re.search(why, capsys.readouterr().err)


def _refusing_corpus_and_a_piece_tagger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, Path]:
    """A corpus that fails if loaded (options are refused before it), a one-layer tiny
    encoder and a piece tagger exported from it: the encoder's directory and the file."""
    from echoic.model.nn.punctuation import (
        export_piece_tagger,
        pretrained_pieces,
        pretrained_tagger,
    )

    monkeypatch.setattr(punctuation, "corpus", lambda prose_dir: 1 / 0)
    directory = _tiny_encoder(tmp_path / "encoder", layers=1)
    pieces_file = tmp_path / "pieces.onnx"
    export_piece_tagger(pretrained_tagger(directory), pretrained_pieces(directory), {},
                        pieces_file)  # fmt: skip
    return directory, pieces_file


def test_piece_options_that_cannot_work_are_refused_before_the_corpus_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from echoic.model.nn.punctuation import pretrained_pieces

    directory, pieces_file = _refusing_corpus_and_a_piece_tagger(tmp_path, monkeypatch)
    base = len(punctuation.kept_pieces([], pretrained_pieces(directory), 0))
    for argv, why in ((["--keep-layers", "1"], "give --pretrained DIR"),
                      (["--pretrained", str(directory), "--window", "4", "--pieces", str(base)],
                       f"single characters alone are {base}; keep more"),
                      (["--pretrained", str(directory)], "--window 48: 48 words of up to 8 pieces "
                       "pass the encoder's 40 positions"),
                      (["--ensemble", str(pieces_file), str(pieces_file)], "read word pieces"),
        (["--score-only", "x.onnx"], "no such tagger: x.onnx"),
                      (["--pretrained", str(directory), "--score-only", str(pieces_file)],
                       "--ensemble and --score-only take exported files"),
                      (["--lr", "0"], "--lr 0.0: a learning rate is above 0")):  # fmt: skip
        with pytest.raises(SystemExit):
            punctuation.main(["--out", str(tmp_path / "t.onnx"), *argv])
        assert why in capsys.readouterr().err


def test_the_runtime_refuses_a_tagger_of_a_kind_it_does_not_read(tmp_path: Path) -> None:
    """A tagger written by a newer echoic (another format or kind) is refused with a line
    saying so, FormattingUnavailable, which the server reports as such."""
    onnx = pytest.importorskip("onnx")
    from echoic.model.core.punctuation import PieceList
    from echoic.model.nn.punctuation import export_piece_tagger, pretrained_tagger
    from echoic.model.runtime.formatting import FormattingUnavailable, Punctuator

    directory = _tiny_encoder(tmp_path / "encoder", layers=1)
    pieces = PieceList(tuple((directory / "vocab.txt").read_text().split()))
    export_piece_tagger(pretrained_tagger(directory), pieces, {}, tmp_path / "pieces.onnx")
    assert Punctuator(tmp_path / "pieces.onnx").pieces is not None
    proto = onnx.load(str(tmp_path / "pieces.onnx"))
    entry = next(p for p in proto.metadata_props if p.key == PUNCT_KEY)
    meta = json.loads(entry.value)
    assert meta["format"] == 2
    meta["format"] = 3
    entry.value = json.dumps(meta)
    (tmp_path / "newer.onnx").write_bytes(proto.SerializeToString())
    with pytest.raises(FormattingUnavailable, match="format 3, kind 'pieces'.*upgrade"):
        Punctuator(tmp_path / "newer.onnx")


def test_a_server_given_a_piece_tagger_formats_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`echoic serve --punctuation-model` with a tagger of word pieces: a real server's
    formatted final is what that tagger writes for the words it heard (a random tagger's
    marks and capitals, so nothing else could have written them)."""
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        pytest.skip("espeak-ng is not installed (scripts/bootstrap.sh installs it)")
    grpc = pytest.importorskip("grpc")
    from echoic.model.core.punctuation import PieceList
    from echoic.model.nn.punctuation import export_piece_tagger, pretrained_tagger
    from echoic.model.runtime import formatting
    from echoic.model.runtime.formatting import Formatter, use_tagger
    from echoic.protos.v1 import transcriber_pb2 as pb
    from echoic.protos.v1 import transcriber_pb2_grpc as pb_grpc
    from tests.test_http import http_server

    directory = _tiny_encoder(tmp_path / "encoder", layers=1)
    pieces = PieceList(tuple((directory / "vocab.txt").read_text().split()))
    torch.manual_seed(3)
    tagger = tmp_path / "pieces.onnx"
    export_piece_tagger(pretrained_tagger(directory).eval(), pieces, {}, tagger)
    wav = tmp_path / "said.wav"
    said = "the cat sat on the mat and it slept did it sleep"
    subprocess.run([espeak, "-w", str(wav), said], check=True, timeout=60)

    def recognize(stub, **formatting: bool) -> str:
        config = pb.RecognitionConfig(formatting=pb.FormattingConfig(**formatting))
        request = pb.RecognizeRequest(config=config, audio_content=wav.read_bytes())
        (result,) = stub.Recognize(request, timeout=60).results
        return result.alternatives[0].transcript

    # The server is in this process: the tagger it was given is put back afterwards.
    monkeypatch.setattr(formatting, "_tagger_file", formatting._tagger_file)
    with http_server(punctuation_model=tagger) as s, grpc.insecure_channel(s.address) as ch:
        stub = pb_grpc.TranscriberStub(ch)
        raw, formatted = recognize(stub), recognize(stub, punctuation=True)
    use_tagger(tagger)
    want = " ".join(t.text for t in Formatter(inverse=False).format(raw.split()))
    assert len(raw.split()) >= 5 and formatted == want != raw


BERT_CASES = ["$2 million", "£5", "€20", "°C", "x\u200by", "日本語", "don't", "Café",
              "a\tb", "\x00", "naïve-ish", "well...", "«quoted»", "50%", "x" * 101]  # fmt: skip


def test_word_pieces_are_those_of_berts_own_tokenizer(tmp_path: Path) -> None:
    """A written token is split into the pieces BERT's uncased tokenizer gives the same
    text (spaces, control characters, symbols kept in a word, punctuation split off, CJK,
    accents), so the server reads what the encoder was pretrained on."""
    transformers = pytest.importorskip("transformers")
    from echoic.model.core.punctuation import PieceList

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "$", "2", "million", "£", "##5", "€", "##20",
             "°", "##c", "x", "##y", "y", "日", "本", "語", "don", "'", "t", "cafe", "a", "b",
             "naive", "-", "ish", ".", "well", "«", "»", "quoted", "50", "%"]  # fmt: skip
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    theirs = transformers.BertTokenizer(str(tmp_path / "vocab.txt"), do_lower_case=True)
    ours = PieceList(tuple(vocab))
    for text in BERT_CASES:
        want = theirs.convert_tokens_to_ids(theirs.tokenize(text)) or [ours.index["[UNK]"]]
        if len(want) > 8:  # a token keeps its first four pieces and its last four
            want = want[:4] + want[-4:]
        assert ours.ids(text) == want, text


class _Stopped(Exception):
    """The session ended (in a test: the optimizer's Nth step)."""


@pytest.mark.parametrize("kind", ["words", "pieces"])
@pytest.mark.parametrize("where", ["part way through an epoch", "at an epoch's end"])
@pytest.mark.parametrize("budget", ["minutes", "steps"])
def test_a_training_stopped_part_way_resumes_from_its_checkpoint_to_the_same_weights(
    kind: str,
    where: str,
    budget: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--checkpoint: a run stopped between two scorings resumes from the last one, part way
    through an epoch or at its end, and ends on the weights of a run never stopped, a GRU
    tagger or a pretrained encoder's, on a budget of CPU minutes or of steps. CPU time is
    a clock of the optimizer's steps here (a second each), so that the two spend the same
    budget step for step."""
    texts = ("Is it the end? It is, of course. We stay.",
             "The cat sat on a mat, and it slept. Did it? No.",
             "Where are you going? Home, then out. Come along.")  # fmt: skip
    prose = [tags_of_prose(p) for p in texts]
    data = Corpus(train=prose * 3, dev=prose[1:], held={"fortunes": prose, "info": prose[:1]})
    monkeypatch.setattr(punctuation, "corpus", lambda prose_dir: data)
    clock = {"steps": 0, "stop_at": 0, "seconds": 1.0}
    step = torch.optim.AdamW.step

    def counted(self: torch.optim.AdamW, *args: object, **kwargs: object) -> object:
        out = step(self, *args, **kwargs)
        clock["steps"] += 1
        if clock["steps"] == clock["stop_at"]:
            raise _Stopped
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", counted)
    monkeypatch.setattr(punctuation.time, "process_time",
                        lambda: clock["steps"] * clock["seconds"])  # fmt: skip
    size = ["--words", "30", "--word-dim", "6", "--char-dim", "5", "--char-filters", "7",
            "--hidden", "5", "--layers", "1", "--dropout", "0.3", "--batch", "4",
            "--window", "6", "--minutes", "0.5", "--eval-minutes", "0.1"]  # fmt: skip
    if kind == "pieces":
        encoder = _tiny_encoder(tmp_path / "encoder", layers=2)
        size = ["--pretrained", str(encoder), "--keep-layers", "1", "--pieces", "90", "--batch",
                "4", "--window", "4", "--minutes", "0.5", "--eval-minutes", "0.1"]  # fmt: skip
    if budget == "steps":  # the same 30 steps, scored every 6
        size[size.index("--minutes") :] = ["--steps", "30", "--eval-steps", "6"]

    # The run never stopped, its saves noted: (steps taken, batches of the epoch taken).
    saves: list[tuple[int, int]] = []
    save = torch.save

    def noted(state: object, *args: object, **kwargs: object) -> None:
        if isinstance(state, dict) and "done" in state:
            saves.append((state["steps"], state["done"]))
        save(state, *args, **kwargs)

    monkeypatch.setattr(torch, "save", noted)
    whole = tmp_path / "whole.onnx"
    punctuation.main(["--out", str(whole), "--checkpoint", str(tmp_path / "whole.pt"), *size])
    assert clock["steps"] >= 30
    mid = where == "part way through an epoch"
    # Stopped at the step after a save of the kind asked for (not the first: some training
    # before it; nor one followed at the same step by the epoch's end), the last save is
    # that one.
    last = next((s, d) for k, (s, d) in enumerate(saves)
                if s >= 6 and (d > 0) == mid and saves[k + 1 :][:1] != [(s, 0)])  # fmt: skip
    checkpoint, out = tmp_path / "run.pt", tmp_path / "resumed.onnx"
    clock.update(steps=0, stop_at=last[0] + 1)
    with pytest.raises(_Stopped):
        punctuation.main(["--out", str(out), "--checkpoint", str(checkpoint), *size])
    saved = torch.load(checkpoint, weights_only=True)
    assert (saved["steps"], saved["done"]) == last
    assert not out.exists()
    capsys.readouterr()
    # On a budget of steps, the CPU's speed is nothing to the run: resumed ten times slower.
    clock.update(stop_at=0, seconds=10.0 if budget == "steps" else 1.0)
    punctuation.main(["--out", str(out), "--checkpoint", str(checkpoint), *size])
    printed = capsys.readouterr().out
    place = f"epoch {saved['epoch']}, {saved['done']} batches into it"
    assert f"resumed {checkpoint}: {place}" in printed
    assert out.read_bytes() == whole.read_bytes()
    if budget == "minutes":  # one saved before --steps and --init were options resumes too
        old = torch.load(checkpoint, weights_only=True)
        for option in ("steps", "init"):
            del old["options"][option]
        torch.save(old, checkpoint)
        punctuation.main(["--out", str(out), "--checkpoint", str(checkpoint), *size])
        assert "resumed" in capsys.readouterr().out

    # Other options cannot resume it, and say which.
    with pytest.raises(SystemExit):
        punctuation.main(["--out", str(out), "--checkpoint", str(checkpoint), *size,
                          "--seed", "3"])  # fmt: skip
    assert "was saved by a training with --seed 0 (given: 3)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        punctuation.main(["--out", str(out), "--checkpoint", str(out), *size])
    assert "not a training checkpoint" in capsys.readouterr().err
    other = Corpus(train=prose * 2, dev=prose[1:], held={"fortunes": prose, "info": prose[:1]})
    monkeypatch.setattr(punctuation, "corpus", lambda prose_dir: other)
    with pytest.raises(SystemExit):
        punctuation.main(["--out", str(out), "--checkpoint", str(checkpoint), *size])
    assert "was saved by a training on other prose" in capsys.readouterr().err


def test_an_exported_piece_tagger_reads_back_as_the_weights_it_was_written_from(
    tmp_path: Path,
) -> None:
    """read_piece_tagger: every weight of an int8 piece tagger back in its place, each
    within a quantization step of the float weight it was written from (a matrix read into
    another's place would be off by the weights' own size), and the runtime's int8 file
    and the tagger read back tag alike."""
    from echoic.model.nn.punctuation import (
        export_piece_tagger,
        pretrained_pieces,
        pretrained_tagger,
        read_piece_tagger,
    )
    from echoic.model.runtime.formatting import Punctuator

    directory = _tiny_encoder(tmp_path / "encoder", layers=2)
    torch.manual_seed(0)
    model, pieces = pretrained_tagger(directory).eval(), pretrained_pieces(directory)
    path = tmp_path / "pieces.onnx"
    export_piece_tagger(model, pieces, {"development": {"case_accuracy": 0.5}}, path)
    back, back_pieces, scores = read_piece_tagger(path)
    assert back.cfg == model.cfg and back_pieces.pieces == pieces.pieces
    assert scores == {"development": {"case_accuracy": 0.5}}
    want = model.state_dict()
    assert back.state_dict().keys() == want.keys()
    for name, got in back.state_dict().items():
        w = want[name]
        if name.endswith((".bias", "segment")) or "norm" in name:
            assert torch.equal(got, w), name  # kept as float32
        else:  # 7 bits (reduce_range): a step is at most the largest weight's 63rd
            step = float(w.abs().max()) / 63
            assert float((got - w).abs().max()) <= step / 2 + 1e-6, name
    tokens = "the cat sat on the mat and it slept did it".split()
    ids, first, last = pieces.encode(tokens)
    with torch.no_grad():
        ml, cl = back.eval()(*(torch.from_numpy(a)[None] for a in (ids, first, last)))
    onnx_ml, onnx_cl = Punctuator(path).logits(tokens)
    np.testing.assert_allclose(ml[0].numpy(), onnx_ml, atol=0.1)
    np.testing.assert_allclose(cl[0].numpy(), onnx_cl, atol=0.1)


def test_a_piece_tagger_is_calibrated_again_as_its_int8_file_tags(tmp_path: Path) -> None:
    """calibrate_as_written: offsets from the finer steps, found on the int8 file's logits
    (not the float32 tagger's) and folded into the mark head's bias; the file written
    afterwards scores on the development pieces what the search scored, and at least what
    the file written before did (no offsets is among the candidates)."""
    from echoic.model.nn.punctuation import (
        export_piece_tagger,
        pretrained_pieces,
        pretrained_tagger,
    )

    directory = _tiny_encoder(tmp_path / "encoder", layers=1)
    torch.manual_seed(0)
    model, pieces = pretrained_tagger(directory), pretrained_pieces(directory)
    prose = ("Is it the end? It is, of course. The cat sat on a mat, and it slept. Is it? "
             "The dog ran, and the cat sat. It is the end.")  # fmt: skip
    dev = sentence_windows([tags_of_prose(prose)] * 6, 12)
    calibrate(model, dev, pieces)
    with torch.no_grad():  # away from the float32 calibration's choice: something to find
        model.marks.bias[2] += 0.4
    before_path = tmp_path / "before.onnx"
    export_piece_tagger(model, pieces, {}, before_path)
    before = _selection(score(exported_tagger(before_path), dev))
    bias = model.marks.bias.detach().clone()
    offsets = punctuation.calibrate_as_written(model, pieces, dev)
    assert all(min(abs(o - s) for s in punctuation.WRITTEN_STEPS) < 1e-6 for o in offsets)
    assert torch.allclose(model.marks.bias.detach(), bias + torch.tensor(offsets))
    assert any(offsets), offsets  # this case moves: the checks below see the bias change
    after_path = tmp_path / "after.onnx"
    export_piece_tagger(model, pieces, {}, after_path)
    after = _selection(score(exported_tagger(after_path), dev))
    assert after >= before
    runtime = punctuation.exported_runtime(before_path)
    searched = score(punctuation.offset_tagger(runtime.logits, np.array(offsets, np.float32)), dev)
    assert _selection(searched) == pytest.approx(after, abs=1e-9)


def test_a_piece_tagger_goes_on_training_from_its_file_for_a_budget_of_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--init FILE --steps N: an exported piece tagger trained N more steps, its record
    naming the file it began from (and that file's own record); --steps makes the run the
    same whatever the CPU's speed: a machine ten times slower writes the same bytes."""
    prose = [tags_of_prose(p) for p in ("Is it the end? It is, of course.",
                                        "The cat sat on a mat, and it slept. Did it?")]  # fmt: skip
    data = Corpus(train=prose * 4, dev=prose[1:], held={"fortunes": prose, "info": prose[:1]})
    monkeypatch.setattr(punctuation, "corpus", lambda prose_dir: data)
    first = tmp_path / "first.onnx"
    encoder = _tiny_encoder(tmp_path / "encoder", layers=2)
    punctuation.main(["--out", str(first), "--minutes", "0.01", "--pretrained", str(encoder),
                      "--keep-layers", "1", "--pieces", "90", "--batch", "4",
                      "--window", "4"])  # fmt: skip
    clock = {"steps": 0, "seconds": 1.0}
    step = torch.optim.AdamW.step

    def counted(self: torch.optim.AdamW, *args: object, **kwargs: object) -> object:
        clock["steps"] += 1
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", counted)
    monkeypatch.setattr(punctuation.time, "process_time",
                        lambda: clock["steps"] * clock["seconds"])  # fmt: skip
    capsys.readouterr()
    outs = []
    for seconds in (1.0, 10.0):  # CPU seconds a step takes
        clock.update(steps=0, seconds=seconds)
        outs.append(tmp_path / f"more-{seconds:g}.onnx")
        punctuation.main(["--out", str(outs[-1]), "--init", str(first), "--steps", "7",
                          "--eval-steps", "3", "--batch", "4", "--window", "4",
                          "--seed", "2"])  # fmt: skip
        assert clock["steps"] == 7
        printed = capsys.readouterr().out
        scored = re.findall(r"epoch \d+ \([\d.]+ min, step (\d+)\)", printed)  # not epoch ends
        assert scored == ["3", "6"]
    assert outs[0].read_bytes() == outs[1].read_bytes()
    from echoic.model.nn.punctuation import file_sha256, read_piece_tagger

    _, _, before = read_piece_tagger(first)
    _, pieces, after = read_piece_tagger(outs[0])
    record = after["data"]
    assert record["steps"] == 7 and record["steps_budget"] == 7 and "cpu_minutes" not in record
    assert record["init"] == {"sha256": file_sha256(first), "data": before["data"]}
    assert record["pretrained"] == before["data"]["pretrained"]
    assert record["keep_layers"] == 1 and len(pieces.pieces) == 90
    assert outs[0].read_bytes() != first.read_bytes()
    # It starts from the file's weights: at a rate too small to move them, the tagger
    # written is the file's but for the calibration in the mark head's bias.
    still = tmp_path / "still.onnx"
    punctuation.main(["--out", str(still), "--init", str(first), "--steps", "2", "--batch", "4",
                      "--window", "4", "--lr", "1e-12"])  # fmt: skip
    a, b = read_piece_tagger(first)[0].state_dict(), read_piece_tagger(still)[0].state_dict()
    for name in a:
        if name != "marks.bias":
            step = float(a[name].abs().max()) / 63  # requantized: within a 7-bit step
            assert float((a[name] - b[name]).abs().max()) <= step, name


def test_init_and_step_options_that_cannot_work_are_refused_before_the_corpus_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    directory, pieces_file = _refusing_corpus_and_a_piece_tagger(tmp_path, monkeypatch)
    words_file = tmp_path / "words.onnx"
    export_tagger(Tagger(TaggerConfig(words=3, word_dim=4, char_dim=4, char_filters=4, hidden=4)),
                  WordList(("the", "a", "is")), {}, words_file)  # fmt: skip
    init = ["--init", str(pieces_file), "--window", "4"]
    for argv, why in ((["--init", "x.onnx"], "no such tagger: x.onnx"),
                      ([*init, "--pretrained", str(directory)], "not with --pretrained"),
                      ([*init, "--pieces", "50"], "keeps its layers and pieces"),
                      (["--init", str(words_file)], "is a tagger of words"),
                      (["--init", str(tmp_path / "encoder" / "vocab.txt")],
                       f"--init {tmp_path / 'encoder' / 'vocab.txt'}: "),
                      (["--init", str(pieces_file), "--out", str(pieces_file)],
                       "is read by --init"),
                      (["--steps", "0"], "--steps 0: a budget of steps is above 0"),
                      (["--steps", "9", "--minutes", "5"], "no --minutes or --eval-minutes"),
                      (["--steps", "9", "--eval-minutes", "1"], "no --minutes or --eval-minutes"),
                      (["--eval-steps", "5"], "give --steps"),
                      ([*init[:2]], "--window 48: 48 words of up to 8 pieces pass the "
                       "tagger's 40 positions")):  # fmt: skip
        with pytest.raises(SystemExit):
            punctuation.main(["--out", str(tmp_path / "t.onnx"), *argv])  # a second --out wins
        assert why in capsys.readouterr().err, argv


def _runs_on_from_one_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int) -> list[Path]:
    """`n` piece taggers trained on (`--init`) from one file, seeds 1 to n, on a tiny corpus
    that `punctuation.corpus` then returns: members for --soup."""
    prose = [tags_of_prose(p) for p in ("Is it the end? It is, of course.",
                                        "The cat sat on a mat, and it slept. Did it?")]  # fmt: skip
    data = Corpus(train=prose * 4, dev=prose[1:], held={"fortunes": prose, "info": prose[:1]})
    monkeypatch.setattr(punctuation, "corpus", lambda prose_dir: data)
    first = tmp_path / "first.onnx"
    punctuation.main(["--out", str(first), "--minutes", "0.01", "--pretrained",
                      str(_tiny_encoder(tmp_path / "encoder", layers=2)), "--keep-layers", "1",
                      "--pieces", "90", "--batch", "4", "--window", "4"])  # fmt: skip
    members = [tmp_path / f"run{seed}.onnx" for seed in range(1, n + 1)]
    monkeypatch.setattr(punctuation, "WARMUP_STEPS", 1)  # a few steps that move the weights
    for seed, member in enumerate(members, 1):
        punctuation.main(["--out", str(member), "--init", str(first), "--steps", "8",
                          "--batch", "4", "--window", "4", "--seed", str(seed),
                          "--lr", "5e-2"])  # fmt: skip
    return members


def test_a_soup_is_the_mean_of_its_members_weights_calibrated_on_top(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--soup A B: one piece tagger whose every weight is the mean of A's and B's (within a
    7-bit step: written as int8 again), but the mark head's bias, which is their mean plus
    the offsets its calibration found; its record names each member (file, SHA-256 and the
    member's own record), and the same files write the same bytes."""
    from echoic.model.nn.punctuation import file_sha256, read_piece_tagger
    from echoic.model.runtime.formatting import Punctuator

    members = _runs_on_from_one_file(tmp_path, monkeypatch, 2)
    capsys.readouterr()
    out = tmp_path / "soup.onnx"
    punctuation.main(["--out", str(out), "--soup", *map(str, members)])
    assert f"wrote {out}" in capsys.readouterr().out
    (a, _, a_scores), (b, _, b_scores) = map(read_piece_tagger, members)
    got, pieces, scores = read_piece_tagger(out)
    assert got.cfg == a.cfg and len(pieces.pieces) == 90
    a, b, got = a.state_dict(), b.state_dict(), got.state_dict()
    offsets = torch.tensor(scores["mark_offsets"]) + torch.tensor(scores["mark_offsets_as_written"])
    assert offsets.any()  # calibration moved the bias: the check below sees it
    apart = 0
    for name, mean in ((k, (a[k] + b[k]) / 2) for k in a):
        step = float(mean.abs().max()) / 63  # written again as int8: a 7-bit step
        if name == "marks.bias":  # float32, the calibrations added to the members' mean
            torch.testing.assert_close(got[name], mean + offsets)
        else:
            assert float((got[name] - mean).abs().max()) <= step / 2 + 1e-6, name
        apart += float((a[name] - b[name]).abs().max()) > 2 * step
    assert apart == len(a)  # every weight of the members differs: the mean is neither's
    record = scores["data"]
    assert record["soup"] == [{"file": "run1.onnx", "sha256": file_sha256(members[0]),
                               "data": a_scores["data"]},
                              {"file": "run2.onnx", "sha256": file_sha256(members[1]),
                               "data": b_scores["data"]}]  # fmt: skip
    assert record["pretrained"] == a_scores["data"]["pretrained"]
    assert record["keep_layers"] == 1 and record["pieces"] == 90
    assert set(scores) >= {",", ".", "?", "development", "uncalibrated", "mark_offsets",
                           "mark_offsets_as_written"}  # fmt: skip
    marks, cases = Punctuator(out).tag(["is", "it", "the", "end"])
    assert len(marks) == len(cases) == 4
    again = tmp_path / "again.onnx"
    punctuation.main(["--out", str(again), "--soup", *map(str, members)])
    assert again.read_bytes() == out.read_bytes()


def test_a_greedy_soup_keeps_a_member_only_where_the_development_score_rises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--soup ... --greedy: the files scored alone, the best first, then each kept only if the
    soup with it scores higher on the development set; a file of noise is left out, and the
    file written is the plain --soup of the files kept, its record holding the trail. The
    members are a run and the run moved either way along one random direction."""
    from echoic.model.nn.punctuation import export_piece_tagger, read_piece_tagger

    (run,) = _runs_on_from_one_file(tmp_path, monkeypatch, 1)
    model, pieces, _ = read_piece_tagger(run)
    state = {name: weight.clone() for name, weight in model.state_dict().items()}
    files = [tmp_path / f"{name}.onnx" for name in ("noise", "plus", "minus")]
    for path, sign in zip(files, (0, 1, -1), strict=True):
        torch.manual_seed(0 if sign else 1)
        with torch.no_grad():
            for name, weight in model.named_parameters():
                away = torch.randn_like(weight) * (state[name].std() if weight.numel() > 1 else 0)
                weight.copy_(state[name] + sign * away / 2 if sign else torch.randn_like(weight))
        export_piece_tagger(model, pieces, {}, path)
    files.append(run)
    capsys.readouterr()
    out = tmp_path / "greedy.onnx"
    punctuation.main(["--out", str(out), "--soup", *map(str, files), "--greedy"])
    printed = capsys.readouterr().out
    scores = read_piece_tagger(out)[2]
    trail = scores["data"]["greedy"]
    assert sorted(line["file"] for line in trail) == sorted(p.name for p in files)
    assert trail[0]["alone"] == max(line["alone"] for line in trail)  # the best alone first
    assert trail[0]["kept"] and trail[0]["soup"] == trail[0]["alone"]
    best = trail[0]["soup"]
    for line in trail:
        assert f"greedy soup: {tmp_path / line['file']} alone {line['alone']:.4f}" in printed
    for line in trail[1:]:
        assert line["kept"] == (line["soup"] > best), trail
        best = line["soup"] if line["kept"] else best
    assert [line["kept"] for line in trail if line["file"] == "noise.onnx"] == [False], trail
    assert round(punctuation._selection(scores["development"]), 4) == best
    kept = [tmp_path / line["file"] for line in trail if line["kept"]]
    assert [m["file"] for m in scores["data"]["soup"]] == [p.name for p in kept]
    assert 1 < len(kept) < len(files), trail  # this case keeps some and leaves some out
    plain = tmp_path / "plain.onnx"  # the files kept, souped without --greedy
    punctuation.main(["--out", str(plain), "--soup", *map(str, kept)])
    a, b = read_piece_tagger(out)[0].state_dict(), read_piece_tagger(plain)[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_soup_options_that_cannot_work_are_refused_before_the_corpus_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from echoic.model.nn.punctuation import (
        export_piece_tagger,
        pretrained_pieces,
        pretrained_tagger,
    )

    directory, pieces_file = _refusing_corpus_and_a_piece_tagger(tmp_path, monkeypatch)
    words_file = tmp_path / "words.onnx"
    export_tagger(Tagger(TaggerConfig(words=3, word_dim=4, char_dim=4, char_filters=4, hidden=4)),
                  WordList(("the", "a", "is")), {}, words_file)  # fmt: skip
    deeper = _tiny_encoder(tmp_path / "deeper", layers=2)
    two_layers, other_pieces, copy = (tmp_path / f"{n}.onnx" for n in ("two", "other", "copy"))
    export_piece_tagger(pretrained_tagger(deeper), pretrained_pieces(deeper), {}, two_layers)
    pieces = pretrained_pieces(directory)
    export_piece_tagger(pretrained_tagger(directory), PieceList(pieces.pieces[::-1]), {},
                        other_pieces)  # fmt: skip
    shutil.copy(pieces_file, copy)
    both = ["--soup", str(pieces_file), str(copy)]
    for argv, why in ((["--soup", str(pieces_file)], "a mean of one tagger is that tagger"),
                      ([*both, str(tmp_path / "." / "pieces.onnx")],
                       f"--soup {tmp_path / '.' / 'pieces.onnx'} is given twice"),
                      ([*both, "--init", str(pieces_file)], "not with --pretrained, --init"),
                      ([*both, "--pretrained", str(directory)], "not with --pretrained, --init"),
                      ([*both, "--keep-layers", "1", "--pieces", "50"],
                       "--keep-layers, --pieces: --soup trains nothing"),
                      ([*both, "--steps", "9", "--lr", "1e-4"],
                       "--steps, --lr: --soup trains nothing"),
                      ([*both, "--out", str(copy)], f"--out {copy} is read by --soup"),
                      ([*both, "--checkpoint", str(tmp_path / "c.pt")],
                       "--ensemble, --soup and --score-only train nothing"),
                      (["--greedy"], "--greedy chooses --soup's members"),
                      (["--soup", str(pieces_file), "x.onnx"], "no such tagger: x.onnx"),
                      (["--soup", str(pieces_file), str(words_file)], "is a tagger of words"),
                      (["--soup", str(pieces_file), str(two_layers)],
                       f"--soup: {two_layers} is not shaped as {pieces_file}"),
                      (["--soup", str(pieces_file), str(other_pieces)],
                       f"--soup: {other_pieces} is not shaped as {pieces_file}")):  # fmt: skip
        with pytest.raises(SystemExit):
            punctuation.main(["--out", str(tmp_path / "t.onnx"), *argv])
        assert why in capsys.readouterr().err, argv


def test_written_prose_is_read_back_as_the_same_corpus(tmp_path: Path) -> None:
    """--write-prose FILE: every source's paragraphs in one file that --prose FILE reads as
    the same corpus (the split, the held-out sets, the counts), on a machine without the
    packages or the system's prose (a lent GPU); the same sources write the same bytes."""
    wordnet = next(s for s in PROSE_SOURCES if s.name == "wordnet")
    (tmp_path / "prose" / wordnet.package / wordnet.where).mkdir(parents=True)
    (tmp_path / "prose" / wordnet.package / wordnet.where / "data.verb").write_text(
        '00001 29 v 01 go 0 | move; "Did he go home?"; "she went home, and then slept."\n'
    )
    packed, again = tmp_path / "prose.json.gz", tmp_path / "again.json.gz"
    punctuation.main(["--prose", str(tmp_path / "prose"), "--write-prose", str(packed)])
    punctuation.main(["--prose", str(tmp_path / "prose"), "--write-prose", str(again)])
    assert packed.read_bytes() == again.read_bytes()
    assert 0 < packed.stat().st_size < 10_000_000
    unpacked, read = punctuation.corpus(tmp_path / "prose"), punctuation.corpus(packed)
    assert read == unpacked
    assert read.counts["fortunes"] > 1000 and read.held["wordnet"] + read.dev + read.train
    # A file that is not one is refused in a line, naming what to give instead.
    with pytest.raises(SystemExit, match="is not a file --write-prose wrote"):
        punctuation.corpus(tmp_path / "prose" / wordnet.package / wordnet.where / "data.verb")


def _a_tiny_corpus_and_encoder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Two paragraphs that `punctuation.corpus` then returns, and a two-layer tiny encoder's
    directory (what --pretrained reads)."""
    prose = [tags_of_prose(p) for p in ("Is it the end? It is, of course.",
                                        "The cat sat on a mat, and it slept. Did it?")]  # fmt: skip
    data = Corpus(train=prose * 4, dev=prose[1:], held={"fortunes": prose, "info": prose[:1]})
    monkeypatch.setattr(punctuation, "corpus", lambda prose_dir: data)
    return _tiny_encoder(tmp_path / "encoder", layers=2)


@contextlib.contextmanager
def _stopped_at_step(n: int, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The block's training stops at its optimizer's nth step (a session's end, a call's
    budget), as `_Stopped`, which the block is expected to raise."""
    step, taken = torch.optim.AdamW.step, {"steps": 0}

    def stopping(self: torch.optim.AdamW, *args: object, **kwargs: object) -> object:
        taken["steps"] += 1
        if taken["steps"] == n:
            raise _Stopped
        return step(self, *args, **kwargs)

    with monkeypatch.context() as m, pytest.raises(_Stopped):
        m.setattr(torch.optim.AdamW, "step", stopping)
        yield


def test_a_run_trained_only_is_written_from_its_checkpoint_as_a_whole_run_writes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--train-only (what a lent GPU runs, scripts/gpu_punct.sh): the run leaves only its
    best weights in the checkpoint (no optimizer, no weights to go on from: what comes back
    from the GPU is small) and writes no tagger; the same command without it writes from
    the checkpoint the file a run never split writes, byte for byte."""
    encoder = _a_tiny_corpus_and_encoder(tmp_path, monkeypatch)
    argv = ["--pretrained", str(encoder), "--keep-layers", "1", "--pieces", "90", "--batch", "4",
            "--window", "4", "--steps", "9", "--eval-steps", "4", "--seed", "3"]  # fmt: skip
    whole, split = tmp_path / "whole.onnx", tmp_path / "split.onnx"
    punctuation.main(["--out", str(whole), "--checkpoint", str(tmp_path / "whole.pt"), *argv])
    checkpoint = tmp_path / "split.pt"
    punctuation.main(["--out", str(split), "--checkpoint", str(checkpoint), "--train-only",
                      *argv])  # fmt: skip
    assert "the same command without --train-only writes the tagger" in capsys.readouterr().out
    assert not split.exists()
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["model"] is None and saved["optimizer"] is None and saved["steps"] == 9
    assert checkpoint.stat().st_size < (tmp_path / "whole.pt").stat().st_size / 2
    punctuation.main(["--out", str(split), "--checkpoint", str(checkpoint), *argv])
    printed = capsys.readouterr().out
    assert f"resumed {checkpoint}: epoch " in printed and ", step 9 of 9" in printed
    assert " loss " not in printed  # written from the checkpoint: not one step trained again
    assert split.read_bytes() == whole.read_bytes()

    # A run cut off part way (a call's budget ran out) sends back its best weights alone
    # (as scripts/gpu_punct.sh strips them): the same command writes the tagger from them,
    # saying so, and its record says how far it got.
    cut, written = tmp_path / "cut.pt", tmp_path / "cut.onnx"
    with _stopped_at_step(6, monkeypatch):  # after the scoring and save at step 4
        punctuation.main(["--out", str(written), "--checkpoint", str(cut), "--train-only",
                          *argv])  # fmt: skip
    state = torch.load(cut, weights_only=True)
    assert state["steps"] == 4 and state["model"] is not None
    state["model"] = state["optimizer"] = None
    torch.save(state, cut)
    capsys.readouterr()
    punctuation.main(["--out", str(written), "--checkpoint", str(cut), *argv])
    printed = capsys.readouterr().out
    assert f"{cut}: a run cut off at step 4 of 9, its best weights alone" in printed
    assert " loss " not in printed
    from echoic.model.nn.punctuation import read_piece_tagger

    record = read_piece_tagger(written)[2]["data"]
    assert record["steps"] == 4 and record["steps_budget"] == 9


def test_device_and_train_only_options_that_cannot_work_are_refused_before_the_corpus_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    directory, _ = _refusing_corpus_and_a_piece_tagger(tmp_path, monkeypatch)
    tuned = ["--pretrained", str(directory), "--window", "4", "--steps", "5"]
    cases = [(["--train-only", "--steps", "5"], "give --checkpoint FILE and a budget of --steps"),
             (["--train-only", "--checkpoint", "c.pt"], "give --checkpoint FILE and a budget"),
             (["--device", "cuda", "--steps", "5"], "a tagger of words trains on the CPU"),
             (["--device", "cuda", "--soup", str(tmp_path / "pieces.onnx"),
               str(tmp_path / "pieces.onnx")], "--soup, --ensemble and --score-only train"),
             (["--device", "cuda", "--pretrained", str(directory), "--window", "4"],
              "give a budget of --steps"),
             (["--write-prose", "p.gz", "--steps", "5"], "--steps: --write-prose trains nothing"),
             (["--write-prose", str(tmp_path / "p.gz"), "--prose", str(tmp_path / "p.gz")],
              "is the --prose it reads")]  # fmt: skip
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda", *tuned], "torch sees no CUDA GPU here"))
    for argv, why in cases:
        with pytest.raises(SystemExit):
            punctuation.main(["--out", str(tmp_path / "t.onnx"), *argv])
        assert why in capsys.readouterr().err, argv


@pytest.mark.slow
def test_the_gpu_script_trains_on_packed_prose_and_the_tagger_is_written_back_here(
    tmp_path: Path,
) -> None:
    """scripts/gpu_punct.sh proved on the CPU (DEVICE=cpu), its three parts as a lent GPU's
    session runs them: pack (the prose in one file, the tagger to go on from, the options),
    run (two seeds side by side: a probe of both sizes the steps to the budget, the runs
    train them and send back their best weights in parts under a call's limits) and finish
    (the parts joined; the same command writes each run's tagger, its record naming the
    file it went on from)."""
    from echoic.model.nn.punctuation import (
        export_piece_tagger,
        file_sha256,
        pretrained_pieces,
        pretrained_tagger,
        read_piece_tagger,
    )

    encoder = _tiny_encoder(tmp_path / "encoder", layers=1)
    init = tmp_path / "init.onnx"
    export_piece_tagger(pretrained_tagger(encoder), pretrained_pieces(encoder), {}, init)
    (tmp_path / "prose").mkdir()  # the system's fortunes and manuals are the prose
    env = {**{k: v for k, v in os.environ.items() if k != "OUT"}, "PYTHON": sys.executable,
           "PACK": str(tmp_path / "pack"), "WORK": str(tmp_path / "work"),
           "OUT": str(tmp_path / "out"), "PROSE": str(tmp_path / "prose"), "DEVICE": "cpu",
           "PROBE_STEPS": "40", "BUDGET_S": "150", "EVAL_STEPS": "300",
           "SEEDS": "3 4"}  # fmt: skip

    def script(*args: str) -> str:
        run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_punct.sh"), *args], env=env,
                             capture_output=True, text=True, timeout=600)  # fmt: skip
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        return run.stdout + run.stderr

    script("pack", str(init), "--window", "4", "--batch", "4", "--lr", "5e-3")
    assert sorted(p.name for p in (tmp_path / "pack").iterdir()) == [
        "init.onnx", "options", "prose.json.gz"]  # fmt: skip
    printed = script("run")
    out = tmp_path / "out"
    steps = int((out / "steps").read_text())
    assert f"gpu_punct: {steps} steps, seeds 3 4" in printed and "s a step" in printed
    assert steps > 40  # the budget holds more than the probe
    sent = sorted(p.name for p in out.iterdir())
    assert sent == ["ckpt-3.pt.part-00", "ckpt-4.pt.part-00", "steps", "train.log"]
    assert all((out / f).stat().st_size < 16_000_000 for f in sent)
    assert "training ended with status 0" in (out / "train.log").read_text()
    script("finish", str(out), str(tmp_path / "tagger.onnx"))
    written = [tmp_path / f"tagger-seed{seed}.onnx" for seed in (3, 4)]
    for path in written:
        _, _, scores = read_piece_tagger(path)
        assert scores["data"]["steps"] == steps == scores["data"]["steps_budget"]
        assert scores["data"]["init"]["sha256"] == file_sha256(init)
    assert written[0].read_bytes() != written[1].read_bytes()  # two seeds, two runs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_run_is_the_same_each_time_resumes_exactly_and_is_written_on_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--device cuda --train-only (scripts/gpu_punct.sh's run, `gpu_check.sh train`): two runs
    write the same tagger once finished on the CPU, and a run stopped part way and resumed
    on the GPU (the CUDA generator's state restored) writes it too."""
    encoder = _a_tiny_corpus_and_encoder(tmp_path, monkeypatch)
    argv = ["--pretrained", str(encoder), "--keep-layers", "2", "--pieces", "90", "--batch", "4",
            "--window", "4", "--steps", "9", "--eval-steps", "4", "--seed", "5"]  # fmt: skip

    def tagger(name: str, stop_at: int = 0) -> bytes:
        checkpoint, out = tmp_path / f"{name}.pt", tmp_path / f"{name}.onnx"
        if stop_at:
            with _stopped_at_step(stop_at, monkeypatch):
                punctuation.main(["--out", str(out), "--checkpoint", str(checkpoint),
                                  "--train-only", "--device", "cuda", *argv])  # fmt: skip
        punctuation.main(["--out", str(out), "--checkpoint", str(checkpoint), "--train-only",
                          "--device", "cuda", *argv])  # fmt: skip
        assert torch.load(checkpoint, weights_only=True)["best_state"] is not None
        punctuation.main(["--out", str(out), "--checkpoint", str(checkpoint), *argv])
        return out.read_bytes()

    first = tagger("first")
    assert tagger("again") == first
    assert tagger("resumed", stop_at=6) == first


def test_the_gpu_script_refuses_what_cannot_work_before_a_call_is_spent(tmp_path: Path) -> None:
    """gpu_punct.sh: options the script sets itself are refused at pack time (a --steps
    there would silently replace the probe's), a seed given twice and more than two at
    run time, and finish of a folder no run came back to, each in a line."""
    init = tmp_path / "init.onnx"
    init.write_bytes(b"not read before the refusals")
    env = {**{k: v for k, v in os.environ.items() if k != "OUT"}, "PYTHON": sys.executable,
           "PACK": str(tmp_path / "pack"), "WORK": str(tmp_path / "work"),
           "OUT": str(tmp_path / "out")}  # fmt: skip
    (tmp_path / "pack").mkdir()
    (tmp_path / "pack" / "prose.json.gz").write_bytes(b"")
    (tmp_path / "empty").mkdir()
    for args, extra, why in (
        (["pack", str(init), "--lr", "1e-4", "--steps", "50"], {}, "pack --steps: the script "
         "sets"),
        (["pack", str(init), "--seed=4"], {}, "pack --seed=4: the script sets"),
        (["run"], {"SEEDS": "3 3"}, "SEEDS='3 3': one seed or two different ones"),
        (["run"], {"SEEDS": "1 2 3"}, "one seed or two different ones"),
        (["finish", str(tmp_path / "empty"), str(tmp_path / "t.onnx")], {},
         "no run came back"),
        (["finish", str(tmp_path / "never"), str(tmp_path / "t.onnx")], {}, "no folder"),
    ):  # fmt: skip
        run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_punct.sh"), *args],
                             env={**env, **extra}, capture_output=True, text=True,
                             timeout=60)  # fmt: skip
        assert run.returncode == 2 and why in run.stderr, (args, run.stderr)
    assert not (tmp_path / "pack" / "options").exists()  # the refused pack wrote nothing
