"""Checkpoints in and weights out: loading, transformers' load report as tl errors, HookedTransformer's weight shapes and folding."""
