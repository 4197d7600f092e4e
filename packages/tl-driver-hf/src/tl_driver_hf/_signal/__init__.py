"""Models that read pixels or audio instead of tokens (ViT, DeiT, wav2vec2, HuBERT), served
at the residual stream of their block stack."""
