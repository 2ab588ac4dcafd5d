"""The workflow config's JSON schema: package data, parsed once per file version.

The schema is ``kvdiverge/schemas/config.schema.yaml`` (:data:`SCHEMA_PATH`, found with
:mod:`importlib.resources`, so it is there in a wheel as in a checkout). :mod:`kvdiverge.config.workflow`
validates configs with it, and :mod:`kvdiverge.settings.checks` checks every door's settings against
its entries. Nothing here imports torch.
"""

from __future__ import annotations

import copy
import functools
import os
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from kvdiverge.engine.core.sampling import decoding_options  # torch-free: the engine packages import nothing
from kvdiverge.engine.llamacpp.caches import CACHE_TYPES

__all__ = ["SCHEMA_PATH", "load_schema"]

#: The config schema, package data of ``kvdiverge`` (a file in every install: checkout, editable
#: or wheel); the workflow validates with the same file.
SCHEMA_PATH = Path(str(resources.files("kvdiverge") / "schemas" / "config.schema.yaml"))


def load_schema(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Load the config JSON schema (YAML): a fresh copy, the file parsed once per version.

    Parsing the schema's YAML takes most of a validation's time (a hundred milliseconds), so
    the parsed schema is kept per path and modification time; each call returns its own copy.

    Raises
    ------
    FileNotFoundError
        If there is no schema at ``path`` (default: :data:`SCHEMA_PATH`, the package's).
    """
    path = Path(path) if path is not None else SCHEMA_PATH
    if not path.is_file():
        raise FileNotFoundError(f"config schema not found at {path}; pass the path of a config schema file")
    return copy.deepcopy(_parsed_schema(str(path.resolve()), path.stat().st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _parsed_schema(path: str, mtime_ns: int) -> dict[str, Any]:
    """The schema file ``path`` as parsed at modification time ``mtime_ns`` (cached), with each decoding
    setting's type and range from its :class:`~kvdiverge.engine.core.sampling.Decoding` field, and the
    llama.cpp cache types of a policy's ``type_k`` and ``type_v`` from
    :data:`kvdiverge.engine.llamacpp.caches.CACHE_TYPES`."""
    with open(path, encoding="utf-8") as fh:
        schema = yaml.load(fh, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    decoding = schema.get("properties", {}).get("decoding", {}).get("properties")
    if decoding is not None:  # each decoding setting's type and range: its Decoding field's
        for name, option in decoding_options().items():
            decoding[name] = {"description": option["help"], **decoding.get(name, {}), **option["schema"]}
    policy = schema.get("$defs", {}).get("policy", {}).get("properties", {})
    for key in ("type_k", "type_v"):  # llama.cpp's cache types: the engine's list
        if key in policy:
            policy[key]["enum"] = list(CACHE_TYPES)
    return schema
