"""The llama.cpp backend: KV cache types as policies, two llama.cpp contexts as a kernel pair."""
