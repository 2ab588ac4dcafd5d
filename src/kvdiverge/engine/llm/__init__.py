"""The LLM cache machinery: the evicted twin, per-row head masks, prefill, the prefill-time and
decode-time LLM pairs, and the batch planner."""
