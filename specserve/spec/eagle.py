"""EAGLE / EAGLE-3 proposer, autoregressive or P-EAGLE parallel drafting.

After each target step the head first appends one "real" row per position whose target feature
that step computed and verification kept (input: the next token's embedding + the target
feature), then drafts: autoregressively (k - 1 more forwards of one row per request, feeding the
head's own output back) or, with `parallel_drafting`, in the same forward through k - 1 P-EAGLE
mask rows placed after the last real position.

KV: the head's one layer keeps a small paged cache of its own (KVCacheManager + the target's
attention backend), not a dense per-request tensor: requests of different lengths then batch into
one varlen forward with no padding, the GPU path reuses the Triton paged kernels, and blocks come
and go with requests like the target's. A request's head sequence is compact: only real rows the
head has seen, at their true RoPE positions. Positions whose features it never saw (a prefix-cache
hit, a prefill chunk that did not sample, so the proposer was not called) are simply absent from its
context: drafts get a little worse, verification keeps the output exact. Draft rows sit after the
real rows and are overwritten by the next propose, because their KV came from the head's own
hidden states, never from the target's.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

import numpy as np
import torch

from specserve.attention.base import AttentionMetadata
from specserve.config import SpeculativeConfig
from specserve.kv.manager import KVCacheManager
from specserve.kv.spec import KVCacheSpec, kv_format
from specserve.sample.h2d import h2d
from specserve.scheduler.request import Request
from specserve.spec.base import OwnKVLifecycle, ProposeInput
from specserve.spec.draft_model import DraftSampler, assign_drafts, draft_kv_blocks
from specserve.spec.draft_tokens import DraftTokens
from specserve.spec.eagle_head import EagleHead, load_head


@dataclass
class _HeadSeq:
    """A request's head sequence (duck-types `Request` for KVCacheManager)."""

    request_id: str
    num_computed_tokens: int = 0  # real rows with valid KV (compact index)
    next_pos: int = 0  # first target position not yet consumed as a real row


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


def recapture_with_aux(runner, aux_layers: tuple[int, ...]) -> None:
    """The target must return these layers' inputs. CUDA graphs captured before that return other
    outputs (the runner would run such steps eagerly), so capture them again with the aux outputs."""
    runner.model.aux_hidden_layers = aux_layers
    old = runner.graphs
    if old is None or old.aux_hidden_layers == tuple(aux_layers):
        return
    args = (old.batch_sizes[-1], old.max_model_len, old.query_lens)
    runner.graphs = None
    del old  # free its memory pool before the new capture
    gc.collect()
    torch.cuda.empty_cache()
    runner.capture_graphs(*args)


