"""llama.cpp's KV cache types with the Hadamard rotation on and off: teacher-forced mean KLD on four passages.

SmolLM2's embedded GGUF file, the first 24 tokens of each passage as the prompt, the next 32 forced
(:func:`kvdiverge.engine.llamacpp.pair.forced_kld`); prints each cache's KLD per passage and the ratio of
q4_0 without rotation to q4_0 with it (docs/results.md). Needs the llamacpp extra (make llamacpp).

    .venv/bin/python benchmarks/llamacpp_rotation_kld.py
"""

import os
import time

import numpy as np

from kvdiverge.engine.llamacpp.caches import parse_cache, require_llama_cpp
from kvdiverge.engine.llamacpp.context import load_model
from kvdiverge.engine.llamacpp.pair import forced_kld
from kvdiverge.models.embedded import EMBEDDED_MODEL
from kvdiverge.models.sources import resolve

TEXTS = [
    "The Constitution of the United States establishes three branches of government: the legislative, the executive and the judicial. Each branch has powers that check the others, so that no single part of the government can act alone. Congress writes the laws, the President carries them out, and the courts decide what they mean when people disagree.",
    "Photosynthesis is the process by which green plants use sunlight to turn water and carbon dioxide into sugar and oxygen. It takes place mostly in the leaves, inside small structures called chloroplasts, which contain the green pigment chlorophyll. Almost all life on Earth depends on it, directly or indirectly.",
    "In 1969 two astronauts walked on the surface of the Moon while a third orbited above them. They collected rocks, planted a flag and set up experiments, then returned safely to Earth after eight days. The mission was watched on television by hundreds of millions of people around the world.",
    "A good recipe for bread needs only flour, water, salt and yeast. Mix them into a dough, knead it until it is smooth, and let it rise in a warm place for an hour or two. Then shape the loaf, let it rise again, and bake it in a hot oven until the crust is brown and it sounds hollow when tapped.",
]


def main() -> None:
    """Print each cache's KLD per passage, the rotation's ratio and the seconds."""
    where, kwargs = resolve(EMBEDDED_MODEL)
    path = os.path.join(where, kwargs["gguf_file"])
    m = load_model(path)
    tok = require_llama_cpp().Llama(path, vocab_only=True, verbose=False)
    t0 = time.time()
    res = {}
    for spec in ("q8_0", "q8_0:norot", "q4_0", "q4_0:norot"):
        per = []
        for t in TEXTS:
            ids = tok.tokenize(t.encode())
            per.append(forced_kld(m, parse_cache(spec), ids[:24], ids[24:56], 2).mean())
        res[spec] = per
        print(spec, " ".join(f"{x:.4f}" for x in per), f"mean {np.mean(per):.4f}", flush=True)
    print("ratio q4_0 norot/rot per doc", np.array(res["q4_0:norot"]) / np.array(res["q4_0"]))
    print("seconds", time.time() - t0)


if __name__ == "__main__":
    main()
