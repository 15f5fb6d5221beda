"""Offline data: a UTF-8 text file read as bytes (byte-level tokens, vocab 256) or a pre-tokenised
binary file of uint16 tokens (``.bin``/``.u16``, e.g. GPT-2 BPE ids), both memory-mapped. Default: the
built-in corpus (trainer/corpus/shakespeare.txt). Nothing is downloaded.

Batches are random windows, and deterministic: the window starts of micro-batch ``index`` at optimizer
step ``step`` come from a generator seeded with (seed, split, step, index). The data position is thus the
step number itself: resuming at step s draws exactly the batches an uninterrupted run draws. Under DDP
rank r takes indices r*grad_accum .. r*grad_accum + grad_accum - 1, so 2 ranks x 1 micro-batch see the same
data as 1 rank x 2 micro-batches.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

CORPUS = Path(__file__).resolve().parent / "corpus" / "shakespeare.txt"
TOKEN_SUFFIXES = (".bin", ".u16", ".tokens")


def load_tokens(path: str | Path | None = None, fmt: str = "auto") -> np.ndarray:
    """A read-only memmap of the token ids: uint8 (text: its UTF-8 bytes) or uint16 (token file)."""
    path = Path(path) if path else CORPUS
    if fmt == "auto":
        fmt = "u16" if path.suffix.lower() in TOKEN_SUFFIXES else "text"
    if fmt not in ("text", "u16"):
        raise ValueError("data format must be auto, text or u16")
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"{path} is empty")
    if fmt == "u16" and size % 2:
        raise ValueError(f"{path}: a uint16 token file has an even size, this one has {size} bytes")
    return np.memmap(path, dtype=np.uint8 if fmt == "text" else np.uint16, mode="r")


def encode(text: str) -> np.ndarray:
    """Byte-level tokenizer: the UTF-8 bytes."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens if 0 <= int(t) < 256).decode("utf-8", errors="replace")


class TokenData:
    """Train/validation split of one token stream: the last ``val_fraction`` is validation."""

    def __init__(self, tokens: np.ndarray, val_fraction: float = 0.1, vocab_size: int | None = None):
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError("val_fraction must be in [0, 1)")
        n_val = int(len(tokens) * val_fraction)
        self.tokens = tokens
        self.splits = {"train": tokens[: len(tokens) - n_val], "val": tokens[len(tokens) - n_val:]}
        self.vocab_size = vocab_size or self.infer_vocab_size(tokens)

    @classmethod
    def from_path(cls, path: str | Path | None = None, fmt: str = "auto", **kwargs) -> TokenData:
        return cls(load_tokens(path, fmt), **kwargs)

    @staticmethod
    def infer_vocab_size(tokens: np.ndarray) -> int:
        if tokens.dtype == np.uint8:
            return 256
        top = 0
        for i in range(0, len(tokens), 1 << 26):  # chunked: big memmaps stay out of RAM
            top = max(top, int(tokens[i:i + (1 << 26)].max()))
        return max(256, -(-(top + 1) // 64) * 64)  # next multiple of 64 (50257 -> 50304)

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, split: str, batch_size: int, seq_len: int, *, seed: int, step: int, index: int = 0,
              device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) int64 (batch_size, seq_len), y = x shifted by one token."""
        data = self.splits[split]
        if len(data) < seq_len + 1:
            raise ValueError(f"the {split} split has {len(data)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
        rng = np.random.default_rng([seed, 0 if split == "train" else 1, step, index])
        starts = rng.integers(0, len(data) - seq_len, size=batch_size)
        buf = torch.from_numpy(np.stack([np.asarray(data[s:s + seq_len + 1], dtype=np.int64) for s in starts]))
        device = torch.device(device)
        if device.type == "cuda":
            buf = buf.pin_memory().to(device, non_blocking=True)
        return buf[:, :-1], buf[:, 1:]
