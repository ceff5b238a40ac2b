"""ARPA n-gram models: Kneser-Ney estimates by hand, normalisation, KenLM agreement, the CLI."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from echoic.cli.main import main
from echoic.model.core.lm import (
    BOS,
    EOS,
    UNK,
    ArpaError,
    ArpaModel,
    arpa_words,
    binary_words,
    build_arpa,
    lm_words,
    model_lm,
)


def _build(tmp_path: Path, sentences: list[str], **kwargs) -> tuple[ArpaModel, Path]:
    path = tmp_path / "model.arpa"
    build_arpa(sentences, path, **kwargs)
    return ArpaModel.load(path), path


def test_bigram_values_by_hand(tmp_path: Path) -> None:
    model, path = _build(tmp_path, ["A b.", "a C"], order=2)
    # Unigram continuation counts: a 1 (after <s>), b 1, c 1, </s> 2. Counts-of-counts
    # t1=3, t2=1, t3=0: too few for three discounts, so one, D = 3 / (3 + 2) = 0.6.
    # Leftover (4 * 0.6) / 5 = 0.48, spread over a, b, c, </s>, <unk>: 0.096 each.
    p = {"a": 0.4 / 5 + 0.096, "b": 0.176, "c": 0.176, EOS: 1.4 / 5 + 0.096, UNK: 0.096}
    for word, expected in p.items():
        assert model.log10_prob(word) == pytest.approx(math.log10(expected), abs=1e-6)
    # Bigram raw counts: <s> a 2, a b 1, a c 1, b </s> 1, c </s> 1: t1=4, t2=1, D = 2/3.
    d = 2 / 3
    p_a_bos = (2 - d) / 2 + (d / 2) * p["a"]
    p_b_a = (1 - d) / 2 + (2 * d / 2) * p["b"]
    p_eos_b = (1 - d) / 1 + d * p[EOS]
    assert model.log10_prob("a", [BOS]) == pytest.approx(math.log10(p_a_bos), abs=1e-6)
    assert model.log10_prob("b", ["a"]) == pytest.approx(math.log10(p_b_a), abs=1e-6)
    assert model.log10_prob("a", ["b"]) == pytest.approx(math.log10(d * p["a"]), abs=1e-6)
    assert model.log10_sentence("a b") == pytest.approx(
        math.log10(p_a_bos * p_b_a * p_eos_b), abs=1e-6
    )
    lines = path.read_text().splitlines()
    assert "ngram 1=6" in lines and "ngram 2=5" in lines  # a b c </s> <unk> <s>
    assert f"-99.0000000\t{BOS}\t{math.log10(d / 2):.7f}" in lines  # gamma(<s>) = D * 1 / 2


def test_modified_discounts_by_hand(tmp_path: Path) -> None:
    # Unigram counts a b c d 1, e f 2, g 3, h 4, </s> 1: t1=5, t2=2, t3=1, t4=1.
    model, _ = _build(tmp_path, ["a b c d e e f f g g g h h h h"], order=1)
    # Y = 5/9; D1 = 1 - 2Y*2/5 = 5/9, D2 = 2 - 3Y*1/2 = 7/6, D3+ = 3 - 4Y = 7/9.
    # 16 tokens; leftover (5 D1 + 2 D2 + 2 D3+) / 16 = 5/12, over 10 words (9 and <unk>).
    stats = build_arpa(["a b c d e e f f g g g h h h h"], tmp_path / "again.arpa", order=1)
    assert stats.discounts[0] == pytest.approx((5 / 9, 7 / 6, 7 / 9))
    uniform = 5 / 12 / 10
    expected = {
        "a": (1 - 5 / 9) / 16 + uniform,  # 5/72
        "e": (2 - 7 / 6) / 16 + uniform,  # 3/32
        "h": (4 - 7 / 9) / 16 + uniform,  # 35/144
        UNK: uniform,
    }
    for word, p in expected.items():
        assert model.log10_prob(word, ["anything"]) == pytest.approx(math.log10(p), abs=1e-6)


def _random_corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = "the cat sat on a mat dog ran far away and then came back home".split()
    return [" ".join(rng.choices(words, k=rng.randint(1, 8))) for _ in range(n)]


@pytest.mark.parametrize(
    ("order", "min_count"),
    [
        pytest.param(1, 1, id="unigram"),
        pytest.param(2, 1, id="bigram"),
        pytest.param(3, 1, id="trigram"),
        pytest.param(4, 1, id="4-gram"),
        pytest.param(3, 2, id="trigram-pruned"),
        pytest.param(3, 4, id="trigram-pruned-below-4"),
    ],
)
def test_every_distribution_sums_to_one(tmp_path: Path, order: int, min_count: int) -> None:
    model, _ = _build(tmp_path, _random_corpus(200, seed=order), order=order, min_count=min_count)
    vocabulary = [w for w in model.vocabulary if w != BOS]
    contexts = [(), (BOS,), ("the",), (BOS, "the"), ("cat", "sat"), ("home", "home", "home")]
    contexts += [("zebra",), ("zebra", "the"), ("the", "zebra")]  # unknown words back off
    for context in contexts:
        total = math.fsum(10 ** model.log10_prob(w, context) for w in vocabulary)
        assert total == pytest.approx(1.0, abs=1e-5), context


def test_pruning_drops_singletons(tmp_path: Path) -> None:
    corpus = _random_corpus(200, seed=7)
    full = build_arpa(corpus, tmp_path / "full.arpa", order=3)
    pruned = build_arpa(corpus, tmp_path / "pruned.arpa", order=3, prune_singletons=True)
    assert pruned.ngrams[0] == full.ngrams[0]
    assert pruned.ngrams[2] < full.ngrams[2]
    assert sum(full.ngrams) - sum(pruned.ngrams) == pruned.pruned > 0
    build_arpa(corpus, tmp_path / "same.arpa", order=3, min_count=2)
    assert (tmp_path / "same.arpa").read_bytes() == (tmp_path / "pruned.arpa").read_bytes()
    fewer = build_arpa(corpus, tmp_path / "fewer.arpa", order=3, min_count=4)
    assert fewer.ngrams[0] == full.ngrams[0] and fewer.ngrams[1:] < pruned.ngrams[1:]
    with pytest.raises(ValueError, match="min_count"):
        build_arpa(corpus, tmp_path / "bad.arpa", min_count=0)


def test_text_is_normalised(tmp_path: Path) -> None:
    stats = build_arpa(["It's 2 CATS!", "", "  ...  "], tmp_path / "m.arpa", order=2)
    assert (stats.sentences, stats.words) == (1, 3)
    assert sorted(arpa_words(tmp_path / "m.arpa")) == sorted([EOS, BOS, UNK, "it's", "two", "cats"])


def test_kenlm_agrees(tmp_path: Path) -> None:
    pytest.importorskip("flashlight.lib.text.decoder", reason="flashlight-text not installed")
    from flashlight.lib.text.decoder.kenlm import KenLM
    from flashlight.lib.text.dictionary import Dictionary

    corpus = _random_corpus(300, seed=11)
    model, path = _build(tmp_path, corpus, order=3)
    words = model.vocabulary
    kenlm = KenLM(str(path), Dictionary(words))
    for sentence in [*corpus[:20], "the zebra sat on a mat", "home home home"]:
        state, total = kenlm.start(False), 0.0
        for word in sentence.split():
            state, score = kenlm.score(state, words.index(word if word in words else UNK))
            total += score
        total += kenlm.finish(state)[1]
        assert total == pytest.approx(model.log10_sentence(sentence), abs=1e-4), sentence


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        pytest.param(lambda p: build_arpa(["a"], p, order=0), ValueError, "order", id="order-0"),
        pytest.param(lambda p: build_arpa(["", "?!"], p), ValueError, "no words", id="no-words"),
        pytest.param(lambda p: ArpaModel.load(__file__), ArpaError, "not an ARPA", id="not-arpa"),
    ],
)
def test_bad_input(tmp_path: Path, call, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        call(tmp_path / "m.arpa")


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "text.txt"
    text.write_text("the cat sat\nthe cat sat on the mat\n\nA dog!\n", encoding="utf-8")
    out = tmp_path / "lm.arpa"
    assert main(["lm", str(text), str(out), "--order", "2"]) == 0
    line = capsys.readouterr().out
    assert line.startswith("3 sentences, 11 words -> ") and "1-grams 10, 2-grams 11" in line
    assert ArpaModel.load(out).order == 2
    assert main(["lm", str(text), str(out), "--prune-singletons", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ngrams"][0] == 10 and summary["pruned"] > 0


def test_cli_missing_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lm", str(tmp_path / "nope.txt"), str(tmp_path / "lm.arpa")]) == 1
    assert "nope.txt" in capsys.readouterr().err


WORDNET_LINES = [
    "  1 This software and database is being provided to you, the LICENSEE, by  ",
    "00001740 03 n 01 entity 0 003 ~ 00001930 n 0000 | that which is perceived or known or "
    "inferred to have its own distinct existence (living or nonliving)  ",
    "00002724 29 v 01 choke 0 002 @ 00001740 v 0000 | breathe with great difficulty, as "
    'when experiencing a strong emotion; "She choked with emotion when she spoke"; '
    '"the cat sat on the mat"  ',
]


def test_cli_several_sources_wordnet_and_exclusions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Text files and WordNet's examples and definitions go into one model; a sentence of
    an --exclude file (held-out text) is never counted, from any source."""
    one, two, held = (tmp_path / name for name in ("one.txt", "two.txt", "held.txt"))
    one.write_text("the cat sat\nthe dog ran away\n", encoding="utf-8")
    two.write_text("a bird flew over the house\n", encoding="utf-8")
    held.write_text("The dog ran away!\nthe cat sat on the mat\n", encoding="utf-8")
    wordnet = tmp_path / "wordnet"
    wordnet.mkdir()
    (wordnet / "data.noun").write_text("\n".join(WORDNET_LINES) + "\n", encoding="latin-1")
    out = tmp_path / "lm.arpa"
    args = ["lm", str(one), str(two), "--wordnet", "--wordnet-dir", str(wordnet)]
    args += ["--exclude", str(held)]
    assert main([*args, str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    words = set(arpa_words(out))
    assert {"bird", "choked", "emotion", "breathe", "difficulty", "cat"} <= words
    assert "away" not in words and "mat" not in words  # excluded wherever they came from
    assert "perceived" not in words  # a definition with brackets is not plain prose
    # The order the scripts use: options between the text files and OUT.arpa.
    again = tmp_path / "again.arpa"
    assert main(["lm", str(one), str(two), "--wordnet", "--exclude", str(held),
                 "--wordnet-dir", str(wordnet), str(again), "--min-count", "1"]) == 0  # fmt: skip
    capsys.readouterr()
    assert again.read_bytes() == out.read_bytes()
    assert summary["sentences"] == 4  # cat sat, bird, one definition, one example
    assert main(["lm", str(out)]) == 1
    assert "no text" in capsys.readouterr().err
    assert main(["lm", "--wordnet", "--wordnet-dir", str(tmp_path / "none"), str(out)]) == 1
    assert "wordnet-base" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/usr/share/wordnet/data.noun").is_file(), reason="no WordNet")
def test_wordnet_sentences_are_clean_and_distinct() -> None:
    from echoic.training.corpus import wordnet_sentences

    sentences = wordnet_sentences()
    assert len(sentences) > 100_000 and len(set(sentences)) == len(sentences)
    assert "she was able to program her computer" in sentences
    assert all(s == s.lower() and "(" not in s and '"' not in s for s in sentences)


def test_a_model_directory_s_lm_is_its_binary_file_first(tmp_path: Path) -> None:
    assert model_lm(tmp_path) is None
    build_arpa(["the cat sat"], tmp_path / "lm.arpa", order=2)
    assert model_lm(tmp_path) == tmp_path / "lm.arpa"
    (tmp_path / "lm.bin").write_bytes(b"")
    assert model_lm(tmp_path) == tmp_path / "lm.bin"


BUNDLED_BINARY = Path(__file__).parent.parent / "model" / "default" / "lm.bin"


@pytest.mark.skipif(not BUNDLED_BINARY.is_file(), reason="no bundled model in model/default")
def test_a_binary_file_s_words_are_read_from_its_end_or_the_fault_named(tmp_path: Path) -> None:
    """KenLM's binary format keeps the vocabulary after the n-grams; a file cut short, or
    of another format version, is an error that says to rebuild it."""
    words = lm_words(BUNDLED_BINARY)
    assert words[0] == UNK and len(words) == len(set(words)) > 50000 and "the" in words
    data = BUNDLED_BINARY.read_bytes()
    cut = tmp_path / "cut.bin"
    cut.write_bytes(data[:-1000])
    with pytest.raises(ArpaError, match=r"no vocabulary of \d+ words at its end"):
        binary_words(cut)
    old = tmp_path / "old.bin"
    old.write_bytes(data.replace(b"format version 5", b"format version 4", 1))
    with pytest.raises(ArpaError, match="another format version.*build_lm_binary.sh"):
        lm_words(old)
