"""ModelRunner: owns the model, the KV pool and the attention backend; runs one step's forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.attention.base import ForwardContext, forward_context
from specserve.kv.spec import KVCacheSpec, KVFormat, LayerKVCache
from specserve.model.loader import LoadedModel
from specserve.runner.batch import (
    BatchInputs,
    BlockTables,
    HostBatch,
    PendingTokens,
    Staging,
    build_host_batch,
    pending_fill,
    putter,
)
from specserve.runner.prompt_logprobs import PromptLogprobEntry, PromptLogprobRows, compute_prompt_logprobs
from specserve.scheduler.scheduler import SchedulerOutput


@dataclass
class StepOutput:
    logits: torch.Tensor  # [num_logit_rows, vocab] float32
    hidden: torch.Tensor  # [num_logit_rows, hidden] final-normed hidden states of those rows
    batch: BatchInputs
    # Only when asked (EAGLE heads): every token's final hidden state and the aux layers' inputs.
    all_hidden: torch.Tensor | None = None  # [num_tokens, hidden]
    aux_hidden: list[torch.Tensor] | None = None  # each [num_tokens, hidden]
    host: HostBatch | None = None  # the step's host-side layout (query/seq lengths), in both paths
    # Per item of the step's prompt-logprobs plan: its entries (runner/prompt_logprobs.py).
    prompt_logprobs: list[list[PromptLogprobEntry]] | None = None


def select_backend(device: torch.device, batch_invariant: bool = False):
    """torch reference on CPU; Triton on CUDA (imported only then); their batch-invariant forms if asked."""
    if batch_invariant:
        from specserve.attention import batch_invariant as bi

        return bi.triton_backend() if device.type == "cuda" else bi.BatchInvariantTorchBackend()
    if device.type != "cuda":
        from specserve.attention.torch_ref import TorchRefBackend

        return TorchRefBackend()
    from specserve.attention.triton_backend import TritonBackend

    return TritonBackend()


class ModelRunner:
    # execute() fills placeholder input ids from tokens still on the device (`pending`): the async
    # step's sampled tokens, a proposal's deferred drafts. The tensor-parallel executor does not.
    accepts_pending = True

    def __init__(
        self, loaded: LoadedModel, spec: KVCacheSpec, num_blocks: int, device: torch.device, backend=None
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.spec = spec
        self.fmt: KVFormat = spec.fmt
        self.device = device
        self.block_size = spec.block_size
        self.num_blocks = num_blocks
        self.kv_caches: list[LayerKVCache] = spec.allocate(num_blocks, device)
        self.backend = backend or select_backend(device)
        self.staging = Staging(device) if device.type == "cuda" else None
        self.block_tables = BlockTables()  # rows kept across steps: a step copies only new blocks
        self.graphs = None  # CudaGraphRunner once capture_graphs() ran

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, *query_lens: tuple[int, ...]) -> None:
        """Capture CUDA graphs (lengths: see CudaGraphRunner), then warm the small eager forwards."""
        from specserve.runner.cuda_graph import CudaGraphRunner, graph_batch_sizes
        from specserve.runner.warmup import warm_start_up

        graphs = CudaGraphRunner(self, max_model_len, graph_batch_sizes(max_num_seqs), *query_lens)
        graphs.capture()
        self.graphs = graphs
        warm_start_up(self)  # the small eager forwards graphs do not cover compile now, not mid-serving

    @torch.inference_mode()
    def execute(
        self,
        sched: SchedulerOutput,
        block_ids_of,
        need_hidden: bool = False,
        prompt_plan: list[PromptLogprobRows] | None = None,
        pending: PendingTokens | None = None,
    ) -> StepOutput:
        """prompt_plan: rows to score prompt logprobs of (every token's hidden state: the step runs eagerly)."""
        host = build_host_batch(sched, block_ids_of, self.block_size, self.block_tables)
        return self._execute(sched, host, need_hidden, prompt_plan, pending)

    @torch.inference_mode()
    def forward_scored(self, host: HostBatch, input_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Logits [host.num_tokens, vocab] of input ids already on the device (a draft model's chained steps)."""
        key = self.graphs.graph_key(host) if self.graphs is not None else None
        if key is not None and not self.graphs.scores_rows(key[1]):
            return self.graphs.run(host, key, (rows, input_ids))
        if self.staging is not None:
            self.staging.begin()
        put = putter(self.device, self.staging)
        meta = host.meta(put)
        positions = put("positions", host.positions)
        self._staged()
        with forward_context(ForwardContext(meta, self.kv_caches, self.fmt, self.backend)):
            hidden = self.model(input_ids, positions)
        return self.model.compute_logits(hidden[0] if isinstance(hidden, tuple) else hidden)

    def _staged(self) -> None:
        """Mark the copies queued BEFORE the forward, so the next step waits only for them."""
        if self.staging is not None:
            self.staging.end()

    def _fill(
        self, host: HostBatch, sched: SchedulerOutput | None, pending: PendingTokens | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Device (indices, token ids) that replace this step's placeholders."""
        if pending is None or sched is None:
            return None
        fill = pending_fill(host, [s.request.request_id for s in sched.scheduled], pending)
        if fill is None:
            return None
        put = putter(self.device, self.staging)
        return put("fill_dst", fill[0]), pending.tokens.index_select(0, put("fill_rows", fill[1]))

    @torch.inference_mode()
    def execute_host(self, host: HostBatch, need_hidden: bool = False) -> StepOutput:
        """A step from its flat batch (tensor-parallel ranks); the graph chosen is a function of `host` alone."""
        return self._execute(None, host, need_hidden, None, None)

    def _execute(
        self,
        sched: SchedulerOutput | None,
        host: HostBatch,
        need_hidden: bool,
        prompt_plan: list[PromptLogprobRows] | None,
        pending: PendingTokens | None,
    ) -> StepOutput:
        if self.staging is not None:
            self.staging.begin()
        g = self.graphs
        # Graphs return hidden states too, but only those of the aux layers they were captured with.
        aux_ok = not need_hidden or (g is not None and g.aux_hidden_layers == tuple(self.model.aux_hidden_layers))
        # Maybe padded per sequence; StepOutput.host describes this layout (EAGLE maps rows by it).
        use_graph = g is not None and not prompt_plan and aux_ok and host.tree_mask is None  # trees run eagerly
        host, key = (g.graph_for(host) if use_graph else None) or (host, None)
        fill = self._fill(host, sched, pending)
        # A uniform graph scores every token itself (a catch-up graph: the batch's logits rows, in order); a
        # mixed one ends at the hidden states and the LM head scores the step's rows after it.
        scored = key is not None and not g.is_mixed(key)
        if key is None:
            batch = host.to_device(self.device, self.staging)
        elif scored and (len(host.logits_indices) == host.num_tokens or g.scores_rows(key[1])):
            batch = BatchInputs(None, None, None, None, host.logit_rows)
        else:
            batch = host.to_device(self.device, self.staging, only_logits=True)
        self._staged()
        if key is not None:
            hidden = g.run(host, key, fill)  # logits [rows, vocab], or hidden [num_tokens, hidden] if mixed
            all_hidden, aux = g.hidden(key, host.num_tokens) if need_hidden else (None, None)
            if scored:
                logits = hidden if batch.logits_indices is None else hidden.index_select(0, batch.logits_indices)
                return StepOutput(logits, None, batch, all_hidden, aux, host=host)
        else:
            if fill is not None:
                batch.input_ids.index_copy_(0, fill[0], fill[1])
            with forward_context(ForwardContext(batch.meta, self.kv_caches, self.fmt, self.backend)):
                hidden = self.model(batch.input_ids, batch.positions)
            hidden, aux = hidden if isinstance(hidden, tuple) else (hidden, None)
        rows = hidden.index_select(0, batch.logits_indices)
        out = StepOutput(self.model.compute_logits(rows), rows, batch, host=host)
        if need_hidden:
            out.all_hidden, out.aux_hidden = hidden, aux
        if prompt_plan:
            out.prompt_logprobs = compute_prompt_logprobs(
                self.model.compute_logits, hidden, prompt_plan, self.loaded.arch.vocab_size
            )
        return out
