"""The oracle engine: one document per kernel pair, the coupling on the CPU, one row at a time.

The unbatched path that the batched engine (:func:`kvdiverge.engine.core.coupled.run_batch`)
must reproduce: :func:`decode_log_probs` and :func:`nucleus` (the decoding transform),
``_CacheSide`` and :class:`LLMKernelPair` (a full and an evicted cache of one prompt, both
left unpadded), ``_absorb_eos`` and :func:`run_document` (the coupled chain, then the
residual branch, drawn from the same uniform streams). ``tests/test_batching.py`` checks
that a batched shard equals the shards of this engine, record for record. Its numerics are
the reference: it changes only together with a deliberate change of the engine's results.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvdiverge.engine.core.coupling import (
    inverse_cdf,
    maximal_coupling,
    overlap_draw,
    probabilities,
    residual_draws,
    total_variation,
)
from kvdiverge.engine.core.errors import CompressionError
from kvdiverge.engine.core.streams import PURPOSES, uniform_streams

if TYPE_CHECKING:
    from tqdm import tqdm

    from kvdiverge.engine.core.pairs import KernelPair


def decode_log_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Log-probabilities of the transformed next-token distribution.

    Parameters
    ----------
    logits : torch.Tensor
        Raw model logits, shape (B, V), any float dtype.
    temperature : float
        Softmax temperature; 0 means greedy (point mass on the arg-max, first index
        on ties, as ``torch.argmax`` and ``model.generate`` pick).
    top_p : float
        Nucleus mass in (0, 1]; keeps the smallest set of most likely tokens whose
        mass reaches ``top_p`` (always at least one token). 1 keeps all.

    Returns
    -------
    torch.Tensor
        Log-probabilities, float64, shape (B, V), ``-inf`` outside the support.

    Raises
    ------
    ValueError
        If ``temperature < 0`` or ``top_p`` is outside (0, 1].
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    logits = logits.to(torch.float64)
    if temperature == 0:
        out = torch.full_like(logits, float("-inf"))
        out.scatter_(-1, logits.argmax(-1, keepdim=True), 0.0)
        return out
    logp = torch.log_softmax(logits / temperature, dim=-1)
    if top_p < 1:
        logp = torch.log_softmax(logp.masked_fill(~nucleus(logp, top_p), float("-inf")), dim=-1)
    return logp


def nucleus(logp: torch.Tensor, top_p: float, candidates: int = 1024) -> torch.Tensor:
    """Tokens of the top-p nucleus: the most likely tokens until their mass reaches ``top_p``.

    A token is kept when the mass of the tokens ranked above it is below ``top_p``
    (so the most likely token is always kept), which is ``TopPLogitsWarper``'s rule.
    Only the ``candidates`` most likely tokens are ranked (``torch.topk``); rows whose
    candidates hold less than ``top_p`` of the mass fall back to a full sort, so the
    result is exact either way. Ranking the whole vocabulary costs ~10x more.

    Parameters
    ----------
    logp : torch.Tensor
        Log-probabilities, float64, shape (B, V).
    top_p : float
        Nucleus mass in (0, 1).
    candidates : int
        Tokens ranked before falling back to a full sort.

    Returns
    -------
    torch.Tensor
        Boolean mask of kept tokens, shape (B, V).
    """
    keep = torch.zeros_like(logp, dtype=torch.bool)
    rows = torch.arange(logp.shape[0], device=logp.device)
    for k in (min(candidates, logp.shape[-1]), logp.shape[-1]):
        top, order = logp[rows].topk(k, dim=-1, sorted=True)
        probs = top.exp()
        before = probs.cumsum(-1) - probs
        keep[rows] = keep[rows].scatter(-1, order, before < top_p)
        rows = rows[probs.sum(-1) < top_p]  # candidates too few: rank everything
        if rows.numel() == 0:
            break
    return keep


class _CacheSide:
    """A batched KV cache plus per-row bookkeeping.

    ``valid`` (n_rows, cache_len) marks the cache columns each row attends to;
    ``step`` (n_rows, cache_len) holds, for generated columns, the 0-based index of
    the generated token stored there (-1 for prompt columns), so ``rewind`` can mask
    a row's abandoned suffix without touching other rows.
    """

    def __init__(self, cache, valid: torch.Tensor, prompt_len: int):
        self.cache = cache
        self.valid = valid
        self.step = torch.full(valid.shape, -1, dtype=torch.long, device=valid.device)
        self.n_gen = torch.zeros(valid.shape[0], dtype=torch.long, device=valid.device)
        self.prompt_len = prompt_len
        self.all_valid = bool(valid.all())

    def forward(self, model, tokens: torch.Tensor) -> torch.Tensor:
        n_rows = tokens.shape[0]
        self.valid = torch.cat([self.valid, self.valid.new_ones(n_rows, 1)], dim=1)
        self.step = torch.cat([self.step, self.n_gen.unsqueeze(1)], dim=1)
        # RoPE positions continue from the *uncompressed* prompt length (estimators.md §1),
        # as kvpress's own pipeline does, whatever the cache length.
        position_ids = (self.prompt_len + self.n_gen).unsqueeze(1)
        out = model(
            input_ids=tokens.unsqueeze(1),
            past_key_values=self.cache,
            attention_mask=None if self.all_valid else self.valid.long(),
            position_ids=position_ids,
            use_cache=True,
        )
        self.n_gen += 1
        return out.logits[:, -1, :]

    def rewind(self, length: torch.Tensor) -> None:
        self.valid = self.valid & (self.step < length.unsqueeze(1))
        self.n_gen = length.clone()
        self.all_valid = bool(self.valid.all())


class LLMKernelPair:
    """One language model, two KV caches: full prompt cache (``P``) and evicted (``Q``).

    The evicted cache is the prompt prefilled under a kvpress press, which compresses
    each layer's cache once, during prefill (kvpress semantics: the prefill's own
    last-position logits use the full attention, so ``q_1 = p_1``; compression acts
    from the first generated token on). Generated tokens are appended to both caches
    and never evicted; their RoPE positions continue from the uncompressed prompt
    length on both sides. This is exactly what ``with press(model): model.generate(...)``
    and kvpress's pipeline do.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM supported by kvpress, in eval mode.
    input_ids : sequence of int
        The chat-rendered prompt, length ``prompt_len`` (tokens).
    press : kvpress.BasePress or None
        The eviction press; ``None`` leaves the evicted cache equal to the full one.
    temperature, top_p : float
        Decoding transform (:func:`kvdiverge.engine.core.decoding.decode_log_probs`).
    expected_kept : int or None
        Prompt positions every layer must keep after compression (tokens). Checked
        after prefill; ``None`` only checks that a compressing press shortened the cache.
    eos_ids : sequence of int or None
        End-of-sequence ids; defaults to ``model.generation_config.eos_token_id``.

    Raises
    ------
    CompressionError
        From :meth:`start`, when a layer's evicted cache length is not the policy's
        kept count (a silently skipped compression).
    """

    def __init__(
        self,
        model,
        input_ids: Sequence[int],
        press=None,
        *,
        temperature: float,
        top_p: float = 1.0,
        expected_kept: int | None = None,
        eos_ids: Sequence[int] | None = None,
    ):
        self.model = model
        self.device = next(model.parameters()).device
        self.input_ids = torch.as_tensor(list(input_ids), dtype=torch.long, device=self.device)
        self.prompt_len = int(self.input_ids.numel())
        self.press = press
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.expected_kept = expected_kept
        if eos_ids is None:
            from kvdiverge.engine.llm.pair_base import model_eos_ids

            eos_ids = model_eos_ids(model)
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self.vocab_size = int(model.config.vocab_size)
        self.kept_len: int | None = None
        self._ref: _CacheSide | None = None
        self._ev: _CacheSide | None = None

    def _transform(self, logits: torch.Tensor) -> torch.Tensor:
        return decode_log_probs(logits, self.temperature, self.top_p)

    def _prefill(self, press) -> tuple[object, torch.Tensor]:
        from transformers import DynamicCache

        cache = DynamicCache()
        ids = self.input_ids.unsqueeze(0)
        if press is None:
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        else:
            with press(self.model):
                out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache, out.logits[:, -1, :]

    def _check_compression(self, cache) -> int:
        lengths = {layer.keys.shape[-2] for layer in cache.layers}
        if len(lengths) != 1:
            raise CompressionError(f"evicted cache layers differ in length: {sorted(lengths)}")
        kept = lengths.pop()
        if self.expected_kept is not None and kept != self.expected_kept:
            raise CompressionError(
                f"evicted cache keeps {kept} of {self.prompt_len} prompt positions per layer, "
                f"the policy promises {self.expected_kept}: the press did not compress as configured"
            )
        ratio = getattr(self.press, "compression_ratio", 0.0) or 0.0
        if self.expected_kept is None and ratio > 0 and kept >= self.prompt_len:
            raise CompressionError(
                f"press {type(self.press).__name__} (compression_ratio={ratio}) left the cache "
                f"at the full {self.prompt_len} positions"
            )
        return kept

    @torch.inference_mode()
    def start(self, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill both caches, check the compression, expand to ``n_rows`` rows.

        The two caches stay separate, each decoded by its own forward pass per step:
        batching them into one pass would let the rows' batch positions perturb the
        logits (~1e-6 on CPU), and ratio 0 must give a TV of exactly 0.

        Returns
        -------
        (torch.Tensor, torch.Tensor)
            ``log p_1`` and ``log q_1``, float64, shape (n_rows, vocab_size).
        """
        ref_cache, ref_logits = self._prefill(None)
        ev_cache, ev_logits = self._prefill(self.press)
        self.kept_len = self._check_compression(ev_cache)
        if n_rows > 1:
            ref_cache.batch_repeat_interleave(n_rows)
            ev_cache.batch_repeat_interleave(n_rows)
        self._ref = _CacheSide(
            ref_cache, torch.ones(n_rows, self.prompt_len, dtype=torch.bool, device=self.device), self.prompt_len
        )
        self._ev = _CacheSide(
            ev_cache, torch.ones(n_rows, self.kept_len, dtype=torch.bool, device=self.device), self.prompt_len
        )
        logp = self._transform(ref_logits).cpu().expand(n_rows, -1)
        logq = self._transform(ev_logits).cpu().expand(n_rows, -1)
        return logp, logq

    @torch.inference_mode()
    def advance(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``x`` (reference) and ``y`` (evicted), int64 shape (n_rows,); return next log-dists."""
        ref_logits = self._ref.forward(self.model, x.to(self.device))
        ev_logits = self._ev.forward(self.model, y.to(self.device))
        return self._transform(ref_logits).cpu(), self._transform(ev_logits).cpu()

    @torch.inference_mode()
    def rewind(self, length: torch.Tensor) -> None:
        """Keep each row's first ``length[r]`` generated tokens on both sides (int64, shape (n_rows,))."""
        length = length.to(self.device)
        self._ref.rewind(length)
        self._ev.rewind(length)


def _absorb_eos(logd: torch.Tensor, last: torch.Tensor, eos_ids: tuple[int, ...]) -> torch.Tensor:
    """Point mass on EOS for rows whose history ends in an EOS id (estimators.md §1)."""
    if not eos_ids:
        return logd
    done = torch.isin(last, torch.tensor(eos_ids, dtype=last.dtype))
    if not done.any():
        return logd
    logd = logd.clone()
    logd[done] = float("-inf")
    logd[done, last[done]] = 0.0
    return logd


def run_document(
    pair: KernelPair,
    T: int,
    replicates: int,
    seed: int,
    model: str,
    doc_id: str,
    progress: tqdm | None = None,
) -> list[dict[str, Any]]:
    """Run ``replicates`` coupled replicates of one document on a kernel pair.

    Parameters
    ----------
    pair : KernelPair
        The kernel pair (LLM or synthetic); its rows are the replicates.
    T : int
        Horizon, ``max_new_tokens`` (tokens = steps).
    replicates : int
        Number of replicates ``R``.
    seed : int
        Master seed.
    model, doc_id : str
        Enter the seeds of the uniform streams (the policy does not).
    progress : tqdm or None
        Progress bar advanced by one per decoding step.

    Returns
    -------
    list[dict]
        One record per replicate with the trajectory columns of
        :data:`TRAJECTORY_SCHEMA` (without ``model``, ``policy``, ``split``,
        ``doc_id``, ``prompt_len``, ``kept_len``, ``seconds``).
    """
    R = int(replicates)
    streams = [uniform_streams(seed, model, doc_id, r, T) for r in range(R)]
    U = {k: torch.from_numpy(np.stack([s[k] for s in streams])) for k in PURPOSES}  # (R, T) each
    eos = tuple(pair.eos_ids)

    # ---- 1-2. agreement chain, tau_naive, residual pairs at every step -------------
    tv = torch.full((R, T), float("nan"), dtype=torch.float64)
    survival = torch.zeros(R, T, dtype=torch.float64)
    chain = torch.full((R, T), -1, dtype=torch.long)
    res_x = torch.full((R, T), -1, dtype=torch.long)
    res_y = torch.full((R, T), -1, dtype=torch.long)
    tau_naive = torch.full((R,), T + 1, dtype=torch.long)  # T + 1 stands for inf
    alive = torch.ones(R, dtype=torch.bool)
    S = torch.ones(R, dtype=torch.float64)
    last = torch.full((R,), -1, dtype=torch.long)

    logp, logq = pair.start(R)
    for t in range(T):
        logp, logq = _absorb_eos(logp, last, eos), _absorb_eos(logq, last, eos)
        p, q = probabilities(logp), probabilities(logq)
        tv_t = total_variation(p, q)
        rows = alive.nonzero().squeeze(1)
        tv[rows, t] = tv_t[rows]
        S = torch.where(alive, S * (1.0 - tv_t), S)
        survival[:, t] = S
        newly = (tau_naive > T) & alive & (U["divergence"][:, t] < tv_t)
        tau_naive[newly] = t + 1
        split = alive & (tv_t > 0)
        if split.any():
            res_x[split, t], res_y[split, t] = residual_draws(
                p[split], q[split], U["residual_x"][split, t], U["residual_y"][split, t]
            )
        go_on = alive & (tv_t < 1)
        if go_on.any():
            chain[go_on, t] = overlap_draw(p[go_on], q[go_on], U["chain"][go_on, t])
        alive = go_on
        if progress is not None:
            progress.update(1)
        if not alive.any() or t == T - 1:
            break
        token = torch.where(alive, chain[:, t], last.clamp(min=0))
        last = torch.where(alive, chain[:, t], last)
        logp, logq = pair.advance(token, token)
    survival[:, t + 1 :] = 0.0  # the loop only ends early once every chain has stopped

    # ---- 3. branch start t* ---------------------------------------------------------
    S_T = survival[:, -1]
    t_star = torch.where(tau_naive <= T, tau_naive, torch.zeros_like(tau_naive))
    draw = (tau_naive > T) & (S_T < 1)
    if draw.any():
        S_prev = torch.cat([torch.ones(R, 1, dtype=torch.float64), survival[:, :-1]], dim=1)
        f_hat = (S_prev - survival).clamp(min=0.0)
        t_star[draw] = inverse_cdf(f_hat[draw], U["t_star"][draw, 0]) + 1
    has_branch = t_star > 0

    # ---- 4. residual branch ------------------------------------------------------------
    records_branch: list[dict[str, list]] = [
        {"branch_x": [], "branch_y": [], "branch_tv": [], "branch_mismatch": []} for _ in range(R)
    ]
    x_star = torch.full((R,), -1, dtype=torch.long)
    y_star = torch.full((R,), -1, dtype=torch.long)
    if has_branch.any():
        idx = (t_star - 1).clamp(min=0)
        x_star = torch.where(has_branch, res_x.gather(1, idx[:, None]).squeeze(1), x_star)
        y_star = torch.where(has_branch, res_y.gather(1, idx[:, None]).squeeze(1), y_star)
        # Rows without a branch ride along on an arbitrary rewind; their output is dropped.
        pair.rewind(torch.where(has_branch, t_star - 1, torch.zeros_like(t_star)))
        x_last, y_last = x_star.clamp(min=0), y_star.clamp(min=0)
        lags = torch.where(has_branch, T - t_star, torch.zeros_like(t_star))
        if int(lags.max()) > 0:
            logp, logq = pair.advance(x_last, y_last)
        for k in range(int(lags.max())):
            logp, logq = _absorb_eos(logp, x_last, eos), _absorb_eos(logq, y_last, eos)
            x, y, btv = maximal_coupling(
                probabilities(logp),
                probabilities(logq),
                U["coin"][:, k],
                U["overlap"][:, k],
                U["branch_x"][:, k],
                U["branch_y"][:, k],
            )
            for r in (lags > k).nonzero().squeeze(1).tolist():
                rec = records_branch[r]
                rec["branch_x"].append(int(x[r]))
                rec["branch_y"].append(int(y[r]))
                rec["branch_tv"].append(float(btv[r]))
                rec["branch_mismatch"].append(int(x[r] != y[r]))
            if progress is not None:
                progress.update(1)
            x_last, y_last = x, y
            if k + 1 < int(lags.max()):
                logp, logq = pair.advance(x, y)

    out = []
    for r in range(R):
        out.append(
            {
                "replicate": r,
                "T": T,
                "chain_token": chain[r].tolist(),
                "tv": tv[r].tolist(),
                "survival": survival[r].tolist(),
                "tau_naive": int(tau_naive[r]) if tau_naive[r] <= T else None,
                "t_star": int(t_star[r]) if has_branch[r] else None,
                "x_star": int(x_star[r]) if has_branch[r] else None,
                "y_star": int(y_star[r]) if has_branch[r] else None,
                **records_branch[r],
            }
        )
    return out
