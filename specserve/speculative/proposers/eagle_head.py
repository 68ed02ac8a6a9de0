"""The EAGLE / EAGLE-3 / P-EAGLE draft head: one decoder layer on top of the target's features."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, cast

import torch
from torch import nn

from specserve.model.arch import ModelArch
from specserve.model.layers import ops as torch_ops

logger = logging.getLogger(__name__)

HEAD_FORMAT = "specserve-eagle-head"
HEAD_METHODS = ("eagle", "eagle3")
CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"
# q, k, v [rows, heads, head_dim] -> [rows, num_heads, head_dim]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class LogitsModel(Protocol):
    """What EagleHead.compute_logits reads of the target model (a full-vocabulary head)."""

    def compute_logits(self, hidden: torch.Tensor, /) -> torch.Tensor: ...


@dataclass(frozen=True)
class EagleHeadConfig:
    method: str  # "eagle" (last hidden state) | "eagle3" (fused aux hidden states)
    hidden_size: int
    vocab_size: int
    aux_hidden_layers: tuple[int, ...]  # target layers whose inputs eagle3 fuses; () for eagle
    num_mask_slots: int  # P-EAGLE mask slots trained (k - 1); 0 = autoregressive only
    layer: dict[str, Any]  # HF-style config of the head's one decoder layer
    target: dict[str, Any]  # name, identity, num_layers, hidden_size, vocab_size of the target
    # Tokens the head can propose (its `d2t` buffer, ascending target ids); None = the whole vocabulary.
    draft_vocab_size: int | None = None
    # "specserve" (this file's architecture) | "published" (EAGLE-3 as vLLM / SGLang run it: head_formats.py)
    flavour: str = "specserve"
    norm_before_residual: bool = False  # published: the residual is hidden_norm(feature), not the feature
    mask_token_id: int | None = None  # published P-EAGLE: the token embedded for mask rows
    own_embed: bool = False  # published: the head has its own embed_tokens

    def __post_init__(self) -> None:
        """ValueError for a config no head can have; aux_hidden_layers as a tuple (JSON holds a list)."""
        object.__setattr__(self, "aux_hidden_layers", tuple(int(i) for i in self.aux_hidden_layers))
        if self.method not in HEAD_METHODS:
            raise ValueError(f"head method must be one of {HEAD_METHODS}, got {self.method!r}.")
        if self.method == "eagle3" and not self.aux_hidden_layers:
            raise ValueError("an eagle3 head needs aux_hidden_layers.")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [1, {self.vocab_size}] or null, got {self.draft_vocab_size}."
            )

    @property
    def logits_width(self) -> int:
        """Columns of the head's logits: the draft vocabulary, or the target's."""
        return self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size

    def to_json(self) -> dict[str, Any]:
        return {"format": HEAD_FORMAT, **asdict(self), "aux_hidden_layers": list(self.aux_hidden_layers)}

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str) -> EagleHeadConfig:
        if data.get("format") != HEAD_FORMAT:
            raise ValueError(f"{where} is not a specserve EAGLE head config (format must be {HEAD_FORMAT!r}).")
        names = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except (TypeError, ValueError) as e:  # a missing field, a bad value
            raise ValueError(f"{where}: {e}") from None

    def layer_arch(self) -> ModelArch:
        return ModelArch.from_hf_config({**self.layer, "num_hidden_layers": 1})


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's layers (2, L/2, L-3) whose inputs are fused, clamped and deduplicated for tiny models."""
    picks = {min(2, num_layers - 1), num_layers // 2, max(0, num_layers - 3)}
    return tuple(sorted(picks))


def head_config_for(
    target_arch: ModelArch,
    target_hf_config: dict[str, Any],
    target_name: str,
    target_identity: str,
    method: str,
    num_mask_slots: int = 0,
    draft_vocab_size: int | None = None,
) -> EagleHeadConfig:
    """A head shaped like one decoder layer of the target (draft_vocab_size: see EagleHeadConfig)."""
    a = target_arch
    keys = (
        "model_type hidden_size intermediate_size num_attention_heads num_key_value_heads head_dim rms_norm_eps "
        "rope_theta rope_scaling rope_parameters attention_bias max_position_embeddings vocab_size"
    ).split()
    layer = {k: target_hf_config[k] for k in keys if target_hf_config.get(k) is not None}
    layer.update(head_dim=a.head_dim, attention_bias=a.qkv_bias, num_key_value_heads=a.num_kv_heads)
    aux = default_aux_layers(a.num_layers) if method == "eagle3" else ()
    target = dict(name=target_name, identity=target_identity, num_layers=a.num_layers, hidden_size=a.hidden_size)
    target["vocab_size"] = a.vocab_size
    return EagleHeadConfig(method, a.hidden_size, a.vocab_size, aux, num_mask_slots, layer, target, draft_vocab_size)


def check_d2t(d2t: torch.Tensor, vocab_size: int, draft_vocab_size: int, where: str) -> None:
    """ValueError unless d2t is [draft_vocab_size] integer ids in [0, vocab_size), strictly ascending."""
    if d2t.dtype.is_floating_point or d2t.dtype.is_complex or d2t.dtype == torch.bool:
        raise ValueError(f"{where}: d2t must hold integer token ids (int64), got {d2t.dtype}.")
    if tuple(d2t.shape) != (draft_vocab_size,):
        raise ValueError(
            f"{where}: d2t has shape {tuple(d2t.shape)}, the config's draft_vocab_size is {draft_vocab_size}."
        )
    ids = d2t.detach().to("cpu", torch.int64)
    if draft_vocab_size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"{where}: d2t holds token ids outside [0, {vocab_size}) (min {int(ids.min())}, max {int(ids.max())})."
        )
    steps = ids[1:] - ids[:-1]
    if (steps == 0).any():
        raise ValueError(f"{where}: d2t holds duplicate token ids (e.g. {int(ids[1:][steps == 0][0])}).")
    if (steps < 0).any():
        raise ValueError(f"{where}: d2t must be sorted ascending.")


