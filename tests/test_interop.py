"""Marian's format and CTranslate2 (docs/interop.md): a minitf model exported and served by
CTranslate2 translates and scores as minitf does; a Marian model (OPUS-MT's layout, written here
by hand with random weights) read into minitf scores as CTranslate2 scores it, and fine-tunes."""
import json
import os
import shutil

import numpy as np
import pytest

import minitf
from minitf.checkpoint import load_checkpoint, save_checkpoint
from minitf.config import id_ranges
from minitf.data.tokenizer import Tokenizer
from minitf.errors import CheckpointError, DataError
from minitf.marian import (OUTSIDE, dump_vocab, dump_yaml, export_marian, halves_order, import_marian,
                           load_vocab, load_yaml, marian_config)
from minitf.translate import translate_ids

from conftest import WORDS

ct2 = pytest.importorskip("ctranslate2", reason="the [serve] extra (ctranslate2) is not installed")

N_SENTENCES = 50


def sentences(n, seed):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(2, 8))) for _ in range(n)]


def copy_batch(ids, eos=3, bos=2):
    """A copy task: the target is the source (so a few steps teach the model to end sentences)."""
    n = max(len(s) for s in ids) + 1
    src, tgt_in, tgt_out = (np.zeros((len(ids), n), dtype=np.int64) for _ in range(3))
    for b, s in enumerate(ids):
        src[b, :len(s) + 1] = s + [eos]
        tgt_in[b, :len(s) + 1] = [bos] + s
        tgt_out[b, :len(s) + 1] = s + [eos]
    return src, tgt_in, tgt_out


def train_steps(model, ids, steps, lr=3e-3, seed=0):
    """`steps` Adam updates of the copy task on batches of 32 of `ids`; the losses."""
    opt = minitf.Adam(model, lr=lambda step: lr * min(1.0, step / 20))
    rng = np.random.default_rng(seed)
    losses = []
    model.train()
    for _ in range(steps):
        pick = rng.choice(len(ids), size=32)
        model.zero_grad()
        losses.append(model.forward_loss(*copy_batch([ids[i] for i in pick])))
        model.backward()
        opt.step()
    return losses


