"""Each press's status from its registry row: its test instance, measured or refused, the press table
of ``docs/presses.md``.

Built on :mod:`kvdiverge.engine.presses.registry` (the rows) and
:mod:`kvdiverge.engine.presses.policies` (building a press from a spec), which the registry itself
does not import. ``python -m kvdiverge.engine.presses.status`` prints that press table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvdiverge.engine.presses.adapters import walk
from kvdiverge.engine.presses.policies import press_from_spec, takes_ratio
from kvdiverge.engine.presses.registry import PRESS_CLASSES, ROWS, adapter_of, refusal

__all__ = ["press_table", "spec_refusal", "status", "test_spec"]


def status(name: str, model=None) -> str:
    """``"measured"`` or ``"refused"`` for the test instance of press ``name`` (:func:`test_spec`),
    on ``model`` if given."""
    return "refused" if spec_refusal(test_spec(name), model) else "measured"


def test_spec(name: str) -> dict[str, Any]:
    """The press matrix's test instance of press ``name``, as a policy entry (ratio 0.5 where it takes one)."""
    params = dict(ROWS[name].test_params)
    spec: dict[str, Any] = {"press": name, "params": params}
    if takes_ratio(name, params):
        spec["compression_ratio"] = 0.5
    return spec


def _spec_needs(spec: Mapping[str, Any]) -> list[str]:
    """Engine parts a press spec (and the specs it nests) uses: its rows' ``engine``, ``eager`` for
    attention weights, ``decode-time`` for eviction while generating."""
    needs: list[str] = []
    for node in walk(spec):
        row = adapter_of(node)
        needs += list(row.engine) + ["eager"] * bool(row.attentions) + ["decode-time"] * row.decodes(node)
    return needs


def spec_refusal(spec: Mapping[str, Any], model=None) -> str | None:
    """The refusal of a policy entry ``{"press", "params", "compression_ratio"}`` (:func:`~kvdiverge.engine.presses.registry.refusal` of its press)."""
    ratio = spec.get("compression_ratio")
    return refusal(
        press_from_spec(
            {"press": spec["press"], "params": spec.get("params") or {}}, ratio, owner=f"press {spec['press']!r}"
        ),
        model,
    )


def press_table() -> str:
    """The press table of ``docs/presses.md`` (markdown): every press, its status, what it needs or why it is refused."""
    lines = ["| press | status | needs / reason |", "|---|---|---|"]
    for name in sorted(ROWS):
        row, spec = ROWS[name], test_spec(name)
        reason = spec_refusal(spec)
        if reason is None:
            needs = sorted(set(_spec_needs(spec)))
            reason = (
                ", ".join(needs) + " engine"
                if needs
                else "keeps every position (noise-floor control)"
                if getattr(PRESS_CLASSES[name], "keeps_every_position", False)
                else "prefill eviction"
            )
        if row.global_rng:
            reason += (
                "; draws from torch's global random generator, which kvdiverge seeds per document prefill "
                "from (seed, model, document id)"
            )
        if row.required and reason != next(iter(row.required.values())):
            reason += "; refused without " + ", ".join(f"`{p}`" for p in row.required)
        if row.note:
            reason = reason.rstrip(".") + "; " + row.note
        lines.append(f"| {name} | {'refused' if spec_refusal(spec) else 'measured'} | {reason.replace('|', '/')} |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m kvdiverge.engine.presses.status: print the table
    print(press_table())
