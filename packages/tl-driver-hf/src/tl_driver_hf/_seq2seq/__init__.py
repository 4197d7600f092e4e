"""Encoder-decoders (T5, BART and their descendants) on the hf driver."""
