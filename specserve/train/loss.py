"""The head's loss in `specserve train-draft`. Block 1, row t: (embed(x[t+1]), target feature t); block s > 1,
row t: the draft s - 1 steps after real row p = t - s + 1 (sees block-1 rows <= p and rows p+1..t of blocks 2..s;
inputs: the previous block's output at t - 1, or P-EAGLE's mask pair). Row t predicts x[t+2] against the target's
distribution at t+1 (renormalized over d2t when reduced), weighted 0.8^(s-1); EAGLE-1 adds feature regression."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from specserve.speculative.proposers.eagle_head import EagleHead, target_lm_weight


def _block_mask(rows: int, s: int, device: torch.device) -> torch.Tensor:
    """[rows, s * rows] bool: keys row t of block s sees (block 1: t' <= t - s + 1; block j: t' == t - (s - j))."""
    size = -(-rows // 256) * 256
    return _block_mask_of_size(size, s, device)[:rows, :, :rows].reshape(rows, s * rows)


@functools.lru_cache(maxsize=64)
def _block_mask_of_size(rows: int, s: int, device: torch.device) -> torch.Tensor:
    """[rows, s, rows]: _block_mask, cached; its top-left corner is the smaller mask."""
    q = torch.arange(rows, device=device)[:, None]
    k = torch.arange(rows, device=device)[None, :]
    parts = [k <= q - (s - 1)] + [k == q - (s - j) for j in range(2, s + 1)]
    return torch.stack(parts, dim=1)


def loss_rows(lengths: list[int], loss_start: list[int], max_len: int, num_blocks: int) -> list[torch.Tensor]:
    """Host (CPU) int64 row indices into [B * (L - 1)] of each block's rows in the loss: row t of sequence b needs
    x[t+1] and the label at t+1, learns only where the answer is (t >= loss_start), and block s starts at row s - 1
    (its last real row must exist)."""
    R = max_len - 1
    pos = torch.arange(R)
    lens, starts = torch.tensor(lengths), torch.tensor(loss_start)
    valid = (pos[None, :] < (lens[:, None] - 1)) & (pos[None, :] >= starts[:, None])
    return [(valid & (pos[None, :] >= s - 1)).reshape(-1).nonzero().squeeze(1) for s in range(1, num_blocks + 1)]


def _to_device_rows(rows: list[torch.Tensor], R: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per block (rows into [B * R], the label rows into [B * (R + 1)]), sent in one copy."""
    both = [x for r in rows for x in (r, r + r // R + 1)]  # b * R + t -> b * (R + 1) + t + 1
    packed = torch.cat(both)
    if device.type == "cuda":
        packed = packed.pin_memory()
    parts = packed.to(device, non_blocking=True).split([x.numel() for x in both])
    return list(zip(parts[0::2], parts[1::2]))


def head_block_outputs(
    head: EagleHead, target, ids: torch.Tensor, feats: torch.Tensor, num_blocks: int, parallel: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(out, logits_input) of every block, each [B * (L - 1), hidden]."""
    B, L = ids.shape
    R, dev = L - 1, ids.device
    arch = head.layer
    embeds = head.embed(ids[:, 1:], target).reshape(B * R, -1)
    hidden = head.fuse_target(feats[:, :R].reshape(B * R, -1))
    positions = torch.arange(R, device=dev).repeat(B)
    keys: list[tuple[torch.Tensor, torch.Tensor]] = []
    outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for s in range(1, num_blocks + 1):
        if s > 1:
            if parallel:
                embeds, hidden = head.mask_inputs(B * R)
            else:  # row t continues from the head's own output at row t - 1 of the previous block
                prev = outputs[-1][0].view(B, R, -1)
                hidden = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1).reshape(B * R, -1)
        mask = _block_mask(R, s, dev)

        def attend(q, k, v, mask=mask):
            q, k, v = (t.view(B, R, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
            keys.append((k, v))
            ks, vs = torch.cat([kv[0] for kv in keys], 2), torch.cat([kv[1] for kv in keys], 2)
            group = arch.num_heads // arch.num_kv_heads
            if group > 1:
                ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
            o = F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask, scale=arch.head_dim**-0.5)
            return o.transpose(1, 2).reshape(B * R, arch.num_heads, arch.head_dim)

        outputs.append(head(embeds, hidden, positions, target.cos_sin_cache, attend))
    return outputs


def reduced_vocab_labels(
    lab: torch.Tensor, target_top: torch.Tensor, d2t: torch.Tensor, hard_weight: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft labels over d2t from lab [rows, N] (the target's probs of d2t; overwritten) and its argmax [rows]."""
    lab = lab.div_(lab.sum(-1, keepdim=True).clamp_(min=torch.finfo(lab.dtype).tiny))
    # The argmax's column in d2t (ascending): exact even where bfloat16 labels tie.
    col = torch.searchsorted(d2t, target_top).clamp_(max=d2t.numel() - 1)
    in_set = d2t.index_select(0, col) == target_top
    hard = in_set.unsqueeze(1).to(lab.dtype) * hard_weight  # [rows, 1]
    return lab.mul_(1 - hard).scatter_add_(1, col.unsqueeze(1), hard), in_set


def _token_loss(
    logits: torch.Tensor, lab: torch.Tensor, hard_weight: float, d2t: torch.Tensor | None, top: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy, top-1 agreement) of logits [rows, width] against lab [rows, width] (overwritten)."""
    if d2t is not None:
        mixed, _ = reduced_vocab_labels(lab, top, d2t, hard_weight)
        agree = d2t.index_select(0, logits.detach().argmax(-1)) == top
        return F.cross_entropy(logits, mixed), agree.float().mean()
    # (1 - w) * soft CE + w * hard CE == CE against (1 - w) * probs + w * onehot: one [rows, vocab] activation.
    best = lab.argmax(-1, keepdim=True)
    mixed = lab.mul_(1 - hard_weight).scatter_add_(1, best, torch.full_like(best, hard_weight, dtype=lab.dtype))
    return F.cross_entropy(logits, mixed), (logits.detach().argmax(-1) == best.squeeze(1)).float().mean()


def head_loss(
    head: EagleHead,
    target,
    ids: torch.Tensor,
    lengths: list[int],
    loss_start: list[int],
    feats: torch.Tensor,
    probs: torch.Tensor,
    last_hidden: torch.Tensor,
    num_blocks: int,
    parallel: bool,
    hard_weight: float = 0.5,
    target_top: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(loss, per-block top-1 agreement as 0-d device tensors), with no device sync."""
    B, L = ids.shape
    R = L - 1
    d2t = head.d2t
    if d2t is not None and (target_top is None or probs.shape[-1] != d2t.numel()):
        raise ValueError(
            f"a head with a {d2t.numel()}-token draft vocabulary needs probs [B, L, {d2t.numel()}] "
            f"and target_top (got probs {tuple(probs.shape)}, target_top {target_top is not None})."
        )
    block_rows = _to_device_rows(loss_rows(lengths, loss_start, L, num_blocks), R, ids.device)
    # Rows of the padded [B, L] tensors, unsliced: row t of [B, R] is row t + 1 of its sequence there.
    labels = probs.reshape(B * L, -1)
    tops = None if d2t is None else target_top.reshape(B * L)
    lm_weight = head.lm_head.weight if head.published else target_lm_weight(target)
    if d2t is not None and not head.published:  # the frozen target LM-head rows of the draft vocabulary
        lm_weight = lm_weight.index_select(0, d2t.to(lm_weight.device))
    loss, accs = torch.zeros((), device=ids.device), []
    outputs = head_block_outputs(head, target, ids, feats, num_blocks, parallel)
    for s, ((out, normed), (rows, label_rows)) in enumerate(zip(outputs, block_rows), 1):
        if rows.numel() == 0:  # sequences too short for this depth (a host-known size: no sync)
            continue
        logits = F.linear(normed.index_select(0, rows), lm_weight).float()
        lab = labels.index_select(0, label_rows).float()
        ce, acc = _token_loss(logits, lab, hard_weight, d2t, None if tops is None else tops.index_select(0, label_rows))
        block_loss = ce
        if head.norm is None:  # EAGLE-1: regress the target's next hidden state as well
            goal = last_hidden.reshape(B * L, -1).index_select(0, label_rows).float()
            block_loss = F.smooth_l1_loss(out.index_select(0, rows).float(), goal) + 0.1 * ce
        loss = loss + (0.8 ** (s - 1)) * block_loss
        accs.append(acc)
    return loss, accs
