"""Teacher-forced fidelity: one continuation fed to both sides of a kernel pair, scored per position.

llama.cpp's ``llama-perplexity --kl-divergence`` and the KV-quantization papers (KIVI,
KVQuant) score a fixed text under the base and the compressed model. Here the text is a
continuation of a document's prompt and the two models are the two sides of a kernel pair
(:class:`kvdiverge.engine.llm.llm_pair.LLMKernelPair` or
:class:`kvdiverge.engine.llm.decode_pair.DecodeTimePair`): the prompt caches are built
exactly as the coupled run builds them (the same prefill, press, kept-count check and RoPE
positions), then the continuation ``c_1 .. c_L`` is appended to *both* sides, and position
``i`` compares ``P(. | prompt, c_<i)`` with ``Q(. | prompt, c_<i)``.

How the continuation enters:

- **Prefill-only presses** (the press acts once, on the prompt): ``c_1 .. c_{L-1}`` in one
  forward per side (:meth:`~kvdiverge.engine.llm.llm_pair.LLMKernelPair.advance_block`),
  the first position's distributions being the prefill's own. Equal to feeding token by
  token up to float rounding (a test). The reference side is the same for every policy of
  a document: :func:`forced_log_probs` takes it from an earlier pair (``reference``), so
  each further policy runs its evicted side only.
- **Head-wise masks** (AdaKV, PyramidKV, DMS, ...) go in the same one forward: the grouped
  attention takes the per-head masks as a boolean attention mask
  (:meth:`kvdiverge.engine.llm.masks.HeadMasks.block`), a masked key weighing exactly 0.
  Decoding masks them with kvpress's fake key, whose weight underflows to 0 for the one
  query it is searched for (its search over all of a block's queries can fail).
- **A sliding window** (:class:`~kvdiverge.engine.presses.window.SlidingWindowPress`, in the
  :class:`~kvdiverge.engine.llm.decode_pair.DecodeTimePair`): also in one forward, its
  attention mask the band each token sees when stepped (sinks and the ``K - n_sink``
  positions before it: :meth:`~kvdiverge.engine.presses.window.SlidingWindowPress.block_mask`),
  equal to stepping up to float rounding (a test).
- **Other decode-time presses and quantized caches** (:class:`~kvdiverge.engine.llm.decode_pair.DecodeTimePair`): token by token,
  as decoding runs them: their state at a step (a counter, a buffer, a residual) follows the steps before. A quantized cache (``transformers``' ``QuantizedLayer``) then
  holds the continuation's keys and values exactly as decoding would: the prompt
  quantized before the first continuation token, the newest ``residual_length`` tokens in
  full precision, and the whole cache re-quantized each time the residual fills (a flush).
  One forward over the continuation would instead keep all ``L`` tokens in full precision
  until the next update, which no decoding step sees.

Per position the values are computed at temperature 1 on the raw logits, as llama.cpp
does (the pair is built with ``temperature=1, top_p=1``; its decoding transform is then a
float64 ``log_softmax`` of the logits): ``KL(P || Q)`` in nats, ``Δp = Q(c_i) - P(c_i)``,
whether both rank the same token first, and both log-likelihoods ``log P(c_i)``,
``log Q(c_i)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvdiverge.engine.core.sampling import Decoding, Sampling
from kvdiverge.engine.hf import DynamicCache
from kvdiverge.estimation.key_tokens import KeyTokens

__all__ = [
    "DEFAULT_LENGTH",
    "TARGETS",
    "Forced",
    "TeacherForcing",
    "forced_log_probs",
    "forced_pass",
    "greedy_continuation",
    "position_measures",
    "short_log_probs",
]


#: Continuation tokens per document by default: on the embedded default's documents the mean KLD's
#: document-bootstrap interval at 64 tokens is at most 1.5x as wide as at 128 (as wide for SnapKV
#: at 50 %) for 73 % of the pass's CPU time; at 32 it is up to 2.9x as wide, and it misses the
#: divergences that start later (docs/benchmarks.md, "The teacher-forced pass").
DEFAULT_LENGTH = 64

#: What the pass scores: the tokens that follow the prompt, or the prompt's own text repeated after an instruction.
TARGETS = ("continuation", "reconstruction")


@dataclass(frozen=True)
class TeacherForcing:
    """Settings of the teacher-forced pass.

    Parameters
    ----------
    length : int
        Tokens scored per document (default :data:`DEFAULT_LENGTH`): the continuation's first ``length``,
        or the first ``length`` of the prompt's text (``target="reconstruction"``); cut to what the context
        leaves after the prompt.
    block : bool
        Feed the continuation in one forward where the press allows it (default); ``False``
        steps token by token everywhere (for comparison).
    target : str
        One of :data:`TARGETS`: ``"continuation"`` (default) or ``"reconstruction"`` (the prompt's text
        after a repeat instruction, KVzip's context reconstruction; the caller builds the tokens).
    key : kvdiverge.estimation.key_tokens.KeyTokens or None
        LongPPL's key-token rule and short context: a forward of the full-cache model on the prompt's
        last ``key.short`` tokens per document, and the ``ll_short`` and ``key`` columns; None: neither.

    Raises
    ------
    ValueError
        If ``length`` is not an integer >= 1, or ``target`` not one of :data:`TARGETS`.
    """

    length: int = DEFAULT_LENGTH
    block: bool = True
    target: str = "continuation"
    key: KeyTokens | None = None

    def __post_init__(self) -> None:
        if isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 1:
            raise ValueError(f"teacher_forced.length must be an integer >= 1, got {self.length!r}")
        if self.target not in TARGETS:
            raise ValueError(f"teacher_forced.target must be one of {', '.join(TARGETS)}, got {self.target!r}")

    def sampling(self, seed: int, model_name: str, eos_ids: Sequence[int]) -> Sampling:
        """The pass's settings for the pairs: ``T = length``, one replicate, the decoding transform off
        (:class:`kvdiverge.engine.core.sampling.Decoding`'s neutral values: the raw logits' log-softmax,
        as llama.cpp scores), ``seed`` and ``model_name`` for the names and the noise floor's permutations,
        ``eos_ids`` for the pairs' stops."""
        return Sampling(T=self.length, replicates=1, decoding=Decoding(eos_ids=tuple(eos_ids)), seed=int(seed),
                        model_name=model_name)  # fmt: skip


def position_measures(logp: torch.Tensor, logq: torch.Tensor, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-position KL, Δp, top-1 agreement and log-likelihoods of two log-distributions.

    Parameters
    ----------
    logp, logq : torch.Tensor
        Reference and compressed log-probabilities, (L, V), float64 (any float dtype).
    tokens : torch.Tensor
        int64 (L,): the fed token at each position.

    Returns
    -------
    dict of str to torch.Tensor
        Each (L,): ``kld`` = ``sum_v P(v) (log P(v) - log Q(v))`` (nats; terms with
        ``P(v) = 0`` count 0, as in llama.cpp's sum), ``delta_p`` = ``Q(c) - P(c)``,
        ``ll_ref`` = ``log P(c)``, ``ll_ev`` = ``log Q(c)``, ``top_ref`` / ``top_ev`` (int64,
        the first arg-max), ``same_top`` (bool).
    """
    tokens = tokens.to(logp.device).view(-1, 1)
    p = logp.exp()
    kld = torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(-1)
    ll_ref, ll_ev = logp.gather(-1, tokens)[:, 0], logq.gather(-1, tokens)[:, 0]
    top_ref, top_ev = logp.argmax(-1), logq.argmax(-1)
    return {
        "kld": kld,
        "delta_p": ll_ev.exp() - ll_ref.exp(),
        "ll_ref": ll_ref,
        "ll_ev": ll_ev,
        "top_ref": top_ref,
        "top_ev": top_ev,
        "same_top": top_ref == top_ev,
    }


@torch.inference_mode()
def forced_pass(pair, tokens: Sequence[int], forcing: TeacherForcing) -> tuple[dict[str, torch.Tensor], bool]:
    """Feed ``tokens`` to both sides of a one-document pair after its prefill; score every position.

    Parameters
    ----------
    pair : LLMKernelPair or DecodeTimePair
        One document, not started, built with ``temperature=1.0`` and ``top_p=1.0``.
    tokens : sequence of int
        The continuation ``c_1 .. c_L`` (L >= 1).
    forcing : TeacherForcing
        ``block``: one forward where the press allows it (see the module).

    Returns
    -------
    (dict of str to torch.Tensor, bool)
        :func:`position_measures` of the ``L`` positions, on the CPU; and whether the
        continuation went in one forward.

    Raises
    ------
    ValueError
        If ``tokens`` is empty or the pair holds more than one document.
    """
    ids = torch.as_tensor(list(tokens), dtype=torch.long, device=pair.device)
    forced = forced_log_probs(pair, ids, forcing)
    return {k: v.cpu() for k, v in position_measures(forced.logp, forced.logq, ids).items()}, forced.one_forward


@dataclass(frozen=True)
class Forced:
    """The two sides' log-distributions over a fed continuation (:func:`forced_log_probs`).

    Attributes
    ----------
    logp, logq : torch.Tensor
        Reference and evicted log-probabilities, (L, vocab), float64, on the pair's device.
    one_forward : bool
        The evicted side took the continuation in one forward.
    shareable : bool
        ``logp`` came from a one-forward pass on the reference model with the sides apart,
        so another policy's pair of the same document can take it as its ``reference``
        (its own reference side would compute the same values, bit for bit).
    """

    logp: torch.Tensor
    logq: torch.Tensor
    one_forward: bool
    shareable: bool


@torch.inference_mode()
def forced_log_probs(pair, ids: torch.Tensor, forcing: TeacherForcing, reference: torch.Tensor | None = None) -> Forced:
    """Both sides' log-distributions at every position of a continuation fed after the prefill.

    Parameters
    ----------
    pair : LLMKernelPair or DecodeTimePair
        One document, not started, built with ``temperature=1.0`` and ``top_p=1.0``; an
        :class:`~kvdiverge.engine.llm.llm_pair.LLMKernelPair` built with ``joint=False``
        can take a ``reference``.
    ids : torch.Tensor
        int64 (L,): the continuation ``c_1 .. c_L`` (L >= 1).
    forcing : TeacherForcing
        ``block``: one forward where the press allows it (see the module).
    reference : torch.Tensor, optional
        ``logp`` of a :class:`Forced` with ``shareable`` from another pair of the same
        document, prompt and continuation: the reference side is then not run again
        (used only where this pair runs the continuation in one forward with its sides apart).

    Returns
    -------
    Forced

    Raises
    ------
    ValueError
        If ``ids`` is empty or the pair holds more than one document.
    """
    if not ids.numel():
        raise ValueError("teacher-forced pass: the continuation is empty")
    if pair.n_documents != 1:
        raise ValueError(f"teacher-forced pass: one document per pair, got {pair.n_documents}")
    logp1, logq1 = pair.start(1)
    block = forcing.block and getattr(pair, "block_forward", False) and ids.numel() > 1
    if not block:
        steps = [(logp1, logq1)] + [pair.advance(t.view(1), t.view(1)) for t in ids[:-1]]
        return Forced(torch.cat([s[0] for s in steps]), torch.cat([s[1] for s in steps]), False, False)
    apart = not getattr(pair, "joint", True)
    if reference is not None and apart:
        _, lq = pair.advance_block(ids[:-1].unsqueeze(0), reference=False)
        return Forced(reference, torch.cat([logq1, lq[0]]), True, True)
    lp, lq = pair.advance_block(ids[:-1].unsqueeze(0))
    return Forced(torch.cat([logp1, lp[0]]), torch.cat([logq1, lq[0]]), True, apart)


@torch.inference_mode()
def greedy_continuation(model, input_ids: Sequence[int], length: int, eos_ids: Sequence[int] = ()) -> list[int]:
    """The full-cache model's greedy continuation of a prompt: at most ``length`` tokens, up to the first EOS.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The reference model (no press entered).
    input_ids : sequence of int
        The prompt.
    length : int
        Most tokens generated.
    eos_ids : sequence of int
        Generation stops after the first of these (it is kept).

    Returns
    -------
    list of int
        The arg-max tokens of the raw logits (first index on ties), one forward each.
    """
    device = next(model.parameters()).device
    cache, eos = DynamicCache(), {int(e) for e in eos_ids}
    ids = torch.as_tensor(list(input_ids), dtype=torch.long, device=device).unsqueeze(0)
    out: list[int] = []
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    while len(out) < int(length):
        tok = int(logits.argmax())
        out.append(tok)
        if tok in eos or len(out) == int(length):
            break
        step = torch.tensor([[tok]], device=device)
        logits = model(input_ids=step, past_key_values=cache, use_cache=True).logits[0, -1]
    return out


@torch.inference_mode()
def short_log_probs(model, context: Sequence[int], fed: Sequence[int], scored: int) -> torch.Tensor:
    """The full-cache model's log-probability of the last ``scored`` fed tokens after a short context.

    One forward of ``model`` (no cache, no press) over ``context + fed[:-1]``: the short-context
    reference of LongPPL's key tokens (:mod:`kvdiverge.estimation.key_tokens`), with ``context``
    the prompt's last tokens and ``fed`` what the teacher-forced pass feeds after the prompt.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The reference model (no press entered).
    context : sequence of int
        The short context (at least 1 token).
    fed : sequence of int
        The tokens fed after it (at least ``scored``).
    scored : int
        How many of the last fed tokens to score (>= 1).

    Returns
    -------
    torch.Tensor
        float64 (scored,) on the CPU: ``log P(fed[j] | context, fed[:j])`` for the last ``scored``
        ``j``, from the float64 ``log_softmax`` of the raw logits (as the pass's).
    """
    device = next(model.parameters()).device
    ids = torch.as_tensor([*context, *fed][:-1], dtype=torch.long, device=device).unsqueeze(0)
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=int(scored)).logits[0, -int(scored) :]
    tokens = torch.as_tensor(list(fed)[-int(scored) :], dtype=torch.long, device=device)
    return logits.double().log_softmax(-1).gather(-1, tokens[:, None])[:, 0].cpu()
