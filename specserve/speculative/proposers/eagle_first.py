"""The head's first forward of a propose over static buffers, as one CUDA graph per batch size."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from specserve.speculative.proposers.eagle_graph import PAD_SLOT, StaticForward

# Sizes above this many picks run eagerly (each graph keeps its float32 logits [bs * picks, vocab]).
MAX_GRAPH_PICKS = 128


class FirstForwardGraphs(StaticForward):
    """Static buffers, and on CUDA graphs, for the head's first forward of a propose."""

    def __init__(
        self,
        proposer,
        batch_sizes: Sequence[int],
        max_blocks: int,
        k: int,
        parallel: bool,
        feed: tuple[torch.Tensor, torch.Tensor] | None,
        capture: bool,
    ) -> None:
        """parallel: P-EAGLE (k picks per request: the last real row and k - 1 mask rows), else one pick.
        feed: HeadStepGraphs' (hidden, tokens), written with the picks' outputs and argmax."""
        picks_per_req = k if parallel else 1
        sizes = [b for b in batch_sizes if b * picks_per_req <= MAX_GRAPH_PICKS] or [1]
        super().__init__(proposer, sizes, max_blocks)
        self.parallel, self.feed, self.picks_per_req = parallel, feed, picks_per_req
        # After verifying k drafts a request has at most k + 1 new real rows, then k - 1 mask rows.
        self.rows_per_req = 2 * k if parallel else k + 1
        max_bs = self.batch_sizes[-1]
        self._rows, self._picks = max_bs * self.rows_per_req, max_bs * self.picks_per_req
        fields = self._alloc([(5, self._rows), (2, self._picks)])  # per row, per pick
        self.rows, self.tokens, self.positions, self.slot_mapping, self.mask, self.pick, self.sel = fields
        dtype, hcfg = self.target.embed_tokens.weight.dtype, self.head.cfg
        num_layers = max(1, len(hcfg.aux_hidden_layers))
        self.feats = torch.zeros(num_layers, self._rows, hcfg.hidden_size, dtype=dtype, device=self.device)
        # Per size: the views the host touches between replays, made once.
        self._gather = {
            bs: (self.rows[: bs * self.rows_per_req], self.feats[:, : bs * self.rows_per_req].unbind(0))
            for bs in self.batch_sizes
        }
        if capture:
            self.capture()

    def size_for(self, ks: list[int], num_real: list[int], tables: list[list[int]]) -> int | None:
        """The padded batch size of a propose, or None when it does not fit the buffers."""
        i = bisect.bisect_left(self.batch_sizes, len(ks))
        extra = max(ks) - 1 if self.parallel else 0
        if (
            i == len(self.batch_sizes)
            or max(num_real) + extra > self.rows_per_req
            or (self.parallel and max(ks) > self.picks_per_req)
            or max(len(t) for t in tables) > self.max_blocks
        ):
            return None
        return self.batch_sizes[i]

    def _forward(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, picks = bs * self.rows_per_req, bs * self.picks_per_req
        meta = self._meta(bs, rows, self.rows_per_req)
        feats = self.feats[:, :rows]
        hidden = self.head.fuse_target(feats[0] if feats.shape[0] == 1 else feats.transpose(0, 1).reshape(rows, -1))
        embeds = self.head.embed(self.tokens[:rows], self.target)
        if self.parallel:  # mask rows read the learned pair instead
            mask = self.mask[:rows].bool().unsqueeze(1)
            me, mh = self.head.mask_inputs(1)
            embeds = torch.where(mask, me.to(embeds.dtype), embeds)
            hidden = torch.where(mask, mh.to(hidden.dtype), hidden)
        out, normed = self.head(embeds, hidden, self.positions[:rows], self.target.cos_sin_cache, self._attend(meta))
        pick = self.pick[:picks]
        out = out.index_select(0, pick)
        logits = self.head.compute_logits(normed.index_select(0, pick), self.target)
        argmax = self.head.greedy_token_ids(logits)  # target ids (a reduced vocabulary maps through d2t)
        if self.feed is not None:  # the first draft step's inputs
            self.feed[0][:picks].copy_(out)
            self.feed[1][:picks].copy_(argmax)
        return out, logits, argmax

    def run(self, bs: int, features: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gather the sent rows' features, run size bs -> (out, logits, argmax) of the picks, [bs * picks_per_req, ...]
        each (valid until the next run)."""
        rows, feats = self._gather[bs]
        for src, dst in zip(features, feats):
            torch.index_select(src, 0, rows, out=dst)
        return self._run(bs)

    def send(self, bs: int, plan, ctx: list[int], tables: list[list[int]]) -> None:
        """Copy a propose's inputs into the static buffers (one pinned slot): the plan's (eagle._Plan) per request
        draft count, real rows and last real position, per real row its feature row, next token and position;
        per request its cached head rows (ctx) and blocks."""
        ks, num_real, positions = plan.ks, plan.num_real, plan.positions
        n, bsz, p, rows_per_req = len(ks), self.block_size, self.picks_per_req, self.rows_per_req
        nbytes = self._fields + n * self.max_blocks * 4
        rows, tokens, pos, slots, mask, pick, sel, cu, seq_lens, tab = self.upload.stage_views(
            self._buf.numel(), self._host_views
        )
        tab[:n] = 0
        # Plain Python: few requests, where numpy's per-call cost would dominate.
        slot_l: list[int] = []
        pos_l: list[int] = []
        pick_l: list[int] = []
        sel_l: list[int] = []
        cu_l, len_l = [0], []
        real_rows: list[int] = []  # row index of each real row
        mask_rows: list[int] = []
        total = r = 0
        for i, (m, k, c, last, t) in enumerate(zip(num_real, ks, ctx, plan.last_pos, tables)):
            e = k - 1 if self.parallel else 0
            tab[i, : len(t)] = t
            slot_l += [t[x // bsz] * bsz + x % bsz for x in range(c, c + m + e)]
            real_rows += range(total, total + m)
            mask_rows += range(total + m, total + m + e)
            pos_l += [*positions[r : r + m], *range(last + 1, last + 1 + e)]
            pick_l += [*range(total + m - 1, total + m + e), *[0] * (p - e - 1)]
            sel_l += range(i * p, i * p + e + 1)
            total += m + e
            r += m
            cu_l.append(total)
            len_l.append(c + m + e)
        end = bs * rows_per_req
        rows[:end] = tokens[:end] = mask[:end] = pos[total:end] = 0
        slots[total:end] = PAD_SLOT
        rows[real_rows], tokens[real_rows] = plan.feature_rows, plan.next_tokens
        mask[mask_rows] = 1
        pos[:total], slots[:total] = pos_l, slot_l
        pick[: n * p], pick[n * p : bs * p] = pick_l, 0
        sel[: len(sel_l)] = sel_l
        cu[: n + 1], cu[n + 1 : bs + 1] = cu_l, total  # padding sequences are empty
        seq_lens[:n], seq_lens[n:bs] = len_l, 0
        self.upload.send_staged(self._buf, nbytes)