VARIANTS = {
    "post-norm": {},
    "pre-norm, swish, logit bias, output vocabulary, learned positions, 2+1 layers":
        dict(norm_position="pre", activation="swish", output_bias=True, positional="learned", n_layers=2,
             n_decoder_layers=1),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def trained(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("interop")
    lines = sentences(400, 0)
    tok = Tokenizer.train(lines, folder / "spm.model", vocab_size=60)
    ids = tok.encode(lines)
    extra = dict(VARIANTS[request.param])
    if extra.get("output_bias"):   # the target side uses a subset of the pieces: score only those (and unk, eos)
        used = sorted(set(i for s in ids for i in s) | {1, 3})
        extra["output_vocab"] = id_ranges(used)   # as training writes it: runs of ids as ranges
    cfg = minitf.Config(vocab_size=tok.vocab_size, d_model=32, n_heads=4, d_ff=64, n_layers=extra.pop("n_layers", 1),
                        dropout=0.0, max_len=64, **extra)
    model = minitf.Transformer(cfg, seed=1)
    losses = train_steps(model, ids, 150)
    assert np.mean(losses[-10:]) < 0.6 * np.mean(losses[:10])
    path = folder / "model.npz"
    save_checkpoint(path, model, tokenizer=tok.to_bytes())
    return path, folder


def pieces_of(tok, id_lists):
    return [[tok.id_to_piece(i) for i in s] for s in id_lists]


def minitf_and_ct2(path, folder, quantization=None):
    from minitf.ctranslate2_export import export_ctranslate2
    out = folder / f"ct2-{quantization}"
    export_ctranslate2(str(path), str(out), quantization=quantization)
    return minitf.load(str(path)), ct2.Translator(str(out), device="cpu")


def test_ctranslate2s_stop_gives_nbest_as_many_hypotheses_as_asked_and_the_same_best(trained):
    # the rule ends a sentence at the first step whose best candidate is EOS: a trained model ends most sentences
    # that way with fewer than n finished, and `--nbest n` had printed as few as 1 of them
    path, _ = trained
    t = minitf.load(str(path))
    src = sentences(20, 5)
    lists = t.nbest(src, n=3, beam=3, alpha=0, stop="ctranslate2")
    assert [len(hyps) for hyps in lists] == [3] * len(src)
    assert [hyps[0].text for hyps in lists] == t.translate(src, beam=3, alpha=0, stop="ctranslate2")


def test_ctranslate2_translates_and_scores_as_minitf(trained):
    path, folder = trained
    t, tr = minitf_and_ct2(path, folder)
    tok = t.tokenizer
    src = tok.encode(sentences(N_SENTENCES, 7))
    src_pieces = pieces_of(tok, src)
    with_eos = [s + [tok.eos_id] for s in src]
    # alpha 0 (CTranslate2's length penalty is length ** alpha, minitf's GNMT's: equal at 0), at least one
    # token (minitf's rule), and no suppression of <pad> and <s>: CTranslate2 suppresses before the softmax,
    # minitf bans them after it (as fairseq does), which changes the scores; a trained model never picks them
    options = dict(max_decoding_length=64, min_decoding_length=1, length_penalty=0.0)
    for beam in (1, 4):
        mine = translate_ids(t.model, with_eos, beam_size=beam, alpha=0.0, max_len_b=60, nbest=1, stop="ctranslate2")
        theirs = tr.translate_batch(src_pieces, beam_size=beam, return_scores=True, **options)
        mine_pieces = pieces_of(tok, [h[0][0] for h in mine])
        assert [r.hypotheses[0] for r in theirs] == mine_pieces, f"beam {beam}"
        assert any(len(p) < 60 for p in mine_pieces)          # the model ends its sentences
        scored = tr.score_batch(src_pieces, mine_pieces)
        for h, s in zip(mine, scored):
            np.testing.assert_allclose(s.log_probs, h[0][1], atol=1e-4)
    # float64: the same model in float64 scores as CTranslate2's float32 to 1e-4
    model64 = load_checkpoint(str(path)).build_model(dtype="float64")
    mine64 = translate_ids(model64, with_eos, beam_size=4, alpha=0.0, max_len_b=60, nbest=1, stop="ctranslate2")
    scored = tr.score_batch(src_pieces, pieces_of(tok, [h[0][0] for h in mine64]))
    for h, s in zip(mine64, scored):
        np.testing.assert_allclose(s.log_probs, h[0][1], atol=1e-4)


# ------------------------------------------------------------------------------ Marian models into minitf
D_M, F_M, H_M = 16, 24, 2


def write_marian_by_hand(folder, activation="swish", seed=0, extra_options=""):
    """A Marian model folder as OPUS-MT distributes one, written from Marian's documented names
    (not by minitf.marian): random weights, a logit bias, </s> at 0 and <unk> at 1, no <pad> or <s>,
    two SentencePiece models trained here (source.spm on lower-case words, target.spm on capitals)
    over one vocabulary of both their pieces."""
    folder.mkdir(exist_ok=True)
    src_tok = Tokenizer.train(sentences(400, 1), folder / "source.model", vocab_size=60)
    tgt_tok = Tokenizer.train([s.upper() for s in sentences(400, 2)], folder / "target.model", vocab_size=50)
    pieces = ["</s>", "<unk>"]           # one vocabulary over both models' pieces
    for tok in (src_tok, tgt_tok):
        pieces += [p for p in (tok.id_to_piece(i) for i in range(4, tok.vocab_size)) if p not in pieces]
    v = len(pieces)
    rng = np.random.default_rng(seed)

    def w(*shape, scale=0.3):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    arrays = {"Wemb": w(v, D_M, scale=0.5), "decoder_ff_logit_out_b": w(1, v)}

    def attention(scope):
        for m in "qkvo":
            arrays[f"{scope}_W{m}"], arrays[f"{scope}_b{m}"] = w(D_M, D_M), w(1, D_M, scale=0.1)
        arrays[f"{scope}_Wo_ln_scale"], arrays[f"{scope}_Wo_ln_bias"] = 1 + w(1, D_M, scale=0.1), w(1, D_M, scale=0.1)

    def ffn(scope):
        arrays[f"{scope}_W1"], arrays[f"{scope}_b1"] = w(D_M, F_M), w(1, F_M, scale=0.1)
        arrays[f"{scope}_W2"], arrays[f"{scope}_b2"] = w(F_M, D_M), w(1, D_M, scale=0.1)
        arrays[f"{scope}_ffn_ln_scale"], arrays[f"{scope}_ffn_ln_bias"] = 1 + w(1, D_M, scale=0.1), w(1, D_M, scale=0.1)

    for layer in (1, 2):
        attention(f"encoder_l{layer}_self")
        ffn(f"encoder_l{layer}_ffn")
    attention("decoder_l1_self")
    attention("decoder_l1_context")
    ffn("decoder_l1_ffn")
    yml = ("type: transformer\ndim-emb: 16\ndim-vocabs:\n  - {v}\n  - {v}\nenc-depth: 2\ndec-depth: 1\n"
           "transformer-heads: 2\ntransformer-dim-ffn: 24\ntransformer-ffn-depth: 2\n"
           "transformer-ffn-activation: {act}\ntransformer-decoder-autoreg: self-attention\n"
           "transformer-no-projection: false\ntransformer-preprocess: \"\"\ntransformer-postprocess: dan\n"
           "transformer-postprocess-emb: d\ntransformer-postprocess-top: \"\"\ntransformer-tied-layers:\n  []\n"
           "transformer-guided-alignment-layer: last\ntied-embeddings-all: true\nright-left: false\n"
           "version: v1.12.0\n").format(v=v, act=activation) + extra_options
    arrays["special:model.yml"] = np.frombuffer(yml.encode() + b"\0", dtype=np.int8)
    np.savez(folder / "opus.npz", **arrays)
    (folder / "opus.vocab.yml").write_text(dump_vocab(pieces), encoding="utf-8")
    (folder / "source.spm").write_bytes((folder / "source.model").read_bytes())   # English-like words
    (folder / "target.spm").write_bytes((folder / "target.model").read_bytes())   # the same words in capitals
    (folder / "decoder.yml").write_text("models:\n  - opus.npz\nvocabs:\n  - opus.vocab.yml\n  - opus.vocab.yml\n"
                                        "beam-size: 4\nnormalize: 1\n")
    return folder, pieces


@pytest.fixture(scope="module")
def marian_folder(tmp_path_factory):
    return write_marian_by_hand(tmp_path_factory.mktemp("opus") / "opus-mt-xx-yy")


def test_an_opus_mt_folder_loads_and_scores_as_ctranslate2_scores_it(marian_folder, tmp_path):
    from ctranslate2.converters import OpusMTConverter
    folder, pieces = marian_folder
    t = minitf.load(str(folder))
    cfg = t.model.cfg
    assert (cfg.activation, cfg.output_bias, cfg.n_layers, cfg.n_decoder_layers) == ("swish", True, 2, 1)
    assert cfg.vocab_size == len(pieces) + 2          # a <pad> and a <s> row added, outside the output vocabulary
    assert not t.model.embedding.params["weight"][[0, 2]].any()
    assert cfg.output_vocab == id_ranges(cfg.output_ids())     # spelled as training spells it: runs as ranges
    from minitf.modelinfo import model_facts
    facts = model_facts(str(folder))
    assert facts["kind"] == "a Marian model (OPUS-MT's layout)" and facts["config"] == cfg.to_dict() and facts["marian"]
    assert facts["tokenizer"] == {"type": "marian", "pieces": cfg.vocab_size}
    OpusMTConverter(str(folder)).convert(str(tmp_path / "ct2"))
    tr = ct2.Translator(str(tmp_path / "ct2"), device="cpu")
    lines = sentences(20, 9)
    src = t.tokenizer.encode(lines)
    out = translate_ids(t.model, [s + [3] for s in src], beam_size=1, alpha=0.0, max_len_b=10, nbest=1)
    src_pieces = [[t.tokenizer.id_to_piece(i) for i in s] for s in src]
    tgt_pieces = [[t.tokenizer.id_to_piece(i) for i in h[0][0]] for h in out]
    assert all(p in pieces for s in src_pieces + tgt_pieces for p in s)
    scored = tr.score_batch(src_pieces, tgt_pieces)
    for h, s in zip(out, scored):
        np.testing.assert_allclose(s.log_probs, h[0][1], atol=1e-4)
    # and CTranslate2's greedy search finds what minitf's finds (Marian starts from a zero vector: here too)
    theirs = tr.translate_batch(src_pieces, beam_size=1, max_decoding_length=10, min_decoding_length=1)
    for h, r, mine in zip(out, theirs, tgt_pieces):
        if len(mine) < 10:
            assert r.hypotheses[0] == mine
    assert t.translate(lines[:2]) == t.translate(lines[:2])   # text in, text out through source.spm / target.spm
    tok = t.tokenizer   # two SentencePiece models over one vocabulary: each side's pieces are known to it
    target = tok.encode_target(["THE CAT SEES A DOG"])[0]
    assert tok.unk_id not in target and tok.decode([target]) == ["THE CAT SEES A DOG"]
    assert tok.unk_id not in tok.encode(["the cat sees a dog"])[0] and tok.encode(["the cat"]) != tok.encode_target(
        ["THE CAT"])


def test_an_imported_model_fine_tunes_and_exports_again(marian_folder, tmp_path):
    from minitf.marian import write_marian
    folder, _ = marian_folder
    t = minitf.load(str(folder))
    model, tok = t.model, t.tokenizer
    ids = tok.encode(sentences(300, 3))
    losses = train_steps(model, ids, 60)
    assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:10])
    write_marian(model.cfg, model.state_dict(), tok, None, str(tmp_path / "tuned"))
    again = minitf.load(str(tmp_path / "tuned"))
    batch = copy_batch(ids[:16])
    model.eval()
    again.model.eval()
    np.testing.assert_allclose(again.model.forward(*batch[:2]), model.forward(*batch[:2]), atol=1e-5)
    assert again.translate(["the cat sees a dog"]) == t.translate(["the cat sees a dog"])


