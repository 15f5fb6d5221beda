"""fp8mon's trainer: a decoder-only LM (llama or FOG-strong) that trains in FP8, bf16 or fp32.

    config.py      named model shapes (tiny, 124m, 1.5b)
    layers.py      RMSNorm, RoPE, attention, SwiGLU, xIELU
    model.py       the Transformer (both architectures)
    data.py        offline data: text (byte-level) or uint16 token files; the built-in corpus
    train.py       the training loop: ``python -m fp8mon.trainer.train`` / ``fp8mon train``
    fp8_linear.py  the FP8 linear layer; kernels/ its Triton kernels

Importing the package imports nothing (no torch): ``fp8mon serve`` stays light.
"""
