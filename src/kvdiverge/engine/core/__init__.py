"""The coupling core: coupling math, the decoding transform, kernel pairs, uniform streams and
the batched coupled run. Knows no press and no model cache."""
