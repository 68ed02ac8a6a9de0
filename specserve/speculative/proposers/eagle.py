"""EAGLE / EAGLE-3 proposer, autoregressive or P-EAGLE parallel drafting.

The head keeps its own paged KV. A request's head sequence is compact: only the real rows it has seen (target
features verification kept), at their true RoPE positions; draft or mask rows sit after them and are overwritten by
the next propose. Positions it never saw (a prefix-cache hit) are absent: drafts get worse, output stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from specserve.attention.base import AttentionMetadata
from specserve.config import SpeculativeConfig
from specserve.kv.block_pool import BlockHash
from specserve.kv.manager import KVCacheManager
from specserve.kv.spec import KVCacheSpec, kv_format
from specserve.sample.h2d import h2d
from specserve.scheduler.request import Request
from specserve.speculative.proposers.base import OwnKVLifecycle, ProposeInput, Proposer
from specserve.speculative.proposers.draft_model import DraftSampler, assign_drafts, draft_kv_blocks
from specserve.speculative.proposers.draft_tokens import DraftDelivery, DraftTokens, assign_resolved
from specserve.speculative.proposers.eagle_first import FirstForwardGraphs
from specserve.speculative.proposers.eagle_graph import (
    HeadStepGraphs,
    PinnedUpload,
    attention_arrays,
    attention_metadata,
    paged_attend,
)
from specserve.speculative.proposers.eagle_head import EagleHead, load_head
from specserve.speculative.proposers.eagle_setup import graph_logits_bytes, recapture_with_aux, step_batch_sizes


@dataclass
class _HeadSeq:
    """A request's head sequence (the kv manager's `Request` protocol, for KVCacheManager)."""

    request_id: str
    num_computed_tokens: int = 0  # real rows with valid KV (compact index)
    next_pos: int = 0  # first target position not yet consumed as a real row
    # The rest of the protocol, which the head's manager (no prefix caching) never reads: no token ids kept.
    block_hashes: list[BlockHash] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return []

    @property
    def num_tokens(self) -> int:
        return self.num_computed_tokens


@dataclass
class _Plan:
    """Real rows of one propose, flattened over requests."""

    seqs: list[_HeadSeq]
    reqs: list[Request]
    ks: list[int]
    num_real: list[int]  # real rows per request
    last_pos: list[int]  # position of each request's last real row
    feature_rows: list[int]  # row of each real row in the step's flat batch
    next_tokens: list[int]  # token t+1 of each real row
    positions: list[int]  # position t of each real row


class DraftVocabSampler(DraftSampler):
    """DraftSampler for a head with a reduced draft vocabulary: logits [rows, draft_vocab], column j = target token
    d2t[j]. Random rows sample over full-vocabulary logits (-inf outside d2t), so draft_probs are the full q with
    zeros outside d2t: what the rejection sampler takes, keeping verification lossless."""

    def __init__(self, vocab_size: int, device: torch.device, d2t: torch.Tensor) -> None:
        super().__init__(vocab_size, device)
        self.d2t = d2t  # [draft_vocab] int64, ascending (see eagle_head.py: greedy ties agree with the full argmax)

    def sample(self, logits: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        if all(self.is_greedy(r) for r in rows):
            return self.d2t.index_select(0, logits.argmax(dim=-1)), None
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        return super().sample(full.index_copy_(1, self.d2t, logits), rows)


class EagleProposer(OwnKVLifecycle, DraftDelivery, Proposer):
    needs_target_hidden = True
    # "auto": static buffers (FirstForwardGraphs, HeadStepGraphs) as CUDA graphs when the target runs graphs,
    # eager otherwise; "static": the buffers without capture (CPU tests); "eager": never. Tests set it.
    step_graphs: str = "auto"

    def __init__(self, cfg: SpeculativeConfig, parts) -> None:
        self.device = parts.device
        self.target = parts.loaded.model
        arch, dtype = parts.loaded.arch, parts.loaded.model.embed_tokens.weight.dtype
        assert cfg.model is not None  # SpeculativeConfig requires it for EAGLE methods
        self.head: EagleHead = load_head(cfg.model, arch, parts.loaded.identity, self.device, dtype)
        self.head.attach_target(self.target)  # a reduced vocabulary's LM-head rows, gathered once
        target_ops = getattr(getattr(self.target, "norm", None), "ops", None)
        if target_ops is not None:  # on a GPU the fused Triton ops, as the target runs
            self.head.set_ops(target_ops)
        hcfg = self.head.cfg
        where = f"speculative_config.model {cfg.model!r}"
        if hcfg.method != cfg.method:
            raise ValueError(f"{where} is an {hcfg.method!r} head; speculative_config.method is {cfg.method!r}.")
        if cfg.parallel_drafting and hcfg.num_mask_slots == 0:
            raise ValueError(f"{where} was not trained for parallel drafting (no mask slots; see --method p-eagle).")
        if cfg.parallel_drafting and cfg.num_speculative_tokens > hcfg.num_mask_slots + 1:
            raise ValueError(
                f"{where} drafts at most {hcfg.num_mask_slots + 1} tokens in parallel; "
                f"num_speculative_tokens is {cfg.num_speculative_tokens}."
            )
        if self.step_graphs not in ("auto", "static", "eager"):
            raise ValueError(f"EagleProposer.step_graphs must be auto, static or eager, got {self.step_graphs!r}.")
        self.name = "p-eagle" if cfg.parallel_drafting else cfg.method
        self.parallel = cfg.parallel_drafting
        # P-EAGLE reads its drafts back in propose: deferred, its step measured slower.
        self.defers_by_default = not self.parallel
        self.aux_hidden_layers = hcfg.aux_hidden_layers
        recapture_with_aux(parts.runner, self.aux_hidden_layers)
        block_size = parts.runner.spec.block_size
        larch = hcfg.layer_arch()
        spec = KVCacheSpec(1, larch.num_kv_heads, larch.head_dim, block_size, kv_format("auto", dtype))
        graphs = parts.runner.graphs is not None
        static = self.step_graphs == "static" or (self.step_graphs == "auto" and graphs)
        capture = static and graphs and self.step_graphs == "auto" and self.device.type == "cuda"
        k = cfg.num_speculative_tokens
        reserve = graph_logits_bytes(step_batch_sizes(parts), k, self.parallel, hcfg.logits_width) if capture else 0
        num_blocks = draft_kv_blocks(parts.kv.num_blocks, spec.bytes_per_block, self.device, "EAGLE head", reserve)
        self.kv_caches = spec.allocate(num_blocks, self.device)
        self.fmt = spec.fmt
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.backend = parts.runner.backend
        self.scale = larch.head_dim**-0.5
        d2t = self.head.d2t
        vs = arch.vocab_size
        self.sampler = DraftSampler(vs, self.device) if d2t is None else DraftVocabSampler(vs, self.device, d2t)
        self.seqs: dict[str, _HeadSeq] = {}
        self.upload = PinnedUpload(self.device)  # every host->device input of a head forward, one copy
        self.steps: HeadStepGraphs | None = None
        self.first: FirstForwardGraphs | None = None
        if static:
            # A head sequence holds at most max_model_len real rows plus k - 1 draft (or mask) rows.
            max_blocks = -(-(parts.loaded.max_model_len + k) // block_size)
            sizes = step_batch_sizes(parts)
            if not self.parallel and k > 1:
                self.steps = HeadStepGraphs(self, sizes, max_blocks, capture)
            feed = None if self.steps is None else (self.steps.hidden, self.steps.tokens)
            self.first = FirstForwardGraphs(self, sizes, max_blocks, k, self.parallel, feed, capture)
        if self.device.type == "cuda":  # the eager first forwards' kernels compile now, not mid-serving
            from specserve.speculative.proposers.eagle_warmup import warm_eager_head

            warm_eager_head(self)

    # -- propose -----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, inp: ProposeInput) -> None:
        plan = self._plan(inp)
        if not plan.reqs:
            return
        self.sampler.begin(plan.reqs)
        tables = [self.kv.block_ids(s.request_id) for s in plan.seqs]
        ctx = [s.num_computed_tokens for s in plan.seqs]
        bs = None if self.first is None else self.first.size_for(plan.ks, plan.num_real, tables)
        if bs is not None:
            self._hand_over(plan.reqs, self._propose_static(plan, inp.step, bs, ctx, tables))
            return
        pick: list[int] | np.ndarray
        if self.parallel:
            positions, q_lens, pick, src = self._parallel_layout(plan)
        else:
            positions, q_lens, pick = plan.positions, plan.num_real, np.cumsum(plan.num_real) - 1
        extra = [np.asarray(pick, dtype=np.int64)] + ([src] if self.parallel else [])
        embeds, hidden, pos, meta, (pick_dev, *src_dev) = self._first_inputs(
            plan, inp.step, ctx, q_lens, tables, positions, extra
        )
        if self.parallel:
            result = self._draft_parallel(plan, embeds, hidden, src_dev[0], pos, meta, pick_dev)
        else:
            result = self._draft_autoregressive(plan, embeds, hidden, pos, meta, pick_dev, tables)
        self._hand_over(plan.reqs, result)

    @torch.inference_mode()
    def absorb(self, inp: ProposeInput) -> None:
        """A prefill chunk that did not sample (a graph-sized piece, or a chunk of a long prompt): its rows enter the
        head's KV now, with no drafts, so the head's context holds the whole prompt when the chunk that ends it
        drafts."""
        plan = self._plan(inp)  # inp.num_draft_tokens are 1: no draft rows reserved
        if not plan.reqs:
            return
        tables = [self.kv.block_ids(s.request_id) for s in plan.seqs]
        ctx = [s.num_computed_tokens for s in plan.seqs]
        embeds, hidden, pos, meta, _ = self._first_inputs(
            plan, inp.step, ctx, plan.num_real, tables, plan.positions, []
        )
        self._head(embeds, hidden, pos, meta)  # writes the rows' K/V
        for seq, m in zip(plan.seqs, plan.num_real):
            seq.num_computed_tokens += m

    def _first_inputs(self, plan: _Plan, step, ctx: list, q_lens: list, tables: list, positions: list, extra: list):
        """The eager first forward's inputs: every host array (the real rows' gathers, `positions`, `extra`, the
        attention metadata) in one copy, then the real rows' token embeddings and fused target features."""
        arrays = attention_arrays(ctx, q_lens, tables, self.kv.block_size)
        host = [np.asarray(v, dtype=np.int64) for v in (plan.feature_rows, plan.next_tokens, positions)]
        dev = self.upload.send(host + extra + arrays)
        rows, next_tokens, pos = dev[:3]
        meta = attention_metadata(arrays, dev[-len(arrays) :], q_lens)
        parts = step.aux_hidden if self.aux_hidden_layers else [step.all_hidden]  # each [num_tokens, hidden]
        feats = torch.cat([p.index_select(0, rows) for p in parts], dim=-1)  # [num_real, n * hidden]
        hidden = self.head.fuse_target(feats)
        return self.head.embed(next_tokens, self.target), hidden, pos, meta, dev[3 : 3 + len(extra)]

    def _hand_over(self, reqs: list[Request], result: DraftTokens | FlatDrafts | tuple[list[list[int]], list]) -> None:
        """Drafts still on the device (DraftDelivery decides when the host reads them) or already lists
        (random parallel drafts, which read their sampled picks back)."""
        greedy = [self.sampler.is_greedy(i) for i in range(len(reqs))]

        def finish(drafts: list[list[int]], probs: list[list[torch.Tensor]]) -> None:
            assign_resolved(reqs, drafts, probs, greedy)

        if isinstance(result, DraftTokens):
            self.deliver(result, reqs, finish)
        elif isinstance(result, FlatDrafts):
            self.deliver_flat(result.tokens, result.counts, [[] for _ in reqs], reqs, finish)
        else:
            assign_drafts(reqs, *result, self.sampler)

    def _plan(self, inp: ProposeInput) -> _Plan:
        assert inp.step is not None and inp.step.host is not None  # the target's step, with its host layout
        host = inp.step.host
        q_lens, s_lens = host.query_lens, host.seq_lens.tolist()
        starts = np.concatenate([[0], np.cumsum(q_lens)]).tolist()
        plan = _Plan([], [], [], [], [], [], [], [])
        for req, k, b in zip(inp.requests, inp.num_draft_tokens, inp.batch_index):
            seq = self.seqs.get(req.request_id)
            if seq is None:
                seq = self.seqs[req.request_id] = _HeadSeq(req.request_id)
            first = s_lens[b] - q_lens[b]  # position of the step's first token of this request
            # Positions whose features this step computed and verification kept.
            lo, hi = max(first, seq.next_pos), req.num_computed_tokens
            extra = k - 1  # draft or mask rows after the real ones
            if hi <= lo or not self.kv.allocate_slots(seq, hi - lo, None, extra):
                continue
            plan.seqs.append(seq)
            plan.reqs.append(req)
            plan.ks.append(k)
            plan.num_real.append(hi - lo)
            plan.last_pos.append(hi - 1)
            plan.feature_rows.extend(range(starts[b] + lo - first, starts[b] + hi - first))
            plan.next_tokens.extend(req.all_token_ids[lo + 1 : hi + 1])
            plan.positions.extend(range(lo, hi))
            seq.next_pos = hi
        return plan

    def _draft_autoregressive(self, plan: _Plan, embeds, hidden, pos, meta: AttentionMetadata, last, tables: list):
        """Step 0 over the real rows (last [n]: each request's last real row), then k - 1 steps of
        one row per request, feeding the head's own output back."""
        n = len(plan.reqs)
        out, normed = self._head(embeds, hidden, pos, meta)
        for seq, m in zip(plan.seqs, plan.num_real):
            seq.num_computed_tokens += m
        # Drafts stay on the device until the end: no host sync between the head's forwards.
        dt = DraftTokens()
        dt.add(list(range(n)), *self.sampler.sample(self._logits(normed.index_select(0, last)), list(range(n))))
        if max(plan.ks) > 1:
            ctx = [s.num_computed_tokens for s in plan.seqs]
            prev = out.index_select(0, last)
            if self.steps is None or not self.steps.draft(dt, self.sampler, plan.ks, ctx, plan.last_pos, tables, prev):
                self._eager_steps(dt, plan.ks, ctx, plan.last_pos, tables, prev)
        return dt

    def _propose_static(self, plan: _Plan, step, bs: int, ctx: list[int], tables: list[list[int]]):
        """The first forward through FirstForwardGraphs (size bs), then for autoregressive drafting
        the draft steps through HeadStepGraphs: no eager head forward, one read-back."""
        first, n = self.first, len(plan.reqs)
        assert first is not None  # bs came from it
        first.send(
            bs, plan.ks, plan.num_real, ctx, plan.last_pos, plan.feature_rows, plan.next_tokens, plan.positions, tables
        )
        _, logits, argmax = first.run(bs, step.aux_hidden if self.aux_hidden_layers else [step.all_hidden])
        for seq, m in zip(plan.seqs, plan.num_real):
            seq.num_computed_tokens += m
        greedy = all(self.sampler.is_greedy(r) for r in range(n))
        if self.parallel:
            p = first.picks_per_req
            if greedy:  # request i's drafts: the argmax of its picks i * p .. + k_i (a copy: a graph's output)
                picks = [i * p + j for i, k in enumerate(plan.ks) for j in range(k)]
                return FlatDrafts(argmax.index_select(0, h2d(torch.tensor(picks), argmax.device)), list(plan.ks))
            rows = [i for i in range(n) for _ in range(plan.ks[i])]
            tokens, probs = self.sampler.sample(logits.index_select(0, first.sel[: len(rows)]), rows)
            return _by_request(rows, tokens.tolist(), probs, n)
        dt = DraftTokens()
        rows = list(range(n))
        if greedy:
            dt.add(rows, argmax[:n], None)
        else:
            dt.add(rows, *self.sampler.sample(logits[:n], rows))
        if max(plan.ks) > 1:  # the first forward fed the steps' buffers (sizes and blocks fit too)
            ctx = [s.num_computed_tokens for s in plan.seqs]
            assert self.steps is not None  # autoregressive with k > 1
            if not self.steps.draft(dt, self.sampler, plan.ks, ctx, plan.last_pos, tables, None):
                raise RuntimeError("HeadStepGraphs refused a batch that FirstForwardGraphs took")
        return dt

    def _eager_steps(self, dt: DraftTokens, ks: list, ctx: list, last_pos: list, tables: list, prev_out) -> None:
        """Draft steps 1..max(ks) - 1 without static buffers, over the requests still drafting.
        prev_out [n, hidden]: each request's last head output row."""
        for step in range(1, max(ks)):
            # Row `step`: the previous draft's embedding + the head's output of the row before.
            active = [i for i, k in enumerate(ks) if k > step]
            arrays = attention_arrays(
                [ctx[i] + step - 1 for i in active], [1] * len(active), [tables[i] for i in active], self.kv.block_size
            )
            host = [
                np.asarray(active),
                np.asarray(dt.rows_in_last(active)),
                np.asarray([last_pos[i] + step for i in active]),
            ]
            dev = self.upload.send([a.astype(np.int64) for a in host] + arrays)
            idx, prev_rows, pos = dev[:3]
            emb = self.head.embed(dt.last_tokens.index_select(0, prev_rows), self.target)
            out, normed = self._head(
                emb, prev_out.index_select(0, idx), pos, attention_metadata(arrays, dev[3:], [1] * len(active))
            )
            prev_out = prev_out.index_copy(0, idx, out)
            dt.add(active, *self.sampler.sample(self._logits(normed), active))

    def _parallel_layout(self, plan: _Plan) -> tuple[list[int], list[int], list[int], np.ndarray]:
        """Rows of the P-EAGLE forward: each request's real rows, then k - 1 mask rows at the next positions."""
        positions: list[int] = []
        q_lens: list[int] = []
        pick: list[int] = []
        src: list[int] = []
        start = row = 0
        num_real = len(plan.positions)
        for i, (m, k) in enumerate(zip(plan.num_real, plan.ks)):
            extra = k - 1
            positions.extend(plan.positions[start : start + m])
            positions.extend(range(plan.last_pos[i] + 1, plan.last_pos[i] + 1 + extra))
            src.extend(range(start, start + m))
            src.extend([num_real] * extra)
            q_lens.append(m + extra)
            pick.extend(range(row + m - 1, row + m + extra))
            start += m
            row += m + extra
        return positions, q_lens, pick, np.asarray(src, dtype=np.int64)

    def _draft_parallel(self, plan: _Plan, embeds, hidden, src, pos, meta: AttentionMetadata, pick):
        """One forward: each request's real rows, then k - 1 mask rows at the next positions."""
        n = len(plan.reqs)
        me, mh = self.head.mask_inputs(1)
        embeds = torch.cat([embeds, me.to(embeds.dtype)]).index_select(0, src)  # [sum(q_lens), hidden]
        hidden = torch.cat([hidden, mh.to(hidden.dtype)]).index_select(0, src)
        _, normed = self._head(embeds, hidden, pos, meta)
        for seq, m in zip(plan.seqs, plan.num_real):
            seq.num_computed_tokens += m
        rows = [i for i in range(n) for _ in range(plan.ks[i])]
        tokens, p = self.sampler.sample(self._logits(normed.index_select(0, pick)), rows)
        return _by_request(rows, tokens.tolist(), p, n)  # the one host sync of a parallel draft

    def _logits(self, normed: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> [rows, logits width] float32 (the draft vocabulary's columns when reduced)."""
        return self.head.compute_logits(normed, self.target)

    def _head(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Head rows [meta.num_tokens, hidden] through the head's paged KV -> (out, normed)."""
        attend = paged_attend(self.backend, self.kv_caches[0], self.fmt, meta, self.scale)
        return self.head(embeds, hidden, positions, self.target.cos_sin_cache, attend)


class FlatDrafts(NamedTuple):
    """Greedy parallel drafts of one forward, request-major on the device."""

    tokens: torch.Tensor  # [sum(counts)] int64
    counts: list[int]  # drafts per request


def _by_request(rows: list[int], values: list[int], probs: torch.Tensor | None, n: int):
    """Drafts (and their distributions' rows) per request from flat ones; rows[r]: draft r's request."""
    drafts: list[list[int]] = [[] for _ in range(n)]
    dists: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for r, i in enumerate(rows):
        drafts[i].append(values[r])
        if probs is not None:
            dists[i].append(probs[r])
    return drafts, dists
