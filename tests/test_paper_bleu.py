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


def test_the_language_is_taken_without_case_or_region_and_unspaced_languages_get_their_tokenizer():
    # "DE" or "de-AT" had skipped the compound splitting; Chinese had been split on spaces (BLEU near 0)
    for lang in ("DE", "de-AT", "de_DE"):
        assert paper_bleu(HYP, REF, lang) == paper_bleu(HYP, REF, "de")
    zh = metrics(["我喜欢吃苹果。"], ["我喜欢吃红苹果。"], lang="zh")
    assert "tok:zh" in zh["bleu_signature"] and zh["bleu"] > 40
    assert zh["bleu_paper"] is None and "does not split zh into words" in zh["bleu_paper_method"]
    assert "tok:13a" in metrics(HYP, REF, lang="de")["bleu_signature"]


def test_evaluate_reads_sgm_segments_and_names_table_2_for_its_languages(tmp_path, capsys):
    # an .sgm file (newstest2014's test set comes so) had been scored with its markup as lines
    from conftest import make_tiny_checkpoint
    from minitf.cli import main
    ckpt, lines = make_tiny_checkpoint(tmp_path)
    def sgm(name, segs):
        (tmp_path / name).write_text('<srcset setid="t" srclang="any">\n<doc docid="d" genre="news">\n'
                                     + "".join(f'<seg id="{i + 1}">{s}</seg>\n' for i, s in enumerate(segs))
                                     + "</doc>\n</srcset>\n")
    sgm("src.sgm", lines[:4])
    sgm("ref.sgm", lines[4:8])
    (tmp_path / "src.txt").write_text("\n".join(lines[:4]) + "\n")
    (tmp_path / "ref.txt").write_text("\n".join(lines[4:8]) + "\n")
    flags = ["--beam", "1", "--max-len-b", "3", "--quiet", "--lang"]
    assert main(["evaluate", "--checkpoint", str(ckpt), "--src", str(tmp_path / "src.sgm"), "--ref",
                 str(tmp_path / "ref.sgm"), *flags, "de"]) == 0
    from_sgm = capsys.readouterr().out
    assert main(["evaluate", "--checkpoint", str(ckpt), "--src", str(tmp_path / "src.txt"), "--ref",
                 str(tmp_path / "ref.txt"), *flags, "de"]) == 0
    assert capsys.readouterr().out == from_sgm and "the number Table 2 reports" in from_sgm
    assert main(["evaluate", "--checkpoint", str(ckpt), "--src", str(tmp_path / "src.txt"), "--ref",
                 str(tmp_path / "ref.txt"), *flags, "en"]) == 0
    assert "the number Table 2 reports" not in capsys.readouterr().out
    (tmp_path / "plain.sgm").write_text("\n".join(lines[:4]) + "\n")   # no markup: not read as no segment at all
    assert main(["evaluate", "--checkpoint", str(ckpt), "--src", str(tmp_path / "plain.sgm"), "--ref",
                 str(tmp_path / "ref.txt"), *flags, "de"]) == 2
    assert "plain.sgm: named .sgm, but it has no <seg> lines" in capsys.readouterr().err
