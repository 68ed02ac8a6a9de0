"""Draft-model speculation: a smaller model with the target's tokenizer proposes k tokens."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from specserve.config import ModelConfig, SpeculativeConfig
from specserve.kv.block_pool import BlockHash
from specserve.kv.manager import KVCacheManager
from specserve.kv.spec import KVCacheSpec
from specserve.model.loader import LoadedModel, load_model
from specserve.runner.batch import HostBatch, block_table_array
from specserve.runner.cuda_graph import CATCH_UP_QUERY_LENS, MIXED_TOKEN_LENS, graph_output_bytes
from specserve.runner.model_runner import ModelRunner
from specserve.sample.h2d import cached_tensor
from specserve.sample.metadata import SamplingMetadata
from specserve.sample.sampler import compute_target_probs, draw_exponential, random_sample, seeded_tokens
from specserve.scheduler.request import PLACEHOLDER, Request
from specserve.scheduler.scheduler import ScheduledRequest, SchedulerOutput
from specserve.speculative.proposers.base import OwnKVLifecycle, ProposeInput, Proposer
from specserve.speculative.proposers.draft_tokens import DraftDelivery, DraftTokens
from specserve.speculative.tree import TreeShape, is_chain
from specserve.speculative.tree_draft import TreeDraft, add_level

# GPU memory kept free beside the draft's KV pool (activations, allocator slack).
_GPU_RESERVE_BYTES = 2 << 30
_VOCAB_SAMPLE = 256


@dataclass
class _DraftSeq:
    """A request as the draft's runner and KV manager see it (duck-types the scheduler's `Request`)."""

    request_id: str
    all_token_ids: list[int] = field(default_factory=list)  # real tokens, then drafts fed so far
    num_computed_tokens: int = 0  # tokens whose KV the draft cache holds
    num_real: int = 0  # how many of all_token_ids were the request's real tokens at the last sync
    spec_token_ids: list[int] = field(default_factory=list)  # empty but while a tree is drafted (build_batch reads it)
    spec_tree_parents: list[int] | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)  # never filled: the draft's KV has no prefix caching

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def draft_kv_blocks(
    target_num_blocks: int, bytes_per_block: int, device: torch.device, what: str, reserve_bytes: int = 0
) -> int:
    """Blocks for a drafter's KV pool: the target's token capacity, capped on CUDA by free memory less
    `reserve_bytes` (what the drafter allocates after its pool, e.g. its CUDA graphs)."""
    blocks = target_num_blocks + 4
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        usable = int((free - _GPU_RESERVE_BYTES - reserve_bytes) * 0.9)
        if usable < 16 * bytes_per_block:
            raise ValueError(f"no GPU memory left for the {what}'s KV cache; lower gpu_memory_utilization.")
        blocks = min(blocks, usable // bytes_per_block)
    return blocks


_VERIFY_QUERY_LENS = (1, 2)  # after verification the catch-up feeds one or two tokens per request
CATCH_UP_BATCHED_TOKENS = 8192  # tokens per catch-up forward (at least): fewer, larger forwards under load
_GRAPH_PIECES = 4  # a catch-up of up to this many longest-graph lengths replays the graph per piece


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


class DraftSampler:
    """Draft logits -> draft tokens, one draft position per `sample` call and row.

    A seeded row's draft at output position t races on the target sampler's keyed noise for (seed, t)
    (`seeded_tokens`): where the draft's distribution is close to the target's they pick the same token, so
    drafts are accepted more often, and the output, the plain sampler's token at every position, is the same
    for every k. Unseeded rows draw from torch's default generator."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self._meta: SamplingMetadata | None = None
        self._greedy: list[bool] = []
        self._drafted: list[int] = []  # per row: draft positions sampled since `begin`

    def begin(self, reqs: list[Request]) -> None:
        """One metadata row per request (rows of `sample` index into this list)."""
        self._greedy = [r.params.greedy for r in reqs]
        self._drafted = [0] * len(reqs)
        self._meta = None
        if all(self._greedy):
            return
        self._meta = SamplingMetadata.build(
            [r.params for r in reqs],
            [r.prompt_token_ids for r in reqs],
            [r.output_token_ids for r in reqs],
            self.vocab_size,
            self.device,
        )

    @property
    def meta(self) -> SamplingMetadata | None:
        """One row per request of the last `begin`, at its next output position; None when all are greedy."""
        return self._meta

    def sample(self, logits: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [len(rows), vocab] -> (tokens [len(rows)] int64, draft_probs [len(rows), vocab] or None if all
        greedy), on the device."""
        if logits.shape[1] != self.vocab_size:
            logits = logits[:, : self.vocab_size]
        if self._meta is None or all(self._greedy[r] for r in rows):
            return logits.argmax(dim=-1), None  # greedy drafts are one-hot: no distribution
        offsets = []  # a row listed twice (P-EAGLE's parallel drafts) drafts consecutive positions
        for r in rows:
            offsets.append(self._drafted[r])
            self._drafted[r] += 1
        meta = self._meta.select_rows(rows, offsets)
        probs = compute_target_probs(logits, meta)
        tokens = random_sample(probs, draw_exponential(len(rows), self.vocab_size, None, logits.device))
        if (seeded := seeded_tokens(probs, meta)) is not None:
            tokens.index_copy_(0, *seeded)
        if meta.greedy_mask is not None:  # the rows' greedy flags, already on the device
            tokens = torch.where(meta.greedy_mask, logits.argmax(dim=-1), tokens)
        return tokens, probs

    def is_greedy(self, row: int) -> bool:
        return self._greedy[row]


def check_same_vocabulary(target: LoadedModel, draft_name: str, draft_vocab_size: int, draft_tokenizer) -> None:
    """A draft must share the target's token ids: same vocab size, same strings for sampled ids."""
    where = f"speculative_config.model {draft_name!r}"
    if draft_vocab_size != target.arch.vocab_size:
        raise ValueError(
            f"{where} has vocab_size {draft_vocab_size}, the target {target.name!r} has "
            f"{target.arch.vocab_size}: a draft model must use the target's tokenizer."
        )
    t_tok, d_tok = target.tokenizer, draft_tokenizer
    if t_tok is None or d_tok is None:
        return
    if len(t_tok) != len(d_tok):
        raise ValueError(f"{where}'s tokenizer has {len(d_tok)} tokens, the target's has {len(t_tok)}.")
    ids = np.unique(np.linspace(0, len(t_tok) - 1, _VOCAB_SAMPLE).astype(np.int64)).tolist()
    t_str, d_str = t_tok.convert_ids_to_tokens(ids), d_tok.convert_ids_to_tokens(ids)
    bad = [i for i, a, b in zip(ids, t_str, d_str) if a != b]
    if bad:
        raise ValueError(
            f"{where}'s tokenizer differs from the target's (e.g. id {bad[0]}: "
            f"{d_str[ids.index(bad[0])]!r} vs {t_str[ids.index(bad[0])]!r})."
        )


def _load_draft(cfg: SpeculativeConfig, parts) -> LoadedModel:
    """Vocab size is checked from the config before any weight is read; token strings after."""
    from specserve.model.loader import WeightSource

    target: LoadedModel = parts.loaded
    dtype = target.model.embed_tokens.weight.dtype
    assert cfg.model is not None  # SpeculativeConfig requires it for draft_model
    load_format = "dummy" if target.identity.startswith("dummy:") else "auto"
    source = WeightSource.open(ModelConfig(model=cfg.model, load_format=load_format))
    check_same_vocabulary(target, cfg.model, int(source.hf_config["vocab_size"]), None)
    window = min(target.max_model_len, cfg.max_model_len or target.max_model_len)
    max_len = min(window, int(source.hf_config.get("max_position_embeddings", 4096)))
    mcfg = ModelConfig(
        cfg.model, dtype=str(dtype).removeprefix("torch."), max_model_len=max_len, load_format=load_format
    )
    loaded = load_model(mcfg, parts.device, dtype, parts.ops, progress=False)
    check_same_vocabulary(target, cfg.model, loaded.arch.vocab_size, loaded.tokenizer)
    return loaded


class DraftModelProposer(OwnKVLifecycle, DraftDelivery, Proposer):
    name = "draft_model"

    def __init__(self, cfg: SpeculativeConfig, parts) -> None:
        self.device = parts.device
        self.loaded = _load_draft(cfg, parts)
        arch, tspec = self.loaded.arch, parts.runner.spec
        spec = KVCacheSpec(arch.num_layers, arch.num_kv_heads, arch.head_dim, tspec.block_size, tspec.fmt)
        graphs = parts.runner.graphs is not None
        lens = (_VERIFY_QUERY_LENS, (), CATCH_UP_QUERY_LENS, MIXED_TOKEN_LENS)  # verify, prefill, catch-up, mixed
        max_seqs, max_len = parts.scheduler.max_num_seqs, self.loaded.max_model_len
        # the graphs' float32 logits and hidden outputs, allocated after the KV pool
        args = (max_seqs, *lens[:2], arch.vocab_size, arch.hidden_size, 4, *lens[2:], max_len)
        reserve = graph_output_bytes(*args) if graphs else 0
        num_blocks = draft_kv_blocks(parts.kv.num_blocks, spec.bytes_per_block, self.device, "draft model", reserve)
        self.runner = ModelRunner(self.loaded, spec, num_blocks, self.device, parts.runner.backend)
        self.kv = KVCacheManager(num_blocks, tspec.block_size, enable_prefix_caching=False)
        self.max_len = max_len
        self.max_batched = max(parts.scheduler.max_num_batched_tokens, CATCH_UP_BATCHED_TOKENS)
        self.sampler = DraftSampler(arch.vocab_size, self.device)
        self.seqs: dict[str, _DraftSeq] = {}
        if graphs:
            self.runner.capture_graphs(max_seqs, self.max_len, *lens)
        self.chain = _ChainSteps(self.runner, self.kv)
        self._catch_up_tokens = 0

    def propose(self, inp: ProposeInput) -> None:
        self._catch_up_tokens = 0
        reqs, seqs, ks = [], [], []
        for req, k in zip(inp.requests, inp.num_draft_tokens):
            seq = self._sync(req)
            k = min(k, self.max_len - req.num_tokens)
            if k <= 0 or not self.kv.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens, None, k - 1):
                continue  # no room in the draft's window or pool: no drafts
            reqs.append(req)
            seqs.append(seq)
            ks.append(k)
        if not reqs:
            return
        self.sampler.begin(reqs)
        self._catch_up_tokens = sum(s.num_tokens - s.num_computed_tokens for s in seqs)
        logits = self._catch_up(seqs)  # [len(reqs), vocab]
        dt = DraftTokens()  # on the device; the host reads them once
        rows = list(range(len(reqs)))
        dt.add(rows, *self.sampler.sample(logits, rows))
        if max(ks) > 1:
            self.chain.run(seqs, ks, dt, self.sampler)
        for seq, k in zip(seqs, ks):
            seq.num_computed_tokens += k - 1

        def fed(drafts: list[list[int]]) -> None:
            for seq, d, k in zip(seqs, drafts, ks):  # the fed drafts (all but the last), which _sync compares
                seq.all_token_ids.extend(d[: k - 1])

        self.deliver(dt, reqs, fed)

    def propose_tree(self, inp: ProposeInput, shape: TreeShape) -> None:
        """EAGLE-2 style trees (tree_draft.py): greedy requests' of the draft's top-k, random ones' sampled from
        the draft's distribution (drafts with probabilities). Each level feeds the root and every fed node again
        with the tree's ancestor mask, at the slots after the root (as the target verifies them); the draft's KV
        keeps the real tokens only."""
        self._catch_up_tokens = 0
        reqs: list[Request] = []
        seqs, trees = [], []
        for req, budget in zip(inp.requests, inp.num_draft_tokens):
            seq, room = self._sync(req), self.max_len - req.num_tokens
            fed = min(shape.branching * (shape.depth - 1), room)
            tree = TreeDraft(shape, budget, min(shape.depth, room), fed, not req.params.greedy, len(reqs))
            unseen = seq.num_tokens - seq.num_computed_tokens
            if tree.depth > 0 and self.kv.allocate_slots(seq, unseen, None, tree.max_fed):
                reqs.append(req)
                seqs.append(seq)
                trees.append(tree)
        if not reqs:
            return
        self.sampler.begin(reqs)  # the random requests' sampling metadata
        self._catch_up_tokens = sum(s.num_tokens - s.num_computed_tokens for s in seqs)
        add_level(trees, self._catch_up(seqs), meta=self.sampler.meta)
        while active := [i for i, t in enumerate(trees) if t.expand()]:
            sched = SchedulerOutput()
            for i in active:
                seqs[i].spec_token_ids, seqs[i].spec_tree_parents = trees[i].fed_tree()
                seqs[i].num_computed_tokens = seqs[i].num_tokens - 1  # the root again: the tree's query starts there
                sched.scheduled.append(
                    ScheduledRequest(cast(Request, seqs[i]), 1 + len(trees[i].fed), len(trees[i].fed))
                )
            out = self.runner.execute(sched, self.kv.block_ids)
            firsts = [cast(tuple[int, int], r)[0] for r in out.batch.logit_rows]
            add_level(
                [trees[i] for i in active],
                out.logits[[f + n for f, i in zip(firsts, active) for n in trees[i].frontier_nodes()]],
                meta=self.sampler.meta,
            )
        for req, seq, tree in zip(reqs, seqs, trees):
            seq.num_computed_tokens, seq.spec_token_ids, seq.spec_tree_parents = seq.num_tokens, [], None
            req.spec_token_ids, parents = tree.result()
            req.spec_tree_parents, req.spec_draft_probs = None if is_chain(parents) else parents, tree.draft_probs()

    def catch_up_tokens(self) -> int:
        return self._catch_up_tokens

    def _sync(self, req: Request) -> _DraftSeq:
        """Keep the draft KV that still matches the request's tokens (rejected drafts fall out)."""
        seq = self.seqs.setdefault(req.request_id, _DraftSeq(req.request_id))
        tokens = req.all_token_ids
        fed = seq.all_token_ids[seq.num_real : seq.num_computed_tokens]
        valid = seq.num_real + common_prefix_len(fed, tokens[seq.num_real :])
        # At least the last token is fed again: its logits are where the first draft comes from.
        seq.num_computed_tokens = min(seq.num_computed_tokens, valid, len(tokens) - 1)
        # Swap the fed drafts for the new real tokens (real tokens only grow).
        del seq.all_token_ids[seq.num_real :]
        seq.all_token_ids.extend(tokens[seq.num_real :])
        seq.num_real = len(tokens)
        return seq

    def catch_up_cap(self, unseen: list[int]) -> int | None:
        """Most tokens a sequence feeds per catch-up forward, sequences with `unseen` tokens each (None: no cap)."""
        graphs = self.runner.graphs
        lens = (graphs.catch_up_query_lens or graphs.prefill_query_lens) if graphs is not None else ()
        if not lens or not unseen or len(unseen) > graphs.sizes_by_q[max(lens)][-1]:
            return None
        sizes = graphs.mixed_sizes
        if sizes and sum(unseen) <= max(sizes) and len(unseen) <= sizes[max(sizes)][-1]:
            return None  # the whole catch-up fits a mixed graph: one replay
        piece = max(lens)
        return piece if piece < max(unseen) <= _GRAPH_PIECES * piece else None

    def _catch_up(self, seqs: list[_DraftSeq]) -> torch.Tensor:
        """Feed every seq's unseen tokens (forwards of <= max_batched tokens, catch_up_cap() per sequence) -> each
        seq's last logits [len(seqs), vocab], valid until the draft's next forward (maybe a CUDA graph's output)."""
        rows: list[torch.Tensor | None] = [None] * len(seqs)
        pending = list(range(len(seqs)))
        cap = self.catch_up_cap([s.num_tokens - s.num_computed_tokens for s in seqs]) or self.max_batched
        while pending:
            budget, sched, order = self.max_batched, SchedulerOutput(), []
            for i in pending:
                n = min(seqs[i].num_tokens - seqs[i].num_computed_tokens, budget, cap)
                if n <= 0:
                    break
                sched.scheduled.append(ScheduledRequest(cast(Request, seqs[i]), n, 0))
                order.append(i)
                budget -= n
            samples = [s.samples for s in sched.scheduled]  # read before num_computed moves
            out = self.runner.execute(sched, self.kv.block_ids)
            got = []  # (seq, its logits row)
            for j, (i, s) in enumerate(zip(order, sched.scheduled)):
                seqs[i].num_computed_tokens += s.num_new_tokens
                if samples[j]:
                    logit_row = out.batch.logit_rows[j]
                    assert logit_row is not None
                    got.append((i, logit_row[0]))
            if got == [(i, i) for i in range(len(seqs))] and out.logits.shape[0] == len(seqs):
                return out.logits  # the usual case: one forward, row i = seq i (no copies)
            for i, first in got:
                rows[i] = out.logits[first].clone()  # a CUDA graph's output is overwritten on replay
            pending = [i for i in pending if rows[i] is None]
        return torch.stack(cast(list[torch.Tensor], rows))  # the loop ends once every seq has its row


