"""``prepare --tokenizer hf:DIR``: a Hugging Face tokenizer.json through the tokenizers
package, recorded whole in the dataset and the checkpoints. The tokenizer is trained
here on a few lines (nothing is downloaded); tests that run it are marked ``hf``."""

import base64
import sys
import zlib

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.data.dataset import TokenDataset
from hpctrain.data.prepare import prepare
from hpctrain.data.tokenizers import (MAX_TOKENIZER_JSON_BYTES, HFTokenizer,
                                      check_tokenizer_name, make_tokenizer,
                                      tokenizer_from_meta, tokenizer_identity)
from hpctrain.errors import DataError
from tests.helpers import cpu_world, save_tokenizer, TEXTS


@pytest.fixture
def corpus(tmp_path):
    paths = []
    for i, text in enumerate(TEXTS):
        paths.append(tmp_path / f"{i}.txt")
        paths[-1].write_text(text * 30)
    return [str(p) for p in paths]


@pytest.mark.hf
def test_prepare_with_a_hugging_face_tokenizer_records_it_whole(tmp_path, corpus):
    vocab = save_tokenizer(tmp_path / "model")
    s = prepare(corpus, tmp_path / "d.h5", tokenizer=f"hf:{tmp_path / 'model'}",
                show_progress=False)
    assert s["tokenizer"] == "hf" and s["vocab_size"] == vocab
    ds = TokenDataset(str(tmp_path / "d.h5"))
    tok = ds.tokenizer
    ids = ds.read("train", np.zeros(1, np.int64), 40)[0]
    ds.close()
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == vocab
    assert tok.decode(ids) == (TEXTS[0] * 30)[:len(tok.decode(ids))]  # the file's own text
    again = tokenizer_from_meta(tok.meta())  # what a checkpoint rebuilds
    text = "def point(x):\n    return 'é' <|end|>"
    assert again.decode(again.encode(text)) == text
    assert list(again.encode(text)) == list(make_tokenizer(f"hf:{tmp_path / 'model'}").encode(text))
    file = HFTokenizer.from_file(tmp_path / "model" / "tokenizer.json")  # the file itself
    assert file.meta() == tok.meta()  # the same file gives the same bytes
    assert tokenizer_identity(file.meta()) == tokenizer_identity(tok.meta())


@pytest.mark.hf
def test_a_run_on_it_samples_and_keeps_it_in_final_h5(tmp_path, corpus):
    from hpctrain.checkpoint.single_file import load_single_file
    from hpctrain.train.trainer import Trainer
    from tests.helpers import tiny_config

    vocab = save_tokenizer(tmp_path / "model")
    prepare(corpus, tmp_path / "d.h5", tokenizer=f"hf:{tmp_path / 'model'}", show_progress=False)
    cfg = tiny_config(tmp_path / "d.h5", tmp_path / "run", **{
        "train.max_iters": 2, "train.sample_tokens": 5, "train.save_checkpoint": True,
        "train.sample_prompt": "def "})
    Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False).fit()
    assert (tmp_path / "run" / "sample.txt").read_text().startswith("def ")
    meta = load_single_file(tmp_path / "run").tokenizer
    assert meta["name"] == "hf" and tokenizer_from_meta(meta).vocab_size == vocab


def test_a_missing_tokenizer_json_names_the_file(tmp_path):
    (tmp_path / "model").mkdir()  # a model directory without the file
    with pytest.raises(DataError, match=r"model/tokenizer.json does not exist; --tokenizer "
                                        r"hf:DIR reads DIR/tokenizer.json"):
        make_tokenizer(f"hf:{tmp_path / 'model'}")


def test_without_the_tokenizers_package_the_message_says_how_to_install(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails as if not installed
    with pytest.raises(DataError, match=r"need the tokenizers package: `pip install tokenizers`"):
        make_tokenizer(f"hf:{tmp_path}")


def test_a_damaged_record_is_refused(tmp_path):
    meta = HFTokenizer('{"not": "checked here"}', 10).meta()
    assert tokenizer_from_meta(meta).text == '{"not": "checked here"}'  # built lazily
    with pytest.raises(DataError, match="fails its sha256 check"):
        tokenizer_from_meta({**meta, "sha256": "0" * 64})
    with pytest.raises(DataError, match="is damaged"):
        tokenizer_from_meta({**meta, "json_zlib": "not base64!"})
    bomb = base64.b64encode(zlib.compress(b" " * (MAX_TOKENIZER_JSON_BYTES + 1))).decode()
    with pytest.raises(DataError, match="damaged .not one whole file of at most"):
        tokenizer_from_meta({**meta, "json_zlib": bomb})


@pytest.mark.parametrize("name", ["hf:", "hf", "sentencepiece"])
def test_tokenizer_names(name):
    with pytest.raises(DataError, match="choose one of byte, char, gpt2 or hf:DIR"):
        check_tokenizer_name(name)


@pytest.mark.hf
@pytest.mark.parametrize("special,separator", [("</s>", "the token"), ("<|end|>", "newline")])
def test_records_documents_follow_the_end_of_text_token_or_a_newline(tmp_path, special,
                                                                    separator):
    import json

    import h5py

    tk = pytest.importorskip("tokenizers")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(TEXTS, tk.trainers.BpeTrainer(
        vocab_size=280, special_tokens=[special],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet()))
    (tmp_path / "m").mkdir()
    tok.save(str(tmp_path / "m" / "tokenizer.json"))
    docs = [t[:60] for t in TEXTS] * 3
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare([tmp_path / "c.jsonl"], tmp_path / "d.h5", tokenizer=f"hf:{tmp_path / 'm'}",
            show_progress=False)
    with h5py.File(tmp_path / "d.h5", "r") as f:
        got = np.concatenate([f["train"][:], f["val"][:]]).tolist()
    sep = ([tok.token_to_id(special)] if separator == "the token"
           else tok.encode("\n", add_special_tokens=False).ids)
    assert got == [t for d in docs for t in sep + tok.encode(d, add_special_tokens=False).ids]
