"""Whole models: the decoder LM, the encoder-decoder, vision families, FLOPs accounting."""
