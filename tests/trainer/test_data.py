"""Offline data: text (byte-level) and uint16 token files, deterministic batches, the train/val split."""

import numpy as np
import pytest
import torch

from fp8mon.trainer.data import CORPUS, TokenData, decode, encode, load_tokens


def test_built_in_corpus_is_small_utf8_text_and_the_default():
    raw = CORPUS.read_bytes()
    assert 100_000 < len(raw) < 1_000_000
    text = raw.decode("utf-8")
    assert "Macbeth" in text or "MACBETH" in text
    tokens = load_tokens()
    assert tokens.dtype == np.uint8 and len(tokens) == len(raw) and bytes(tokens[:64]) == raw[:64]
    data = TokenData(tokens)
    assert data.vocab_size == 256


def test_byte_level_tokenizer_round_trips_utf8():
    text = "Fair is foul — and foul is fair: naïve 🜲 ∑"
    ids = encode(text)
    assert ids.dtype == np.uint8 and len(ids) == len(text.encode("utf-8"))
    assert decode(ids) == text


def test_text_file_and_uint16_token_file(tmp_path):
    text_file = tmp_path / "doc.txt"
    text_file.write_text("héllo wörld " * 50, encoding="utf-8")
    data = TokenData.from_path(text_file)
    assert data.vocab_size == 256 and bytes(data.tokens) == text_file.read_bytes()

    ids = np.arange(5000, dtype=np.uint16) * 10 + 7  # max 49997 -> vocab 49998 -> 50048 (multiple of 64)
    bin_file = tmp_path / "tokens.bin"
    ids.tofile(bin_file)
    data = TokenData.from_path(bin_file, val_fraction=0.2)
    assert data.tokens.dtype == np.uint16 and np.array_equal(data.tokens, ids)
    assert data.vocab_size == 50048
    assert TokenData.from_path(bin_file, vocab_size=50304).vocab_size == 50304
    x, y = data.batch("train", 4, 16, seed=0, step=0)
    assert x.dtype == torch.int64 and x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row in x:  # contiguous windows of the stream
        start = int((row[0] - 7) // 10)
        assert torch.equal(row, torch.from_numpy(ids[start:start + 16].astype(np.int64)))
    # an odd-sized token file and an empty file are refused
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"abc")
    with pytest.raises(ValueError, match="even size"):
        load_tokens(odd)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_tokens(empty)


def test_batches_are_deterministic_per_seed_step_and_index_and_splits_are_disjoint():
    tokens = np.arange(10_000, dtype=np.uint16) % 60000
    data = TokenData(tokens, val_fraction=0.1)
    assert len(data.splits["train"]) == 9000 and len(data.splits["val"]) == 1000
    a = data.batch("train", 8, 32, seed=1, step=5, index=2)
    b = data.batch("train", 8, 32, seed=1, step=5, index=2)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    for other in (dict(seed=2, step=5, index=2), dict(seed=1, step=6, index=2), dict(seed=1, step=5, index=3)):
        assert not torch.equal(data.batch("train", 8, 32, **other)[0], a[0])
    tr = torch.cat([data.batch("train", 16, 32, seed=0, step=s)[1] for s in range(20)])
    va = torch.cat([data.batch("val", 16, 32, seed=0, step=s)[1] for s in range(20)])
    assert tr.max() < 9000 and va.min() >= 9000  # targets included: no window crosses the split
    with pytest.raises(ValueError, match="fewer than seq_len"):
        data.batch("val", 1, 1000, seed=0, step=0)