def test_the_marian_export_loads_back_to_the_same_model(trained, tmp_path):
    path, _ = trained
    export_marian(str(path), str(tmp_path / "m"))
    assert sorted(os.listdir(tmp_path / "m")) == ["decoder.yml", "model.npz", "source.spm", "target.spm", "vocab.yml"]
    with np.load(tmp_path / "m" / "model.npz", allow_pickle=False) as z:
        options = load_yaml(z["special:model.yml"].tobytes().rstrip(b"\0").decode())
        names = set(z.files)
    assert {"Wemb", "encoder_l1_self_Wq", "decoder_l1_context_Wo", "decoder_ff_logit_out_b"} <= names
    original, back = minitf.load(str(path)), minitf.load(str(tmp_path / "m"))
    assert options["dec-depth"] == original.model.cfg.n_decoder_layers
    assert {k: v for k, v in back.model.cfg.model_fields().items() if k != "decode_alpha"} == \
        {k: v for k, v in original.model.cfg.model_fields().items() if k != "decode_alpha"}
    for name, a in original.model.state_dict().items():
        np.testing.assert_array_equal(back.model.state_dict()[name], a, err_msg=name)
    lines = sentences(10, 4)
    assert back.translate(lines) == original.translate(lines)


def test_the_d_permutation_makes_the_papers_sinusoids_marians_halves():
    from minitf.layers.positional import sinusoid_table
    d = 8
    table = sinusoid_table(5, d)
    pos = np.arange(5)[:, None]
    freq = 1.0 / np.power(10000.0, 2 * np.arange(d // 2) / d)
    halves = np.concatenate([np.sin(pos * freq), np.cos(pos * freq)], axis=1)   # CTranslate2's table for Marian
    np.testing.assert_allclose(table, halves[:, halves_order(d)], atol=1e-12)


def test_options_minitf_lacks_are_refused_in_one_line(tmp_path):
    folder, _ = write_marian_by_hand(tmp_path / "aan", extra_options="")
    with np.load(folder / "opus.npz", allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    text = arrays["special:model.yml"].tobytes().rstrip(b"\0").decode()
    for old, new, named in (("transformer-decoder-autoreg: self-attention", "transformer-decoder-autoreg: average-attention",
                             "--transformer-decoder-autoreg"),
                            ("transformer-ffn-activation: swish", "transformer-ffn-activation: gelu",
                             "--transformer-ffn-activation"),
                            ("transformer-postprocess: dan", "transformer-postprocess: dhn", "--transformer-postprocess")):
        arrays["special:model.yml"] = np.frombuffer(text.replace(old, new).encode() + b"\0", dtype=np.int8)
        np.savez(folder / "opus.npz", **arrays)
        with pytest.raises(CheckpointError) as e:
            import_marian(str(folder))
        assert named in str(e.value) and "\n" not in str(e.value)


def test_what_real_opus_mt_folders_hold_is_read_or_refused_in_one_line(tmp_path):
    # an output layer of its own under today's name (_Wt, transposed) had been ignored: the tied embedding scored
    # instead, silently; a vocabulary of another length, a SentencePiece model named as the vocabulary, a decoder.yml
    # without its lists, and yaml-cpp's \x escapes had been tracebacks
    import yaml
    folder, pieces = write_marian_by_hand(tmp_path / "opus")
    with np.load(folder / "opus.npz", allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    np.savez(folder / "opus.npz", **arrays, decoder_ff_logit_out_Wt=arrays["Wemb"][::-1].copy())
    with pytest.raises(CheckpointError, match=r"an output layer of its own \(decoder_ff_logit_out_Wt\)"):
        import_marian(str(folder))
    np.savez(folder / "opus.npz", **arrays)
    vocab = (folder / "opus.vocab.yml").read_text(encoding="utf-8")
    (folder / "opus.vocab.yml").write_text("".join(vocab.splitlines(keepends=True)[:-3]), encoding="utf-8")
    with pytest.raises(CheckpointError, match=rf"opus.vocab.yml: {len(pieces) - 3} pieces, but the embedding of .* has "
                                              rf"{len(pieces)} rows: not this model's vocabulary"):
        import_marian(str(folder))
    (folder / "opus.vocab.yml").write_bytes((folder / "source.spm").read_bytes())
    with pytest.raises(CheckpointError, match=r"opus.vocab.yml: not a YAML vocabulary \(binary"):
        import_marian(str(folder))
    cut = vocab.encode("utf-8") + '"\u00e9": 99\n'.encode("utf-8")
    (folder / "opus.vocab.yml").write_bytes(cut[:-7])    # cut inside the é: a copy stopped part-way, not binary
    with pytest.raises(CheckpointError, match=r"opus.vocab.yml: cut short inside a character at byte"):
        import_marian(str(folder))
    (folder / "opus.vocab.yml").write_text(vocab, encoding="utf-8")
    decoder = (folder / "decoder.yml").read_text()
    (folder / "decoder.yml").write_text("beam-size: 4\n")
    with pytest.raises(CheckpointError, match=r"decoder.yml: expected the lists 'models' .* and 'vocabs'"):
        import_marian(str(folder))
    (folder / "decoder.yml").write_text(decoder)
    # yaml-cpp's escapes (U+0080..U+00A0 and control characters as \xNN), read as YAML reads them
    text = '"\\xa0": 0\n"a\\x85b": 1\n"\\u00e9\\U0001F600": 2\n"tab\\there": 3\n"\\ud83d\\ude00": 4\n'
    (tmp_path / "esc.yml").write_text(text, encoding="utf-8")
    as_yaml = [k for k, _ in sorted(yaml.safe_load(text).items(), key=lambda kv: kv[1])]
    assert load_vocab(tmp_path / "esc.yml") == as_yaml[:4] + ["\U0001F600"]     # a \u pair is one character, as in JSON
    (tmp_path / "bad.yml").write_text('"\\q": 0\n', encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"bad.yml:1: not a vocabulary line"):
        load_vocab(tmp_path / "bad.yml")
    # a .json vocabulary, which Marian reads as YAML too, found beside a model without decoder.yml
    (folder / "decoder.yml").unlink()
    (folder / "opus.vocab.yml").rename(folder / "opus.vocab.json")
    (folder / "opus.vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}, ensure_ascii=False))
    assert load_vocab(folder / "opus.vocab.json") == pieces
    assert import_marian(str(folder))[2].pieces[4:] == import_marian(str(folder / "opus.npz"))[2].pieces[4:]
    # a decoder feed-forward width of its own is named as the Marian option, not as a shape further on
    text = arrays["special:model.yml"].tobytes().rstrip(b"\0").decode() + "transformer-decoder-dim-ffn: 32\n"
    np.savez(folder / "opus.npz", **{**arrays, "special:model.yml": np.frombuffer(text.encode() + b"\0", np.int8)})
    with pytest.raises(CheckpointError, match=r"--transformer-decoder-dim-ffn 32 \(the encoder's --transformer-dim-ffn "
                                              r"24\) is not supported by minitf"):
        import_marian(str(folder))
    # a decoder feed-forward of three layers (a real option, 0 in OPUS-MT's model.yml) and a layer's weight minitf has
    # no place for had loaded as another model, translating garbage with exit 0
    text = arrays["special:model.yml"].tobytes().rstrip(b"\0").decode() + "transformer-decoder-ffn-depth: 3\n"
    np.savez(folder / "opus.npz", **{**arrays, "special:model.yml": np.frombuffer(text.encode() + b"\0", np.int8)})
    with pytest.raises(CheckpointError, match=r"--transformer-decoder-ffn-depth 3 is not supported by minitf"):
        import_marian(str(folder))
    text = arrays["special:model.yml"].tobytes().rstrip(b"\0").decode() + "transformer-decoder-ffn-depth: 0\n"
    np.savez(folder / "opus.npz", **{**arrays, "special:model.yml": np.frombuffer(text.encode() + b"\0", np.int8)})
    assert import_marian(str(folder))[0].d_ff == 24                     # 0: the encoder's depth, as Marian reads it
    np.savez(folder / "opus.npz", **arrays, decoder_l1_ffn_W3=arrays["decoder_l1_ffn_W2"].T.copy())
    with pytest.raises(CheckpointError, match=r"opus\.npz: decoder_l1_ffn_W3: weights of a layer minitf does not build"):
        import_marian(str(folder))
    np.savez(folder / "opus.npz", **arrays)
    # an empty source.spm (a copy stopped before it began) had been a traceback inside SentencePiece's first encode
    spm_bytes = (folder / "source.spm").read_bytes()
    (folder / "source.spm").write_bytes(b"")
    with pytest.raises(DataError, match=r"source\.spm or .*target\.spm is not a SentencePiece model"):
        import_marian(str(folder))
    (folder / "source.spm").write_bytes(spm_bytes)
    # a .safetensors export holds a minitf checkpoint: an OPUS-MT folder is refused there in one line
    from minitf.cli import main
    assert main(["export", "--checkpoint", str(folder), "--out", str(tmp_path / "c.safetensors")]) == 2
    assert not (tmp_path / "c.safetensors").exists()


def test_a_multilingual_models_language_token_is_its_piece(tmp_path):
    # a multilingual OPUS-MT model reads the target language from a first token such as >>deu<<, a piece of its
    # vocabulary: SentencePiece had cut it into characters (<unk> among them), so the model never saw it
    from minitf.data.tokenizer import MarianTokenizer
    folder, pieces = write_marian_by_hand(tmp_path / "opus")
    tok = MarianTokenizer.from_files(folder / "source.spm", folder / "target.spm", pieces + [">>deu<<"])
    lang = len(pieces)
    plain = tok.encode(["the cat sees a dog"])[0]
    assert tok.encode([">>deu<< the cat sees a dog", "  >>deu<<the cat sees a dog"]) == [[lang] + plain] * 2
    assert tok.encode([">>fra<< the cat sees a dog"])[0][0] != lang      # not a piece of this vocabulary: text
    assert tok.encode_target([">>deu<< the cat sees a dog"])[0][0] == lang


def test_vocabulary_and_yaml_files_round_trip(tmp_path):
    pieces = ["</s>", "<unk>", "▁a", 'quote"d', "back\\slash", "colon:", "'single'", "▁über"]
    (tmp_path / "v.yml").write_text(dump_vocab(pieces), encoding="utf-8")
    assert load_vocab(tmp_path / "v.yml") == pieces
    from ctranslate2.converters.marian import load_vocab as ct2_load_vocab
    assert ct2_load_vocab(str(tmp_path / "v.yml")) == pieces
    cfg = minitf.Config(vocab_size=50, d_model=16, n_heads=2, d_ff=24, n_layers=1, norm_position="pre")
    options = marian_config(cfg)
    assert load_yaml(dump_yaml(options)) == options
    import yaml
    assert yaml.safe_load(dump_yaml(options)) == options
    assert OUTSIDE < -1e8 and json.dumps(options)


def test_train_wmt_fine_tunes_an_opus_mt_folder_with_init_from(marian_folder, tmp_path):
    """train_wmt.py --init-from: the Marian model's weights and tokenizer, the corpus encoded with
    source.spm and target.spm, checkpoints that carry that tokenizer (translate, --resume and export
    read them), a loss that falls."""
    import subprocess
    import sys
    folder, _ = marian_folder
    rng = np.random.default_rng(2)
    for split, n in (("train", 300), ("valid", 20)):
        lines = [" ".join(rng.choice(WORDS, size=rng.integers(2, 7))) for _ in range(n)]
        (tmp_path / f"{split}.xx").write_text("\n".join(lines) + "\n")
        (tmp_path / f"{split}.yy").write_text("\n".join(lines).upper() + "\n")   # copy task, into capitals
    out = tmp_path / "run"
    base = [sys.executable, "train_wmt.py", "--init-from", str(folder), "--train", str(tmp_path / "train"),
            "--valid", str(tmp_path / "valid"), "--src", "xx", "--tgt", "yy", "--preset", "tiny", "--device", "cpu",
            "--warmup", "10", "--lr-factor", "2", "--log-every", "10", "--valid-every", "0", "--beam", "1",
            "--out", str(out), "--cache-dir", str(tmp_path / "cache"), "--quiet"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(base + ["--max-steps", "40"], cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "init: the weights of" in r.stderr
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    losses = [rec["loss"] for rec in log if "loss" in rec]
    assert losses[-1] < losses[0], losses
    t = minitf.load(str(out / "model.npz"))
    assert type(t.tokenizer).__name__ == "MarianTokenizer" and t.tokenizer.source_language == "xx"
    assert t.model.cfg.activation == "swish" and t.model.cfg.n_layers == 2
    r = subprocess.run(base + ["--max-steps", "50", "--resume"], cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resuming from" in r.stderr
    export_marian(str(out / "model.npz"), str(tmp_path / "back"))
    assert minitf.load(str(tmp_path / "back")).translate(["the cat"]) == minitf.load(str(out / "model.npz")).translate(
        ["the cat"])
    r = subprocess.run([sys.executable, "train_wmt.py", "--init-from", str(folder), "--d-model", "32", "--train",
                        str(tmp_path / "train"), "--valid", str(tmp_path / "valid"), "--src", "xx", "--tgt", "yy",
                        "--out", str(tmp_path / "x")], cwd=root, capture_output=True, text=True)
    assert r.returncode != 0 and "drop --d-model" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(base[:-5] + ["--out", str(tmp_path / "y"), "--max-steps", "1", "--bpe-dropout-source", "0.1",
                                    "--cache-dir", str(tmp_path / "cache")], cwd=root, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.splitlines()[-1] == (
        f"error: --init-from {folder} brings a Marian tokenizer, which has no BPE merges for BPE-dropout to leave out: "
        f"drop --bpe-dropout-source, or start from a model whose tokenizer is BPE (one trained with --subword bpe)"), \
        r.stderr[-2000:]


def test_the_export_command_writes_each_format_and_refuses_bad_flags_in_one_line(trained, tmp_path):
    import subprocess
    import sys
    path, _ = trained
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def export(*flags):
        return subprocess.run([sys.executable, "-m", "minitf", "export", "--checkpoint", str(path), *flags],
                              cwd=str(tmp_path), capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=root))

    r = export("--format", "ctranslate2", "--out", "ct2", "--quantization", "int8")
    assert r.returncode == 0, r.stderr
    assert {"model.bin", "shared_vocabulary.json", "config.json", "source.spm"} <= set(os.listdir(tmp_path / "ct2"))
    config = json.loads((tmp_path / "ct2" / "config.json").read_text())
    assert config["decoder_start_token"] == "<s>" and config["add_source_eos"] is True
    assert ct2.Translator(str(tmp_path / "ct2")).translate_batch([["▁the", "▁cat"]])[0].hypotheses
    r = export("--format", "marian", "--out", "m")
    assert r.returncode == 0, r.stderr
    assert minitf.load(str(tmp_path / "m")).translate(["the cat"]) == minitf.load(str(path)).translate(["the cat"])
    for flags, says in ((["--out", "x.safetensors", "--quantization", "int8"], "only --format ctranslate2 quantizes"),
                        (["--format", "marian", "--out", "nowhere/m"], "does not exist"),
                        (["--out", "m"], "name it *.safetensors")):
        r = export(*flags)
        assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, (flags, r.stderr)
    rnn = tmp_path / "rnn.npz"
    ckpt = load_checkpoint(str(path))
    rnn_cfg = minitf.Config(vocab_size=ckpt.config.vocab_size, d_model=16, n_heads=2, d_ff=24, n_layers=1, arch="rnn")
    from minitf.architectures import build_model
    save_checkpoint(rnn, build_model(rnn_cfg), tokenizer=ckpt.tokenizer)
    r = subprocess.run([sys.executable, "-m", "minitf", "export", "--checkpoint", str(rnn), "--format", "marian", "--out",
                        "r"], cwd=str(tmp_path), capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=root))
    assert r.returncode != 0 and "only the Transformer exports" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_plot_attention_draws_an_imported_model(marian_folder, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from minitf.viz import plot_attention
    folder, _ = marian_folder
    plot_attention(str(folder), "the cat sees a dog", str(tmp_path / "a.png"), layer=0, head=1, beam_size=1)
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plot_attention(str(folder), "the cat", str(tmp_path / "b.png"), tgt="A DOG")   # --tgt through target.spm
    decoder_input = [line for line in capsys.readouterr().out.splitlines() if line.startswith("decoder input:")][-1]
    assert decoder_input.startswith("decoder input: <s> ▁") and "DOG" in decoder_input.replace(" ", "")


def test_export_never_replaces_what_an_earlier_export_did_not_write(tmp_path):
    # a run's folder as --out: CTranslate2's converter empties the folder it writes (shutil.rmtree with force=True),
    # which had deleted a run's checkpoints; Marian's model.npz had replaced the run's. Both are refused now, the
    # folder untouched; a folder of other files keeps them; an earlier export of the same kind is written again.
    from conftest import make_tiny_checkpoint
    from minitf.ctranslate2_export import export_ctranslate2
    from minitf.errors import ConfigError
    (tmp_path / "src").mkdir()
    path, _ = make_tiny_checkpoint(tmp_path / "src")
    run = tmp_path / "run"
    run.mkdir()
    for name in ("model.npz", "config.json", "checkpoint_0000010.npz"):
        (run / name).write_bytes(path.read_bytes() if name.endswith(".npz") else b"{}")
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    with pytest.raises(ConfigError, match=r"run holds config.json, and no CTranslate2 model minitf exported: .* "
                                          r"would replace it \(another model's files, or a run's folder\?\); name a "
                                          r"new or empty folder$"):
        export_ctranslate2(str(path), str(run))
    with pytest.raises(ConfigError, match=r"run holds model.npz, and no Marian model minitf exported"):
        export_marian(str(path), str(run))
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".minitf-")]    # no converter folder left
    for fmt, export, made in (("ct2", export_ctranslate2, "model.bin"), ("marian", export_marian, "decoder.yml")):
        out = tmp_path / fmt
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        export(str(path), str(out))
        export(str(path), str(out))                                  # written again over the earlier export
        assert (out / "notes.txt").read_text() == "mine" and (out / made).is_file()
    with pytest.raises(ConfigError, match="is a file; name the folder"):
        export_ctranslate2(str(path), str(run / "config.json"))
    # minitf writes CTranslate2's format but does not read it: said in one line, for the folder and its model.bin
    from minitf.cli import main
    for name in (tmp_path / "ct2", tmp_path / "ct2" / "model.bin"):
        with pytest.raises(CheckpointError, match=r"is a CTranslate2 model: minitf writes that format"):
            minitf.load(str(name))
        assert main(["info", str(name)]) == 2
        assert main(["export", "--format", "marian", "--checkpoint", str(name), "--out", str(tmp_path / "m2")]) == 2
    # a .safetensors file minitf did not export (another model's weights) had been replaced without a word; an earlier
    # export is written again; the Marian export's decoder.yml resolves its files beside itself, as OPUS-MT's does
    foreign = tmp_path / "hf.safetensors"
    from minitf.safetensors import save_safetensors
    save_safetensors(foreign, {"w": np.ones(3, dtype=np.float32)}, {"format": "pt"})
    before = foreign.read_bytes()
    assert main(["export", "--checkpoint", str(path), "--output", str(foreign)]) == 2 and foreign.read_bytes() == before
    ours = tmp_path / "ours.safetensors"
    assert main(["export", "--checkpoint", str(path), "--output", str(ours)]) == 0
    assert main(["export", "--checkpoint", str(path), "--output", str(ours)]) == 0
    assert load_yaml((tmp_path / "marian" / "decoder.yml").read_text())["relative-paths"] is True


def test_the_marian_export_records_the_models_length_penalty(tmp_path):
    # decoder.yml's normalize is Marian's length penalty: the model's own (small: 2.0), not a fixed 0.6
    from minitf.marian import load_yaml
    (tmp_path / "src").mkdir()
    from conftest import make_tiny_checkpoint
    path, _ = make_tiny_checkpoint(tmp_path / "src")
    c = load_checkpoint(path)
    save_checkpoint(tmp_path / "a2.npz", params=c.params, tokenizer=c.tokenizer,
                    config=minitf.Config(**{**c.config.to_dict(), "decode_alpha": 2.0}))
    export_marian(str(tmp_path / "a2.npz"), str(tmp_path / "mar"))
    assert load_yaml((tmp_path / "mar" / "decoder.yml").read_text())["normalize"] == 2.0
    # ... and read back, the model searches with it (it had searched with 0.6: other translations than the .npz's)
    assert minitf.load(str(tmp_path / "mar")).model.cfg.decode_alpha == 2.0
    decoder = tmp_path / "mar" / "decoder.yml"
    for normalize, alpha in (("1", 1.0), ("-1", 0.6), ("yes", 0.6)):   # outside minitf's range, or no number: 0.6
        decoder.write_text(decoder.read_text().replace(f"normalize: {load_yaml(decoder.read_text())['normalize']}",
                                                       f"normalize: {normalize}"))
        assert minitf.load(str(tmp_path / "mar")).model.cfg.decode_alpha == alpha


def test_a_marian_folder_exports_to_ctranslate2_exactly_and_the_stock_converters_start_is_said(trained, marian_folder,
                                                                                                 tmp_path, capsys):
    # CTranslate2's own Marian converters start the decoder from a zero vector: a minitf model's Marian export (which
    # starts from <s>'s embedding) translated otherwise through them, and export had pointed there for a Marian
    # folder. export --format ctranslate2 now reads a Marian folder (minitf's export or OPUS-MT's) as minitf reads
    # it; --format marian says where the start differs
    from minitf.cli import main
    from ctranslate2.converters import OpusMTConverter
    path, _ = trained
    assert main(["export", "--format", "marian", "--checkpoint", str(path), "--out", str(tmp_path / "m")]) == 0
    assert "start the decoder from a zero vector, this model from <s>'s embedding" in capsys.readouterr().err
    for name, source in (("from_ckpt", path), ("from_marian", tmp_path / "m")):
        assert main(["export", "--format", "ctranslate2", "--checkpoint", str(source), "--out", str(tmp_path / name)]) == 0
    t = minitf.load(str(path))
    src = [[t.tokenizer.id_to_piece(i) for i in s] for s in t.tokenizer.encode(sentences(20, 11))]
    options = dict(beam_size=4, max_decoding_length=40, min_decoding_length=1, length_penalty=0.0)
    via_ckpt = [r.hypotheses[0] for r in ct2.Translator(str(tmp_path / "from_ckpt")).translate_batch(src, **options)]
    via_marian = [r.hypotheses[0] for r in ct2.Translator(str(tmp_path / "from_marian")).translate_batch(src, **options)]
    assert via_marian == via_ckpt
    OpusMTConverter(str(tmp_path / "m")).convert(str(tmp_path / "stock"))   # what the note warns of: another start
    stock = [r.hypotheses[0] for r in ct2.Translator(str(tmp_path / "stock")).translate_batch(src, **options)]
    assert stock != via_ckpt
    # an OPUS-MT folder (a zero start): minitf's conversion translates as the stock converter's, and no note
    folder, _ = marian_folder
    OpusMTConverter(str(folder)).convert(str(tmp_path / "opus_stock"))
    assert main(["export", "--format", "ctranslate2", "--checkpoint", str(folder), "--out", str(tmp_path / "opus_ours")]) == 0
    assert main(["export", "--format", "marian", "--checkpoint", str(folder), "--out", str(tmp_path / "opus_m")]) == 0
    assert "zero vector" not in capsys.readouterr().err
    u = minitf.load(str(folder))
    src = [[u.tokenizer.id_to_piece(i) for i in s] for s in u.tokenizer.encode(sentences(20, 12))]
    options = dict(beam_size=1, max_decoding_length=10, min_decoding_length=1)
    ours = [r.hypotheses[0] for r in ct2.Translator(str(tmp_path / "opus_ours")).translate_batch(src, **options)]
    theirs = [r.hypotheses[0] for r in ct2.Translator(str(tmp_path / "opus_stock")).translate_batch(src, **options)]
    assert ours == theirs


def test_an_export_never_replaces_another_models_files(trained, marian_folder, tmp_path):
    # an export into an OPUS-MT folder had replaced its decoder.yml, source.spm and target.spm (any decoder.yml counted
    # as an earlier export), leaving its .npz beside another model's tokenizer; into another converter's CTranslate2
    # folder, its model.bin. Refused now, the folder untouched; minitf's own exports are written again
    from ctranslate2.converters import OpusMTConverter
    from minitf.ctranslate2_export import export_ctranslate2
    from minitf.errors import ConfigError
    path, _ = trained
    folder, _ = marian_folder
    opus = tmp_path / "opus"
    shutil.copytree(folder, opus)
    OpusMTConverter(str(folder)).convert(str(tmp_path / "ct2"))
    for out, export in ((opus, export_marian), (tmp_path / "ct2", export_ctranslate2)):
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        with pytest.raises(ConfigError, match=r"minitf exported: writing .* \(another model's files, or a run's folder\?\)"):
            export(str(path), str(out))
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    for name, export in (("m", export_marian), ("c", export_ctranslate2)):
        export(str(path), str(tmp_path / name))
        export(str(path), str(tmp_path / name))


def test_a_marian_export_keeps_its_languages_and_its_npz_alone_searches_as_the_folder(tmp_path, capsys):
    # the .npz of a Marian folder, named alone, had searched with alpha 0.6 where the folder's decoder.yml gives the
    # model's; the export had dropped the language pair (info showed none, evaluate skipped the paper's BLEU); an
    # empty model.npz had been a traceback (EOFError)
    from minitf.cli import main
    from minitf.modelinfo import model_facts
    from conftest import make_tiny_checkpoint
    (tmp_path / "src").mkdir()
    ckpt, _ = make_tiny_checkpoint(tmp_path / "src")
    c = load_checkpoint(ckpt)
    save_checkpoint(tmp_path / "a2.npz", params=c.params, tokenizer=c.tokenizer,
                    config=minitf.Config(**{**c.config.to_dict(), "decode_alpha": 2.0}),
                    train_state={"languages": ["en", "de"]})
    export_marian(str(tmp_path / "a2.npz"), str(tmp_path / "mar"))
    assert minitf.load(str(tmp_path / "mar" / "model.npz")).model.cfg.decode_alpha == 2.0
    for name in ("mar", "mar/model.npz"):
        assert model_facts(str(tmp_path / name))["languages"] == ["en", "de"]
    assert minitf.load(str(tmp_path / "mar")).languages == ["en", "de"]
    (tmp_path / "other").mkdir()
    shutil.copy(tmp_path / "mar" / "model.npz", tmp_path / "other" / "model.npz")
    (tmp_path / "other" / "decoder.yml").write_text("models: [another.npz]\nvocabs: [v.yml]\nnormalize: 1.0\n")
    shutil.copy(tmp_path / "mar" / "vocab.yml", tmp_path / "other" / "vocab.yml")
    for name in ("source.spm", "target.spm"):
        shutil.copy(tmp_path / "mar" / name, tmp_path / "other" / name)
    assert minitf.load(str(tmp_path / "other" / "model.npz")).model.cfg.decode_alpha == 0.6   # not its decoder.yml
    (tmp_path / "other" / "decoder.yml").unlink()            # two Marian .npz files and nothing to say which
    shutil.copy(tmp_path / "other" / "model.npz", tmp_path / "other" / "second.npz")
    with pytest.raises(CheckpointError, match=r"a Marian model folder holds decoder.yml or one .npz file, found 2"):
        minitf.load(str(tmp_path / "other"))
    assert main(["export", "--format", "marian", "--checkpoint", str(tmp_path / "other"), "--out",
                 str(tmp_path / "again")]) == 2      # the export reads it as translate does: the same line
    assert "holds decoder.yml or one .npz file, found 2" in capsys.readouterr().err
    (tmp_path / "mar" / "model.npz").write_bytes(b"")
    assert main(["info", str(tmp_path / "mar")]) == 2
    err = capsys.readouterr().err
    assert "model.npz: not a readable .npz file" in err and "Traceback" not in err


def test_a_tokenizer_with_other_special_piece_names_is_refused_by_the_marian_and_ctranslate2_exports(tmp_path):
    """SentencePiece lets a model name its specials [PAD], [UNK], [CLS], [SEP] at minitf's ids: training and the
    .safetensors export take it; the Marian export had written a folder minitf itself could not read back ('no </s>
    piece') and the CTranslate2 one a model that translated [PAD] [PAD] ...: both are refused in one line."""
    import sentencepiece as spm
    from minitf.cli import main
    from conftest import make_tiny_checkpoint
    (tmp_path / "src").mkdir()
    path, lines = make_tiny_checkpoint(tmp_path / "src")
    c = load_checkpoint(path)
    (tmp_path / "text").write_text("\n".join(lines) + "\n")
    spm.SentencePieceTrainer.train(input=str(tmp_path / "text"), model_prefix=str(tmp_path / "named"),
                                   vocab_size=c.config.vocab_size, pad_id=0, unk_id=1, bos_id=2, eos_id=3,
                                   pad_piece="[PAD]", unk_piece="[UNK]", bos_piece="[CLS]", eos_piece="[SEP]",
                                   hard_vocab_limit=False, minloglevel=100)
    tok = Tokenizer(str(tmp_path / "named.model"))
    assert tok.id_to_piece(3) == "[SEP]"
    cfg = minitf.Config(**{**c.config.to_dict(), "vocab_size": tok.vocab_size})
    save_checkpoint(tmp_path / "named.npz", minitf.Transformer(cfg, seed=0), tokenizer=tok.to_bytes())
    for fmt in ("marian", "ctranslate2"):
        assert main(["export", "--checkpoint", str(tmp_path / "named.npz"), "--format", fmt,
                     "--out", str(tmp_path / fmt)]) == 2
        assert not (tmp_path / fmt).exists() or not os.listdir(tmp_path / fmt)
    assert main(["export", "--checkpoint", str(tmp_path / "named.npz"), "--format", "safetensors",
                 "--output", str(tmp_path / "named.safetensors")]) == 0


def test_a_translation_kept_beside_a_marian_folder_is_made_from_its_model_files(marian_folder, tmp_path):
    # translate --output's FILE.partial is keyed by the files the model is read from: a file written into the folder
    # (the output and its FILE.partial themselves, a log) leaves the key, a vocabulary saved again changes it; the
    # folder's .npz named alone reads the same files
    import shutil
    from minitf.partial_output import model_files, run_key
    folder = tmp_path / "opus"
    shutil.copytree(marian_folder[0], folder)
    key = run_key(str(folder), ["a line"], {"beam": 4})
    (folder / "out.txt").write_text("x\n")
    (folder / "out.txt.partial").write_text("x\n")
    assert run_key(str(folder), ["a line"], {"beam": 4}) == key
    assert run_key(str(folder), ["another line"], {"beam": 4}) != key != run_key(str(folder), ["a line"], {"beam": 5})
    npz = [f for f in model_files(str(folder)) if f.endswith(".npz")]
    assert len(npz) == 1 and {os.path.basename(f) for f in model_files(npz[0])} >= {"source.spm", "target.spm"}
    spm = folder / "source.spm"
    os.utime(spm, ns=(spm.stat().st_atime_ns, spm.stat().st_mtime_ns + 1_000_000_000))
    assert run_key(str(folder), ["a line"], {"beam": 4}) != key


def test_an_export_onto_a_pipe_or_a_link_to_one_is_refused_and_nothing_there_is_replaced(tmp_path, capsys):
    # a .safetensors export is written whole and renamed over its path: over a pipe it had left a regular file in the
    # pipe's place, and through a link to /dev/null it had replaced /dev/null itself with the model (as root)
    from conftest import make_tiny_checkpoint
    from minitf.cli import main
    from minitf.fileio import WriteFailed, atomic_write_bytes, not_a_regular_file
    (tmp_path / "src").mkdir()
    path, _ = make_tiny_checkpoint(tmp_path / "src")
    fifo, link = tmp_path / "f.safetensors", tmp_path / "l.safetensors"
    os.mkfifo(fifo)
    link.symlink_to(fifo)
    for out, said in ((fifo, "is a pipe"), (link, f"is a link to {fifo}, a pipe")):
        capsys.readouterr()
        assert main(["export", "--checkpoint", str(path), "--output", str(out)]) == 2
        assert f"--output {out} {said}: an export is a file of its own" in capsys.readouterr().err
        assert fifo.is_fifo() and link.is_symlink()
        with pytest.raises(WriteFailed, match=r"a file written whole is renamed over the one there"):
            atomic_write_bytes(str(out), b"x")                # (every writer of whole files: the average, the plots)
        assert fifo.is_fifo() and link.is_symlink() and os.readlink(link) == str(fifo)
    assert not_a_regular_file(os.devnull) == "a device" and not_a_regular_file(str(tmp_path)) is None
    assert not_a_regular_file(str(tmp_path / "new")) is None and not_a_regular_file(str(path)) is None
    assert main(["export", "--checkpoint", str(path), "--output", str(tmp_path / "ok.safetensors")]) == 0
