"""The study: config, corpus, prompts, models, provenance, cost, devices, rule logging and
the workflow's shard job."""
