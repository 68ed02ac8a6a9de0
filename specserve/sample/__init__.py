"""Sampling: the plain sampler and the lossless rejection sampler for speculative decoding."""

from specserve.sample.metadata import SamplingMetadata
from specserve.sample.rejection import RejectionSampler
from specserve.sample.sampler import Sampler, compute_target_probs

__all__ = ["RejectionSampler", "Sampler", "SamplingMetadata", "compute_target_probs"]
