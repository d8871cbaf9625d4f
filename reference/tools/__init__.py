"""The programs: what llama.cpp's tools/ and examples/ do with the library.

Generation, batched and parallel decoding, speculative decoding, prompt lookup,
Self-Extend, passkey, perplexity and the server's scheduler. A program may import the
library (everything else under ``reference/``); the library never imports a program.
"""
