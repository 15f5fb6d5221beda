"""Models fp8mon did not write, for bench/external.py: a nanoGPT-style GPT-2 (``gpt2``) and transformers' Llama
(``llama``)."""
