"""EAGLE / EAGLE-3 proposer, autoregressive or P-EAGLE parallel drafting.

A request's head sequence (own paged KV) is compact: the real rows it has seen, at their true RoPE positions, then
draft or mask rows the next propose overwrites. Positions it never saw (a prefix-cache hit) only worsen drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from specserve.attention.base import AttentionMetadata
from specserve.attention.tree_mask import tree_layout
from specserve.config import SpeculativeConfig
from specserve.kv.block_pool import BlockHash
from specserve.kv.manager import KVCacheManager
from specserve.kv.spec import KVCacheSpec, kv_format
from specserve.scheduler.request import Request
from specserve.speculative.proposers.base import OwnKVLifecycle, ProposeInput, Proposer
from specserve.speculative.proposers.draft_model import DraftSampler, draft_kv_blocks
from specserve.speculative.proposers.draft_tokens import DraftDelivery, DraftTokens
from specserve.speculative.proposers.eagle_first import FirstForwardGraphs
from specserve.speculative.proposers.eagle_graph import (
    HeadStepGraphs,
    PinnedUpload,
    StepHost,
    attention_arrays,
    attention_metadata,
    paged_attend,
)
from specserve.speculative.proposers.eagle_head import EagleHead, load_head
from specserve.speculative.proposers.eagle_setup import (
    graph_logits_bytes,
    recapture_with_aux,
    step_batch_sizes,
    warm_eager_head,
)
from specserve.speculative.tree import TreeShape, is_chain
from specserve.speculative.tree_draft import TreeDraft, add_level
from specserve.speculative.tree_parallel import parallel_trees


@dataclass
class _HeadSeq:
    """A request's head sequence (the kv manager's `Request` protocol; no prefix caching, no token ids)."""

    request_id: str
    num_computed_tokens: int = 0  # real rows with valid KV (compact index)
    next_pos: int = 0  # first target position not yet consumed as a real row
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
    """DraftSampler over a reduced draft vocabulary: logits [rows, draft_vocab], column j = target token d2t[j].
    Random rows' draft_probs are the full-vocabulary q, zero outside d2t, so verification stays lossless."""

    def __init__(self, vocab_size: int, device: torch.device, d2t: torch.Tensor) -> None:
        super().__init__(vocab_size, device)
        self.d2t = d2t  # [draft_vocab] int64, ascending: greedy ties agree with the full argmax

    def sample(self, logits: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        if all(self.is_greedy(r) for r in rows):
            return self.d2t.index_select(0, logits.argmax(dim=-1)), None
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        return super().sample(full.index_copy_(1, self.d2t, logits), rows)


class EagleProposer(OwnKVLifecycle, DraftDelivery, Proposer):
    needs_target_hidden = True
    # "auto": static buffers as CUDA graphs when the target runs graphs, else eager; "static": the buffers without
    # capture (CPU tests); "eager": never.
    step_graphs: str = "auto"

    def __init__(self, cfg: SpeculativeConfig, parts) -> None:
        self.device = parts.device
        self.target = parts.loaded.model
        arch, dtype = parts.loaded.arch, parts.loaded.model.embed_tokens.weight.dtype
        assert cfg.model is not None  # SpeculativeConfig requires it for EAGLE methods
        self.head: EagleHead = load_head(cfg.model, arch, parts.loaded.identity, self.device, dtype)
        self.head.attach_target(self.target)  # a reduced vocabulary's LM-head rows, gathered once
        target_ops = getattr(getattr(self.target, "norm", None), "ops", None)
        if target_ops is not None:  # the fused ops the target runs
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
        self.name = "p-eagle" if cfg.parallel_drafting else cfg.method
        self.parallel = cfg.parallel_drafting
        self.defers_by_default = not self.parallel  # P-EAGLE reads its drafts back in propose
        self.aux_hidden_layers = hcfg.aux_hidden_layers
        recapture_with_aux(parts.runner, self.aux_hidden_layers)
        block_size, larch, k = parts.runner.spec.block_size, hcfg.layer_arch(), cfg.num_speculative_tokens
        spec = KVCacheSpec(1, larch.num_kv_heads, larch.head_dim, block_size, kv_format("auto", dtype))
        graphs, sizes = parts.runner.graphs is not None, step_batch_sizes(parts)
        static = self.step_graphs == "static" or (self.step_graphs == "auto" and graphs)
        capture = static and graphs and self.step_graphs == "auto" and self.device.type == "cuda"
        reserve = graph_logits_bytes(sizes, k, self.parallel, hcfg.logits_width) if capture else 0
        num_blocks = draft_kv_blocks(parts.kv.num_blocks, spec.bytes_per_block, self.device, "EAGLE head", reserve)
        self.kv_caches, self.fmt = spec.allocate(num_blocks, self.device), spec.fmt
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.backend, self.scale = parts.runner.backend, larch.head_dim**-0.5
        d2t, vs = self.head.d2t, arch.vocab_size
        self.sampler = DraftSampler(vs, self.device) if d2t is None else DraftVocabSampler(vs, self.device, d2t)
        self.seqs: dict[str, _HeadSeq] = {}
        self.upload = PinnedUpload(self.device)  # every host->device input of a head forward, one copy
        self.steps: HeadStepGraphs | None = None
        self.first: FirstForwardGraphs | None = None
        if static:  # a head sequence holds at most max_model_len real rows plus k - 1 draft (or mask) rows
            max_blocks = -(-(parts.loaded.max_model_len + k) // block_size)
            if not self.parallel and k > 1:
                self.steps = HeadStepGraphs(self, sizes, max_blocks, capture)
            feed = None if self.steps is None else (self.steps.hidden, self.steps.tokens)
            self.first = FirstForwardGraphs(self, sizes, max_blocks, k, self.parallel, feed, capture)
        if self.device.type == "cuda":  # the eager first forwards' kernels compile now, not mid-serving
            warm_eager_head(self)

    @torch.inference_mode()
    def propose(self, inp: ProposeInput) -> None:
        plan = self._plan(inp)
        if not plan.reqs:
            return
        self.sampler.begin(plan.reqs)
        n, tables = len(plan.reqs), [self.kv.block_ids(s.request_id) for s in plan.seqs]
        bs = None if self.first is None else self.first.size_for(plan.ks, plan.num_real, tables)
        if bs is not None:
            dt = self._propose_static(plan, inp.step, bs, tables)
        else:  # no host sync between the head's forwards
            out, normed = self._first_forward(plan, inp.step, plan.ks if self.parallel else [1] * n, tables)
            dt, rows = DraftTokens(), self._pick_rows(plan.ks)
            dt.add(rows, *self.sampler.sample(self.head.compute_logits(normed, self.target), rows))
            if not self.parallel:
                self._draft_steps(dt, plan, tables, out)
        self.deliver(dt, plan.reqs)  # DraftDelivery decides when the host reads them

    @torch.inference_mode()
    def propose_tree(self, inp: ProposeInput, shape: TreeShape) -> None:
        """EAGLE-2 style trees (tree_draft.py; P-EAGLE: tree_parallel.py), eagerly: greedy requests' of the
        head's top-k, random ones' sampled from its distribution (drafts with probabilities). After the first
        forward each level feeds every fed node again (its token, its parent's head output) with the tree's
        ancestor mask, at the head rows after the real ones."""
        if self.parallel:
            return self._propose_parallel_tree(inp, shape)
        budget = {r.request_id: b for r, b in zip(inp.requests, inp.num_draft_tokens)}
        cap = shape.branching * (shape.depth - 1)  # fed nodes at most: head rows reserved after the real ones
        plan = self._plan(replace(inp, num_draft_tokens=[min(cap, b) + 1 for b in inp.num_draft_tokens]))
        if not plan.reqs:
            return
        n, tables = len(plan.reqs), [self.kv.block_ids(s.request_id) for s in plan.seqs]
        outs, normed = self._first_forward(plan, inp.step, [1] * n, tables)  # [n, hidden]: the roots' outputs
        trees = [
            TreeDraft(shape, budget[r.request_id], shape.depth, k - 1, not r.params.greedy, i)
            for i, (r, k) in enumerate(zip(plan.reqs, plan.ks))
        ]
        self.sampler.begin(plan.reqs)  # the random requests' sampling metadata
        sampling = self.sampler.meta
        add_level(trees, self.head.compute_logits(normed, self.target), self.head.d2t, sampling)
        row_of = [[i] for i in range(n)]  # per tree: its fed nodes' rows of outs (node 0: the root)
        while active := [i for i, t in enumerate(trees) if t.expand()]:
            fed = [trees[i].fed_tree() for i in active]
            q_lens, layouts = [len(t) for t, _ in fed], [tree_layout(p) for _, p in fed]
            starts = np.cumsum([0, *q_lens]).tolist()
            ctx = [plan.seqs[i].num_computed_tokens for i in active]
            arrays = attention_arrays(ctx, q_lens, [tables[i] for i in active], self.kv.block_size)
            host = [
                [t for toks, _ in fed for t in toks],
                [row_of[i][p] for i, (_, par) in zip(active, fed) for p in par],
                np.concatenate([plan.last_pos[i] + d[1:] for i, (d, _) in zip(active, layouts)]),
                np.concatenate([m[1:] >> 1 for _, m in layouts]),  # ancestors among the fed nodes (no root row)
                [s + f - 1 for i, s in zip(active, starts) for f in trees[i].frontier_nodes()],
            ]
            dev = self.upload.send([np.asarray(a, dtype=np.int64) for a in host] + arrays)
            meta = attention_metadata(arrays, dev[5:], q_lens)
            meta.tree_mask = dev[3]
            out, normed = self._head(self.head.embed(dev[0], self.target), outs.index_select(0, dev[1]), dev[2], meta)
            for i, s in zip(active, starts):
                row_of[i][1:] = range(len(outs) + s, len(outs) + s + len(trees[i].fed))
            outs = torch.cat([outs, out])
            logits = self.head.compute_logits(normed.index_select(0, dev[4]), self.target)
            add_level([trees[i] for i in active], logits, self.head.d2t, sampling)
        for req, tree in zip(plan.reqs, trees):
            req.spec_token_ids, parents = tree.result()
            req.spec_tree_parents, req.spec_draft_probs = None if is_chain(parents) else parents, tree.draft_probs()

    def _propose_parallel_tree(self, inp: ProposeInput, shape: TreeShape) -> None:
        """P-EAGLE's one forward (k rows per request, as `propose`), its first row branching (tree_parallel.py)."""
        plan = self._plan(replace(inp, num_draft_tokens=[min(shape.depth, b) for b in inp.num_draft_tokens]))
        if not plan.reqs:
            return
        self.sampler.begin(plan.reqs)
        tables = [self.kv.block_ids(s.request_id) for s in plan.seqs]
        _, normed = self._first_forward(plan, inp.step, plan.ks, tables)  # [sum(ks), hidden]
        budget = {r.request_id: b for r, b in zip(inp.requests, inp.num_draft_tokens)}
        trees = parallel_trees(
            self.head.compute_logits(normed, self.target),
            plan.ks,
            [budget[r.request_id] for r in plan.reqs],
            shape,
            [r.params.greedy for r in plan.reqs],
            self.head.d2t,
            self.sampler.meta,
        )
        for req, tree in zip(plan.reqs, trees):
            req.spec_token_ids, req.spec_draft_probs = tree.tokens, tree.draft_probs
            req.spec_tree_parents = None if is_chain(tree.parents) else tree.parents

    @torch.inference_mode()
    def absorb(self, inp: ProposeInput) -> None:
        """Rows of a prefill chunk that did not sample enter the head's KV now (no drafts): its context stays whole."""
        plan = self._plan(inp)  # inp.num_draft_tokens are 1: no draft rows reserved
        if plan.reqs:
            self._first_forward(
                plan, inp.step, [1] * len(plan.reqs), [self.kv.block_ids(s.request_id) for s in plan.seqs]
            )

    def _features(self, step) -> list[torch.Tensor]:
        return step.aux_hidden if self.aux_hidden_layers else [step.all_hidden]  # each [num_tokens, hidden]

    def _first_forward(self, plan: _Plan, step, ks: list[int], tables: list[list[int]]):
        """The eager first forward over each request's real rows, then k - 1 mask rows (P-EAGLE; ks are 1
        otherwise), host inputs in one copy -> (out, normed) of the picks: each request's last real and mask rows."""
        ctx = [s.num_computed_tokens for s in plan.seqs]
        positions: list[int] = []
        pick: list[int] = []
        src: list[int] = []  # each row's real row, or len(plan.positions): the mask pair
        start = row = 0
        for m, k, last in zip(plan.num_real, ks, plan.last_pos):
            positions += [*plan.positions[start : start + m], *range(last + 1, last + k)]
            src += [*range(start, start + m), *[len(plan.positions)] * (k - 1)]
            pick += range(row + m - 1, row + m + k - 1)
            start, row = start + m, row + m + k - 1
        q_lens = [m + k - 1 for m, k in zip(plan.num_real, ks)]
        arrays = attention_arrays(ctx, q_lens, tables, self.kv.block_size)
        host = [np.asarray(v, dtype=np.int64) for v in (plan.feature_rows, plan.next_tokens, positions, pick, src)]
        dev = self.upload.send(host + arrays)
        rows, next_tokens, pos, pick_dev, src_dev = dev[:5]
        feats = torch.cat([p.index_select(0, rows) for p in self._features(step)], dim=-1)  # [num_real, n * hidden]
        hidden, embeds = self.head.fuse_target(feats), self.head.embed(next_tokens, self.target)
        if max(ks) > 1:  # mask rows read the learned pair
            me, mh = self.head.mask_inputs(1)
            embeds = torch.cat([embeds, me.to(embeds.dtype)]).index_select(0, src_dev)  # [sum(q_lens), hidden]
            hidden = torch.cat([hidden, mh.to(hidden.dtype)]).index_select(0, src_dev)
        out, normed = self._head(embeds, hidden, pos, attention_metadata(arrays, dev[5:], q_lens))
        _advance(plan)
        return out.index_select(0, pick_dev), normed.index_select(0, pick_dev)

    def _plan(self, inp: ProposeInput) -> _Plan:
        assert inp.step is not None and inp.step.host is not None
        host = inp.step.host
        q_lens, s_lens = host.query_lens, host.seq_lens.tolist()
        starts = np.concatenate([[0], np.cumsum(q_lens)]).tolist()
        plan = _Plan([], [], [], [], [], [], [], [])
        for req, k, b in zip(inp.requests, inp.num_draft_tokens, inp.batch_index):
            seq = self.seqs.setdefault(req.request_id, _HeadSeq(req.request_id))
            first = s_lens[b] - q_lens[b]  # position of the step's first token of this request
            lo, hi = max(first, seq.next_pos), req.num_computed_tokens  # features computed and kept
            if hi <= lo or not self.kv.allocate_slots(seq, hi - lo, None, k - 1):  # k - 1 draft or mask rows
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

    def _propose_static(self, plan: _Plan, step, bs: int, tables: list[list[int]]):
        """The first forward through FirstForwardGraphs (size bs), then the draft steps through HeadStepGraphs."""
        first, n, ctx = self.first, len(plan.reqs), [s.num_computed_tokens for s in plan.seqs]
        assert first is not None  # bs came from it
        first.send(bs, plan, ctx, tables)
        _, logits, argmax = first.run(bs, self._features(step))
        _advance(plan)
        dt, rows, par = DraftTokens(), self._pick_rows(plan.ks), self.parallel
        sel = first.sel[: len(rows)]  # P-EAGLE: request i's picks i * picks_per_req .. + k_i
        if all(self.sampler.is_greedy(r) for r in range(n)):  # P-EAGLE's a copy: argmax is a graph's output
            dt.add(rows, argmax.index_select(0, sel) if par else argmax[:n], None)
        else:
            dt.add(rows, *self.sampler.sample(logits.index_select(0, sel) if par else logits[:n], rows))
        if not par:
            self._draft_steps(dt, plan, tables, None)  # the first forward fed the steps' buffers
        return dt

    def _pick_rows(self, ks: list[int]) -> list[int]:
        """The request of each pick of the first forward: P-EAGLE's k_i of request i (one step of drafts), else one."""
        return [i for i, k in enumerate(ks) for _ in range(k if self.parallel else 1)]

    def _draft_steps(self, dt: DraftTokens, plan: _Plan, tables: list[list[int]], prev: torch.Tensor | None) -> None:
        """Draft steps 1..max(ks) - 1 through HeadStepGraphs where they fit, else eagerly. prev [n, hidden]: each
        request's last head output (None: FirstForwardGraphs fed it to HeadStepGraphs)."""
        ks, ctx, last_pos = plan.ks, [s.num_computed_tokens for s in plan.seqs], plan.last_pos
        if max(ks) == 1:
            return
        if self.steps is not None and self.steps.draft(dt, self.sampler, StepHost(ks, ctx, last_pos, tables), prev):
            return
        assert prev is not None, "HeadStepGraphs refused a batch that FirstForwardGraphs took"
        for step in range(1, max(ks)):  # eagerly
            active = [i for i, k in enumerate(ks) if k > step]
            arrays = attention_arrays(
                [ctx[i] + step - 1 for i in active], [1] * len(active), [tables[i] for i in active], self.kv.block_size
            )
            host = [active, dt.rows_in_last(active), [last_pos[i] + step for i in active]]
            dev = self.upload.send([np.asarray(a, dtype=np.int64) for a in host] + arrays)
            idx, prev_rows, pos = dev[:3]
            emb = self.head.embed(dt.last_tokens.index_select(0, prev_rows), self.target)
            out, normed = self._head(
                emb, prev.index_select(0, idx), pos, attention_metadata(arrays, dev[3:], [1] * len(active))
            )
            prev = prev.index_copy(0, idx, out)
            dt.add(active, *self.sampler.sample(self.head.compute_logits(normed, self.target), active))

    def _head(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Head rows [meta.num_tokens, hidden] through the head's paged KV -> (out, normed)."""
        attend = paged_attend(self.backend, self.kv_caches[0], self.fmt, meta, self.scale)
        return self.head(embeds, hidden, positions, self.target.cos_sin_cache, attend)


def _advance(plan: _Plan) -> None:
    for seq, m in zip(plan.seqs, plan.num_real):
        seq.num_computed_tokens += m
