import pytest
from conftest import loaded, requires_models

from kvq.data import split_documents, token_windows
from kvq.errors import KvqError


def test_split_is_disjoint_and_fixed():
    docs = [f"doc{i}" for i in range(10)]
    eval_docs, calib_docs = split_documents(docs, "eval"), split_documents(docs, "calib")
    assert set(eval_docs).isdisjoint(calib_docs)
    assert sorted(eval_docs + calib_docs) == sorted(docs)


def test_local_text_file(tmp_path):
    class CharTokenizer:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) % 97 for c in text]}

    corpus = tmp_path / "t.txt"
    corpus.write_text("".join(f"line {i} of a small local corpus\n" for i in range(1000)))
    eval_w = token_windows(CharTokenizer(), str(corpus), seq_len=32, n_windows=4, split="eval")
    calib_w = token_windows(CharTokenizer(), str(corpus), seq_len=32, n_windows=4, split="calib")
    assert eval_w.shape == (4, 32) and calib_w.shape == (4, 32)
    assert not (eval_w == calib_w).all()
    with pytest.raises(KvqError, match="fewer than"):
        token_windows(CharTokenizer(), str(corpus), seq_len=4096, n_windows=100)


def test_unknown_corpus():
    with pytest.raises(KvqError, match="unknown corpus"):
        token_windows(None, "no/such/corpus")


@requires_models
def test_shakespeare_windows_deterministic_and_held_out():
    tokenizer = loaded("smollm2-135m").tokenizer
    a = token_windows(tokenizer, "shakespeare", 128, 3)
    b = token_windows(tokenizer, "shakespeare", 128, 3)
    calib = token_windows(tokenizer, "shakespeare", 128, 3, split="calib")
    assert a.equal(b)
    eval_rows = {tuple(r) for r in a.tolist()}
    assert all(tuple(r) not in eval_rows for r in calib.tolist())