@functools.lru_cache(maxsize=64)
def _uniform_layout(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int], list[tuple[int, int] | None]]:
    """Host arrays (shared: never written) of n one-token sequences, all scored: (placeholder input ids,
    cu_query_lens, logits_indices, query_lens, logit_rows)."""
    return (
        np.full(n, PLACEHOLDER, dtype=np.int64),
        np.arange(n + 1, dtype=np.int32),
        np.arange(n, dtype=np.int64),
        [1] * n,
        [(i, 1) for i in range(n)],
    )


class _ChainSteps:
    """The draft's one-token forwards after the catch-up (step s = 1..k-1 feeds step s - 1's draft), with block
    tables made once per propose and each step's positions, slots and lengths in a few numpy operations."""

    def __init__(self, runner: ModelRunner, kv: KVCacheManager) -> None:
        self.runner, self.kv = runner, kv

    def run(self, seqs: list[_DraftSeq], ks: list[int], dt: DraftTokens, sampler: DraftSampler) -> None:
        """Steps 1..max(ks) - 1; request i takes part in steps s < ks[i]. Leaves the seqs' state to propose()."""
        base = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, len(seqs))
        tables = block_table_array([self.kv.block_ids(s.request_id) for s in seqs])
        active = list(range(len(seqs)))
        for step in range(1, max(ks)):
            prev, active = active, [i for i in active if ks[i] > step]
            tokens = dt.last_tokens
            if active != prev:  # fewer requests than the last step: their rows of its drafts
                keep = dt.rows_in_last(active)
                tokens = tokens.index_select(0, self._index(tuple(keep)))
                base, tables = base[keep], tables[keep]
            host = self.host_batch(base + (step - 1), tables)
            dt.add(active, *sampler.sample(self.forward(host, tokens), active))

    def host_batch(self, positions: np.ndarray, tables: np.ndarray) -> HostBatch:
        """One token per sequence at `positions` ([n] int64) with block tables `tables`."""
        bs = self.runner.block_size
        n = len(positions)
        ids, cu, logits_indices, query_lens, logit_rows = _uniform_layout(n)
        slots = tables[np.arange(n), positions // bs].astype(np.int64) * bs + positions % bs
        return HostBatch(
            ids, positions, slots, tables, (positions + 1).astype(np.int32), cu, logits_indices, query_lens, logit_rows
        )

    def forward(self, host: HostBatch, tokens: torch.Tensor) -> torch.Tensor:
        """host's batch with input ids `tokens` ([n] int64 on the device) -> logits [n, vocab] (valid until the
        draft's next forward)."""
        return self.runner.forward_scored(host, tokens, self._index(tuple(range(host.num_tokens))))

    def _index(self, rows: tuple[int, ...]) -> torch.Tensor:
        """rows as an int64 device tensor (cached: steady-state steps repeat them)."""
        return cached_tensor(self.runner.device, ("rows", rows), lambda: torch.tensor(rows, dtype=torch.int64))
