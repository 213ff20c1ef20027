"""The paper's tokenized, compound-split BLEU beside sacreBLEU (translate.paper_bleu)."""
import sys

import pytest

from minitf.translate import metrics, paper_bleu

pytest.importorskip("sacremoses", reason="sacremoses is in the dev extra: pip install -e '.[dev]'")

HYP = ["Der Mann trägt ein T-Shirt und einen Hut."]
REF = ["Der Mann trägt ein T-Shirt und eine Mütze."]


def test_compound_split_bleu_by_hand():
    # tokens: Der Mann trägt ein T ##AT##-##AT## Shirt und {einen Hut | eine Mütze} .  (11 each, BP 1)
    # n-gram matches: 9/11, 7/10, 6/9, 5/8 -> BLEU = (9/11 * 7/10 * 6/9 * 5/8) ** (1/4)
    bleu, how = paper_bleu(HYP, REF, "de")
    assert bleu == round(100 * (9 / 11 * 7 / 10 * 6 / 9 * 5 / 8) ** 0.25, 2) == 69.89
    assert "compound splitting" in how


def test_without_compound_splitting_the_hyphenated_word_is_one_token():
    # English rules: T-Shirt stays one token: 9 tokens, matches 7/9, 5/8, 4/7, 3/6
    bleu, how = paper_bleu(HYP, REF, "en")
    assert bleu == round(100 * (7 / 9 * 5 / 8 * 4 / 7 * 3 / 6) ** 0.25, 2)
    assert "compound" not in how


def test_moses_tokenization_is_applied_to_both_sides():
    # a reference already tokenized and a detokenized hypothesis tokenize alike: 100
    assert paper_bleu(["Ein Hund, der läuft."], ["Ein Hund , der läuft ."], "de")[0] == 100.0
    # metrics() reports it beside sacreBLEU when it knows the target language, and not otherwise
    both = metrics(HYP, REF, lang="de")
    assert both["bleu_paper"] == 69.89 and both["bleu"] != both["bleu_paper"]
    assert "bleu_paper" not in metrics(HYP, REF)


def test_a_missing_sacremoses_is_named_not_a_traceback(monkeypatch):
    monkeypatch.setitem(sys.modules, "sacremoses", None)
    bleu, how = paper_bleu(HYP, REF, "de")
    assert bleu is None and "pip install 'minitf[paper]'" in how
    assert metrics(HYP, REF, lang="de")["bleu_paper"] is None
