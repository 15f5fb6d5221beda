"""fp8mon's trainer: a decoder-only LM (llama or FOG-strong) that trains in FP8, bf16 or fp32.

    config.py      named model shapes (tiny, 124m, 1.5b)
    layers.py      RoPE, attention, SwiGLU, xIELU (the math of the blocks)
    model.py       the Transformer: a llama or a FOG block per layer, each forward the block's math
    parts.py       the factory of a block's parts (linears by precision, fused modules)
    fused.py       the drop-in modules of the fused kernels: RMSNorm, residual add, RoPE, heads, SwiGLU
    reporting.py   the one protocol by which a module that computes a watched tensor gives the agent its row
    torch_ops.py   the torch references of the fused kernels (the CPU path)
    weight_rows.py the weights' rows of a reporting step in one launch
    data.py        offline data: text (byte-level) or uint16 token files; the built-in corpus
    train.py       the training loop: ``python -m fp8mon.trainer.train`` / ``fp8mon train``
    fp8_linear.py  the FP8 linear layer; kernels/ its Triton kernels

Importing the package imports nothing (no torch): ``fp8mon serve`` stays light.
"""
