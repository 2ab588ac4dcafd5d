"""The engine: coupling math, decoding transform, kernel pairs, uniform streams, the batched
coupled run, the runner, the planner, presses and policies (torch, transformers, kvpress)."""