def target_lm_weight(target: nn.Module) -> torch.Tensor:
    """The target's LM head weight [vocab, hidden] (its tied embedding when it has no lm_head)."""
    if getattr(target, "logits_head", None) is not None:
        raise ValueError("a reduced draft vocabulary needs the target's whole LM head (not a sharded one).")
    lm_head = getattr(target, "lm_head", None)
    owner: Any = target.embed_tokens if lm_head is None else lm_head  # nn.Embedding / nn.Linear
    return cast(torch.Tensor, owner.weight)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps
        self.ops: ModuleType = torch_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class HeadLayer(nn.Module):
    """A Llama/Qwen2 decoder layer with injected attention; `ops`: torch ops or the target's fused twins."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.ops: ModuleType = torch_ops
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.intermediate = arch.intermediate_size
        h = arch.hidden_size
        self.input_layernorm = RMSNorm(h, arch.rms_norm_eps)
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, arch.rms_norm_eps)
        self.gate_up_proj = nn.Linear(h, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, h, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        """x [rows, hidden] -> [rows, hidden] (pre-norm residual stream after the layer)."""
        ops, norm = self.ops, self.input_layernorm
        qkv, _ = ops.rms_norm_linear(x, None, norm.weight, norm.eps, self.qkv_proj.weight, self.qkv_proj.bias)
        return self.attend_mlp(qkv, x, positions, cos_sin, attend)

    def attend_mlp(
        self, qkv: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """qkv [rows, q + 2 kv], residual x [rows, hidden] -> x + attn, then + mlp: [rows, hidden]."""
        ops = self.ops
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], -1)
        q, k = q.reshape(-1, self.num_heads, self.head_dim), k.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = ops.apply_rope(q, k, positions, cos_sin)
        attn = attend(q, k, v.reshape(-1, self.num_kv_heads, self.head_dim))
        x = x + ops.linear(attn.reshape(-1, self.q_size), self.o_proj.weight)
        h = ops.linear_silu_and_mul(self.post_attention_layernorm(x), self.gate_up_proj.weight)  # silu(gate) * up
        return x + ops.linear(h, self.down_proj.weight)


class EagleHead(nn.Module):
    mask_embed: torch.Tensor  # [hidden]: P-EAGLE's mask-row embedding
    lm_head: nn.Linear  # published layouts: the head's own [draft_vocab, hidden]
    norm: Any  # final RMSNorm (None: EAGLE-1)
    # A buffer (register_buffer): [draft_vocab] int64 target ids, or None for the whole vocabulary.
    d2t: torch.Tensor | None

    def __init__(self, cfg: EagleHeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        arch = cfg.layer_arch()
        h, eps = cfg.hidden_size, arch.rms_norm_eps
        self.eps = eps
        n_aux = len(cfg.aux_hidden_layers)
        # [draft_vocab] int64 target ids, ascending (set_draft_vocab / the checkpoint); None = full vocab.
        d2t = None if cfg.draft_vocab_size is None else torch.arange(cfg.draft_vocab_size, dtype=torch.int64)
        self.register_buffer("d2t", d2t)
        # [draft_vocab, hidden]: the target's LM-head rows d2t, gathered once (attach_lm_head); not saved.
        self.lm_weight: torch.Tensor | None = None
        self.published = cfg.flavour == "published"
        if self.published:
            from specserve.speculative.proposers.head_formats import init_published

            init_published(self, cfg, arch)
            return
        if cfg.method == "eagle3":
            # Per-layer norms: residual streams of different depths differ in scale by orders of magnitude.
            self.aux_norm = nn.Parameter(torch.ones(n_aux, h))
            self.fuse = nn.Linear(n_aux * h, h, bias=False)
        self.embed_norm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = HeadLayer(arch)
        # EAGLE-1 regresses the target's final-normed hidden state; EAGLE-3 normalizes like the target.
        self.norm = RMSNorm(h, eps) if cfg.method == "eagle3" else None
        if cfg.num_mask_slots > 0:
            self.mask_embed = nn.Parameter(torch.randn(h) * 0.02)
            self.mask_hidden = nn.Parameter(torch.randn(h) * 0.02)

    @torch.no_grad()
    def attach_target(self, target: Any) -> None:
        """Bind what the head reads of the serving target: the LM-head rows of a reduced vocabulary, or (a
        published P-EAGLE head) the embedding of its mask token."""
        if self.published:
            if self.cfg.num_mask_slots:
                ids = torch.tensor([self.cfg.mask_token_id], device=target.embed_tokens.weight.device)
                self.mask_embed = self.embed(ids, target)[0].to(self.fc.weight)  # [hidden], the head's dtype
        elif self.d2t is not None:
            self.attach_lm_head(target_lm_weight(target))

    def embed(self, tokens: torch.Tensor, target: Any) -> torch.Tensor:
        """tokens [rows] -> [rows, hidden]: the head's own embedding when it has one, else the target's."""
        embedding: Any = self.embed_tokens if self.cfg.own_embed else target.embed_tokens
        return embedding(tokens)

    @torch.no_grad()
    def set_draft_vocab(self, d2t: torch.Tensor) -> None:
        """The draft vocabulary (training): [draft_vocab_size] ascending target ids."""
        draft_vocab_size = self.cfg.draft_vocab_size
        if self.d2t is None or draft_vocab_size is None:
            raise ValueError("this head has no reduced draft vocabulary (draft_vocab_size is None).")
        check_d2t(d2t, self.cfg.vocab_size, draft_vocab_size, "draft vocabulary")
        self.d2t.copy_(d2t.to(self.d2t.device, torch.int64))
        self.lm_weight = None  # gathered for the old rows

    @torch.no_grad()
    def attach_lm_head(self, weight: torch.Tensor) -> None:
        """Gather the target's LM-head rows d2t (weight [vocab, hidden]) once into [draft_vocab, hidden]."""
        if self.d2t is None:
            return
        self.d2t = self.d2t.to(weight.device)
        self.lm_weight = weight.detach().index_select(0, self.d2t).contiguous()

    def compute_logits(self, normed: torch.Tensor, target: LogitsModel) -> torch.Tensor:
        """normed [rows, hidden] -> float32 logits [rows, cfg.logits_width] (column j: token d2t[j] if reduced)."""
        if self.published:
            return self.layer.ops.linear(normed, self.lm_head.weight).float()
        if self.d2t is None:
            return target.compute_logits(normed)
        if self.lm_weight is None:
            raise RuntimeError("EagleHead.attach_lm_head must run before a reduced-vocabulary head drafts.")
        return self.layer.ops.linear(normed, self.lm_weight).float()

    def greedy_token_ids(self, logits: torch.Tensor) -> torch.Tensor:
        """compute_logits' output [rows, width] -> [rows] int64 target ids of each row's argmax."""
        if self.d2t is None:
            return logits[:, : self.cfg.vocab_size].argmax(dim=-1)
        return self.d2t.index_select(0, logits.argmax(dim=-1))

    def fuse_target(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[rows, n_aux * hidden] (eagle3: concatenated aux states) or [rows, hidden] (eagle) -> [rows, hidden]."""
        if self.published:  # fc only where the width differs (the first step's target features)
            fit = target_hidden.shape[-1] == self.cfg.hidden_size
            return target_hidden if fit else self.layer.ops.linear(target_hidden, self.fc.weight)
        if self.cfg.method != "eagle3":
            return target_hidden
        n = self.aux_norm.shape[0]
        x = target_hidden.reshape(target_hidden.shape[0], n, -1)
        x32 = x.float()
        x = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.aux_norm
        return self.fuse(x.reshape(target_hidden.shape[0], -1))

    def mask_inputs(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeds, hidden) of P-EAGLE mask rows, each [rows, hidden]."""
        hidden = self.fuse_target(self.mask_hidden[None])[0] if self.published else self.mask_hidden
        return self.mask_embed.expand(rows, -1), hidden.expand(rows, -1)

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, attend: Attend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds, hidden [rows, hidden]; returns (out, logits_input), each [rows, hidden]: `out` is
        fed back as the next row's hidden, `logits_input` goes to the target's LM head."""
        if self.published:
            out = self.layer(embeds, hidden, positions, cos_sin, attend)
            return out, self.norm(out)
        x = self.layer.ops.linear(
            torch.cat([self.embed_norm(embeds), self.hidden_norm(hidden)], dim=-1), self.fc.weight
        )
        out = self.layer(x, positions, cos_sin, attend)
        return out, (out if self.norm is None else self.norm(out))

    def set_ops(self, ops: ModuleType) -> None:
        """Run norms, RoPE and projections through `ops` (model/layers/ops.py signatures; on a GPU the target's)."""
        for m in self.modules():
            if isinstance(m, (RMSNorm, HeadLayer)):
                m.ops = ops


def save_head(head: EagleHead, out_dir: str | Path) -> Path:
    """Write config.json + model.safetensors (weights float32, d2t int64), the weights via a rename."""
    from safetensors.torch import save_file

    if head.published:  # P-EAGLE in the speculators layout (its mask token has no HF field), EAGLE-3 in HF's
        from specserve.speculative.proposers.head_formats import save_published

        return save_published(head, out_dir, "speculators" if head.cfg.num_mask_slots else "hf", head.cfg.to_json())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {
        k: (v.detach().float() if v.is_floating_point() else v.detach()).cpu().contiguous()
        for k, v in head.state_dict().items()
    }
    tmp = out / (WEIGHTS_NAME + ".tmp")
    save_file(state, str(tmp), metadata={"format": HEAD_FORMAT})
    tmp.replace(out / WEIGHTS_NAME)
    (out / CONFIG_NAME).write_text(json.dumps(head.cfg.to_json(), indent=2) + "\n")
    return out


def read_config_json(path: str | Path) -> dict[str, Any]:
    """config.json of a head directory (any layout); ValueError naming what is wrong."""
    d = Path(path).expanduser()
    where = f"speculative_config.model {str(path)!r}"
    if not d.is_dir():
        raise ValueError(f"{where} is not a directory holding an EAGLE head ({CONFIG_NAME} + weights).")
    if not (d / CONFIG_NAME).is_file():
        raise ValueError(f"{where} must hold {CONFIG_NAME} and the weights ({WEIGHTS_NAME}).")
    try:
        return dict(json.loads((d / CONFIG_NAME).read_text()))
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: {CONFIG_NAME} is not valid JSON (an object): {e}.") from None


def read_head_config(path: str | Path) -> EagleHeadConfig:
    """The config of a specserve-format head directory; ValueError naming what is wrong."""
    where = f"speculative_config.model {str(path)!r}"
    data = read_config_json(path)
    data = data.get("specserve", data)  # a published layout written by specserve keeps its config there
    if not (Path(path).expanduser() / WEIGHTS_NAME).is_file():
        raise ValueError(f"{where} must hold {CONFIG_NAME} and {WEIGHTS_NAME}.")
    return EagleHeadConfig.from_json(data, f"{where}/{CONFIG_NAME}")


def check_head_matches(cfg: EagleHeadConfig, arch: ModelArch, target_identity: str, where: str) -> None:
    """Shapes must match the target exactly; another weights identity only warns."""
    want = {"hidden_size": arch.hidden_size, "vocab_size": arch.vocab_size, "num_layers": arch.num_layers}
    got = {k: cfg.target.get(k) for k in want}
    if got != want:
        raise ValueError(f"{where} was trained for a target with {got}, this target has {want}.")
    if cfg.hidden_size != arch.hidden_size or cfg.vocab_size != arch.vocab_size:
        raise ValueError(f"{where}: head hidden/vocab sizes do not match the target.")
    if any(not 0 <= i < arch.num_layers for i in cfg.aux_hidden_layers):
        raise ValueError(f"{where}: aux_hidden_layers {cfg.aux_hidden_layers} out of range.")
    identity = cfg.target.get("identity")
    if identity != target_identity:
        logger.warning(
            "%s was trained on %r, serving %r: same shapes, maybe other weights.", where, identity, target_identity
        )


def load_head(
    path: str | Path, arch: ModelArch, target_identity: str, device: torch.device, dtype: torch.dtype
) -> EagleHead:
    """Load and validate a head directory for this target; ValueError before anything runs."""
    from safetensors.torch import load_file

    where = f"speculative_config.model {str(path)!r}"
    if "format" not in read_config_json(path):  # a published EAGLE-3 / P-EAGLE head
        from specserve.speculative.proposers.head_formats import load_published

        return load_published(path, arch, where).to(device=device, dtype=dtype).eval().requires_grad_(False)
    cfg = read_head_config(path)
    check_head_matches(cfg, arch, target_identity, where)
    head = EagleHead(cfg)
    try:
        state = load_file(str(Path(path).expanduser() / WEIGHTS_NAME))
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"{where}: cannot read {WEIGHTS_NAME}: {e}.") from None
    if cfg.draft_vocab_size is not None:
        if "d2t" not in state:
            raise ValueError(f"{where}: the config sets draft_vocab_size but {WEIGHTS_NAME} holds no d2t tensor.")
        check_d2t(state["d2t"], cfg.vocab_size, cfg.draft_vocab_size, where)
        state["d2t"] = state["d2t"].to(torch.int64)
    try:  # strict: missing, unexpected (a d2t without draft_vocab_size) and misshapen tensors
        head.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"{where}: weights do not match the config: {e}") from None
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)
