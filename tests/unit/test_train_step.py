"""The trainer's step without device syncs equals the straightforward one: the batched dense
attention of the frozen target == per-sequence causal attention, and head_loss with host-computed
rows == the old device-side row selection (same loss, accuracies and gradients)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from specserve.attention.base import AttentionMetadata, ForwardContext, forward_context
from specserve.model.arch import ModelArch, rope_cos_sin_cache
from specserve.model.llama import CausalLM
from specserve.speculative.proposers.eagle_head import EagleHead, head_config_for
from specserve.train import loop as train
from specserve.train import target as train_target
from specserve.train.loss import _block_mask, head_block_outputs, head_loss, loss_rows, reduced_vocab_labels
from specserve.train.target import dense_forward, target_batch

HF = {
    "model_type": "qwen2",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "vocab_size": 50,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 128,
}
LENGTHS = [7, 3, 12, 1, 12, 5]


# -- the references: the trainer's code before it went sync-free --------------------------------
class _PerSequenceCausal:
    name = "per_sequence_causal"

    def forward(self, q, k, v, cache, fmt, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        start = 0
        for n in meta.query_lens_cpu:
            qs, ks, vs = (t[start : start + n].transpose(0, 1) for t in (q, k, v))
            if group > 1:
                ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
            out[start : start + n] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(
                0, 1
            )
            start += n
        return out


@torch.no_grad()
def _reference_dense_forward(model, seqs, aux_layers):
    lengths = [len(s) for s in seqs]
    L, B = max(lengths), len(seqs)
    flat = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    none = torch.zeros(1, dtype=torch.int32)
    meta = AttentionMetadata(cu, cu[1:] - cu[:-1], none.view(1, 1), none.long(), L, L, B, len(flat), lengths, lengths)
    model.aux_hidden_layers = aux_layers
    try:
        with forward_context(ForwardContext(meta, [None] * len(model.layers), None, _PerSequenceCausal())):
            hidden, aux = model(flat, positions)
    finally:
        model.aux_hidden_layers = ()
    return hidden, aux


def _reference_head_loss(
    head, target, ids, lengths, loss_start, feats, probs, last_hidden, num_blocks, parallel, hard_weight=0.5
):
    B, L = ids.shape
    R = L - 1
    pos = torch.arange(R, device=ids.device)
    valid_rows = (pos[None, :] < (lengths[:, None] - 1)) & (pos[None, :] >= loss_start[:, None])
    labels = probs[:, 1:].reshape(B * R, -1)
    lm_weight = target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
    loss, accs = torch.zeros((), device=ids.device), []
    for s, (out, normed) in enumerate(head_block_outputs(head, target, ids, feats, num_blocks, parallel), 1):
        rows = (valid_rows & (pos[None, :] >= s - 1)).reshape(-1).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        logits = F.linear(normed.index_select(0, rows), lm_weight).float()
        lab = labels.index_select(0, rows).float()
        top = lab.argmax(-1, keepdim=True)
        mixed = lab.mul_(1 - hard_weight).scatter_add_(1, top, torch.full_like(top, hard_weight, dtype=lab.dtype))
        ce = F.cross_entropy(logits, mixed)
        block_loss = ce
        if head.norm is None:
            goal = last_hidden[:, 1:].reshape(B * R, -1).index_select(0, rows).float()
            block_loss = F.smooth_l1_loss(out.index_select(0, rows).float(), goal) + 0.1 * ce
        loss = loss + (0.8 ** (s - 1)) * block_loss
        accs.append((logits.detach().argmax(-1) == top.squeeze(1)).float().mean().item())
    return loss, accs


# -- the target's dense attention -----------------------------------------------------------------
def _target(seed: int = 0) -> CausalLM:
    arch = ModelArch.from_hf_config(HF)
    torch.manual_seed(seed)
    model = CausalLM(arch, rope_cos_sin_cache(arch, 128, torch.device("cpu")))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.3 if "norm" not in name else 0.1).add_(1.0 if "norm" in name else 0.0)
    return model.eval().requires_grad_(False)


def _seqs(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("native_gqa", [True, False], ids=["enable_gqa", "repeat_kv"])
def test_batched_dense_forward_equals_per_sequence(monkeypatch, native_gqa):
    if not native_gqa:
        monkeypatch.setattr(train_target, "_SDPA_HAS_GQA", False)
    model = _target()
    seqs = _seqs(LENGTHS)
    flat, hidden, aux = dense_forward(model, seqs, (1, 3), torch.device("cpu"))
    ref_hidden, ref_aux = _reference_dense_forward(model, seqs, (1, 3))
    assert flat.tolist() == [t for s in seqs for t in s]
    assert model.aux_hidden_layers == ()  # restored
    # float32 over other batch shapes: the CPU's kernels may sum in another order (3 of 1,280 aux values
    # off by up to 2.3e-5 on one machine, at 1e-5 this failed there); 1e-4 is still far below the values.
    tol = {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(hidden, ref_hidden, **tol)
    assert len(aux) == 2
    for a, r in zip(aux, ref_aux):
        torch.testing.assert_close(a, r, **tol)
    # One sequence alone gives its rows of the batch (padding never leaks into valid rows).
    _, alone, _ = dense_forward(model, [seqs[2]], (), torch.device("cpu"))
    torch.testing.assert_close(alone, hidden[10:22], **tol)


def test_target_batch_pads_the_flat_outputs():
    model = _target(1)
    seqs = _seqs([5, 9, 2], seed=3)
    ids, lens, feats, probs, last, top = target_batch(model, seqs, (2,), torch.device("cpu"))
    assert top is None  # the target's argmax travels only with a reduced vocabulary
    ref_hidden, ref_aux = _reference_dense_forward(model, seqs, (2,))
    assert ids.shape == (3, 9) and lens.tolist() == [5, 9, 2]
    start = 0
    for b, s in enumerate(seqs):
        n = len(s)
        assert ids[b, :n].tolist() == s and not ids[b, n:].any()
        torch.testing.assert_close(last[b, :n], ref_hidden[start : start + n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(feats[b, :n], ref_aux[0][start : start + n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            probs[b, :n], model.compute_logits(ref_hidden[start : start + n]).softmax(-1), rtol=1e-5, atol=1e-6
        )
        assert not probs[b, n:].any()
        start += n


# -- the head's loss --------------------------------------------------------------------------------
def _head(method: str, slots: int, seed: int = 0, d2t: list[int] | None = None):
    """A random head (norms at 1) and a stand-in target; d2t: a reduced draft vocabulary."""
    arch = ModelArch.from_hf_config(HF)
    torch.manual_seed(seed)
    head = EagleHead(
        head_config_for(arch, HF, "t", "id", method, slots, draft_vocab_size=None if d2t is None else len(d2t))
    )
    if d2t is not None:
        head.set_draft_vocab(torch.tensor(d2t))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2)
    target = types.SimpleNamespace(
        embed_tokens=torch.nn.Embedding(50, 32),
        lm_head=None,
        cos_sin_cache=rope_cos_sin_cache(arch, 128, torch.device("cpu")),
    )
    target.embed_tokens.requires_grad_(False)
    return head, target


@pytest.mark.parametrize(
    "method,parallel,blocks",
    [("eagle3", False, 3), ("eagle", False, 3), ("eagle3", True, 4)],
    ids=["eagle3", "eagle", "p-eagle"],
)
# A sequence too short for blocks > 1 and one with a single loss row; then a batch whose blocks > 2 are empty.
@pytest.mark.parametrize("lengths,starts", [([9, 4, 2, 6], [3, 0, 0, 5]), ([3, 2], [0, 0])], ids=["mixed", "short"])
def test_head_loss_with_host_rows_equals_device_rows(method, parallel, blocks, lengths, starts):
    head, target = _head(method, blocks - 1 if parallel else 0, seed=2)
    B, L = len(lengths), max(lengths)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 50, (B, L), generator=g)
    feat_dim = 32 * len(head.cfg.aux_hidden_layers) if method == "eagle3" else 32
    feats = torch.randn(B, L, feat_dim, generator=g)
    probs = torch.randn(B, L, 50, generator=g).softmax(-1)
    last = torch.randn(B, L, 32, generator=g)

    def run(fn, *args):
        head.zero_grad(set_to_none=True)
        loss, accs = fn(head, target, ids, *args, feats, probs, last, blocks, parallel, 0.3)
        loss.backward()
        return loss.detach(), accs, {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}

    loss, accs, grads = run(head_loss, lengths, starts)
    ref_loss, ref_accs, ref_grads = run(_reference_head_loss, torch.tensor(lengths), torch.tensor(starts))
    assert all(isinstance(a, torch.Tensor) for a in accs)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert [a.item() for a in accs] == pytest.approx(ref_accs)
    assert grads.keys() == ref_grads.keys() and grads
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-6)


def test_loss_rows_skip_blocks_without_rows():
    rows = loss_rows([3, 2], [0, 0], 3, 3)  # R = 2; valid: (0,0),(0,1),(1,0)
    assert [r.tolist() for r in rows] == [[0, 1, 2], [1], []]


@pytest.mark.parametrize("rows,s", [(1, 1), (6, 3), (255, 2), (256, 4), (300, 3)])
def test_cached_block_mask_equals_a_fresh_one(rows, s):
    q = torch.arange(rows)[:, None]
    k = torch.arange(rows)[None, :]
    fresh = torch.cat([k <= q - (s - 1)] + [k == q - (s - j) for j in range(2, s + 1)], dim=1)
    assert torch.equal(_block_mask(rows, s, torch.device("cpu")), fresh)


# -- a reduced draft vocabulary -------------------------------------------------------------------------
D2T = [1, 4, 5, 8, 13, 21, 22, 30, 34, 41, 47, 49]  # ascending target ids, 12 of the toy's 50


@pytest.mark.parametrize("chunk_rows", [None, 5], ids=["one-chunk", "chunks"])
def test_target_batch_reduced_vocab_keeps_the_d2t_columns(monkeypatch, chunk_rows):
    if chunk_rows is not None:  # the labels a few rows at a time
        monkeypatch.setattr(train_target, "_LABEL_CHUNK_BYTES", chunk_rows * 4 * HF["vocab_size"])
    model = _target(1)
    seqs = _seqs([5, 9, 2], seed=3)
    d2t = torch.tensor(D2T)
    full = target_batch(model, seqs, (2,), torch.device("cpu"))
    red = target_batch(model, seqs, (2,), torch.device("cpu"), d2t)
    assert red.probs.shape == (3, 9, len(D2T)) and red.top.shape == (3, 9) and red.top.dtype == torch.int64
    for name in ("ids", "lengths", "feats", "last"):
        torch.testing.assert_close(getattr(red, name), getattr(full, name))
    # Normalized over the whole vocabulary (a row of the slice sums to its in-set mass, not 1).
    torch.testing.assert_close(red.probs, full.probs[..., d2t], rtol=1e-5, atol=1e-7)
    for b, s in enumerate(seqs):
        assert red.top[b, : len(s)].tolist() == full.probs[b, : len(s)].argmax(-1).tolist()
        assert not red.top[b, len(s) :].any() and not red.probs[b, len(s) :].any()


def test_reduced_vocab_labels_by_hand():
    target = torch.tensor(
        [
            [0.5, 0.2, 0.2, 0.1],  # argmax 0: outside d2t -> soft term alone
            [0.1, 0.6, 0.2, 0.1],
        ]
    )  # argmax 1: in d2t -> mixed with the hard label
    d2t = torch.tensor([1, 2, 3])
    labels, in_set = reduced_vocab_labels(target[:, d2t].clone(), target.argmax(-1), d2t, 0.5)
    assert in_set.tolist() == [False, True]
    torch.testing.assert_close(
        labels, torch.tensor([[0.4, 0.4, 0.2], [0.5 * 0.6 / 0.9 + 0.5, 0.5 * 0.2 / 0.9, 0.5 * 0.1 / 0.9]])
    )
    # Labels that tie in bfloat16 where the target's float32 logits did not: the hard label goes to
    # the target's own argmax (token 2), not to the first of the tied columns.
    tied, _ = reduced_vocab_labels(torch.tensor([[0.4, 0.4, 0.1]]), torch.tensor([2]), d2t, 0.5)
    torch.testing.assert_close(tied, torch.tensor([[0.5 * 0.4 / 0.9, 0.5 * 0.4 / 0.9 + 0.5, 0.5 * 0.1 / 0.9]]))


def _reference_reduced_loss(
    head, target, ids, lengths, loss_start, feats, full_probs, num_blocks, parallel, hard_weight
):
    """A reduced-vocabulary head's loss row by row from the target's FULL distribution: logits =
    the full head's columns d2t; label = the in-set probabilities renormalized, mixed with the hard
    label where the full argmax is in d2t; accuracy = d2t[argmax] == the full argmax."""
    B, L = ids.shape
    d2t = head.d2t.tolist()
    lm = target.embed_tokens.weight
    loss, accs, kinds = torch.zeros(()), [], set()
    for s, (_, normed) in enumerate(head_block_outputs(head, target, ids, feats, num_blocks, parallel), 1):
        terms, hits = [], []
        for b in range(B):
            for t in range(max(loss_start[b], s - 1), lengths[b] - 1):
                logits = (normed[b * (L - 1) + t] @ lm.t())[d2t]
                p = full_probs[b, t + 1]
                label = p[d2t] / p[d2t].sum()
                top = int(p.argmax())
                if top in d2t:
                    label = (1 - hard_weight) * label + hard_weight * F.one_hot(torch.tensor(d2t.index(top)), len(d2t))
                kinds.add(top in d2t)
                terms.append(-(label * logits.log_softmax(-1)).sum())
                hits.append(d2t[int(logits.argmax())] == top)
        if terms:
            loss = loss + 0.8 ** (s - 1) * torch.stack(terms).mean()
            accs.append(sum(hits) / len(hits))
    return loss, accs, kinds


@pytest.mark.parametrize(
    "method,parallel,blocks", [("eagle3", False, 3), ("eagle3", True, 3)], ids=["eagle3", "p-eagle"]
)
def test_head_loss_reduced_vocab_equals_a_row_by_row_reference(method, parallel, blocks):
    head, target = _head(method, blocks - 1 if parallel else 0, seed=2, d2t=D2T)
    lengths, starts = [9, 4, 2, 6], [3, 0, 0, 1]
    B, L = len(lengths), max(lengths)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 50, (B, L), generator=g)
    feats = torch.randn(B, L, 32 * len(head.cfg.aux_hidden_layers), generator=g)
    full = (torch.randn(B, L, 50, generator=g) * 3).softmax(-1)
    d2t = torch.tensor(D2T)
    loss, accs = head_loss(
        head,
        target,
        ids,
        lengths,
        starts,
        feats,
        full[..., d2t],
        torch.zeros(B, L, 32),
        blocks,
        parallel,
        0.3,
        full.argmax(-1),
    )
    ref, ref_accs, kinds = _reference_reduced_loss(
        head, target, ids, lengths, starts, feats, full, blocks, parallel, 0.3
    )
    assert kinds == {True, False}  # rows whose target argmax is in the set and rows where it is not
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    assert [a.item() for a in accs] == pytest.approx(ref_accs)
    loss.backward()  # the gathered LM-head rows are frozen: gradients reach the head only
    assert head.fc.weight.grad is not None and target.embed_tokens.weight.grad is None
    with pytest.raises(ValueError, match="draft vocabulary"):  # full-vocabulary labels for a reduced head
        head_loss(head, target, ids, lengths, starts, feats, full, torch.zeros(B, L, 32), blocks, parallel)


def test_draft_vocab_from_answer_token_frequencies():
    from specserve.train.data import TrainSeq, draft_vocab

    seqs = [
        TrainSeq([7, 7, 7, 7, 3, 3, 3, 9, 2], num_prompt_tokens=4),  # prompt 7 7 7 7, answer 3 3 3 9 2
        TrainSeq([5, 6, 3, 9, 9, 1], num_prompt_tokens=0),
    ]  # no prompt: the loss predicts from token 2 on
    # Answer counts: 3 x4, 9 x3, 2 x1, 1 x1; 7 only in a prompt, 5 and 6 before position 2.
    got = draft_vocab(seqs, 12, 3)
    assert got.token_ids == [1, 3, 9]  # ties (2 and 1, one each) by whole count, then by id
    assert got.answer_coverage == pytest.approx(8 / 9)
    # Special tokens that occur anywhere are always kept (10 never occurs: not kept).
    assert draft_vocab(seqs, 12, 3, special_ids=[7, 10]).token_ids == [3, 7, 9]
    # Tokens no answer holds fill by their count in the whole sequences, then by id.
    assert draft_vocab(seqs, 12, 7).token_ids == [1, 2, 3, 5, 6, 7, 9]
    assert draft_vocab(seqs, 12, 9).token_ids == [0, 1, 2, 3, 4, 5, 6, 7, 9]


def test_draft_vocab_size_flag():
    def size(flag, vocab):
        return train._draft_vocab_size(types.SimpleNamespace(draft_vocab_size=flag), vocab)

    assert size(None, 151936) == train.DEFAULT_DRAFT_VOCAB == 32768  # default: reduced where it is smaller
    assert size(None, 32000) is None and size(None, 384) is None  # ... else the full vocabulary
    assert size(0, 151936) is None and size(1000, 151936) == 1000 and size(500, 384) is None
    with pytest.raises(ValueError, match="--draft-vocab-size"):
        size(-1, 384)
