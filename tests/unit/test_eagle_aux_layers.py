"""A served EAGLE head is fed the target features of the intended layers, at the intended positions.

Greedy equality with plain decoding cannot catch a wrong feature (verification is lossless whatever the
head proposes), so these tests record what the head receives: the input of `EagleHead.fuse_target`
(eagle3: the concatenated aux states, before the head's own norms and fc; eagle: the final hidden
state) together with the positions and requests `EagleProposer._plan` assigned to those rows, and
compare it with features captured from the transformers reference by plain forward hooks.

The conventions checked (eagle_head.py, model/llama.py; vLLM and SGLang use the same ones):
- eagle3 aux layer i is the INPUT of decoder layer i (the residual stream before it: layer 0 reads the
  embeddings), default layers (2, L // 2, L - 3);
- EAGLE-1's feature is the target's final hidden state AFTER the final norm (what the LM head reads, the
  feature the original EAGLE regresses; the head then has no final norm of its own).
The trainer's features (train_target.target_batch) must follow the same conventions as serving.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.speculative.proposers.eagle import EagleProposer
from specserve.speculative.proposers.eagle_head import EagleHead, read_head_config, save_head
from specserve.train.target import target_batch
from tests.helpers.eagle_heads import make_random_head_dir
from tests.helpers.tiny_models import make_tiny_model_dir

NUM_LAYERS = 8  # enough depth for three distinct default layers (2, 4, 5) that a shift would move
DEFAULT_AUX = (2, 4, 5)  # EAGLE-3's 2, L // 2, L - 3, written out so a changed default is caught too
EXPLICIT_AUX = (0, 3, 7)  # the embeddings (layer 0's input) and the last layer's input: both edges
K = 3
# Same float32 weights, same math, different kernels (paged vs dense attention): differences are
# ~1e-6; neighbouring layers differ by ~0.1 (checked in each test, so a shift cannot pass).
ATOL = RTOL = 1e-4
PROMPTS = [[5 + (7 * i) % 300 for i in range(23)], [11, 42, 7, 99, 23] * 4 + [3]]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("aux-target"), arch="llama", seed=3, num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def heads(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("aux-heads")
    default = make_random_head_dir(str(target_dir), base / "eagle3", "eagle3")
    # An explicit layer list: the same head with aux_hidden_layers (and its fuse width) replaced.
    cfg = dataclasses.replace(read_head_config(default), aux_hidden_layers=EXPLICIT_AUX)
    torch.manual_seed(1)
    explicit = save_head(EagleHead(cfg), base / "eagle3-explicit")
    return {
        "eagle3": str(default),
        "eagle3-explicit": str(explicit),
        "eagle": str(make_random_head_dir(str(target_dir), base / "eagle", "eagle")),
    }


class Features(NamedTuple):
    layer_inputs: list[torch.Tensor]  # per decoder layer i: its input [T, hidden] (layer 0: embeddings)
    pre_norm: torch.Tensor  # [T, hidden] the residual stream after the last layer
    final: torch.Tensor  # [T, hidden] after the final norm: what the LM head reads


class Reference:
    """The transformers model's per-layer inputs and final hidden states, by forward hooks."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self._cache: dict[tuple[int, ...], Features] = {}

    @torch.no_grad()
    def features(self, token_ids: list[int]) -> Features:
        key = tuple(token_ids)
        if key not in self._cache:
            inputs: dict[int, torch.Tensor] = {}
            final: dict[str, torch.Tensor] = {}

            def first_arg(args: tuple, kwargs: dict) -> torch.Tensor:
                return (args[0] if args else kwargs["hidden_states"])[0].clone()

            def grab_input(i: int) -> Callable[[torch.nn.Module, tuple, dict], None]:
                def hook(_mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
                    # Hooks, not output_hidden_states: what a layer actually reads, whatever a
                    # transformers version puts in its hidden_states tuple (the last entry is post-norm).
                    inputs[i] = first_arg(args, kwargs)

                return hook

            inner = self.model.model
            handles = [
                layer.register_forward_pre_hook(grab_input(i), with_kwargs=True) for i, layer in enumerate(inner.layers)
            ]

            def grab_norm_input(_mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
                final["pre"] = first_arg(args, kwargs)

            def grab_norm_output(_mod: torch.nn.Module, _args: tuple, out: torch.Tensor) -> None:
                final["post"] = out[0].clone()

            handles.append(inner.norm.register_forward_pre_hook(grab_norm_input, with_kwargs=True))
            handles.append(inner.norm.register_forward_hook(grab_norm_output))
            try:
                self.model(torch.tensor([token_ids]))
            finally:
                for h in handles:
                    h.remove()
            self._cache[key] = Features([inputs[i] for i in range(len(inner.layers))], final["pre"], final["post"])
        return self._cache[key]

    def expected(self, token_ids: list[int], positions: list[int], aux: tuple[int, ...]) -> torch.Tensor:
        """[len(positions), n * hidden]: the aux layers' inputs concatenated (eagle3), or the final
        hidden state (aux == ())."""
        f = self.features(token_ids)
        parts = [f.layer_inputs[i] for i in aux] if aux else [f.final]
        return torch.cat([p[positions] for p in parts], dim=-1)


@pytest.fixture(scope="module")
def reference(target_dir: Path) -> Reference:
    return Reference(target_dir)


@pytest.fixture(autouse=True, scope="module")
def few_threads() -> Iterator[None]:
    """Tiny tensors on a shared 2-core runner: more intra-op threads only add contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def serve_and_record(
    target: str, head: str, method: str, mode: str, monkeypatch: pytest.MonkeyPatch, **llm_kw: Any
) -> tuple[list[tuple[list[str], list[int], torch.Tensor]], dict[str, list[int]]]:
    """Generate with the head; returns, per fuse_target call, (request id of each real row, its position,
    the fuse input [rows (maybe padded), width]) and each request's final token ids."""
    monkeypatch.setattr(EagleProposer, "step_graphs", mode)
    plans: list[tuple[list[str], list[int]]] = []
    calls: list[tuple[list[str], list[int], torch.Tensor]] = []
    plan_of = EagleProposer._plan
    fuse = EagleHead.fuse_target

    def recording_plan(self: EagleProposer, inp: Any) -> Any:
        plan = plan_of(self, inp)
        if plan.reqs:  # a plan with rows is followed by exactly one first forward, hence one fuse call
            assert not plans, "a plan's rows never reached the head"
            plans.append(
                ([r.request_id for r, m in zip(plan.reqs, plan.num_real) for _ in range(m)], list(plan.positions))
            )
        return plan

    def recording_fuse(self: EagleHead, target_hidden: torch.Tensor) -> torch.Tensor:
        assert plans, "fuse_target ran without a plan"
        ids, positions = plans.pop()
        calls.append((ids, positions, target_hidden.detach().clone()))
        return fuse(self, target_hidden)

    monkeypatch.setattr(EagleProposer, "_plan", recording_plan)
    monkeypatch.setattr(EagleHead, "fuse_target", recording_fuse)
    spec = {"method": method, "model": head, "num_speculative_tokens": K, "adaptive": False}
    llm = LLM(
        model=target,
        progress=False,
        speculative_config=spec,
        enable_prefix_caching=False,
        **{"kv_cache_memory_bytes": 4 << 20, **llm_kw},
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=7, max_tokens=14, ignore_eos=True),
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert not plans
    return calls, {o.request_id: o.prompt_token_ids + o.outputs[0].token_ids for o in outs}


def check_features(
    calls: list[tuple[list[str], list[int], torch.Tensor]],
    tokens: dict[str, list[int]],
    reference: Reference,
    aux: tuple[int, ...],
) -> None:
    """Every real row the head received equals the reference feature of its request and position; each
    request's positions come once each, 0, 1, 2, ... (no target feature skipped or fed twice)."""
    assert calls
    width = reference.model.config.hidden_size * max(1, len(aux))
    seen: dict[str, list[int]] = {rid: [] for rid in tokens}
    for ids, positions, got in calls:
        # The static path pads its batch after the real rows (request-major, like the eager path).
        assert got.shape[0] >= len(ids) and got.shape[1] == width
        for rid in dict.fromkeys(ids):
            rows = [r for r, i in enumerate(ids) if i == rid]
            pos = [positions[r] for r in rows]
            want = reference.expected(tokens[rid], pos, aux)
            torch.testing.assert_close(
                got[rows], want, atol=ATOL, rtol=RTOL, msg=lambda m, rid=rid, pos=pos: f"{rid} positions {pos}: {m}"
            )
            seen[rid] += pos
    for rid, pos in seen.items():
        # Only the last verify step's tokens (at most K + 1, and one more of slack) come after the last
        # propose: the head saw the prompt and the decoded positions, not just the prompt.
        assert pos == list(range(len(pos))) and len(pos) >= len(tokens[rid]) - (K + 2), (rid, pos)


def assert_layers_distinguishable(reference: Reference, aux: tuple[int, ...]) -> None:
    """The comparison can see a shift: each aux layer's input is far (>> ATOL) from its neighbours'."""
    f = reference.features(PROMPTS[0])
    stack = [*f.layer_inputs, f.pre_norm]  # layer i's output is layer i + 1's input
    for i in aux:
        for j in (i - 1, i + 1):
            if 0 <= j < len(stack):
                assert (stack[i] - stack[j]).abs().max() > 100 * ATOL, (i, j)


@pytest.mark.parametrize("mode", ["eager", "static"])
@pytest.mark.parametrize("head", ["eagle3", "eagle3-explicit"])
def test_eagle3_head_receives_the_aux_layers_inputs(
    head: str, mode: str, heads: dict[str, str], target_dir: Path, reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    aux = DEFAULT_AUX if head == "eagle3" else EXPLICIT_AUX
    assert read_head_config(heads[head]).aux_hidden_layers == aux
    assert_layers_distinguishable(reference, aux)
    calls, tokens = serve_and_record(str(target_dir), heads[head], "eagle3", mode, monkeypatch)
    check_features(calls, tokens, reference, aux)


def test_eagle3_features_with_chunked_prefill(
    heads: dict[str, str], target_dir: Path, reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompt chunks that do not sample reach the head through absorb with the same features."""
    calls, tokens = serve_and_record(
        str(target_dir), heads["eagle3"], "eagle3", "eager", monkeypatch, max_num_batched_tokens=8
    )
    assert max(len(ids) for ids, _, _ in calls) <= 8  # both prompts (23, 21 tokens) arrived in chunks
    check_features(calls, tokens, reference, DEFAULT_AUX)


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_eagle1_head_receives_the_final_normed_hidden_state(
    mode: str, heads: dict[str, str], target_dir: Path, reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert read_head_config(heads["eagle"]).aux_hidden_layers == ()
    f = reference.features(PROMPTS[0])
    # The residual stream before the final norm differs from after it: a head fed the wrong one is caught.
    assert (f.pre_norm - f.final).abs().max() > 100 * ATOL
    calls, tokens = serve_and_record(str(target_dir), heads["eagle"], "eagle", mode, monkeypatch)
    check_features(calls, tokens, reference, ())


@pytest.mark.parametrize("head", ["eagle", "eagle3", "eagle3-explicit"])
def test_training_features_follow_the_serving_convention(
    head: str, heads: dict[str, str], target_dir: Path, reference: Reference
) -> None:
    """The trainer's features (what a head learns from) are what serving feeds it, per layer and position."""
    aux = read_head_config(heads[head]).aux_hidden_layers
    llm = LLM(model=str(target_dir), progress=False, kv_cache_memory_bytes=4 << 20)
    seqs = [PROMPTS[0], PROMPTS[1]]
    tb = target_batch(llm.engine.runner.model, seqs, aux, torch.device("cpu"))
    for b, seq in enumerate(seqs):
        want = reference.expected(seq, list(range(len(seq))), aux)
        torch.testing.assert_close(tb.feats[b, : len(seq)], want, atol=ATOL, rtol=RTOL)
