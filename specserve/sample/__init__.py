"""Sampling: the plain sampler and the lossless rejection sampler for speculative decoding."""

from specserve.sample.metadata import MinTokensMask, SamplingMetadata
from specserve.sample.penalties import PenaltyTensors
from specserve.sample.rejection import RejectionOutput, RejectionSampler
from specserve.sample.sampler import LogprobsTensors, Sampler, SamplerOutput, compute_logprobs, compute_target_probs

__all__ = [
    "LogprobsTensors",
    "MinTokensMask",
    "PenaltyTensors",
    "RejectionOutput",
    "RejectionSampler",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "compute_logprobs",
    "compute_target_probs",
]
