"""Published EAGLE-3 / P-EAGLE heads (HF `midlayer.*` and speculators `layers.0.*` layouts) as EagleHeads of the
"published" flavour (vLLM's architecture). In memory q/k/v and gate/up are fused and d2t holds target ids; on
disk d2t holds offsets (target_id = draft_id + d2t[draft_id])."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specserve.model.arch import ModelArch
from specserve.speculative.proposers.eagle_head import (
    Attend,
    EagleHead,
    EagleHeadConfig,
    HeadLayer,
    RMSNorm,
    check_d2t,
    default_aux_layers,
    read_config_json,
)

HF_ARCH = "LlamaForCausalLMEagle3"
# In-memory parameter -> the published tensors concatenated (dim 0) into it; "L." is the layer's prefix.
FUSED = {
    "layer.qkv_proj.weight": ["L.self_attn.q_proj.weight", "L.self_attn.k_proj.weight", "L.self_attn.v_proj.weight"],
    "layer.qkv_proj.bias": ["L.self_attn.q_proj.bias", "L.self_attn.k_proj.bias", "L.self_attn.v_proj.bias"],
    "layer.o_proj.weight": ["L.self_attn.o_proj.weight"],
    "layer.gate_up_proj.weight": ["L.mlp.gate_proj.weight", "L.mlp.up_proj.weight"],
    "layer.down_proj.weight": ["L.mlp.down_proj.weight"],
    "layer.input_layernorm.weight": ["L.input_layernorm.weight"],
    "layer.hidden_norm.weight": ["L.hidden_norm.weight"],
    "layer.post_attention_layernorm.weight": ["L.post_attention_layernorm.weight"],
}


class PublishedLayer(HeadLayer):
    """The published midlayer: q/k/v read concat(input_layernorm(embeds), hidden_norm(feature)) [2 * hidden]."""

    def __init__(self, arch: ModelArch, norm_before_residual: bool) -> None:
        super().__init__(arch)
        h = arch.hidden_size
        self.qkv_proj = nn.Linear(2 * h, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.hidden_norm = RMSNorm(h, arch.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(  # type: ignore[override]
        self, embeds: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, a: Attend
    ) -> torch.Tensor:
        """embeds, feature [rows, hidden] -> the pre-norm output [rows, hidden] (the next step's feature)."""
        normed = self.hidden_norm(feature)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [rows, 2 * hidden]
        qkv = self.ops.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        return self.attend_mlp(qkv, normed if self.norm_before_residual else feature, positions, cos_sin, a)


def init_published(head: EagleHead, cfg: EagleHeadConfig, arch: ModelArch) -> None:
    """The published flavour's modules on `head` (called from EagleHead.__init__)."""
    h, width = cfg.hidden_size, len(cfg.aux_hidden_layers) * int(cfg.target["hidden_size"])
    head.fc = nn.Linear(width, h, bias=False)
    head.layer = PublishedLayer(arch, cfg.norm_before_residual)
    head.norm = RMSNorm(h, arch.rms_norm_eps)
    head.lm_head = nn.Linear(h, cfg.logits_width, bias=False)
    if cfg.own_embed:
        head.embed_tokens = nn.Embedding(cfg.vocab_size, h)
    if cfg.num_mask_slots:
        head.mask_hidden = nn.Parameter(torch.zeros(width))  # [n_aux * target hidden]: a mask row's feature


def published_config(data: dict[str, Any], arch: ModelArch, has_embed: bool, where: str) -> EagleHeadConfig:
    """The EagleHeadConfig of a published config.json; ValueError unless it fits the target `arch`."""
    kind = data.get("speculators_model_type")
    if kind is not None:
        if kind not in ("eagle3", "peagle"):
            raise ValueError(f"{where}: speculators_model_type must be eagle3 or peagle, got {kind!r}.")
        layer = dict(data.get("transformer_layer_config") or {})
        aux = data.get("eagle_aux_hidden_state_layer_ids")
        nbr = bool(data.get("norm_before_residual", True))
        methods = (data.get("speculators_config") or {}).get("proposal_methods") or [{}]
        k = int(methods[0].get("speculative_tokens") or 8)
    else:
        archs = data.get("architectures") or []
        if HF_ARCH not in archs and not ("LlamaForCausalLM" in archs and data.get("num_hidden_layers") == 1):
            raise ValueError(
                f"{where}: not a specserve EAGLE head nor a published one (format, speculators_model_type, {HF_ARCH})."
            )
        layer, kind, k = dict(data), "eagle3", 1
        aux = (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        nbr = bool(data.get("norm_before_residual", False))
    try:
        hidden, vocab = int(layer["hidden_size"]), int(layer.get("vocab_size", arch.vocab_size))
        draft_vocab = int(data.get("draft_vocab_size") or layer.get("draft_vocab_size") or vocab)
        target_hidden = int(data.get("target_hidden_size") or layer.get("target_hidden_size") or hidden)
        aux_layers = default_aux_layers(arch.num_layers) if aux is None else tuple(int(i) for i in aux)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: a missing or bad config field: {e!r}.") from None
    for name, got, want in (
        ("vocab_size", vocab, arch.vocab_size),
        ("target_hidden_size", target_hidden, arch.hidden_size),
        ("hidden_size", hidden, arch.hidden_size),  # heads narrower than their target are not run yet
    ):
        if got != want:
            raise ValueError(f"{where}: the head's {name} is {got}, this target's is {want}.")
    if any(not 0 <= i < arch.num_layers for i in aux_layers) or len(set(aux_layers)) != len(aux_layers):
        raise ValueError(
            f"{where}: aux layers {aux_layers} are not distinct layers of a {arch.num_layers}-layer target."
        )
    mask_id = data.get("mask_token_id", data.get("pard_token"))
    if kind == "peagle" and mask_id is None:
        raise ValueError(f"{where}: a peagle head needs mask_token_id.")
    target = dict(name="", identity=None, num_layers=arch.num_layers, hidden_size=target_hidden, vocab_size=vocab)
    layer = {**layer, "vocab_size": vocab}
    layer.pop("num_hidden_layers", None)
    slots = k - 1 if kind == "peagle" else 0
    dv = None if draft_vocab == vocab else draft_vocab
    return EagleHeadConfig(
        "eagle3", hidden, vocab, aux_layers, slots, layer, target, dv, "published", nbr,
        None if mask_id is None else int(mask_id), has_embed,
    )  # fmt: skip


def read_tensors(d: Path, where: str) -> dict[str, torch.Tensor]:
    """model.safetensors or pytorch_model.bin, names without a leading "model." and with "layers.0." as "L."."""
    if (d / "model.safetensors").is_file():
        from safetensors.torch import load_file

        raw = load_file(str(d / "model.safetensors"))
    elif (d / "pytorch_model.bin").is_file():
        raw = torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{where} holds no model.safetensors or pytorch_model.bin.")
    out = {}
    for name, t in raw.items():
        name = name.removeprefix("model.")
        for prefix in ("midlayer.", "layers.0."):
            name = "L." + name.removeprefix(prefix) if name.startswith(prefix) else name
        out[name] = t
    return out


def load_published(path: str | Path, arch: ModelArch, where: str) -> EagleHead:
    """A published head directory as a CPU EagleHead; ValueError naming a tensor that does not fit the target."""
    d = Path(path).expanduser()
    tensors = read_tensors(d, where)
    head = EagleHead(published_config(read_config_json(d), arch, "embed_tokens.weight" in tensors, where))
    for name, shape in published_shapes(head).items():
        if name not in tensors:
            if name != "d2t" and not name.endswith("_proj.bias"):
                raise ValueError(f"{where}: the head has no tensor {name!r} (shape {shape}).")
            continue
        got = tuple(tensors[name].shape)
        if got != shape and not (name == "mask_hidden" and tensors[name].numel() == shape[0]):
            raise ValueError(f"{where}: tensor {name!r} has shape {got}, this target needs {shape}.")
    head.load_state_dict(published_state(tensors, head, where))
    return head


def published_state(tensors: dict[str, torch.Tensor], head: EagleHead, where: str) -> dict[str, torch.Tensor]:
    """read_tensors' output as `head`'s state dict (fused, d2t absolute); keys with no source are left out."""
    state = {}
    for key, t in head.state_dict().items():
        if key == "d2t":
            offsets = tensors.get("d2t", torch.zeros_like(t)).to(torch.int64)
            state[key] = torch.arange(offsets.shape[0]) + offsets
            check_d2t(state[key], head.cfg.vocab_size, t.shape[0], where)
        elif all(n in tensors for n in FUSED.get(key, [key])):
            state[key] = torch.cat([tensors[n] for n in FUSED.get(key, [key])]).reshape(t.shape)
    return state


def head_state(path: str | Path, head: EagleHead) -> dict[str, torch.Tensor]:
    """The tensors of a head directory of either format, under `head`'s names."""
    from safetensors.torch import load_file

    d = Path(path).expanduser()
    if "format" in read_config_json(d):
        return load_file(str(d / "model.safetensors"))
    return published_state(read_tensors(d, str(d)), head, str(d))


def published_shapes(head: EagleHead) -> dict[str, tuple[int, ...]]:
    """Every published tensor name (with "L." for the layer) -> its shape, for this head."""
    shapes: dict[str, tuple[int, ...]] = {}
    for key, t in head.state_dict().items():
        if key not in FUSED:
            shapes[key] = tuple(t.shape)
            continue
        parts = FUSED[key]
        lay = head.layer
        sizes = {3: [lay.q_size, lay.kv_size, lay.kv_size], 2: [lay.intermediate] * 2, 1: [t.shape[0]]}[len(parts)]
        for name, rows in zip(parts, sizes):
            shapes[name] = (rows, *t.shape[1:])
    return shapes


def save_published(head: EagleHead, out_dir: str | Path, layout: str = "hf", extras: dict | None = None) -> Path:
    """Write a published head in the "hf" or "speculators" layout; `extras` go under config.json's "specserve"."""
    from safetensors.torch import save_file

    cfg, out = head.cfg, Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prefix, shapes = "midlayer." if layout == "hf" else "layers.0.", published_shapes(head)
    state: dict[str, torch.Tensor] = {}
    for key, t in head.state_dict().items():
        t = t.detach().cpu()
        if key == "d2t":
            state["d2t"] = (t - torch.arange(t.shape[0])).contiguous()
            state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(0, t, True)
        elif key in FUSED:
            names = FUSED[key]
            for name, part in zip(names, t.float().split([shapes[n][0] for n in names])):
                state[name.replace("L.", prefix, 1)] = part.contiguous()
        else:
            state[key] = t.float().contiguous()
    tmp = out / "model.safetensors.tmp"
    save_file(state, str(tmp))
    tmp.replace(out / "model.safetensors")
    layer = {**cfg.layer, "model_type": "llama", "num_hidden_layers": 1, "tie_word_embeddings": False}
    common = {
        "draft_vocab_size": cfg.logits_width,
        "target_hidden_size": cfg.target["hidden_size"],
        "norm_before_residual": cfg.norm_before_residual,
        "specserve": extras or {},
    }
    if layout == "hf":
        eagle = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": list(cfg.aux_hidden_layers)}
        data = {**layer, "architectures": [HF_ARCH], **common, "eagle_config": eagle}
    else:
        method = {"proposal_type": "eagle3", "speculative_tokens": cfg.num_mask_slots + 1 if cfg.num_mask_slots else 3}
        data = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "peagle" if cfg.num_mask_slots else "eagle3",
            "transformer_layer_config": layer,
            "speculators_config": {"proposal_methods": [method], "verifier": {"name_or_path": cfg.target["name"]}},
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_hidden_layers),
            "mask_token_id": cfg.mask_token_id,
            **common,
        }
    (out / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    return out
