"""A draft model's chained single-token steps of a propose as ONE CUDA graph per (batch size, steps).

`_ChainSteps` (draft_model.py) replays the draft's decode graph once per draft step. Each step the host
fills and copies that step's inputs (positions, slots, sequence lengths, block tables), replays, and
launches the argmax that feeds the next step. On the H200 a chained step took ~0.61 ms against
0.556 ms for the replay alone (bench/verify_cost.py and bench/spec_profile.py, tenth session): ~50 us
of copies, launches and gaps per step, ~0.5 ms of a k = 12 proposal. Here the whole chain is one
graph. Its inputs are copied once per propose: each row's first position, its step count, its block
table and its first draft. Every step then computes its positions, slots and lengths on the device,
runs the forward and the LM head, and feeds its argmax to the next step, all inside the graph.

Greedy rows only: a random row samples between steps, with its own generator. A propose with a
random row, more rows than the largest captured size, or more steps than captured runs `_ChainSteps`.
A row with fewer steps than the chain (a smaller k) stops at its last position. It then stores no
K/V (slot -1), and its extra drafts are dropped.

Off unless SPECSERVE_DRAFT_CHAIN_GRAPH=1, until it is measured on the H200. Without capture (the
CPU) the same buffers run the same steps eagerly; tests/unit/test_draft_chain_graph.py compares that
with `_ChainSteps`.
"""
from __future__ import annotations

import numpy as np
import torch

from specserve.attention.base import AttentionMetadata, ForwardContext, forward_context
from specserve.runner.cuda_graph import gc_paused_for_capture
from specserve.runner.model_runner import ModelRunner

# Batch sizes with a chain graph: speculation pays at small batches (the controller drafts nothing
# at large ones), and every (size, steps) pair is its own graph.
CHAIN_BATCH_SIZES = (1, 2, 4)


class DraftChainGraphs:
    def __init__(self, runner: ModelRunner, max_model_len: int, max_num_seqs: int, max_steps: int,
                 capture: bool) -> None:
        self.runner, self.max_model_len, self.max_steps = runner, max_model_len, max_steps
        self.block_size = runner.block_size
        self.vocab_size = runner.loaded.arch.vocab_size
        self.sizes = tuple(b for b in CHAIN_BATCH_SIZES if b <= max_num_seqs) or (1,)
        self.max_blocks = -(-max_model_len // self.block_size)
        dev, max_bs = runner.device, self.sizes[-1]
        # The propose's inputs, one pinned host buffer and one copy: per row its first position, its
        # steps, then its block table (int64 throughout, so one buffer serves all).
        self._host = torch.zeros(2 * max_bs + max_bs * self.max_blocks, dtype=torch.int64,
                                 pin_memory=dev.type == "cuda")
        self._inputs = torch.zeros_like(self._host, device=dev)
        self.base, self.steps, flat_tables = self._inputs.split([max_bs, max_bs, max_bs * self.max_blocks])
        self.tables = flat_tables.view(max_bs, self.max_blocks)
        self.first = torch.zeros(max_bs, dtype=torch.int64, device=dev)  # step 1's input ids
        # What each step's forward reads (written inside the graph).
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.slots = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        self.tables32 = torch.zeros(max_bs, self.max_blocks, dtype=torch.int32, device=dev)
        self.cu = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self.drafts = torch.zeros(max_steps, max_bs, dtype=torch.int64, device=dev)  # [step, row]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.replays = 0  # chains run (tests and benchmarks read it)
        if capture:
            self._capture()

    def fits(self, n: int, steps: int) -> bool:
        return n <= self.sizes[-1] and 1 <= steps <= self.max_steps

    @torch.inference_mode()
    def run(self, base: np.ndarray, ks: list[int], tables: np.ndarray, first: torch.Tensor) -> torch.Tensor:
        """Rows i = 0..n-1: first chained position base[i], ks[i] - 1 steps, block table tables[i], step
        1's input first[i] (on the device). Returns drafts [max(ks) - 1, n] on the device (row i's valid
        for its first ks[i] - 1 steps); a view of a static buffer, valid until the next chain."""
        n, steps = len(ks), max(ks) - 1
        bs = next(b for b in self.sizes if b >= n)
        max_bs = self.sizes[-1]
        host = self._host.numpy()
        host[:] = 0  # padding rows: position 0, no steps, block 0
        host[:n] = base
        host[max_bs:max_bs + n] = np.asarray(ks, dtype=np.int64) - 1
        host[2 * max_bs:].reshape(max_bs, self.max_blocks)[:n, :tables.shape[1]] = tables
        self._inputs.copy_(self._host, non_blocking=True)
        self.first[:n].copy_(first)
        self.first[n:].zero_()
        graph = self.graphs.get((bs, steps))
        if graph is not None:
            graph.replay()
        else:
            self._chain(bs, steps)
        self.replays += 1
        return self.drafts[:steps, :n]

    def _chain(self, bs: int, steps: int) -> None:
        """Steps 1..steps of bs rows: positions, slots and lengths from the inputs, then the forward,
        the LM head and the argmax that the next step reads."""
        runner, blk = self.runner, self.block_size
        self.tables32[:bs].copy_(self.tables[:bs])
        meta = AttentionMetadata(self.cu[:bs + 1], self.seq_lens[:bs], self.tables32[:bs], self.slots[:bs],
                                 max_query_len=1, max_seq_len=self.max_model_len, num_seqs=bs, num_tokens=bs)
        base, limit = self.base[:bs], self.steps[:bs]
        tokens = self.first[:bs]
        for s in range(steps):
            # A row past its steps stays at its last position (inside its blocks) and stores nothing.
            pos = base + (limit - 1).clamp(min=0, max=s)
            block = torch.div(pos, blk, rounding_mode="floor").clamp_(max=self.max_blocks - 1)
            slot = self.tables[:bs].gather(1, block.unsqueeze(1)).squeeze(1) * blk + pos % blk
            self.positions[:bs].copy_(pos)
            self.slots[:bs].copy_(slot.masked_fill_(limit <= s, -1))
            self.seq_lens[:bs].copy_(pos + 1)
            with forward_context(ForwardContext(meta, runner.kv_caches, runner.fmt, runner.backend)):
                out = runner.model(tokens, self.positions[:bs])
            logits = runner.model.compute_logits(out[0] if isinstance(out, tuple) else out)
            self.drafts[s, :bs].copy_(logits[:, :self.vocab_size].argmax(dim=-1))
            tokens = self.drafts[s, :bs]

    def _capture(self) -> None:
        pool = None
        with gc_paused_for_capture():
            for bs in reversed(self.sizes):
                self._inputs.zero_()  # no row has steps: nothing is stored in the KV
                self.first.zero_()
                for _ in range(2):  # warm up (Triton compiles, cuBLAS picks): a step is a step at any length
                    self._chain(bs, 1)
                torch.cuda.synchronize(self.runner.device)
                for steps in range(self.max_steps, 0, -1):  # longest first: later graphs reuse its pool
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._chain(bs, steps)
                    pool = graph.pool()
                    self.graphs[(bs, steps)] = graph
        torch.cuda.synchronize(self.runner.device)