def head_attention_metadata(ctx_lens: list[int], q_lens: list[int], tables: list[list[int]], block_size: int,
                            device: torch.device) -> AttentionMetadata:
    """Sequence i: q_lens[i] new rows after ctx_lens[i] cached ones, in blocks tables[i]."""
    n = len(tables)
    block_tables = np.zeros((n, max(1, max(len(t) for t in tables))), dtype=np.int32)
    for i, t in enumerate(tables):
        block_tables[i, :len(t)] = t
    seq_lens = np.asarray(ctx_lens, dtype=np.int32) + np.asarray(q_lens, dtype=np.int32)
    seq_index = np.repeat(np.arange(n), q_lens)
    idx = np.concatenate([np.arange(c, c + q) for c, q in zip(ctx_lens, q_lens)])
    slots = block_tables[seq_index, idx // block_size].astype(np.int64) * block_size + idx % block_size
    cu = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(q_lens, out=cu[1:])

    def dev(a: np.ndarray) -> torch.Tensor:
        return h2d(torch.from_numpy(a), device)

    return AttentionMetadata(dev(cu), dev(seq_lens), dev(block_tables), dev(slots), max(q_lens),
                             int(seq_lens.max()), n, int(cu[-1]), list(q_lens), seq_lens.tolist())


class EagleProposer(OwnKVLifecycle):
    needs_target_hidden = True

    def __init__(self, cfg: SpeculativeConfig, parts) -> None:
        self.device = parts.device
        self.target = parts.loaded.model
        arch, dtype = parts.loaded.arch, parts.loaded.model.embed_tokens.weight.dtype
        self.head: EagleHead = load_head(cfg.model, arch, parts.loaded.identity, self.device, dtype)
        hcfg = self.head.cfg
        where = f"speculative_config.model {cfg.model!r}"
        if hcfg.method != cfg.method:
            raise ValueError(f"{where} is an {hcfg.method!r} head; speculative_config.method is {cfg.method!r}.")
        if cfg.parallel_drafting and hcfg.num_mask_slots == 0:
            raise ValueError(f"{where} was not trained for parallel drafting (no mask slots); "
                             "train it with `specserve train-draft --method p-eagle` or drop parallel_drafting.")
        if cfg.parallel_drafting and cfg.num_speculative_tokens > hcfg.num_mask_slots + 1:
            raise ValueError(f"{where} was trained to draft at most {hcfg.num_mask_slots + 1} tokens in parallel "
                             f"({hcfg.num_mask_slots} mask slots); num_speculative_tokens is "
                             f"{cfg.num_speculative_tokens}.")
        self.name = "p-eagle" if cfg.parallel_drafting else cfg.method
        self.parallel = cfg.parallel_drafting
        self.aux_hidden_layers = hcfg.aux_hidden_layers
        recapture_with_aux(parts.runner, self.aux_hidden_layers)
        block_size = parts.runner.spec.block_size
        larch = hcfg.layer_arch()
        spec = KVCacheSpec(1, larch.num_kv_heads, larch.head_dim, block_size, kv_format("auto", dtype))
        num_blocks = draft_kv_blocks(parts.kv.num_blocks, spec.bytes_per_block, self.device, "EAGLE head")
        self.kv_caches = spec.allocate(num_blocks, self.device)
        self.fmt = spec.fmt
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.backend = parts.runner.backend
        self.scale = larch.head_dim ** -0.5
        self.sampler = DraftSampler(arch.vocab_size, self.device)
        self.seqs: dict[str, _HeadSeq] = {}

    # -- propose -----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, inp: ProposeInput) -> None:
        plan = self._plan(inp)
        if not plan.reqs:
            return
        self.sampler.begin(plan.reqs)
        step = inp.step
        rows = h2d(torch.tensor(plan.feature_rows, dtype=torch.int64), self.device)
        parts = step.aux_hidden if self.aux_hidden_layers else [step.all_hidden]  # each [num_tokens, hidden]
        feats = torch.cat([p.index_select(0, rows) for p in parts], dim=-1)  # [num_real, n * hidden]
        hidden = self.head.fuse_target(feats)  # [num_real, hidden]
        embeds = self.target.embed_tokens(h2d(torch.tensor(plan.next_tokens, dtype=torch.int64), self.device))
        if self.parallel:
            drafts, probs = self._draft_parallel(plan, embeds, hidden)
        else:
            drafts, probs = self._draft_autoregressive(plan, embeds, hidden)
        assign_drafts(plan.reqs, drafts, probs, self.sampler)

    def _plan(self, inp: ProposeInput) -> _Plan:
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
            plan.next_tokens.extend(req.all_token_ids[lo + 1:hi + 1])
            plan.positions.extend(range(lo, hi))
            seq.next_pos = hi
        return plan

    def _draft_autoregressive(self, plan: _Plan, embeds: torch.Tensor, hidden: torch.Tensor):
        n = len(plan.reqs)
        ctx = [s.num_computed_tokens for s in plan.seqs]
        out, normed = self._forward(embeds, hidden, plan.positions, ctx, plan.num_real, plan.seqs)
        last = h2d(torch.from_numpy(np.cumsum(plan.num_real) - 1), self.device)
        prev_out, normed = out.index_select(0, last), normed.index_select(0, last)  # [n, hidden]
        for seq, m in zip(plan.seqs, plan.num_real):
            seq.num_computed_tokens += m
        # Drafts stay on the device until the end: no host sync between the head's forwards.
        dt = DraftTokens(self.device)
        dt.add(list(range(n)), *self.sampler.sample(self.target.compute_logits(normed), list(range(n))))
        for step in range(1, max(plan.ks)):
            # Draft row `step` of a request: its previous draft's embedding + the head's own output
            # of the row before, after the real rows (compact index num_computed + step - 1).
            active = [i for i, k in enumerate(plan.ks) if k > step]
            idx = h2d(torch.tensor(active, dtype=torch.int64), self.device)
            emb = self.target.embed_tokens(dt.last(active))
            seqs = [plan.seqs[i] for i in active]
            out, normed = self._forward(emb, prev_out.index_select(0, idx), [plan.last_pos[i] + step for i in active],
                                        [s.num_computed_tokens + step - 1 for s in seqs], [1] * len(active), seqs)
            prev_out = prev_out.index_copy(0, idx, out)
            dt.add(active, *self.sampler.sample(self.target.compute_logits(normed), active))
        return dt.to_lists(n)

    def _draft_parallel(self, plan: _Plan, embeds: torch.Tensor, hidden: torch.Tensor):
        """One forward: each request's real rows, then k - 1 mask rows at the next positions."""
        n = len(plan.reqs)
        emb_parts, hid_parts, positions, q_lens, pick = [], [], [], [], []
        start = row = 0
        for i in range(n):
            m, extra = plan.num_real[i], plan.ks[i] - 1
            emb_parts.append(embeds[start:start + m])
            hid_parts.append(hidden[start:start + m])
            if extra:
                me, mh = self.head.mask_inputs(extra)
                emb_parts.append(me.to(embeds.dtype))
                hid_parts.append(mh.to(hidden.dtype))
            positions.extend(plan.positions[start:start + m])
            positions.extend(range(plan.last_pos[i] + 1, plan.last_pos[i] + 1 + extra))
            q_lens.append(m + extra)
            pick.extend(range(row + m - 1, row + m + extra))  # last real row + mask rows
            start += m
            row += m + extra
        ctx = [s.num_computed_tokens for s in plan.seqs]
        _, normed = self._forward(torch.cat(emb_parts), torch.cat(hid_parts), positions, ctx, q_lens, plan.seqs)
        for seq, m in zip(plan.seqs, plan.num_real):
            seq.num_computed_tokens += m
        normed = normed.index_select(0, h2d(torch.tensor(pick, dtype=torch.int64), self.device))
        rows = [i for i in range(n) for _ in range(plan.ks[i])]
        tokens, p = self.sampler.sample(self.target.compute_logits(normed), rows)
        values = tokens.tolist()  # the one host sync of a parallel draft
        drafts: list[list[int]] = [[] for _ in range(n)]
        probs: list[list[torch.Tensor]] = [[] for _ in range(n)]
        for r, i in enumerate(rows):
            drafts[i].append(values[r])
            if p is not None:
                probs[i].append(p[r])
        return drafts, probs

    def _forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: list[int], ctx_lens: list[int],
                 q_lens: list[int], seqs: list[_HeadSeq]) -> tuple[torch.Tensor, torch.Tensor]:
        """Head rows [sum(q_lens), hidden] after ctx_lens[i] cached rows of seqs[i] -> (out, normed)."""
        tables = [self.kv.block_ids(s.request_id) for s in seqs]
        meta = head_attention_metadata(ctx_lens, q_lens, tables, self.kv.block_size, self.device)
        pos = h2d(torch.tensor(positions, dtype=torch.int64), self.device)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.backend.forward(q, k, v, self.kv_caches[0], self.fmt, meta, self.scale)

        return self.head(embeds, hidden, pos, self.target.cos_sin_cache, attend)
